"""Offline datasets in and out: a buffer's episodes (a live daemon's consistent cut, or a
checkpoint folder) exported to Parquet or Minari, and such a dataset loaded as a daemon's
starting data (``docs/offline.md``). Above both sides: it reads checkpoints (daemon) and asks
a running daemon for one (clients); only :mod:`shmbuffer.cli` imports it."""
