"""Errors the command line reports as one line and a non-zero exit status."""


class UserError(Exception):
    """Bad input from the command line: printed without a traceback, exit status 2."""
