"""A checkpoint followed while the daemon writes it (``offline/follow.py``): the wait ends with
the checkpoint's own error, when it finished without what was waited for, or at the timeout;
it never hangs. The converted bytes are checked end to end in ``tests/e2e/test_offline.py``."""

from __future__ import annotations

import time
from concurrent.futures import Future
from typing import Any

import pytest

from shmbuffer.errors import CheckpointError
from shmbuffer.offline.follow import FollowedCheckpoint


def test_a_failed_checkpoint_ends_the_wait_with_its_error(tmp_path):
    pending: Future[dict[str, Any]] = Future()
    pending.set_exception(CheckpointError("checkpoint to /x failed: disk full"))
    with pytest.raises(CheckpointError, match="disk full"):
        FollowedCheckpoint(tmp_path, pending, timeout=30.0)


def test_a_checkpoint_finished_without_a_folder_is_an_error(tmp_path):
    pending: Future[dict[str, Any]] = Future()
    pending.set_result({"path": str(tmp_path / "checkpoint")})
    with pytest.raises(CheckpointError, match="finished without the cut's state"):
        FollowedCheckpoint(tmp_path, pending, timeout=30.0)


def test_a_copy_that_never_starts_times_out(tmp_path):
    pending: Future[dict[str, Any]] = Future()
    t0 = time.monotonic()
    with pytest.raises(CheckpointError, match="the cut's state not written in time"):
        FollowedCheckpoint(tmp_path, pending, timeout=0.05)
    assert time.monotonic() - t0 < 10.0
