"""Worker functions run in child processes by the e2e tests (no pytest imports here).

:func:`entry` sets ``SHMBUFFER_RUNTIME_DIR`` before anything looks for a daemon, runs one
worker and reports ``(tag, "ok", result)`` or ``(tag, "error", traceback)`` on the queue.
Workers may also post ``(tag, "<message>", value)`` progress lines through ``say``.

The children start from :func:`context`: a forkserver that has imported torch, tensordict and
shmbuffer once, so that a child does not pay the ~3-6 s of CPU a fresh interpreter spends on
them (every e2e test starts a daemon, most start workers too). :func:`run_cli` is the daemon
fixture's ``shmbuffer-daemon`` process, started the same way.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from multiprocessing.context import ForkServerContext, ForkServerProcess
from typing import Any

#: What the fork server imports before it forks anything: only imports, no torch op and no
#: zmq context runs there (each child makes its own), so a child forked from it is as clean
#: as a spawned one. A name that fails to import is skipped by multiprocessing; the child
#: then imports it itself.
PRELOAD = [
    "torch",
    "tensordict",
    "shmbuffer.clients",
    "shmbuffer.cli.demo_loops",
    "shmbuffer.cli",
    "shmbuffer.cli.start",
    "shmbuffer.daemon.server",
    "shmbuffer.daemon.service",
    "shmbuffer.samplers._jit",  # numba, where the fast extra is installed
    "tests.e2e._workers",
]


class EnvProcess(ForkServerProcess):
    """A forkserver child that runs with the environment its parent had when it started it,
    as a spawned child does: the fork server's own environment is the one it was started
    with (by whichever test came first, with that test's ``SHMBUFFER_RUNTIME_DIR``)."""

    _environ: dict[str, str] | None = None

    def start(self) -> None:
        self._environ = dict(os.environ)
        super().start()

    def run(self) -> None:
        if self._environ is not None:
            os.environ.clear()
            os.environ.update(self._environ)
        super().run()


class _EnvForkServerContext(ForkServerContext):
    Process = EnvProcess  # type: ignore[assignment]


_CONTEXT = _EnvForkServerContext()


def context() -> Any:
    """The multiprocessing context of the e2e children (``Process``, ``Queue``, ``Pipe``)."""
    _CONTEXT.set_forkserver_preload(PRELOAD)  # takes effect when the server first starts
    return _CONTEXT


def run_cli(argv: list[str], log_path: str) -> None:
    """``python -m shmbuffer.cli ARGV`` with stdout and stderr to ``log_path``, in this
    (forkserver) child: the daemon is still its own process with its own pid, signal
    handlers, log and exit code (``main``'s return value)."""
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    import shmbuffer.cli

    sys.argv = [shmbuffer.cli.__file__, *argv]  # `start --detach` re-runs sys.argv[1:]
    raise SystemExit(shmbuffer.cli.main(argv))


def entry(runtime_dir: str, results: Any, tag: str, fn: str, args: tuple[Any, ...]) -> None:
    os.environ["SHMBUFFER_RUNTIME_DIR"] = runtime_dir
    try:
        value = globals()[fn](*args, say=lambda msg, v=None: results.put((tag, msg, v)))
    except BaseException:
        results.put((tag, "error", traceback.format_exc()))
        raise SystemExit(1) from None
    results.put((tag, "ok", value))


def write_episodes(
    name: str, writer_id: int, episodes: int, length: int, obs_shape: tuple[int, ...], say: Any
) -> int:
    from shmbuffer.cli.demo_loops import writer_loop

    return writer_loop(name, writer_id, episodes, length, tuple(obs_shape))


def learn(name: str, seconds: float, say: Any) -> dict[str, int]:
    from shmbuffer.cli.demo_loops import learner_loop

    return learner_loop(name, seconds)


def lease_and_hang(name: str, n: int, say: Any) -> None:
    """Take a lease on ``n`` sampled episodes, report their starts, then wait to be killed."""
    from shmbuffer import Reader

    reader = Reader(name)
    with reader.sample_episodes(n) as episodes:
        starts = sorted({_start(reader, ep) for ep in episodes})
        say("leased", starts)
        time.sleep(600)


def _start(reader: Any, ep: Any) -> int:
    """Physical row of a zero-copy episode view inside the reader's segment."""
    base = reader.segment.columns[("step",)]
    return (ep["step"].data_ptr() - base.data_ptr()) // (base.stride(0) * base.element_size())


# -- chaos workers (tests/e2e/test_chaos.py) ---------------------------------------------------
#
# They talk to the test through their own one-way Pipe, never a shared Queue: a worker is
# SIGKILLed at random points, and one killed while holding a Queue's (process-shared) write
# lock would block every other process's messages for good. A small message on a pipe is one
# write(2): it arrives whole or not at all. They stop when the test creates ``stop_file``.


def _close_in_background(client: Any) -> None:
    """Close a client whose daemon may be dead (its flush and 'bye' then wait out their
    timeouts) without holding the worker up: it reconnects to the resumed daemon meanwhile."""
    import contextlib
    import threading

    def close() -> None:
        with contextlib.suppress(Exception):
            client.close()

    threading.Thread(target=close, daemon=True).start()


def _wait_for_daemon(name: str, stop_file: str, limit: float) -> None:
    """Until the buffer's runtime file names a live daemon (or the test says stop)."""
    from shmbuffer.runtime import is_stale, read

    deadline = time.monotonic() + limit
    while not os.path.exists(stop_file):
        info = read(name)
        if info is not None and not is_stale(info):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"no live daemon for {name!r} within {limit}s")
        time.sleep(0.02)


def chaos_writer(
    runtime_dir: str,
    out: Any,
    name: str,
    writer_id: int,
    seed: int,
    lengths: tuple[int, int],
    obs_shape: tuple[int, ...],
    timeout: float,
    stop_file: str,
) -> None:
    """Write episodes ``0, 1, 2, ...`` of ``writer_id`` (random lengths), one flush each.

    Sends ``("ack", id, episode, t_begin, t_ack)`` only after ``flush`` returned (the episode is
    acknowledged), with ``t_begin`` taken before its reservation. A daemon error (dead or
    restarted daemon) makes the episode's fate unknown: ``("uncertain", id, episode, t, why)``,
    then the worker reconnects and goes on with the next episode number (it never writes an
    episode number twice). ``("done", id, next_episode)`` at the stop file.
    """
    os.environ["SHMBUFFER_RUNTIME_DIR"] = runtime_dir
    import numpy as np

    from shmbuffer import Writer
    from shmbuffer.cli.demo_loops import make_episode
    from shmbuffer.errors import ShmBufferError

    try:
        rng = np.random.default_rng(seed)
        writer = None
        episode = 0
        while not os.path.exists(stop_file):
            if writer is None:
                try:
                    _wait_for_daemon(name, stop_file, 60.0)
                    if os.path.exists(stop_file):
                        break
                    writer = Writer(name, timeout=timeout, reserve_timeout=4 * timeout)
                except ShmBufferError:
                    time.sleep(0.02)  # the daemon died again, or is not listening yet
                    continue
                out.send(("connected", writer_id, time.monotonic()))
            data = make_episode(writer_id, episode, int(rng.integers(*lengths)), obs_shape)
            t_begin = time.monotonic()
            try:
                writer.add_episode(data)
                writer.flush()
            except ShmBufferError as exc:
                out.send(("uncertain", writer_id, episode, time.monotonic(), repr(exc)))
                _close_in_background(writer)
                writer = None
            else:
                out.send(("ack", writer_id, episode, t_begin, time.monotonic()))
            episode += 1
        if writer is not None:
            writer.close()
        out.send(("done", writer_id, episode))
    except BaseException:
        out.send(("error", writer_id, traceback.format_exc()))
        raise SystemExit(1) from None


def chaos_priority(writer: Any, episode: Any) -> Any:
    """The priority chaos learners give an episode: a function of whose it is, in (0, 1), so a
    stored priority is either new data's default (1, the largest ever seen) or this value of
    the episode that holds the row now; one applied to a later occupant of its rows shows."""
    return 0.005 + ((writer * 7919 + episode * 104729) % 991) / 1000.0


def chaos_learner(
    runtime_dir: str,
    out: Any,
    name: str,
    learner_id: int,
    timeout: float,
    stop_file: str,
    prioritized: bool = False,
    update_lag: int = 16,
    report_every: float = 0.2,
) -> None:
    """Sample leased episodes (each checked whole inside its lease) and rows (each checked
    against its stamp) until the stop file appears.

    A checker's AssertionError is a torn read: counted and its message sent at once
    (``("torn", id, message)``). TornReadError (the reader gave up resampling rows a writer
    kept overwriting: no wrong data was returned) is counted apart. Daemon errors make it
    reconnect. ``("counts", id, {...})`` every ``report_every`` seconds and at the end, so a
    killed learner's counts so far are not lost.

    ``prioritized``: rows are sampled with ``return_info`` and given
    :func:`chaos_priority` of their episode through ``update_priorities(...,
    generation=...)``, as a PER learner does while writers overwrite; each batch is updated
    ``update_lag`` samples later (a learner's pipeline), so that writers have overwritten
    some of its rows by then. Only the daemon going away (DaemonUnavailableError, its
    reconnect) may fail an update; any other error is reported at once (``("bad_update", id,
    message)``): stale rows are skipped, not errors.
    """
    os.environ["SHMBUFFER_RUNTIME_DIR"] = runtime_dir
    from collections import deque

    from shmbuffer import Reader
    from shmbuffer.cli.demo_loops import check_episode, check_rows
    from shmbuffer.errors import (
        DaemonUnavailableError,
        EmptyBufferError,
        ShmBufferError,
        TornReadError,
    )

    counts = {
        "episodes": 0,
        "rows": 0,
        "torn": 0,
        "torn_read_errors": 0,
        "empty": 0,
        "reconnects": 0,
        "updates_sent": 0,
        "updates_applied": 0,
        "update_errors": 0,
    }

    pending: deque[tuple[Any, Any]] = deque()  # (priority, info) of batches not updated yet

    def update(reader: Any, batch: Any, info: Any) -> None:
        pending.append((chaos_priority(batch["writer"].double(), batch["episode"].double()), info))
        if len(pending) <= update_lag:
            return
        priority, info = pending.popleft()
        try:
            applied = reader.update_priorities(
                info["index"], priority, generation=info["generation"]
            )
        except DaemonUnavailableError:
            pending.clear()  # sampled from a daemon that is gone
            raise
        except ShmBufferError as exc:
            counts["update_errors"] += 1
            out.send(("bad_update", learner_id, repr(exc)))
            return
        counts["updates_sent"] += len(priority)
        counts["updates_applied"] += applied

    def torn(exc: AssertionError) -> None:
        counts["torn"] += 1
        out.send(("torn", learner_id, repr(exc)))

    try:
        reader = None
        last_report = time.monotonic()
        while not os.path.exists(stop_file):
            if time.monotonic() - last_report >= report_every:
                out.send(("counts", learner_id, dict(counts)))
                last_report = time.monotonic()
            if reader is None:
                try:
                    _wait_for_daemon(name, stop_file, 60.0)
                    if os.path.exists(stop_file):
                        break
                    reader = Reader(name, timeout=timeout)
                except ShmBufferError:
                    time.sleep(0.02)
                    continue
            try:
                with reader.sample_episodes(8) as episodes:
                    for ep in episodes:
                        try:
                            check_episode(ep)
                            counts["episodes"] += 1
                        except AssertionError as exc:
                            torn(exc)
                info = None
                if prioritized:
                    batch, info = reader.sample(64, return_info=True)
                else:
                    batch = reader.sample(64)
                try:
                    check_rows(batch)
                    counts["rows"] += len(batch)
                except AssertionError as exc:
                    torn(exc)
                    info = None  # never prioritise by a torn row's stamps
                if info is not None:
                    update(reader, batch, info)
            except EmptyBufferError:
                counts["empty"] += 1
                time.sleep(0.01)
            except TornReadError:
                counts["torn_read_errors"] += 1
            except ShmBufferError:
                counts["reconnects"] += 1
                _close_in_background(reader)
                reader = None
        if reader is not None:
            reader.close()
        out.send(("counts", learner_id, dict(counts)))
        out.send(("done", learner_id, None))
    except BaseException:
        out.send(("error", learner_id, traceback.format_exc()))
        raise SystemExit(1) from None


def chaos_consumer(
    runtime_dir: str,
    out: Any,
    name: str,
    learner_id: int,
    timeout: float,
    stop_file: str,
    batch: int,
    wait: float,
    pause: float,
    report_every: float = 0.2,
) -> None:
    """Consume a FIFO consume-once buffer (``--sampler fifo --max-times-sampled 1``):
    ``sample_episodes(batch)`` under a lease, each episode checked whole, then ``pause``
    seconds (slower than the writers: the ring fills and they wait), until the stop file.

    The ledger the test keeps: ``("asking", id, seq)`` before each call; once its episodes
    are checked, still inside the lease, ``("consumed", id, seq, daemon_pid, [(writer,
    episode), ...])``; ``("settled", id, seq)`` when the daemon had nothing to hand out within
    ``wait`` seconds (WaitTimeoutError: nothing consumed); ``("uncertain_call", id, seq, why)``
    when the call failed with the daemon gone or silent (it may have handed the episodes out
    and the reply never arrived). A SIGKILL between "asking" and "consumed" leaves the call in
    flight. ``("counts", id, {...})`` as :func:`chaos_learner`.
    """
    os.environ["SHMBUFFER_RUNTIME_DIR"] = runtime_dir
    from shmbuffer import Reader
    from shmbuffer.cli.demo_loops import check_episode
    from shmbuffer.errors import ShmBufferError, WaitTimeoutError

    counts = {"episodes": 0, "rows": 0, "torn": 0, "waits": 0, "reconnects": 0}
    try:
        reader = None
        seq = 0
        last_report = time.monotonic()
        while not os.path.exists(stop_file):
            if time.monotonic() - last_report >= report_every:
                out.send(("counts", learner_id, dict(counts)))
                last_report = time.monotonic()
            if reader is None:
                try:
                    _wait_for_daemon(name, stop_file, 60.0)
                    if os.path.exists(stop_file):
                        break
                    reader = Reader(name, timeout=timeout, sample_timeout=wait)
                except ShmBufferError:
                    time.sleep(0.02)
                    continue
            seq += 1
            out.send(("asking", learner_id, seq))
            recorded = False
            try:
                with reader.sample_episodes(batch) as episodes:
                    keys = []
                    for ep in episodes:
                        keys.append((int(ep["writer"][0]), int(ep["episode"][0])))
                        try:
                            check_episode(ep)
                        except AssertionError as exc:
                            counts["torn"] += 1
                            out.send(("torn", learner_id, repr(exc)))
                        counts["rows"] += len(ep)
                    out.send(("consumed", learner_id, seq, reader.conn.daemon_pid, keys))
                    recorded = True
                    counts["episodes"] += len(keys)
                time.sleep(pause)
            except WaitTimeoutError:
                counts["waits"] += 1
                out.send(("settled", learner_id, seq))
            except ShmBufferError as exc:  # the daemon died, or did not answer in time
                counts["reconnects"] += 1
                if not recorded:
                    out.send(("uncertain_call", learner_id, seq, repr(exc)))
                _close_in_background(reader)
                reader = None
        if reader is not None:
            reader.close()
        out.send(("counts", learner_id, dict(counts)))
        out.send(("done", learner_id, None))
    except BaseException:
        out.send(("error", learner_id, traceback.format_exc()))
        raise SystemExit(1) from None


# -- sampling workers (tests/e2e/test_sampling.py) ---------------------------------------------


def sample_row_ids(name: str, batches: int, batch_size: int, say: Any) -> list[int]:
    """``batches`` samples of ``batch_size`` rows; the ``id`` column of every row, in order."""
    from shmbuffer import Reader

    with Reader(name, timeout=5.0) as reader:
        assert not reader.prefetch, "a consume-once sampler must never be sampled ahead"
        say("ready")
        ids: list[int] = []
        for _ in range(batches):
            ids += reader.sample(batch_size)["id"].flatten().tolist()
    return ids


def count_sampled_rows(name: str, n: int, batch_size: int, say: Any) -> list[int]:
    """How often each physical row came up in ``n`` sampled rows (by the ``id`` column)."""
    import numpy as np

    from shmbuffer import Reader

    with Reader(name, timeout=5.0) as reader:
        counts = np.zeros(reader.capacity, dtype=np.int64)
        for _ in range(n // batch_size):
            batch, info = reader.sample(batch_size, return_info=True)
            assert (batch["id"].flatten() == info["index"]).all()
            np.add.at(counts, info["index"].numpy(), 1)
    return [int(c) for c in counts]


def consume_fifo_episodes(
    name: str, pause: float, first_wait: float, wait: float, say: Any
) -> list[int]:
    """Take leased episodes one at a time until none comes within ``wait`` seconds (the first
    within ``first_wait``); the ``ep`` id of each, in the order received, each checked whole
    (one id, steps 0..L-1)."""
    from shmbuffer import Reader
    from shmbuffer.errors import WaitTimeoutError

    got: list[int] = []
    with Reader(name, timeout=5.0, sample_timeout=first_wait) as reader:
        assert not reader.prefetch
        say("ready")
        while True:
            try:
                with reader.sample_episodes(1) as episodes:
                    ep = episodes[0]
                    ids = ep["ep"].unique().tolist()
                    assert len(ids) == 1, f"an episode mixes ids {ids}"
                    assert ep["step"].tolist() == list(range(len(ep))), "steps out of order"
                    got.append(int(ids[0]))
            except WaitTimeoutError:
                return got
            reader.sample_timeout = wait
            time.sleep(pause)


def write_fifo_episodes(name: str, episodes: int, length: int, say: Any) -> float:
    """``episodes`` episodes ``ep = 0, 1, ...`` of ``length`` steps, each flushed; returns how
    long the writes took in all (the daemon holds them back while rows are unconsumed)."""
    import torch

    from shmbuffer import Writer

    t0 = time.monotonic()
    with Writer(name, timeout=5.0, reserve_timeout=20.0) as writer:
        for ep in range(episodes):
            steps = torch.arange(length)
            writer.add_episode({"ep": torch.full((length,), ep), "step": steps})
            writer.flush()
    return time.monotonic() - t0


def write_rows_steadily(name: str, chunks: int, rows: int, say: Any) -> int:
    """``chunks`` writes of ``rows`` rows, each its own reservation (no gathering), flushed."""
    import torch

    from shmbuffer import Writer

    with Writer(name, timeout=5.0, reserve_timeout=20.0, batch_bytes=0) as writer:
        for i in range(chunks):
            writer.extend({"id": torch.arange(i * rows, (i + 1) * rows)})
        writer.flush()
        return writer.rows_committed


def sample_until_starved(
    name: str, batch_size: int, first_wait: float, wait: float, say: Any
) -> int:
    """Sample ``batch_size`` rows at a time until the daemon holds a sample ``wait`` seconds
    (the first one ``first_wait``: the writer may still be starting); rows sampled."""
    from shmbuffer import Reader
    from shmbuffer.errors import WaitTimeoutError

    sampled = 0
    with Reader(name, timeout=5.0, sample_timeout=first_wait) as reader:
        while True:
            try:
                sampled += len(reader.sample(batch_size))
            except WaitTimeoutError:
                return sampled
            reader.sample_timeout = wait


def write_numbered_episodes(name: str, episodes: int, length: int, width: int, say: Any) -> int:
    """``episodes`` episodes of ``length`` steps, each its own write numbered ``w = 1, 2, ...``
    so that a reader can tell two writes apart in any row: obs ``w * 1000 + step`` (``width``
    copies of it: large rows, so that a reader's copy takes long enough to be lapped), reward
    ``w`` on every step, next.obs ``obs + 0.5``, the last step truncated."""
    import numpy as np

    from shmbuffer import Writer

    steps = np.arange(length, dtype=np.float32)
    truncated = np.zeros(length, bool)
    truncated[-1] = True
    with Writer(name, timeout=5.0, reserve_timeout=20.0, batch_bytes=0) as writer:
        for w in range(1, episodes + 1):
            obs = np.repeat((w * 1000 + steps)[:, None], width, axis=1)
            writer.add_episode(
                {
                    "obs": obs,
                    "reward": np.full(length, w, np.float32),
                    "terminated": np.zeros(length, bool),
                    "truncated": truncated,
                    "next": {"obs": obs + 0.5},
                }
            )
        writer.flush()
        return episodes


def write_framed_episodes(name: str, episodes: int, width: int, say: Any) -> int:
    """``episodes`` episodes of 2-7 steps into a buffer whose ``obs`` stacks frames (its
    schema ``tests/e2e/test_frames.py`` declares), one write each: frame ``s`` of episode
    ``e`` is ``width`` copies of ``e * 1_000_000 + s`` (large rows: a reader's copy takes long
    enough to be lapped), the next observation one frame on, the last step terminated, and
    ``episode`` (a column gathered after the frames) ``e``."""
    import numpy as np

    from shmbuffer import Writer

    step = 0
    with Writer(name, timeout=5.0, reserve_timeout=20.0, batch_bytes=0) as writer:
        for eid in range(1, episodes + 1):
            length = 2 + eid % 6
            values = eid * 1_000_000 + np.arange(step, step + length + 1, dtype=np.int64)
            frames = np.repeat(values[:, None], width, axis=1)
            terminated = np.zeros(length, bool)
            terminated[-1] = True
            episode = {"obs": frames[:-1], "next": {"obs": frames[1:]}, "terminated": terminated}
            writer.add_episode({**episode, "episode": np.full(length, eid, np.int64)})
            step += length + 1
        writer.flush()
    return episodes


def sample_whole_rows(name: str, seconds: float, say: Any) -> tuple[int, int]:
    """Sample for ``seconds``, checking every row is whole (``img`` all ``v % 256``):
    ``(rows checked, rows torn)``. Says "started" once its first sample came back."""
    import numpy as np

    from shmbuffer import Reader

    checked = torn = 0
    with Reader(name) as reader:
        reader.sample(4)
        say("started", reader.local_draws)
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            batch = reader.sample(16)
            img = batch["img"].reshape(16, -1).numpy()
            want = (batch["v"].numpy() % 256).astype(np.uint8)
            torn += int(((img != want[:, None]).any(axis=1)).sum())
            checked += 16
    return checked, torn


def rewrite_big(name: str, rows: list[int], value: int, say: Any) -> None:
    """Rewrite ``rows`` (``img`` all ``value % 256``, ``v`` = ``value``) in one request; the
    daemon may be killed under it."""
    import numpy as np

    from shmbuffer import Writer

    with Writer(name, timeout=30) as writer:
        img = np.full((len(rows), *writer.schema["img"].shape), value % 256, dtype=np.uint8)
        say("sending")
        try:
            writer.rewrite(rows, {"img": img, "v": np.full(len(rows), value)})
        except Exception as exc:  # the daemon killed mid-request
            say("refused", type(exc).__name__)
