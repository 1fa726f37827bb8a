"""KV transfers between engines (P/D over NIXL): the layout handshake, the read hold and NIXL's
progress thread."""
