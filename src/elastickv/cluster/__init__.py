"""``elastickv cluster``: ``elastickv serve`` on every device of a Ray cluster, behind one
OpenAI endpoint, models placed and routed by Ray Serve.

Above :mod:`elastickv.serve` (which never imports it). :mod:`.config` (what to deploy, checked
before anything starts) and :mod:`.placement` (the routing rule) need no Ray; the rest runs in
Ray Serve: :mod:`.device` (a replica's ``elastickv serve`` process), :mod:`.replica` (a device
replica: multiplexed models registered in its serve), :mod:`.routing` (the pools' request
router), :mod:`.ingress` (the OpenAI endpoint), :mod:`.metrics` (through Ray's Prometheus
export) and :mod:`.app`, which puts the application together.
"""
