"""Chaos: writers and learners SIGKILLed at random points while the others keep going, and the
daemon SIGKILLed and resumed (``start --resume``) under them.

``test_chaos_short`` runs by default (a few kills, one daemon kill); ``test_chaos_full`` is the
long one: ``pytest -m chaos tests/e2e/test_chaos.py -s`` (``-s`` shows the figures).

How it proves its claims:

* **The ledger.** Each writer (``_workers.chaos_writer``) writes its episodes 0, 1, 2, ... under
  its own writer id, one ``flush`` each, and tells the test ``ack`` only after ``flush``
  returned; a replaced writer gets a fresh id. So the test knows exactly which episodes were
  acknowledged, and when each began (before its reservation) and was acknowledged. An episode
  interrupted by a daemon error is reported ``uncertain`` (committed or not: either is fine),
  and a killed writer may have committed one more episode than it reported. Messages travel on
  one pipe per worker (never a shared Queue, whose process-shared lock a SIGKILL can leave held).
* **Torn reads.** Learners check every leased episode inside its lease (``check_episode``) and
  every row sample (``check_rows``); an AssertionError there is a torn read and must never
  happen. Counts come back every 0.2 s, so a killed learner's work is counted too.
* **Nothing lost.** At the end every worker is stopped and the daemon writes a checkpoint
  (``shmbuffer-daemon checkpoint``): its ``state.json`` lists the registry exactly (episode id
  and physical rows), taken at one consistent moment. Each listed episode is read from the
  shared segment and checked whole, which names its (writer, episode). Then:
  - every acknowledged episode must be there, unless the ring evicted it in order: the ring is
    FIFO in reservation order, so an acknowledged episode may be missing only if it could have
    been reserved before every surviving episode, i.e. it began before the earliest
    acknowledgement of a surviving episode. Anything else is **data lost** (the short run sizes
    the ring so nothing is evicted at all: there every acknowledged episode must be there);
  - every stored episode was written by this run and acknowledged, uncertain, or the last one
    of a killed writer (no phantoms), and none is stored twice.
* **Stalls.** The longest gap between two consecutive acknowledgements of one writer while it
  lived (other processes dying around it, the ring evicting under leases); apart, the gaps
  that span a daemon kill-to-ready window (the writer's reconnect included).
"""

from __future__ import annotations

import itertools
import json
import multiprocessing.connection
import random
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from shmbuffer.demo import check_episode
from shmbuffer.segment import Segment
from tests.e2e import _workers

OBS = (4,)
LENGTHS = (4, 33)  # episode lengths drawn from [4, 33)
CLIENT_TIMEOUT = 2.0  # a dead daemon is noticed within this
JOIN_TIMEOUT = 30.0
START_TIMEOUT = 60.0


@dataclass
class Worker:
    kind: str  # "writer" or "learner"
    id: int
    proc: Any
    pipe: Any
    killed: bool = False
    done: bool = False
    ready: bool = False  # has written or verified something


@dataclass
class WriterLog:
    acks: dict[int, tuple[float, float]] = field(default_factory=dict)  # ep -> (begin, ack)
    uncertain: set[int] = field(default_factory=set)
    killed: bool = False
    next_episode: int | None = None  # from "done"


@dataclass
class Chaos:
    """The parent's side: workers, the ledger and the kill log."""

    children: Any
    runtime_dir: str
    name: str
    stop_file: Path
    seed: int
    workers: dict[tuple[str, int], Worker] = field(default_factory=dict)
    writers: dict[int, WriterLog] = field(default_factory=dict)
    learner_counts: dict[int, dict[str, int]] = field(default_factory=dict)
    torn_messages: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    killed: dict[str, int] = field(default_factory=lambda: {"writer": 0, "learner": 0})
    next_id: dict[str, int] = field(default_factory=lambda: {"writer": 0, "learner": 0})
    reconnects: int = 0  # writers' connections after their first

    def spawn(self, kind: str) -> Worker:
        wid = self.next_id[kind]
        self.next_id[kind] += 1
        recv, send = self.children.ctx.Pipe(duplex=False)
        stop = str(self.stop_file)
        if kind == "writer":
            self.writers[wid] = WriterLog()
            target: Any = _workers.chaos_writer
            args: tuple[Any, ...] = (self.name, wid, self.seed * 1000 + wid, LENGTHS, OBS)
            args += (CLIENT_TIMEOUT, stop)
        else:
            self.learner_counts[wid] = {}
            target = _workers.chaos_learner
            args = (self.name, wid, CLIENT_TIMEOUT, stop)
        proc = self.children.ctx.Process(
            target=target, args=(self.runtime_dir, send, *args), daemon=True
        )
        proc.start()
        send.close()  # the child holds the only write end: EOF when it is gone
        self.children.procs.append(proc)
        worker = Worker(kind, wid, proc, recv)
        self.workers[(kind, wid)] = worker
        return worker

    def kill(self, worker: Worker) -> None:
        worker.proc.kill()
        worker.proc.join(10)
        worker.killed = True
        self.killed[worker.kind] += 1
        if worker.kind == "writer":
            self.writers[worker.id].killed = True
        self.drain(worker, 0)  # what it said before it died

    def alive(self) -> list[Worker]:
        return [w for w in self.workers.values() if not w.killed and not w.done]

    def drain(self, only: Worker | None = None, timeout: float = 0.05) -> None:
        """Take the messages waiting (up to ``timeout`` for the first, 0.5 s more at most)."""
        pipes: dict[Any, Worker] = {
            w.pipe: w
            for w in ([only] if only is not None else self.workers.values())
            if not w.pipe.closed
        }
        if not pipes:
            time.sleep(timeout)
            return
        give_up = time.monotonic() + timeout + 0.5  # busy writers never keep us here
        while time.monotonic() < give_up:
            ready: list[Any] = multiprocessing.connection.wait(list(pipes), timeout)
            if not ready:
                return
            timeout = 0
            for pipe in ready:
                worker = pipes[pipe]
                try:
                    message = pipe.recv()
                except (EOFError, OSError):
                    pipe.close()
                    del pipes[pipe]
                    continue
                self.take(worker, message)
            if not pipes:
                return

    def take(self, worker: Worker, message: tuple[Any, ...]) -> None:
        what = message[0]
        if what == "ack":
            _, wid, episode, begin, acked = message
            self.writers[wid].acks[episode] = (begin, acked)
            worker.ready = True
        elif what == "uncertain":
            _, wid, episode, _, _ = message
            self.writers[wid].uncertain.add(episode)
        elif what == "connected":
            if worker.ready:
                self.reconnects += 1
        elif what == "counts":
            self.learner_counts[message[1]] = message[2]
            worker.ready = worker.ready or message[2]["episodes"] > 0
        elif what == "torn":
            self.torn_messages.append(f"learner {message[1]}: {message[2]}")
        elif what == "done":
            worker.done = True
            if worker.kind == "writer":
                self.writers[message[1]].next_episode = message[2]
        elif what == "error":
            self.errors.append(f"{worker.kind} {worker.id}:\n{message[2]}")


def sigkill_daemon(d: Any) -> None:
    d.process.send_signal(signal.SIGKILL)
    d.process.wait(10)


def read_registry(d: Any, e2e_env: Any, dest: Path) -> list[tuple[int, int, int]]:
    """The daemon's registry, exactly: ``(id, start, end)`` from a checkpoint's state.json."""
    out = e2e_env.cli("checkpoint", "--name", d.name, "--to", str(dest), timeout=60)
    assert out.returncode == 0, out.stderr
    state = json.loads((dest / "checkpoint" / "state.json").read_text())
    return [(int(i), int(s), int(e)) for i, s, e in state["registry"]["episodes"]]


def run_chaos(
    daemon: Any,
    e2e_env: Any,
    children: Any,
    *,
    seconds: float,
    writers: int,
    learners: int,
    kill_every: float,
    seed: int,
    daemon_kills: int,
    capacity: int,
    workdir: Path,
) -> dict[str, Any]:
    """Run the scenario; return its figures (the caller asserts on them)."""
    rng = random.Random(seed)
    d = daemon(capacity=capacity, unit="episode")
    chaos = Chaos(
        children, str(e2e_env.runtime_dir), d.name, e2e_env.runtime_dir / "chaos.stop", seed
    )
    restarts: list[tuple[float, float]] = []  # (killed, ready) of each daemon kill
    under_daemon_kill = 0  # workers running when the daemon was killed
    try:
        for _ in range(writers):
            chaos.spawn("writer")
        for _ in range(learners):
            chaos.spawn("learner")
        # the chaos starts once everyone runs (a spawned interpreter takes seconds to import
        # torch on a busy machine): every writer acknowledged an episode, every learner verified
        deadline = time.monotonic() + START_TIMEOUT
        while not all(w.ready for w in chaos.workers.values()):
            chaos.drain()
            assert not chaos.errors, chaos.errors[0]
            assert time.monotonic() < deadline, f"workers not running in {START_TIMEOUT}s"
        t0 = time.monotonic()
        end = t0 + seconds
        next_kill = t0 + kill_every * rng.uniform(0.5, 1.5)
        daemon_at = [
            t0 + seconds * (i + 1) / (daemon_kills + 1) + rng.uniform(-0.5, 0.5)
            for i in range(daemon_kills)
        ]
        # a daemon kill waits for every replacement worker to run; on a loaded machine that
        # can outlast the chaos time, so a kill still due keeps the chaos going (bounded)
        overtime = end + START_TIMEOUT
        while time.monotonic() < end or (daemon_at and time.monotonic() < overtime):
            chaos.drain()
            assert not chaos.errors, chaos.errors[0]
            now = time.monotonic()
            # the daemon dies under clients that all run (none still starting up), so every
            # one of them must notice and reconnect
            if daemon_at and now >= daemon_at[0] and all(w.ready for w in chaos.alive()):
                daemon_at.pop(0)
                under_daemon_kill += len(chaos.alive())
                killed_at = time.monotonic()
                sigkill_daemon(d)
                d = daemon(name=d.name, capacity=capacity, unit="episode", args=["--resume"])
                restarts.append((killed_at, time.monotonic()))
                end += restarts[-1][1] - killed_at  # the chaos time excludes the restart
                next_kill += restarts[-1][1] - killed_at
            # the victim: any worker that runs (not one still importing torch), killed with no
            # warning wherever it is; a fresh one takes its place
            # (none while a daemon kill is due: it waits for every worker to run)
            running = sorted((w for w in chaos.alive() if w.ready), key=lambda w: (w.kind, w.id))
            daemon_due = bool(daemon_at) and now >= daemon_at[0]
            if now >= next_kill and running and not daemon_due:
                next_kill = now + kill_every * rng.uniform(0.5, 1.5)
                victim = rng.choice(running)
                chaos.kill(victim)
                chaos.spawn(victim.kind)
            for w in chaos.alive():  # a worker must only die by our hand
                if not w.proc.is_alive() and w.proc.exitcode not in (0, None):
                    chaos.drain(w, 0)
                    pytest.fail(f"{w.kind} {w.id} died ({w.proc.exitcode}): {chaos.errors}")
        # stop: every worker finishes its episode and says done
        chaos.stop_file.touch()
        deadline = time.monotonic() + JOIN_TIMEOUT
        while chaos.alive() and time.monotonic() < deadline:
            chaos.drain(timeout=0.1)
            assert not chaos.errors, chaos.errors[0]
        stuck = [(w.kind, w.id) for w in chaos.alive()]
        assert not stuck, f"workers did not stop within {JOIN_TIMEOUT}s: {stuck}"
        for w in chaos.workers.values():
            children.join(w.proc, 10)
        chaos.drain(timeout=0)
        assert not chaos.errors, chaos.errors[0]
        run_s = time.monotonic() - t0

        # -- the final pass: the registry, every episode in it read and checked whole -------
        registry = read_registry(d, e2e_env, workdir)
        stats = d.stats()
        assert stats["episodes"] == len(registry)
        info = stats["segment"]
        stored: dict[tuple[int, int], int] = {}  # (writer, episode) -> daemon episode id
        corrupt: list[str] = []
        duplicates: list[tuple[int, int]] = []
        with Segment.attach(info["name"], storage_dir=info["storage_dir"]) as seg:
            data = seg.data
            for eid, start, stop in registry:
                ep = data[start:stop]
                try:
                    check_episode(ep)
                except AssertionError as exc:
                    corrupt.append(f"episode id {eid} rows [{start}, {stop}): {exc}")
                    continue
                key = (int(ep["writer"][0]), int(ep["episode"][0]))
                if key in stored:
                    duplicates.append(key)
                stored[key] = eid
    finally:
        chaos.stop_file.touch()

    # -- the ledger against the registry ------------------------------------------------------
    acked = {(wid, e): t for wid, log in chaos.writers.items() for e, t in log.acks.items()}
    # the earliest acknowledgement of a surviving episode: a missing episode that began after
    # it was reserved after that survivor, so the FIFO ring cannot have evicted it first
    survivor_acks = [acked[k][1] for k in stored if k in acked]
    horizon = min(survivor_acks) if survivor_acks else float("inf")
    missing = [k for k in acked if k not in stored]
    lost = sorted(k for k in missing if acked[k][0] >= horizon)
    evicted = len(missing) - len(lost)
    allowed = set(acked)
    for wid, log in chaos.writers.items():
        allowed |= {(wid, e) for e in log.uncertain}
        if log.killed:  # it may have committed one more than it said
            allowed.add((wid, max(log.acks, default=-1) + 1))
    phantoms = sorted(k for k in stored if k not in allowed)
    unacked_stored = sum(1 for k in stored if k not in acked)

    # -- stalls: gaps between consecutive acknowledgements of one writer (while it lived) ---
    def gaps(log: WriterLog) -> list[tuple[float, float]]:
        times = sorted(t for _, t in log.acks.values())
        return list(itertools.pairwise(times))

    stall = restart_stall = 0.0
    for log in chaos.writers.values():  # a killed writer's gaps before its death count too
        for a, b in gaps(log):
            if any(a < ready and b > killed for killed, ready in restarts):
                restart_stall = max(restart_stall, b - a)
            else:
                stall = max(stall, b - a)

    learned = {
        key: sum(c.get(key, 0) for c in chaos.learner_counts.values())
        for key in ("episodes", "rows", "torn", "torn_read_errors", "reconnects")
    }
    figures: dict[str, Any] = {
        "seconds": round(run_s, 1),
        "writers_killed": chaos.killed["writer"],
        "learners_killed": chaos.killed["learner"],
        "processes_killed": chaos.killed["writer"] + chaos.killed["learner"],
        "daemon_kills": len(restarts),
        "workers_running_at_daemon_kills": under_daemon_kill,
        "writer_reconnects": chaos.reconnects,
        "daemon_restart_s": round(max((r - k for k, r in restarts), default=0.0), 2),
        "writer_ids": len(chaos.writers),
        "episodes_acknowledged": len(acked),
        "episodes_uncertain": sum(len(log.uncertain) for log in chaos.writers.values()),
        "episodes_committed_daemon": int(stats["episodes_committed"]),
        "episodes_stored": len(registry),
        "episodes_verified_final": len(stored),
        "episodes_evicted_in_order": evicted,
        "stored_unacknowledged": unacked_stored,
        "episodes_verified_by_learners": learned["episodes"],
        "rows_verified_by_learners": learned["rows"],
        "torn_reads": learned["torn"] + len(corrupt),
        "torn_read_errors": learned["torn_read_errors"],
        "learner_reconnects": learned["reconnects"],
        "data_lost": len(lost),
        "phantoms": len(phantoms),
        "duplicates": len(duplicates),
        "longest_stall_s": round(stall, 3),
        "longest_stall_across_daemon_restart_s": round(restart_stall, 3),
        "clients_reaped": int(stats["clients_reaped"]),
        "reservations_expired": int(stats["reservations_expired"]),
        "leases_expired": int(stats["leases_expired"]),
    }
    figures["_details"] = {
        "lost": lost[:20],
        "phantoms": phantoms[:20],
        "duplicates": duplicates[:20],
        "corrupt": corrupt[:5],
        "torn": chaos.torn_messages[:5],
    }
    return figures


def report(figures: dict[str, Any], record_property: Any, title: str) -> None:
    lines = [f"--- chaos figures: {title} ---"]
    for key, value in figures.items():
        if not key.startswith("_"):
            lines.append(f"  {key:40s} {value}")
            record_property(key, value)
    print("\n" + "\n".join(lines))


def check(figures: dict[str, Any]) -> None:
    details = figures["_details"]
    assert figures["torn_reads"] == 0, details
    assert figures["data_lost"] == 0, details
    assert figures["phantoms"] == 0, details
    assert figures["duplicates"] == 0, details
    assert figures["episodes_verified_final"] == figures["episodes_stored"], details
    assert figures["episodes_acknowledged"] > 0 and figures["episodes_verified_by_learners"] > 0
    assert figures["processes_killed"] > 0


def test_chaos_short(daemon, e2e_env, children, tmp_path, record_property):
    figures = run_chaos(
        daemon,
        e2e_env,
        children,
        seconds=10,
        writers=2,
        learners=1,
        kill_every=2.5,
        seed=1,
        daemon_kills=1,
        capacity=1_000_000,  # never wraps here: every acknowledged episode must be stored
        workdir=tmp_path,
    )
    report(figures, record_property, "short")
    check(figures)
    assert figures["episodes_evicted_in_order"] == 0
    assert figures["daemon_kills"] == 1


@pytest.mark.chaos
@pytest.mark.timeout(300)
def test_chaos_full(daemon, e2e_env, children, tmp_path, record_property):
    figures = run_chaos(
        daemon,
        e2e_env,
        children,
        seconds=100,
        writers=3,
        learners=2,
        kill_every=2.0,
        seed=2,
        daemon_kills=3,
        capacity=400_000,  # wraps about twice: eviction (in order) under leases
        workdir=tmp_path,
    )
    report(figures, record_property, "full")
    check(figures)
    assert figures["daemon_kills"] == 3
