"""Hardware probes: end-to-end checks that run against a real backend in minutes."""
