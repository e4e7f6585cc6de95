"""``shmbuffer-daemon episodes``: the live episodes a metadata filter selects, as a table (or
JSON), from a running daemon (``docs/metadata.md``).

One reader :class:`~shmbuffer.clients.connection.Connection`, imported when the command runs,
and the ``episodes`` op; the daemon parses the filter, so a bad one is refused with the
position of the error, as from any client. Part of the command line (:mod:`shmbuffer.cli`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from typing import Any

from shmbuffer.errors import ShmBufferError

#: The buffer's own names, shown first; the writers' follow in name order.
_FIRST = ("id", "length", "commit_time", "writer")


def cmd_episodes(args: argparse.Namespace) -> int:
    from shmbuffer.clients.connection import Connection
    from shmbuffer.wire.protocol import decode_i64

    fields: dict[str, Any] = {"limit": args.limit}
    if args.where:
        fields["where"] = args.where
    if args.order_by:
        fields["order_by"] = args.order_by
    try:
        conn = Connection(args.name, "reader", timeout=args.timeout)
        try:
            reply = conn.call("episodes", **fields)
        finally:
            conn.close()
    except ShmBufferError as exc:
        print(f"episodes: {exc}", file=sys.stderr)
        return 1
    ids = decode_i64(reply["ids"]).tolist()
    columns: dict[str, list[Any]] = {"id": ids, **reply["columns"]}
    names = [n for n in _FIRST if n in columns] + sorted(set(columns) - set(_FIRST))
    rows = [{name: columns[name][i] for name in names} for i in range(len(ids))]
    if args.json:
        for row in rows:
            print(json.dumps(row))
        return 0
    print(format_table(names, rows))
    return 0


def format_table(names: list[str], rows: list[dict[str, Any]]) -> str:
    """Aligned columns, a header line first; a missing value is ``-``, a commit time is the
    local time of day (to the millisecond), a float shown to 6 significant digits."""
    cells = [[_cell(name, row[name]) for name in names] for row in rows]
    widths = [max([len(name)] + [len(r[i]) for r in cells]) for i, name in enumerate(names)]
    lines = ["  ".join(name.ljust(w) for name, w in zip(names, widths, strict=True)).rstrip()]
    for r in cells:
        lines.append("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    if not rows:
        lines.append("(no episode matches)")
    return "\n".join(lines)


def _cell(name: str, value: Any) -> str:
    if value is None:
        return "-"
    if name == "commit_time":
        return datetime.datetime.fromtimestamp(value).strftime("%H:%M:%S.%f")[:-3]
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)
