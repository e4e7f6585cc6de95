"""A daemon's tables: configured by ``--table`` or ``[tables.NAME]`` with the Buffer's words,
refused with the table named, read and written by name through the service's ops, and kept by a
``--resume`` (the runtime record's settings, the journal's state)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from shmbuffer.cli.parser import build_parser
from shmbuffer.daemon.config import DaemonConfig
from shmbuffer.daemon.recovery import _saved_parts, _table_conflicts
from shmbuffer.daemon.state import Deferred
from shmbuffer.daemon.table_config import parse_table_flag
from shmbuffer.errors import ConfigError, InvalidArgumentError
from shmbuffer.samplers import FifoSampler, PrioritizedSampler, SampleToInsertRatio
from shmbuffer.wire.protocol import encode_f64
from tests.test_service import ADMIN, SPEC, Harness, R, W, i64, storage

__all__ = ["storage"]  # the fixture, used by name

TABLES = {
    "replay": {"sampler": "prioritized", "priority_exponent": 0.6},
    "online": {"sampler": "fifo", "max_times_sampled": 1},
}


def test_a_table_flag_is_a_name_a_sampler_and_options_as_the_flags_spell_them() -> None:
    assert parse_table_flag("online:fifo,max-times-sampled=1") == (
        "online",
        {"sampler": "fifo", "max_times_sampled": 1},
    )
    name, options = parse_table_flag(
        "replay:prioritized,priority-exponent=0.6,rate-limiter=sample-to-insert,"
        "samples-per-insert=4,error-buffer=8,min-size=100"
    )
    assert name == "replay"
    assert options == {
        "sampler": "prioritized",
        "priority_exponent": 0.6,
        "rate_limiter": "sample-to-insert",
        "samples_per_insert": 4.0,
        "error_buffer": 8.0,
        "min_size": 100,
    }


@pytest.mark.parametrize(
    ("flag", "message"),
    [
        ("online", "expected NAME:SAMPLER"),
        ("online:fifo,max-times-sampled", "is not option=value"),
        ("online:fifo,max-times-sampled=once", "max-times-sampled must be an integer"),
    ],
)
def test_a_malformed_table_flag_is_refused_naming_it(flag: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_table_flag(flag)


def test_tables_build_each_its_own_sampler_and_limiter_the_first_the_default() -> None:
    config = DaemonConfig(
        capacity=100,
        tables={
            **TABLES,
            "paced": {
                "rate_limiter": "sample-to-insert",
                "samples_per_insert": 2,
                "error_buffer": 8,
            },
        },
    )
    built = config.make_tables()
    assert list(built) == ["replay", "online", "paced"]
    assert isinstance(built["replay"][0], PrioritizedSampler)
    assert isinstance(built["online"][0], FifoSampler)
    limiter = built["paced"][1]
    assert isinstance(limiter, SampleToInsertRatio)
    assert limiter.settings()["min_size"] == 1  # as --rate-limiter sample-to-insert has it
    assert list(DaemonConfig().make_tables()) == ["default"]


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({"tables": {"a": {"colour": 1}}}, "table 'a': unknown table option 'colour'"),
        ({"tables": {"a": {"sampler": "nope"}}}, "table 'a': .*unknown sampler 'nope'"),
        ({"tables": {"a": {"priority_exponent": 0.5}}}, "table 'a': .*priority_exponent"),
        ({"tables": {"a": {"min-size": 1000}, "b": {}}, "capacity": 10}, "table 'a'"),
        ({"tables": {"a b": {}}}, "table name 'a b'"),
        ({"tables": {"a": {"max-times-sampled": "1"}}}, "max-times-sampled must be an integer"),
        ({"tables": {"a": {}}, "sampler": "prioritized"}, "with --table give --sampler"),
        ({"tables": {"a": {}}, "min_size": 3}, "with --table give --min-size"),
        ({"tables": {}}, "non-empty"),
    ],
)
def test_bad_tables_are_refused_naming_the_table_or_the_flag(
    given: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        DaemonConfig(**given)


def test_the_config_file_takes_tables_at_the_top_or_beside_a_daemon_section(
    tmp_path: Path,
) -> None:
    top = tmp_path / "top.toml"
    top.write_text(
        'capacity = 64\n[tables.replay]\nsampler = "prioritized"\npriority-exponent = 0.7\n'
        '[tables.online]\nsampler = "fifo"\nmax_times_sampled = 1\n'
    )
    config = DaemonConfig.load(top)
    assert config.tables == {
        "replay": {"sampler": "prioritized", "priority_exponent": 0.7},
        "online": {"sampler": "fifo", "max_times_sampled": 1},
    }
    beside = tmp_path / "beside.toml"
    beside.write_text('[daemon]\ncapacity = 64\n[tables.online]\nsampler = "fifo"\n')
    assert list(DaemonConfig.load(beside).tables or {}) == ["online"]


def test_the_start_command_line_takes_repeated_tables() -> None:
    args = build_parser().parse_args(
        ["start", "--table", "replay:prioritized", "--table", "online:fifo,max-times-sampled=1"]
    )
    assert args.table == ["replay:prioritized", "online:fifo,max-times-sampled=1"]


# -- through the service's ops ----------------------------------------------------------------


@pytest.fixture
def h(storage: str) -> Iterator[Harness]:
    online = {**TABLES["online"], "rate_limiter": "min-size"}
    harness = Harness(storage, capacity=40, unit="episode", tables={**TABLES, "online": online})
    harness.hello(W)
    harness(W, "define_schema", schema=SPEC)
    harness.hello(R, "reader")
    for i in range(6):
        harness.write(W, 5, float(i))
    yield harness
    harness.close()


def sampled(h: Harness, n: int, **fields: Any) -> list[int]:
    return i64(h(R, "sample", kind="episodes", n=n, **fields)["ids"]).tolist()


def test_the_hello_reply_lists_the_tables_and_a_sample_reads_the_one_it_names(
    h: Harness,
) -> None:
    tables = h(R, "hello", role="reader", pid=1, host="test-host")["buffer"]["tables"]
    assert [t["name"] for t in tables] == ["replay", "online"]
    assert tables[1] == {
        "name": "online",
        "sampler": "fifo",
        "consumes": True,
        "max_times_sampled": 1,
    }
    assert sampled(h, 2, table="online") == [0, 1]  # FIFO: oldest first, each once
    assert sampled(h, 2, table="online") == [2, 3]
    assert len(sampled(h, 3)) == 3  # the default table: prioritized, the same rows again
    assert len(sampled(h, 3, table="replay")) == 3
    with pytest.raises(InvalidArgumentError, match="no table named 'nope'; the tables are"):
        sampled(h, 1, table="nope")
    stats = h(R, "stats")["stats"]["tables"]
    assert list(stats) == ["replay", "online"]
    assert stats["online"]["sampler"]["figures"] != stats["replay"]["sampler"]["figures"]
    assert stats["online"]["rate_limiter"]["sampled"] == 20
    assert stats["replay"]["rate_limiter"]["sampled"] == 30


def test_priorities_and_configure_address_a_table_by_name(h: Harness) -> None:
    drawn = h(R, "sample", kind="episodes", n=2, info=True)
    fields = {"index": drawn["index"], "priority": encode_f64(np.array([3.0, 4.0]))}
    assert h(R, "update_priorities", table="replay", **fields)["updated"] == 2
    assert h.service.container.tables["replay"].priority_updates == 2
    with pytest.raises(InvalidArgumentError, match="fifo"):
        h(R, "update_priorities", table="online", **fields)
    h.hello(ADMIN, "admin")
    reply = h(ADMIN, "configure", table="online", min_size=10)
    assert reply["rate_limiter"]["settings"]["min_size"] == 10
    assert h.service.container.tables["online"].rate_limiter.settings()["min_size"] == 10
    with pytest.raises(InvalidArgumentError, match="table 'replay': rate limiter none has no"):
        h(ADMIN, "configure", table="replay", min_size=10)
    with pytest.raises(InvalidArgumentError, match="no table named 'nope'"):
        h(ADMIN, "configure", table="nope", min_size=1)


def test_a_write_the_consume_once_table_holds_back_waits_naming_it(h: Harness) -> None:
    for i in range(2):  # the ring is full: the next write evicts what online has not read
        h.write(W, 5, float(i))
    with pytest.raises(Deferred, match="table 'online'"):
        h(W, "reserve", rows=5)
    sampled(h, 1, table="online")  # one episode consumed: its rows may go
    assert h(W, "reserve", rows=5)["reservation"]


def test_a_resume_keeps_the_saved_tables_and_refuses_others(h: Harness) -> None:
    state = h.service.persistent_state()
    saved = _saved_parts(state)["tables"]
    assert list(saved) == ["replay", "online"]
    assert saved["online"]["sampler"] == "fifo" and saved["online"]["max_times_sampled"] == 1
    assert DaemonConfig(capacity=40, tables=saved).make_tables()  # builds them again
    asked = {"replay": {"sampler": "prioritized"}, "online": {"sampler": "uniform"}}
    assert _table_conflicts(asked, saved) == [
        "table 'online': requested the uniform sampler, saved fifo"
    ]
    assert _table_conflicts(asked, None) == [f"tables: requested {asked}, saved one table"]
    assert _table_conflicts({"online": {}}, saved) == [
        "tables: requested online, saved replay, online"
    ]
    settings = h.service.resume_settings()
    assert settings["table"] == "replay" and list(settings["tables"]) == ["online"]


def test_status_and_its_watch_show_a_line_per_table(h: Harness) -> None:
    from rich.console import Console

    from shmbuffer.cli.statusview import LiveStatus, format_status

    sampled(h, 2, table="online")
    stats = h(R, "stats")["stats"]
    text = format_status(stats)
    assert "tables      replay (default): prioritized" in text
    assert "online: fifo" in text and "consumed_episodes=2" in text
    console = Console(record=True, width=200)
    console.print(LiveStatus().render(stats))
    assert "online: fifo" in console.export_text()


def test_metrics_label_each_tables_series_by_its_name(h: Harness) -> None:
    from shmbuffer.daemon.metrics import families

    sampled(h, 2, table="online")
    by_name = {f.name: f for f in families(h(R, "stats")["stats"], {})}
    sampled_rows = dict(by_name["shmbuffer_table_rows_sampled"].samples)
    assert sampled_rows == {("replay",): 0, ("online",): 10}
    kinds = {labels for labels, _ in by_name["shmbuffer_table_info"].samples}
    assert kinds == {("replay", "prioritized", "none"), ("online", "fifo", "min-size")}
    figures = dict(by_name["shmbuffer_sampler_figure"].samples)
    assert figures[("online", "consumed_episodes")] == 2


def test_a_clusters_tables_become_start_flags_the_daemon_reads_back() -> None:
    from shmbuffer.cluster.options import check_options, start_flags

    options = check_options({"tables": TABLES, "seed": 1})
    flags = start_flags(options, 0)
    assert flags[flags.index("--table") + 1] == "replay:prioritized,priority-exponent=0.6"
    given = [flags[i + 1] for i, flag in enumerate(flags) if flag == "--table"]
    assert dict(parse_table_flag(flag) for flag in given) == TABLES
    with pytest.raises(ValueError, match="'tables' must map names to options"):
        check_options({"tables": ["replay"]})


def test_a_writers_priorities_reach_a_prioritized_table_behind_a_consume_once_default(
    storage: str,
) -> None:
    from shmbuffer.daemon.journal import Journal, restore_container

    tables = {"online": TABLES["online"], "replay": TABLES["replay"]}  # FIFO the default
    h = Harness(storage, capacity=40, unit="episode", tables=tables)
    try:
        h.hello(W)
        h(W, "define_schema", schema=SPEC)
        for i in range(3):
            h.write(W, 5, float(i), priority=float(i + 1))
        replay = h.service.container.tables["replay"].sampler.state_dict()
        assert h.service.journal is not None
        back = restore_container(Journal(h.service.journal.folder).load())
        again = back.tables["replay"].sampler.state_dict()
        assert np.array_equal(again["leaves"], replay["leaves"])  # as the writer gave them
        total = back.tables["replay"].sampler.stats()["priority_total"]
        assert total == pytest.approx(sum((i + 1.0) ** 0.6 for i in range(3)))
    finally:
        h.close()
