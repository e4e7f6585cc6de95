"""Progress bars for checkpoint and restore: drawn on a terminal (a real pseudo-terminal here),
absent elsewhere, and never in the way of the work's result or error."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from shmbuffer.daemon.checkpoint import copy_data
from shmbuffer.storage import progress


@pytest.fixture
def terminal(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[bytes]]:
    """stderr on a pseudo-terminal; yields what was drawn on it (read by a thread)."""
    pytest.importorskip("rich")
    master, slave = os.openpty()
    drawn: list[bytes] = []

    def drain() -> None:
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:
                return
            if not chunk:
                return
            drawn.append(chunk)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    stream = os.fdopen(slave, "w", buffering=1)
    # pytest puts its own capture on sys.stderr before each test's call: aim the bars at
    # the terminal itself
    monkeypatch.setattr(progress, "_stream", lambda: stream)
    yield drawn
    stream.close()
    os.close(master)
    reader.join(5)


def test_off_a_terminal_nothing_is_drawn_and_work_runs() -> None:
    assert not progress.enabled()  # pytest captures stderr: not a terminal
    update, done = progress.copy_progress("restore", 100)
    update(50)
    done()
    assert progress.wait_with_progress("checkpoint", 100, lambda: 0, lambda: 42) == 42


def test_a_copy_in_this_process_draws_its_bar(terminal: list[bytes], tmp_path: Path) -> None:
    assert progress.enabled()
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.write_bytes(os.urandom(3 << 20))
    update, done = progress.copy_progress("restore", 3 << 20)
    seen: list[int] = []
    try:
        copy_data(src, dst, 3 << 20, lambda n: (seen.append(n), update(n)))
    finally:
        done()
    assert seen[-1] == 3 << 20 and dst.read_bytes() == src.read_bytes()
    time.sleep(0.2)
    assert b"restore" in b"".join(terminal)


def test_waiting_polls_the_measure_and_returns_the_result(terminal: list[bytes]) -> None:
    done_bytes = {"n": 0}
    polls: list[int] = []

    def measure() -> int:
        polls.append(done_bytes["n"])
        return done_bytes["n"]

    def work() -> str:
        for n in range(1, 6):
            time.sleep(0.1)
            done_bytes["n"] = n * 20
        return "ok"

    assert progress.wait_with_progress("checkpoint", 100, measure, work) == "ok"
    assert len(polls) >= 2 and polls == sorted(polls)  # it followed the copy as it grew
    time.sleep(0.2)
    assert b"checkpoint" in b"".join(terminal)


def test_the_work_error_reaches_the_caller(terminal: list[bytes]) -> None:
    def work() -> None:
        raise ValueError("disk full")

    with pytest.raises(ValueError, match="disk full"):
        progress.wait_with_progress("checkpoint", 100, lambda: 0, work)
