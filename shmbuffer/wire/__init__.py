"""What crosses a socket: the protocol's tables, the msgpack codec, the framings, CURVE keys."""
