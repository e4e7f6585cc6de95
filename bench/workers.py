"""The multi-process implementations the daemon scenarios time: what each child process does (one
role each) and how each implementation spawns its children.

Inserts: shmbuffer ``Writer`` processes into a daemon; producer processes putting episodes on a
pickled ``multiprocessing.Queue`` to one consumer process; cpprb's ``MPReplayBuffer`` written
from child processes. Messages: ``ping`` clients of a daemon. Every implementation returns
``(rows, seconds)`` per pass, timed by :class:`bench.harness.Children`.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import closing, contextmanager
from typing import Any

import numpy as np

from bench import data
from bench.harness import PASS_TIMEOUT, Body, Children, running_daemon
from bench.peers import cpprb_env

LENGTH = 200  # steps per episode
POOL = 8  # distinct episodes each writer cycles through

Passes = list[tuple[int, float]]


# -- roles (run in the child processes) ------------------------------------------------------


@contextmanager
def writer_role(target: str, kind: str, unit: str, wid: int, episodes: int) -> Iterator[Body]:
    """A shmbuffer ``Writer`` (it attaches the segment with prefault): ``episodes`` episodes
    per pass, then ``flush``."""
    pool = data.pool(kind, POOL, LENGTH, seed=wid)
    from shmbuffer import Writer

    with Writer(target) as writer:
        write = writer.add_episode if unit == "episode" else writer.extend

        def body(_: int) -> tuple[int, bool]:
            for i in range(episodes):
                write(pool[i % len(pool)])
            writer.flush()
            return episodes * LENGTH, True

        yield body


@contextmanager
def producer_role(data_q: Any, kind: str, wid: int, episodes: int) -> Iterator[Body]:
    """Puts episodes on a ``multiprocessing.Queue`` (pickled by its feeder thread); its own end
    time is not the pass's end (the consumer's is)."""
    pool = data.pool(kind, POOL, LENGTH, seed=wid)

    def body(_: int) -> tuple[int, bool]:
        for i in range(episodes):
            data_q.put(pool[i % len(pool)])
        return episodes * LENGTH, False

    try:
        yield body
    finally:
        data_q.close()
        data_q.join_thread()  # everything put is delivered before the process exits


@contextmanager
def consumer_role(data_q: Any, kind: str, episodes: int, capacity: int) -> Iterator[Body]:
    """Takes ``episodes`` episodes per pass off the queue and copies each into a preallocated
    ring (fresh ``np.empty`` memory on the first pass, reused on the second)."""
    ring = {k: np.empty((capacity, *shape), dt) for k, (shape, dt) in data.SPECS[kind].items()}
    pos = 0

    def body(_: int) -> tuple[int, bool]:
        nonlocal pos
        rows = 0
        for _ in range(episodes):
            ep = data_q.get(timeout=PASS_TIMEOUT)
            n = len(ep["done"])
            if pos + n > capacity:
                pos = 0
            for k, v in ep.items():
                np.copyto(ring[k][pos : pos + n], v)
            pos += n
            rows += n
        return rows, True

    yield body


@contextmanager
def cpprb_role(rb: Any, kind: str, wid: int, episodes: int) -> Iterator[Body]:
    """``MPReplayBuffer.add(**episode)`` from a child process."""
    pool = data.pool(kind, POOL, LENGTH, seed=wid)

    def body(_: int) -> tuple[int, bool]:
        for i in range(episodes):
            rb.add(**pool[i % len(pool)])
        return episodes * LENGTH, True

    yield body


@contextmanager
def pinger_role(target: str, seconds: float, window: int) -> Iterator[Body]:
    """``ping`` requests pipelined ``window`` at a time (send them all, then wait for all)."""
    from shmbuffer.clients.connection import Connection

    with closing(Connection(target, "admin", timeout=30.0)) as conn:

        def body(_: int) -> tuple[int, bool]:
            count = 0
            t0 = time.perf_counter()
            while time.perf_counter() - t0 < seconds:
                seqs = [conn.send("ping") for _ in range(window)]
                conn.wait_all(seqs)
                for seq in seqs:
                    conn.wait(seq)  # pops the reply and checks it is ok
                count += window
            return count, True

        yield body


# -- implementations (run in this process) --------------------------------------------------
# Children are forked from bench.harness.preloaded_context's server (torch imported once, not
# once per child); they get the daemon's endpoint, since their environment is the server's.


def _endpoint(name: str) -> str:
    from shmbuffer.runtime import resolve_endpoint

    return resolve_endpoint(name)


def insert_daemon(root: str, kind: str, unit: str, n: int, per_writer: int) -> Passes:
    """``n`` Writer processes into a fresh daemon holding every row of a pass."""
    capacity = n * per_writer * LENGTH
    with (
        running_daemon(root, capacity, unit, data.SPECS[kind]) as name,
        Children(preloaded=True) as kids,
    ):
        target = _endpoint(name)
        for w in range(n):
            kids.start(writer_role, target=target, kind=kind, unit=unit, wid=w, episodes=per_writer)
        return kids.run_passes()


def insert_queue(root: str, kind: str, unit: str, n: int, per_writer: int) -> Passes:
    """``n`` producer processes -> one pickled Queue -> one consumer process."""
    with Children(preloaded=True) as kids:
        data_q = kids.mp.Queue()
        kids.start(
            consumer_role,
            data_q=data_q,
            kind=kind,
            episodes=n * per_writer,
            capacity=n * per_writer * LENGTH,
        )
        for w in range(n):
            kids.start(producer_role, data_q=data_q, kind=kind, wid=w, episodes=per_writer)
        return kids.run_passes()


def insert_cpprb(root: str, kind: str, unit: str, n: int, per_writer: int) -> Passes:
    """An ``MPReplayBuffer`` made here (the children's context), written by ``n`` children."""
    import cpprb

    with Children(preloaded=True) as kids:
        rb = cpprb.MPReplayBuffer(n * per_writer * LENGTH, cpprb_env(data.SPECS[kind]), ctx=kids.mp)
        try:
            for w in range(n):
                kids.start(cpprb_role, rb=rb, kind=kind, wid=w, episodes=per_writer)
            return kids.run_passes()
        finally:
            del rb


def ping_daemon(root: str, clients: int, seconds: float, window: int) -> tuple[int, float]:
    """``clients`` ping processes against a fresh daemon, one pass of ``seconds``."""
    with (
        running_daemon(root, 1000, "transition") as name,
        Children(passes=1, preloaded=True) as kids,
    ):
        target = _endpoint(name)
        for _ in range(clients):
            kids.start(pinger_role, target=target, seconds=seconds, window=window)
        return kids.run_passes()[0]
