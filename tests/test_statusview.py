"""The live view of ``status --watch`` (statusview.LiveStatus) drawn from a real service's
stats, and the CLI's error when rich is missing. The view under a real terminal is in
tests/e2e/test_status_watch.py."""

from __future__ import annotations

import io
import sys
from collections.abc import Iterator

import pytest

pytest.importorskip("rich")
from rich.console import Console

from shmbuffer import cli
from shmbuffer.cli.statusview import LiveStatus, format_status
from tests.test_service import SPEC, Harness, storage  # noqa: F401  (fixture)

W, R = b"writer-1", b"reader-1"


@pytest.fixture
def h(storage: str) -> Iterator[Harness]:  # noqa: F811  (the fixture imported above)
    harness = Harness(storage, capacity=40, sampler="prioritized", rate_limiter="min-size")
    harness.hello(W)
    harness(W, "define_schema", schema=SPEC)
    harness.hello(R, "reader")
    yield harness
    harness.close()


def draw(view: LiveStatus, stats: dict[str, object]) -> str:
    console = Console(file=io.StringIO(), width=140, color_system=None)
    console.print(view.render(stats))
    return console.file.getvalue()  # type: ignore[attr-defined,no-any-return]


def test_live_view_shows_fill_rates_clients_sampler_and_limiter(h: Harness) -> None:
    view = LiveStatus()
    h.now = 1.0
    before = h.service.stats(h.now)
    first = draw(view, before)
    assert "rows committed      0" in first

    h.write(W, 10, 1.0)
    h(R, "sample", kind="rows", n=6)
    stats = h.service.stats(h.now)
    # the view's per-client rates run on the daemon's clock (its uptime, wall time): 2 s on
    # it, however long this test took between the two replies
    stats["uptime_s"] = before["uptime_s"] + 2.0
    text = draw(view, stats)
    assert "rows committed      10" in text
    assert "25.0%" in text  # fill: 10 of 40 rows
    assert "prioritized" in text and "min-size" in text
    assert "inserts blocked" in text and "0 waiting now" in text
    rows = [line for line in text.splitlines() if "clients:" not in line]  # not the title
    lines = [line for line in rows if " writer " in line or " reader " in line]
    writer = next(line for line in lines if " writer " in line)
    reader = next(line for line in lines if " reader " in line)
    assert "10 (5/s)" in writer and "test-host" in writer  # 10 rows in 2 s
    assert "6 (3/s)" in reader
    assert "lag: seconds since the client's last request" in text


def test_live_view_of_a_daemon_without_per_client_figures(h: Harness) -> None:
    stats = h.service.stats(0.0)
    del stats["clients"]  # an older daemon's reply
    assert "no per-client figures" in draw(LiveStatus(), stats)
    assert "1 writer, 1 reader" in format_status(stats)  # the plain text is unchanged


def test_watch_on_a_terminal_without_rich_names_the_extra(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "rich", None)  # as if not installed
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    assert cli.main(["status", "--name", "nobody", "--watch", "0.5"]) == 1
    err = capsys.readouterr().err
    assert "needs rich" in err and "shmbuffer[live]" in err


def test_status_shows_the_compressed_byte_store(tmp_path) -> None:
    pytest.importorskip("zstandard")
    harness = Harness(str(tmp_path), unit="episode", compressed_bytes=4096)
    try:
        harness.hello(b"w")
        obs = {"dtype": "uint8", "shape": [4], "compress": "zstd"}
        harness(b"w", "define_schema", schema={"obs": obs})
        text = format_status(harness(b"w", "stats")["stats"])
        assert "compressed  obs (zstd): 0 of 4,096 bytes (fill 0.0%), ratio - raw/stored" in text
    finally:
        harness.close()
