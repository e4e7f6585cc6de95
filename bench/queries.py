"""Episode metadata queries: what a filter over every live episode costs, and a draw filtered
by one, at 10k, 100k and 1M episodes.

shmbuffer keeps episode metadata columnar beside its registry (``shmbuffer/ring/meta.py``) and
evaluates a filter vectorised (``shmbuffer/registry/query.py``); a draw with ``where=`` tests
only what was committed since its last draw (a standing filter). No peer filters episodes
across processes, so the baseline is what a user writes without one: the same episodes as a
list of dicts and a list comprehension over it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from bench.registry import Context, Row, make_row, median_us, scenario

NAME = "meta.queries"
SIZES = (10_000, 100_000, 1_000_000)
QUICK_SIZES = (10_000,)
#: Episodes committed per reservation while filling (one commit attaches one set of values).
PER_COMMIT = 100
LENGTH = 4  # rows per episode: the rows themselves are never read here
QUERY = "ret > 0.9 and version >= 2 and env in ('e1', 'e3')"  # selects about 1 in 40
SELECTIVE = "ret > 0.99"  # about 1 in 100, for the draws
FIXED = 1_000  # episodes "tag == 1" selects, at every size: a selective filter's draws


def _filled(episodes: int) -> tuple[Any, Any, Any, list[dict[str, Any]]]:
    """A ring of ``episodes`` live episodes with metadata, its uniform and its prioritized
    table (random priorities), and the same metadata as a list of dicts (the baseline's)."""
    from shmbuffer.ring.container import Container
    from shmbuffer.samplers import make_rate_limiter, make_sampler

    tables = {
        name: (make_sampler(kind), make_rate_limiter("none"))
        for name, kind in (("uniform", "uniform"), ("prioritized", "prioritized"))
    }
    container = Container.of_tables(episodes * LENGTH, tables, unit="episode", seed=0)
    meta = container.keep_meta()
    prioritized = container.tables["prioritized"]
    rng = np.random.default_rng(0)
    dicts: list[dict[str, Any]] = []
    for commit in range(episodes // PER_COMMIT):
        values = {
            "ret": float(rng.random()),
            "version": commit % 5,
            "env": f"e{commit % 4}",
            "tag": int(commit < FIXED // PER_COMMIT),  # the first FIXED episodes, at any size
        }
        reservation = container.ring.reserve_rows(PER_COMMIT * LENGTH, PER_COMMIT)
        ids = container.ring.commit(reservation.id)
        meta.attach(ids, meta.check(values))
        dicts += [{"id": i, **values} for i in ids]
    starts = np.arange(episodes, dtype=np.int64) * LENGTH
    prioritized.update_priorities(starts, rng.uniform(0.05, 2.0, episodes))
    return meta, container.table, prioritized, dicts


@scenario(NAME)
def queries(ctx: Context) -> list[Row]:
    """A filter over every live episode (``episodes(where=..., limit=10)``) and
    ``sample(256, where=...)``'s draw at 10k / 100k / 1M episodes; vs a list comprehension
    over the same metadata as dicts."""
    sizes = QUICK_SIZES if ctx.quick else SIZES
    seconds = 0.05 if ctx.quick else 0.5
    ctx.note(
        NAME,
        f"in-process EpisodeMeta over a ring of episodes of {LENGTH} rows, metadata ret (float), "
        f"version (int), env (str), one set per {PER_COMMIT} episodes; query = {QUERY!r} "
        f"(~1/40 selected), the first 10 found; sample-where = Table.sample_rows(256) among "
        f"{SELECTIVE!r} (~1/100), standing filter; sample-where-{FIXED // 1000}k: among the "
        f"{FIXED:,} episodes 'tag == 1' selects at every size (a selective filter's draws stay "
        "flat in buffer size); sample-where-prioritized: the same as sample-where on a "
        "prioritized table (random priorities in [0.05, 2)), by priority among the selection; "
        "rows = episodes scanned per query, 256 per draw; python-list = [d for d in dicts if "
        "...] over the same values",
    )
    rows: list[Row] = []

    def add(impl: str, op: str, size: int, us: float, calls: int, per_call: int) -> None:
        rows.append(
            make_row(
                NAME,
                impl,
                f"{op}@{_label(size)}",
                rows=per_call * calls,
                nbytes=0,
                seconds=us * calls / 1e6,
                pass_="steady",
                calls=calls,
                us_per_call=us,
            )
        )

    for size in sizes:
        _time_size(size, seconds, add)
    return rows


def _time_size(size: int, seconds: float, add: Callable[..., None]) -> None:
    meta, table, prioritized, dicts = _filled(size)
    where = meta.parsed(QUERY)
    us, calls = median_us(lambda: meta.select(where, limit=10), seconds)
    add("shmbuffer", "query", size, us, calls, size)

    def listed() -> list[int]:
        found = [
            d["id"]
            for d in dicts
            if d["ret"] > 0.9 and d["version"] >= 2 and d["env"] in ("e1", "e3")
        ]
        return found[:10]

    us, calls = median_us(listed, seconds)
    add("python-list", "query", size, us, calls, size)
    us, calls = median_us(
        lambda: table.sample_rows(256, among=meta.subset(SELECTIVE, table)), seconds
    )
    add("shmbuffer", "sample-where", size, us, calls, 256)
    us, calls = median_us(
        lambda: table.sample_rows(256, among=meta.subset("tag == 1", table)), seconds
    )
    add("shmbuffer", f"sample-where-{FIXED // 1000}k", size, us, calls, 256)
    us, calls = median_us(
        lambda: prioritized.sample_rows(256, among=meta.subset(SELECTIVE, prioritized)), seconds
    )
    add("shmbuffer", "sample-where-prioritized", size, us, calls, 256)


def _label(size: int) -> str:
    return f"{size // 1_000_000}M" if size >= 1_000_000 else f"{size // 1000}k"
