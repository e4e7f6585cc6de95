"""``shmbuffer-daemon export``: a live daemon's episodes, or a checkpoint folder's, to Parquet
or Minari (:mod:`shmbuffer.offline`, ``docs/offline.md``). ``start --import`` is
:mod:`shmbuffer.cli.start`'s."""

from __future__ import annotations

import argparse


def cmd_export(args: argparse.Namespace) -> int:
    from shmbuffer.errors import ConfigError
    from shmbuffer.offline.export import describe, export_checkpoint, export_live, parse_target

    parse_target(args.to)  # a wrong target fails before anything is cut
    if (args.name is None) == (args.checkpoint is None):
        raise ConfigError("export: give --name (a running daemon) or --checkpoint DIR, one")
    if args.checkpoint is not None:
        result = export_checkpoint(args.checkpoint, args.to)
    else:
        result = export_live(args.name, args.to, spool=args.spool, timeout=args.timeout)
    print(describe(result))
    return 0
