"""Fixtures of the client state-machine tests: a fake daemon and its connection installed
where the Writer and Reader modules look for ``Connection``."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import shmbuffer.clients.readerstate
import shmbuffer.clients.writer
from shmbuffer.storage.schema import Schema
from tests.clients.fakeconn import FakeConnection, FakeDaemon

SCHEMA = Schema.from_batch({"obs": np.zeros((1, 3), np.float32), "step": np.zeros(1, np.int64)})

MakeDaemon = Callable[..., FakeDaemon]


@pytest.fixture
def fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[MakeDaemon]:
    """``fake(**options)``: a FakeDaemon (options as its fields) that Writers and Readers made
    after the call talk to."""
    made: list[FakeDaemon] = []

    class Conn(FakeConnection):
        pass

    def make(**options: Any) -> FakeDaemon:
        daemon = FakeDaemon(tmp_path / f"d{len(made)}", SCHEMA, **options)
        made.append(daemon)
        Conn.daemon = daemon
        return daemon

    monkeypatch.setattr(shmbuffer.clients.writer, "Connection", Conn)
    monkeypatch.setattr(shmbuffer.clients.readerstate, "Connection", Conn)
    yield make
    for daemon in made:
        daemon.close()
