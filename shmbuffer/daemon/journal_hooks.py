"""The journal's hooks into the parts it keeps across a resume: which sample log a container
gets (:func:`sample_log_for`: every draw, or only room for leases), how a LEASE body is packed,
the per-row use-counter file (:func:`file_backed`), how a lease table learns a client's
process, and how a generator moves on when draws since a snapshot were not journaled.
"""

from __future__ import annotations

import errno
import functools
import os
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import numpy as np

from shmbuffer.daemon.clients import ClientTable
from shmbuffer.daemon.leases import holder
from shmbuffer.daemon.records import LEASE_FIELDS, record_bytes
from shmbuffer.errors import OutOfSpaceError
from shmbuffer.ring.container import Container, SampleRecord
from shmbuffer.ring.listeners import SampleLog
from shmbuffer.ring.table import Table


class _Journal(SampleLog, Protocol):
    """What the hooks need of a :class:`~shmbuffer.daemon.journal.Journal` (no import of it:
    it imports this module)."""

    def reserve(self, nbytes: int) -> None: ...


_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


class _TableJournal(_Journal, Protocol):
    def sampled_by(self, draw: SampleRecord, table: int) -> None: ...


def sample_log_for(table: Table, journal: _TableJournal, index: int = 0) -> SampleLog:
    """The log ``table`` (the container's ``index``-th) tells its draws: where they are
    journaled (:func:`journals_samples`), ``journal`` itself for the default table (the hot
    path of one table stays one call) or a :class:`TableLog` naming the table in each record;
    else a :class:`LeaseRoom` over it."""
    if not journals_samples(table):
        return LeaseRoom(journal)
    return journal if index == 0 else TableLog(journal, index)


class TableLog:
    """The sample log of a table other than the default: the journal's, each SAMPLE record
    naming the table by its place (a replay redraws on it)."""

    def __init__(self, journal: _TableJournal, index: int) -> None:
        self.journal = journal
        self.index = index

    def room_for_sample(self, n: int) -> None:
        self.journal.room_for_sample(n)

    def sampled(self, draw: SampleRecord) -> None:
        self.journal.sampled_by(draw, self.index)


def journals_samples(table: Container | Table) -> bool:
    """Whether ``table``'s draws are journaled: where they change sampler state (FIFO
    consumption, epochs, ``max_times_sampled`` counts) or the limiter decides by the sampled
    count. A uniform or prioritized sampler without ``max_times_sampled`` under no limiter (or
    a min-size one) changes only the generator and the sampled figure: no record, no cost
    (``bench/sample_journal.py``); a resume takes both from the last snapshot and moves the
    generator to a fresh stream, so it does not hand out the same draws again."""
    return table.sampler.draws_change_state or table.rate_limiter.counts_samples


def move_on(rng: np.random.Generator) -> None:
    """Put ``rng`` on a stream none of its draws since its saved state used: PCG64 jumped
    2**127 steps ahead (deterministic), another bit generator freshly seeded."""
    bits = rng.bit_generator
    if isinstance(bits, np.random.PCG64):
        bits.state = bits.jumped().state
    else:
        bits.state = type(bits)().state


def file_backed(path: Path, values: np.ndarray) -> np.ndarray:
    """``values`` (int32 use counters) copied into a fresh ``path`` mapped shared: a plain
    ndarray over the mapping (numpy's fast ``add.at`` path, no memmap subclass), written in
    place from then on. Allocated up front: a full tmpfs is OutOfSpaceError here, never a
    SIGBUS later."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        try:
            if values.nbytes:
                os.posix_fallocate(fd, 0, values.nbytes)
        except OSError as exc:
            if exc.errno in _NO_SPACE:
                raise OutOfSpaceError(
                    f"cannot allocate {path} ({values.nbytes:,} bytes of use counters): its "
                    "file system is full"
                ) from None
            raise
        mapped = np.memmap(tmp, dtype=np.int32, mode="r+", shape=values.shape)
        mapped[:] = values
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        os.close(fd)
    return mapped.view(np.ndarray)


def holder_lookup(clients: ClientTable) -> Callable[[int], tuple[int, int] | None]:
    """A client id's (pid, host) holder, found in ``clients`` (once per client and lease
    table: the table caches it)."""

    def lookup(client_id: int) -> tuple[int, int] | None:
        for client in clients:
            if client.id == client_id:
                return holder(client.pid, client.host)
        return None

    return lookup


class LeaseRoom:
    """The sample log of a container whose draws are not journaled: it only makes room for
    the lease a sample may be granted, before the draw (the journal's rule)."""

    def __init__(self, journal: _Journal) -> None:
        self.journal = journal

    def room_for_sample(self, n: int) -> None:
        self.journal.reserve(record_bytes(LEASE_FIELDS + n))

    def sampled(self, draw: SampleRecord) -> None:
        return None


@functools.lru_cache(maxsize=64)
def lease_struct(n: int) -> struct.Struct:
    """The packer of a LEASE body of ``n`` episodes (a lease is usually of one batch size)."""
    return struct.Struct(f"<{1 + LEASE_FIELDS + n}q")
