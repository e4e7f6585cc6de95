"""The public API's rules, shared by every front end and the ring: argument checks, write
plans, episode assembly, hooks."""
