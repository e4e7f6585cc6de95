"""The benchmark's trust machinery on synthetic rows: repetitions folded into median and
min-max, winners (a peer ahead is said so), the README section between its markers, the load
refusal, the notes of repeated runs and the figures. No benchmark runs here."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from typing import Any

import pytest

from bench import machine, readme, report, runner, runs
from bench.registry import SCENARIOS, Context, Row, make_row


def _row(
    impl: str, op: str, rate: float, scenario: str = "s", pass_: str = "steady", **extra: Any
) -> Row:
    return make_row(
        scenario, impl, op, rows=int(rate), nbytes=int(rate) * 10, seconds=1.0, pass_=pass_, **extra
    )


def test_aggregate_keeps_the_median_run_and_its_range() -> None:
    runs_ = [
        [_row("shmbuffer", "write", v), _row("cpprb", "write", 10 * v)] for v in (300, 100, 200)
    ]
    rows = report.aggregate(runs_)
    assert [r["impl"] for r in rows] == ["shmbuffer", "cpprb"]
    ours = rows[0]
    assert ours["rows_per_s"] == 200 and ours["rows"] == 200  # one run's row, consistent
    assert (ours["rows_per_s_min"], ours["rows_per_s_max"]) == (100, 300)
    assert ours["repeats"] == 3 and ours["runs_rows_per_s"] == [300, 100, 200]


def test_aggregate_counts_a_measurement_missing_from_a_run() -> None:
    rows = report.aggregate([[_row("a", "x", 1), _row("a", "x", 5)], [_row("a", "x", 2)]])
    # Two rows of one (impl, op, pass) in a run are two measurements; the second ran once.
    assert [(r["repeats"], r["rows_per_s"]) for r in rows] == [(2, 1), (1, 5)]


def test_a_peer_ahead_is_the_winner_and_bold_in_the_markdown() -> None:
    rows = report.aggregate(
        [
            [
                _row("shmbuffer", "sample", 100),
                _row("cpprb", "sample", 150 + d),
                _row("copy-limit", "sample", 999),
            ]
            for d in (0, 10, 20)
        ]
    )
    report.add_ratios(rows)
    report.add_winners(rows)
    assert {r["winner"] for r in rows} == {"cpprb"}  # the copy limit is no contender
    assert rows[0]["winner_overlaps"] is False
    md = report.markdown(rows, [], {"versions": {}, "scenarios": {}})
    line = next(ln for ln in md.splitlines() if ln.startswith("| shmbuffer |"))
    assert line.endswith("| **cpprb** |")
    line = next(ln for ln in md.splitlines() if ln.startswith("| cpprb |"))
    assert "| 160 | 150-170 |" in line  # median, then the runs' min-max
    assert "| winner |" in md


def test_overlapping_ranges_are_marked_and_no_winner_without_a_contest() -> None:
    rows = report.aggregate(
        [
            [_row("shmbuffer", "x", a), _row("cpprb", "x", b)]
            for a, b in ((100, 90), (80, 95), (95, 85))
        ]
    )
    rows += [_row("shmbuffer-daemon", "ping", 5)]
    rows += [_row("shmbuffer", "create", 1), _row("cpprb", "create", 2)]  # lazy: no contest
    report.add_winners(rows)
    assert [r["winner"] for r in rows[-2:]] == [None, None]
    assert rows[0]["winner"] == "shmbuffer" and rows[0]["winner_overlaps"] is True
    assert report.winner(rows[0]) == "shmbuffer ~"
    assert rows[-3]["winner"] is None and report.winner(rows[-3]) == "-"


def _meta() -> dict[str, Any]:
    return {
        "command": "python -m bench --all --readme",
        "date": "2026-12-01 10:00 UTC",
        "repeat": 3,
        "machine": {"cpu": "Test CPU", "cores": 2, "memory_gb": 24.0, "system": "Linux"},
        "versions": {
            "python": "3.11",
            "torch": "2.x",
            "shmbuffer": "0.1",
            "torchrl": "0.14",
            "cpprb": "11",
        },
        "scenarios": {"s": {"load_before": [0.2, 0.1, 0.1], "other_cores": 0.05}},
    }


def test_readme_section_replaces_only_the_marked_text(tmp_path: Path) -> None:
    rows = report.aggregate([[_row("shmbuffer", "w", 300), _row("cpprb", "w", 400)]] * 3)
    rows.append(_row("shmbuffer-daemon", "ping-1c", 9, scenario="alone"))
    report.add_winners(rows)
    path = tmp_path / "README.md"
    path.write_text(
        f"# title\n\n## Benchmarks\n\n{readme.START}\nold figures\n{readme.END}\n\n## Layout\n"
    )
    out = tmp_path / "bench" / "results"
    text = readme.section(rows, _meta(), out, [out / "s.png"], path)
    readme.write(path, text)
    doc = path.read_text()
    assert doc.startswith("# title\n\n## Benchmarks\n\n<!-- bench:start -->")
    assert doc.endswith("<!-- bench:end -->\n\n## Layout\n") and "old figures" not in doc
    assert "`python -m bench --all --readme`" in doc and "2026-12-01" in doc
    assert "Test CPU, 2 cores, 24 GB memory" in doc and "torch 2.x" in doc and "cpprb 11" in doc
    assert (
        "| s | w | steady | shmbuffer: 300 [300-300] | cpprb: 400 [400-400] | 0.75 | **cpprb** |"
        in doc
    )
    assert "[s](bench/results/s.png)" in doc and "(bench/results/results.md)" in doc
    assert "Without a peer (figures in results.md): alone." in doc


def test_readme_without_markers_is_refused_naming_them(tmp_path: Path) -> None:
    path = tmp_path / "README.md"
    path.write_text("# no section\n")
    with pytest.raises(ValueError, match="bench:start"):
        readme.write(path, "x")
    assert path.read_text() == "# no section\n"


def test_too_busy_by_start_load_or_by_other_processes() -> None:
    limit = machine.load_limit()
    assert machine.too_busy(limit / 2, {"a": {"other_cores": 0.0}}) is None
    assert "before the run" in (machine.too_busy(limit + 0.1, {}) or "")
    reason = machine.too_busy(0.0, {"a": {"other_cores": limit + 1}, "b": {"other_cores": None}})
    assert reason is not None and "during: a" in reason


def test_load_watch_reports_load_and_other_cores() -> None:
    info = machine.LoadWatch().stop()
    assert len(info["load_before"]) == 3 and len(info["load_after"]) == 3
    assert info["other_cores"] is None or info["other_cores"] >= 0


def test_repeated_notes_are_kept_once_and_differing_ones_tagged() -> None:
    notes = ["s: sizes", "s: 12 us"]
    notes += ["s: sizes", "s: 15 us"]
    runs.merge_notes(notes, 2, rep=1, repeat=3)
    assert notes == ["s: sizes", "s: 12 us", "s (run 2/3): 15 us"]


def _main(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = runner.main(list(argv))
    return code, out.getvalue()


def test_list_names_every_scenario() -> None:
    code, text = _main("--list")
    assert code == 0
    for name in ("contention", "rollout", "core.transitions", "daemon.insert_images"):
        assert f"{name} " in text


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--all", "core"], "--all runs every scenario"),
        (["--readme", "core"], "--readme writes the table of every scenario"),
        (["--readme", "--quick"], "--readme with --quick"),
        (["--repeat", "0"], "--repeat must be >= 1"),
        (["--workers", "0,2", "rollout"], "argument --workers: expected positive integers"),
        (["--workers", "2,x", "rollout"], "argument --workers: expected positive integers"),
        (["--workers", "", "rollout"], "argument --workers: expected positive integers"),
        (["--workers", "4,2,4", "rollout"], "argument --workers: '4,2,4' gives 4 more than once"),
        (["--workers", "4", "core"], "--workers sets the worker counts of rollout and contention"),
    ],
)
def test_bad_flags_are_refused_naming_the_flag(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        runner.main(argv)
    assert message in capsys.readouterr().err


def test_one_figure_per_kind(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from bench.plot import plot

    rows = report.aggregate(
        [
            [
                _row("shmbuffer", "write", 100 + d, scenario="bars"),
                _row("cpprb", "write", 120, scenario="bars"),
                _row("copy-limit", "write", 200, scenario="bars"),
                *(
                    _row(i, f"insert-{n}w", n * 50 + d, scenario="lines", writers=n)
                    for i in ("shmbuffer-daemon", "cpprb")
                    for n in (1, 2, 4)
                ),
                _row("shmbuffer-daemon", "ping-1c", 5, scenario="alone"),
            ]
            for d in (0, 5, 10)
        ]
    )
    paths = plot(rows, tmp_path)
    assert [p.name for p in paths] == ["bars.png", "lines.png", "alone.png"]
    assert all(p.stat().st_size > 1000 for p in paths)
    json.dumps(rows)  # what report.write stores stays JSON


def test_run_repeats_a_scenario_rotating_its_order_and_survives_a_failing_one() -> None:
    order: list[str] = []

    def fake(ctx: Context) -> list[Row]:
        out = []
        for impl in ctx.rotate(["shmbuffer", "cpprb"]):
            order.append(impl)
            out.append(_row(impl, "x", 100 + 10 * ctx.rep, scenario="test.fake"))
        return out

    def boom(ctx: Context) -> list[Row]:
        raise RuntimeError("no such field 'obs'")

    SCENARIOS["test.fake"], SCENARIOS["test.boom"] = fake, boom
    try:
        ctx = Context()
        rows, info = runs.run(["test.boom", "test.fake"], ctx, repeat=3)
    finally:
        del SCENARIOS["test.fake"], SCENARIOS["test.boom"]
    assert order == ["shmbuffer", "cpprb", "cpprb", "shmbuffer", "shmbuffer", "cpprb"]
    assert [(r["impl"], r["rows_per_s"], r["repeats"]) for r in rows] == [
        ("shmbuffer", 110, 3),
        ("cpprb", 110, 3),
    ]
    assert "test.boom: failed: RuntimeError: no such field 'obs'" in ctx.notes
    assert info["test.fake"]["repeats"] == 3 and "load_after" in info["test.boom"]


def test_workers_flag_sets_the_counts_of_the_loads(tmp_path: Path) -> None:
    assert runner.worker_counts("8, 4,14") == (4, 8, 14)
    assert Context().worker_counts() == (1, 2, 4)
    assert Context(quick=True).worker_counts() == (2,)
    seen: list[tuple[int, ...]] = []

    def fake(ctx: Context) -> list[Row]:
        seen.append(ctx.worker_counts())
        return [_row("shmbuffer", f"x-{n}w", 10, scenario="rollout.fake") for n in seen[-1]]

    SCENARIOS["rollout.fake"] = fake
    try:
        code, text = _main(
            "rollout.fake", "--workers", "3,1", "--repeat", "1", "--out", str(tmp_path)
        )
    finally:
        del SCENARIOS["rollout.fake"]
    assert code == 0 and seen == [(1, 3)]
    assert "python -m bench rollout.fake --workers 3,1 --repeat 1" in text


def _cpu_rows() -> list[Row]:
    figures = [
        ("shmbuffer-daemon", 4.0, 0.25),
        ("cpprb-MPReplayBuffer", 5.0, None),
        ("torchrl-shared-LazyMemmapStorage", 8.0, None),
    ]
    rows = report.aggregate(
        [
            [
                _row(impl, "insert-2w", 100, cpu_s_per_m_rows=c, daemon_cpu_share=d)
                for impl, c, d in figures
            ]
        ]
    )
    rows.append(_row("shmbuffer-daemon", "ping-1c", 9))  # a scenario without CPU figures
    report.add_ratios(rows)
    report.add_winners(rows)
    return rows


def test_cpu_per_row_is_a_cost_compared_with_the_most_frugal_peer(tmp_path: Path) -> None:
    rows = _cpu_rows()
    assert rows[0]["cpu_vs_best_peer"] == pytest.approx(0.8)
    assert rows[2]["cpu_vs_best_peer"] == pytest.approx(1.6)
    assert rows[0]["runs_cpu_s_per_m_rows"] == [4.0]
    assert "cpu_vs_best_peer" not in rows[3]
    md = report.markdown(rows, [], {"versions": {}, "scenarios": {}})
    assert "| cpu_s_per_M_rows | daemon_share | cpu_vs_best_peer (lower = better) |" in md
    line = next(ln for ln in md.splitlines() if ln.startswith("| shmbuffer-daemon | insert"))
    assert line.endswith("| 4 | 25% | 0.80 |")
    line = next(ln for ln in md.splitlines() if ln.startswith("| cpprb-MPReplayBuffer |"))
    assert line.endswith("| 5 | — | 1.00 |")
    json.dumps(rows)

    path = tmp_path / "README.md"
    text = readme.section(rows, _meta(), tmp_path, [], path)
    assert (
        "| scenario | op | shmbuffer-daemon | cpprb-MPReplayBuffer | "
        "torchrl-shared-LazyMemmapStorage | daemon share | vs peer (lower = better) |" in text
    )
    assert "| s | insert-2w | 4 | 5 | 8 | 25% | 0.80 |" in text
    assert "| s | ping-1c |" not in text
