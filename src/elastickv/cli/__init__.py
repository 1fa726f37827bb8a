"""The ``elastickv`` command line."""
