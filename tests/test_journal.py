"""The metadata journal: record codec, torn tails, epochs, and replay == live state (samples,
use counts and leases included)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from shmbuffer.daemon.journal import (
    COMMIT,
    EPOCH,
    RESERVE,
    SAMPLE,
    USE_COUNTS_FILE,
    Journal,
    JournalError,
    container_state,
    encode_record,
    iter_records,
    record_bytes,
    restore_container,
)
from shmbuffer.daemon.leases import ORPHAN, LeaseTable
from shmbuffer.errors import CapacityError, EmptyBufferError, InvalidArgumentError, OutOfSpaceError
from shmbuffer.ring.container import Container
from shmbuffer.ring.listeners import rng_words, set_rng_words
from shmbuffer.samplers import (
    FifoSampler,
    PrioritizedSampler,
    SampleToInsertRatio,
    make_sampler,
)


@pytest.fixture
def folder(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path


def records(data: bytes) -> list[tuple[int, list[int]]]:
    return [(kind, fields.tolist()) for kind, fields, _ in iter_records(data)]


def test_records_round_trip() -> None:
    data = encode_record(EPOCH, [3]) + encode_record(RESERVE, [5, 10, 2, 1, 0, 5])
    data += encode_record(COMMIT, [5, 1, 1, 0, 0, 5])
    assert records(data) == [
        (EPOCH, [3]),
        (RESERVE, [5, 10, 2, 1, 0, 5]),
        (COMMIT, [5, 1, 1, 0, 0, 5]),
    ]


def test_torn_or_corrupt_last_record_is_ignored() -> None:
    good = encode_record(EPOCH, [1]) + encode_record(COMMIT, [3, 1, 1, 0, 0, 3])
    last = encode_record(COMMIT, [6, 2, 1, 1, 3, 6])
    for cut in range(1, len(last)):  # every way a crash can cut the last write short
        assert records(good + last[:cut]) == records(good)
    flipped = bytearray(good + last)
    flipped[-3] ^= 0xFF  # a corrupt body fails its CRC
    assert records(bytes(flipped)) == records(good)
    assert len(records(good + last)) == 3


def _live_equals_loaded(container: Container, loaded: dict[str, Any]) -> None:
    restored = restore_container(loaded)
    assert list(restored.registry) == list(container.registry)
    assert restored.registry.next_id == container.registry.next_id
    assert restored.pointer == container.pointer
    assert restored.rows_written == container.rows_written
    assert restored.next_reservation == container.next_reservation
    committed = container.use_counts >= 0
    assert np.array_equal(restored.use_counts >= 0, committed)
    # what commits and evictions did to the sampler and the limiter is replayed too
    assert restored.sampler.state_dict() == container.sampler.state_dict()
    limiter = container.rate_limiter
    assert (restored.rate_limiter.inserted, restored.rate_limiter.deleted) == (
        limiter.inserted,
        limiter.deleted,
    )


def _drive(
    container: Container, journal: Journal, rng: np.random.Generator, steps: int
) -> dict[str, int]:
    """A random mix of reserve/commit/abort/clear, journaled the way the service does."""
    counters = {"rows_committed": 0, "episodes_committed": 0}
    open_ids: list[int] = []
    for _ in range(steps):
        action = rng.choice(["reserve", "reserve", "commit", "commit", "abort", "clear", "snap"])
        if action == "reserve":
            sub = int(rng.integers(1, 3))
            n = sub * int(rng.integers(1, 6))
            try:
                evict = container.plan(n, sub).evict
                r = container.reserve_rows(n, sub)
            except CapacityError:
                continue
            journal.append_reserve(
                evict, container.pointer, container.rows_written, container.next_reservation
            )
            open_ids.append(r.id)
        elif action in ("commit", "abort") and open_ids:
            rid = open_ids.pop(int(rng.integers(len(open_ids))))
            if action == "abort":  # a copy that failed part way: what it left untouched returns
                n = container.reservations[rid].num_rows
                before = (container.pointer, container.rows_written)
                written = None if rng.random() < 0.3 else int(rng.integers(0, n + 1))
                restored = container.abort(rid, written)
                if restored or before != (container.pointer, container.rows_written):
                    journal.append_restore(restored, container.pointer, container.rows_written)
                continue
            bounds = container.reservations[rid].episodes
            rows = container.reservations[rid].num_rows
            ids = container.commit(rid)
            counters["rows_committed"] += rows
            counters["episodes_committed"] += len(ids)
            journal.append_commit(
                [(i, s, e) for i, (s, e) in zip(ids, bounds, strict=True)],
                counters["rows_committed"],
                counters["episodes_committed"],
            )
        elif action == "clear" and not open_ids:
            container.clear()
            journal.append_clear(container.pointer)
        elif action == "snap" and rng.random() < 0.3:
            journal.snapshot(container_state(container, counters))
    return counters


@pytest.mark.parametrize("unit", ["transition", "episode"])
@pytest.mark.parametrize("mode", ["circular", "fixed"])
@pytest.mark.parametrize("seed", range(6))
def test_snapshot_plus_journal_replays_the_live_state(
    folder: Path, unit: str, mode: str, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    container = Container(32, mode=mode, unit=unit)
    journal = Journal(folder)
    journal.start(container_state(container))
    counters = _drive(container, journal, rng, 300)
    loaded = Journal(folder).load()
    _live_equals_loaded(container, loaded)
    assert loaded["counters"].get("rows_committed", 0) == counters["rows_committed"]
    journal.close()


def test_open_reservations_are_never_published(folder: Path) -> None:
    container = Container(10, unit="episode")
    journal = Journal(folder)
    journal.start(container_state(container))
    evict = container.plan(4).evict
    container.reserve_rows(4)
    journal.append_reserve(evict, container.pointer, container.rows_written, 2)
    r1 = container.reservations[1]
    ids = container.commit(1)
    journal.append_commit([(ids[0], *r1.episodes[0])], 4, 1)
    evict = container.plan(10).evict  # laps the ring: evicts episode 0; never committed
    container.reserve_rows(10)
    journal.append_reserve(evict, container.pointer, container.rows_written, 3)
    loaded = restore_container(Journal(folder).load())
    assert len(loaded.registry) == 0
    assert loaded.reservations == {}
    assert loaded.pointer == 0  # where the crashed daemon's ring stood
    assert loaded.rows_written == 14


def test_crash_between_snapshot_and_truncate_does_not_replay_twice(folder: Path) -> None:
    container = Container(16)
    journal = Journal(folder)
    journal.start(container_state(container))
    for _ in range(3):
        evict = container.plan(2).evict
        r = container.reserve_rows(2)
        journal.append_reserve(evict, container.pointer, container.rows_written, r.id + 1)
        bounds = r.episodes
        ids = container.commit(r.id)
        journal.append_commit([(ids[0], *bounds[0])], 2, 1)
    old_journal = journal.path.read_bytes()
    journal.snapshot(container_state(container))
    journal.path.write_bytes(old_journal)  # as if the truncate never happened
    loaded = Journal(folder).load()
    assert loaded["replayed"] == 0
    _live_equals_loaded(container, loaded)


def test_torn_tail_in_the_file_is_ignored_and_reported(folder: Path) -> None:
    container = Container(16)
    journal = Journal(folder)
    journal.start(container_state(container))
    evict = container.plan(4).evict
    r = container.reserve_rows(4)
    journal.append_reserve(evict, container.pointer, container.rows_written, 2)
    ids = container.commit(r.id)
    journal.append_commit([(ids[0], 0, 4)], 4, 1)
    with open(journal.path, "ab") as f:
        f.write(encode_record(COMMIT, [8, 2, 1, 1, 4, 8])[:-5])  # died mid-write
    loaded = Journal(folder).load()
    assert loaded["replayed"] == 2
    assert loaded["torn"] > 0
    _live_equals_loaded(container, loaded)


def test_load_refuses_nothing_or_garbage(folder: Path) -> None:
    with pytest.raises(JournalError, match="nothing to resume"):
        Journal(folder).load()
    (folder / "state.json").write_text("{not json")
    with pytest.raises(JournalError, match="unreadable"):
        Journal(folder).load()
    (folder / "state.json").write_text(json.dumps({"format": 99}))
    with pytest.raises(JournalError, match="format"):
        Journal(folder).load()


def test_replay_that_does_not_fit_is_an_error(folder: Path) -> None:
    container = Container(16)
    journal = Journal(folder)
    journal.start(container_state(container))
    journal.append_commit([(5, 0, 4)], 4, 1)  # id 5, but the registry hands out 0
    with pytest.raises(JournalError, match="id"):
        Journal(folder).load()


def test_epochs_keep_increasing_across_restarts(folder: Path) -> None:
    container = Container(8)
    first = Journal(folder)
    first.start(container_state(container))
    first.close()
    second = Journal(folder)
    second.start(container_state(container))
    assert second.epoch > first.epoch
    assert os.stat(second.path).st_size > 0
    second.close()


@pytest.mark.parametrize("unit", ["transition", "episode"])
def test_aborts_that_give_back_evictions_replay_to_the_live_state(folder: Path, unit: str) -> None:
    # A reservation whose copy failed publishes again what it evicted; the
    # RESTORE record makes a resumed daemon agree (ids, bounds, ring pointer).
    rng = np.random.default_rng(7)
    container = Container(24, unit=unit)
    journal = Journal(folder)
    journal.start(container_state(container))
    counters = {"rows_committed": 0, "episodes_committed": 0}
    restores = 0
    for _ in range(400):
        n = int(rng.integers(1, 7))
        evict = container.plan(n).evict
        r = container.reserve_rows(n)
        journal.append_reserve(
            evict, container.pointer, container.rows_written, container.next_reservation
        )
        if rng.random() < 0.6:
            ids = container.commit(r.id)
            counters["rows_committed"] += n
            counters["episodes_committed"] += len(ids)
            journal.append_commit(
                [(i, s, e) for i, (s, e) in zip(ids, r.episodes, strict=True)],
                counters["rows_committed"],
                counters["episodes_committed"],
            )
            continue
        restored = container.abort(r.id, written=int(rng.integers(0, n + 1)))
        journal.append_restore(restored, container.pointer, container.rows_written)
        restores += bool(restored)
    assert restores > 20
    _live_equals_loaded(container, Journal(folder).load())
    journal.close()


# -- space reserved ahead: a full file system refuses before anything changes ------------------


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 512 KiB tmpfs, so the journal's file system can really fill up."""
    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=512k,mode=0700", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {done.stderr.strip() or done.returncode}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def fill(folder: Path, leave: int = 0) -> Path:
    """Take every free byte of ``folder``'s file system but ``leave``."""
    filler = folder / "filler"
    with open(filler, "wb", buffering=0) as f, contextlib.suppress(OSError):
        for _ in range((shutil.disk_usage(folder).free - leave) // 4096 + (leave == 0)):
            f.write(b"\xff" * 4096)
    return filler


def commit_one(container: Container, journal: Journal, counters: dict[str, int]) -> None:
    """Reserve + commit one 2-row episode the way the service does: room first."""
    evict = container.plan(2).evict
    journal.reserve(record_bytes(4 + 2 * len(evict)) + record_bytes(6))
    r = container.reserve_rows(2)
    journal.append_reserve(
        evict, container.pointer, container.rows_written, container.next_reservation
    )
    ids = container.commit(r.id)
    counters["rows_committed"] += 2
    counters["episodes_committed"] += 1
    journal.append_commit([(ids[0], *r.episodes[0])], **counters)


def test_a_full_file_system_refuses_before_anything_changes(small_fs: Path) -> None:
    container = Container(64, unit="episode")
    counters = {"rows_committed": 0, "episodes_committed": 0}
    journal = Journal(small_fs, chunk=4096)
    journal.start(container_state(container, counters))  # no state_fn: no snapshot fallback
    filler = fill(small_fs)
    done = 0
    with pytest.raises(OutOfSpaceError, match="journal"):
        for _ in range(1000):
            commit_one(container, journal, counters)
            done += 1
    assert 0 < done < 1000  # the preallocated chunk held some; then a clean refusal
    assert container.reservations == {} and container.num_episodes == min(done, 32)
    loaded = Journal(small_fs).load()
    assert loaded["torn"] == 0  # never a record cut short
    _live_equals_loaded(container, loaded)
    filler.unlink()  # space again: the journal grows and goes on
    for _ in range(100):
        commit_one(container, journal, counters)
    _live_equals_loaded(container, Journal(small_fs).load())
    journal.close()


def test_a_full_file_system_is_met_with_a_snapshot_that_rewinds_the_journal(
    small_fs: Path,
) -> None:
    container = Container(16, unit="episode")
    counters = {"rows_committed": 0, "episodes_committed": 0}
    journal = Journal(small_fs, chunk=64 * 1024)
    journal.start(
        container_state(container, counters), state_fn=lambda: container_state(container, counters)
    )
    fill(small_fs, leave=16 * 1024)  # room for a snapshot, not for another journal chunk
    epoch = journal.epoch
    for _ in range(2000):  # 2000 x 128 bytes: four times the preallocated chunk
        commit_one(container, journal, counters)
    assert journal.epoch > epoch  # it snapshotted instead of refusing
    assert os.stat(journal.path).st_size == 64 * 1024  # and never grew
    _live_equals_loaded(container, Journal(small_fs).load())
    journal.close()


# -- sampler state: priorities replayed, sample-side state from the snapshot -------------------


def _commit_journaled(
    container: Container, journal: Journal, rid: int, priority: Any, counters: dict[str, int]
) -> None:
    """Commit the way the service does: the writer's priorities as a PRIORITY record."""
    reservation = container.reservations[rid]
    given = container.commit_priorities(rid, priority)
    ids = container.commit(rid, priority)
    counters["rows_committed"] += reservation.num_rows
    counters["episodes_committed"] += len(ids)
    journal.append_commit(
        [(i, s, e) for i, (s, e) in zip(ids, reservation.episodes, strict=True)], **counters
    )
    if given is not None:
        journal.append_priorities(given.rows, given.priority)


@pytest.mark.parametrize("unit", ["transition", "episode"])
def test_priorities_survive_replay_exactly(folder: Path, unit: str) -> None:
    rng = np.random.default_rng(11)
    container = Container(48, unit=unit, sampler=PrioritizedSampler(priority_exponent=0.8))
    journal = Journal(folder)
    journal.start(container_state(container))
    counters = {"rows_committed": 0, "episodes_committed": 0}
    updates = 0
    for step in range(400):
        n = int(rng.integers(1, 7))
        evict = container.plan(n).evict
        r = container.reserve_rows(n)
        journal.append_reserve(
            evict, container.pointer, container.rows_written, container.next_reservation
        )
        if rng.random() < 0.15:  # a failed copy: what it did not touch comes back
            restored = container.abort(r.id, written=int(rng.integers(0, n + 1)))
            journal.append_restore(restored, container.pointer, container.rows_written)
            continue
        count = n if unit == "transition" else 1
        priority = None if rng.random() < 0.5 else rng.uniform(0.1, 9.0, count)
        _commit_journaled(container, journal, r.id, priority, counters)
        drawn = container.sample_rows(8)
        update = container.check_priorities(drawn.rows, rng.uniform(0.0, 12.0, 8))
        updates += container.apply_priorities(update)
        journal.append_priorities(update.rows, update.priority)
        if step == 200:
            journal.snapshot(container_state(container, counters))
    assert updates > 1000
    loaded = Journal(folder).load()
    assert loaded["replayed"] > 500
    restored = restore_container(loaded)
    _live_equals_loaded(container, loaded)
    live, back = container.sampler.state_dict(), restored.sampler.state_dict()
    assert back["leaves"] == live["leaves"] and back["max_priority"] == live["max_priority"]
    journal.close()


# -- what samples change: SAMPLE records drawn again on replay ---------------------------------

#: Samplers whose draws change their state; and, journaled because a sample-to-insert limiter
#: decides by the sampled count, two whose draws do not.
SAMPLERS = [
    ("fifo", {"max_times_sampled": 1}),
    ("fifo", {"max_times_sampled": 2}),
    ("without-replacement", {}),
    ("without-replacement", {"max_times_sampled": 2}),
    ("prioritized", {"max_times_sampled": 3}),
    ("uniform", {"max_times_sampled": 2}),
    ("prioritized", {"limiter": True}),
    ("uniform", {"limiter": True}),
]


def _open_limiter() -> SampleToInsertRatio:
    """A sample-to-insert limiter that never refuses (its window is huge)."""
    return SampleToInsertRatio(samples_per_insert=1.0, min_size=0, error_buffer=1e12)


def _sample_mix(container: Container, rng: np.random.Generator) -> None:
    """One draw of a random kind and size; refusals (nothing to hand out, a call the sampler
    does not serve in this unit) are part of the mix."""
    kind = rng.choice(["rows", "episodes", "slices", "slices"])
    n = int(rng.integers(1, 6))
    with contextlib.suppress(EmptyBufferError, InvalidArgumentError):
        if kind == "rows":
            container.sample_rows(n)
        elif kind == "episodes":
            container.sample_episodes(n)
        else:
            container.sample_slices(n, int(rng.integers(1, 5)), strict=bool(rng.random() < 0.7))


@pytest.mark.parametrize("unit", ["transition", "episode"])
@pytest.mark.parametrize(("sampler", "options"), SAMPLERS)
def test_samples_replay_to_the_live_sampler_state(
    folder: Path, unit: str, sampler: str, options: dict[str, Any]
) -> None:
    """A daemon SIGKILLed at any point resumes with what samples changed: consumption,
    epochs, max_times_sampled counts, the limiter's sampled count, use counts, and (where the
    draws are the sampler's own) the generator."""
    rng = np.random.default_rng(len(sampler) + 7 * len(options) + len(unit))
    options = dict(options)
    limiter = _open_limiter() if options.pop("limiter", False) else None
    container = Container(
        60,
        unit=unit,
        sampler=make_sampler(sampler, **options),
        rate_limiter=limiter,
        seed=int(rng.integers(99)),
    )
    journal = Journal(folder)
    journal.track(container)
    assert container.sample_log is journal
    journal.start(container_state(container))
    counters = {"rows_committed": 0, "episodes_committed": 0}
    samples = 0
    for step in range(600):
        action = rng.random()
        n = int(rng.integers(1, 5)) * int(rng.integers(1, 3))
        if action < 0.35 and not container.plan(n).blocked:  # a FIFO waits for readers
            evict = container.plan(n, 1).evict
            r = container.reserve_rows(n)
            journal.append_reserve(
                evict, container.pointer, container.rows_written, container.next_reservation
            )
            _commit_journaled(container, journal, r.id, None, counters)
        elif action < 0.95:
            before = container.rate_limiter.sampled
            _sample_mix(container, rng)
            samples += container.rate_limiter.sampled > before
        elif step % 3 == 0:
            journal.snapshot(container_state(container, counters))
    assert samples > 50
    loaded = Journal(folder).load()
    assert loaded["diverged"] == 0
    back = restore_container(loaded)
    assert back.sampler.state_dict() == container.sampler.state_dict()
    assert back.rate_limiter.sampled == container.rate_limiter.sampled
    assert np.array_equal(back.use_counts, container.use_counts)
    if sampler != "uniform" and not container.rng_unlogged:
        # uniform draws go through the registry's slots, which a resume compacts
        assert back.rng.bit_generator.state == container.rng.bit_generator.state
    journal.close()


@pytest.mark.parametrize("sampler", ["uniform", "prioritized"])
def test_draws_that_change_nothing_are_not_journaled(folder: Path, sampler: str) -> None:
    """No record, no cost: a resume takes the sampled figure from the snapshot and moves the
    generator on, so it does not hand out the draws it handed out since again."""
    container = Container(40, unit="episode", sampler=make_sampler(sampler), seed=3)
    journal = Journal(folder)
    journal.track(container)
    assert container.sample_log is not journal  # it only makes room for leases
    journal.start(container_state(container))
    counters = {"rows_committed": 0, "episodes_committed": 0}
    for _ in range(4):
        evict = container.plan(5).evict
        r = container.reserve_rows(5)
        journal.append_reserve(
            evict, container.pointer, container.rows_written, container.next_reservation
        )
        _commit_journaled(container, journal, r.id, None, counters)
    container.sample_rows(8)
    journal.snapshot(container_state(container, counters))
    at_snapshot = container.rng.bit_generator.state
    after = container.sample_rows(64).rows
    assert all(kind != SAMPLE for kind, _ in records(journal.path.read_bytes()))
    back = restore_container(Journal(folder).load())
    assert back.rate_limiter.sampled == 8  # the snapshot's figure
    assert back.rng.bit_generator.state != at_snapshot
    assert not np.array_equal(back.sample_rows(64).rows, after)  # not the same draws again
    journal.close()


def test_fifo_consumed_before_a_crash_is_never_handed_out_again(folder: Path) -> None:
    container = Container(40, unit="episode", sampler=FifoSampler(max_times_sampled=1), seed=5)
    journal = Journal(folder)
    journal.track(container)
    journal.start(container_state(container))
    counters = {"rows_committed": 0, "episodes_committed": 0}
    for _ in range(6):
        evict = container.plan(5).evict
        r = container.reserve_rows(5)
        journal.append_reserve(
            evict, container.pointer, container.rows_written, container.next_reservation
        )
        _commit_journaled(container, journal, r.id, None, counters)
    assert container.sample_episodes(2).ids.tolist() == [0, 1]
    journal.snapshot(container_state(container, counters))
    assert container.sample_episodes(1).ids.tolist() == [2]  # after the snapshot: journaled
    assert container.sample_slices(1, 5).starts.tolist() == [15]
    loaded = Journal(folder).load()
    assert loaded["replayed"] == 2
    records_after = records(journal.path.read_bytes())
    assert [kind for kind, _ in records_after[1:]] == [SAMPLE, SAMPLE]
    restored = restore_container(loaded)
    assert restored.rate_limiter.sampled == 20
    assert restored.sample_episodes(2).ids.tolist() == [4, 5]  # never 0 to 3 again
    assert np.array_equal(restored.use_counts[:20], np.ones(20))
    journal.close()


def test_a_refused_fifo_draw_that_dropped_rows_is_journaled(folder: Path) -> None:
    # A strict slice call with too little left drops the short remainders it met (they can
    # never be served) even though it waits: a resumed daemon must drop them too.
    container = Container(20, unit="transition", sampler=FifoSampler(max_times_sampled=1))
    journal = Journal(folder)
    journal.track(container)
    journal.start(container_state(container))
    counters = {"rows_committed": 0, "episodes_committed": 0}
    for n in (3, 3):
        evict = container.plan(n).evict
        r = container.reserve_rows(n)
        journal.append_reserve(
            evict, container.pointer, container.rows_written, container.next_reservation
        )
        _commit_journaled(container, journal, r.id, None, counters)
    with pytest.raises(EmptyBufferError):
        container.sample_slices(1, 4)  # both 3-row chunks are too short: dropped, then waits
    assert container.sampler.stats()["dropped_rows"] == 6
    kinds = [(kind, f[5]) for kind, f in records(journal.path.read_bytes()) if kind == SAMPLE]
    assert kinds == [(SAMPLE, 1)]  # one SAMPLE, marked refused
    restored = restore_container(Journal(folder).load())
    assert restored.sampler.state_dict() == container.sampler.state_dict()
    journal.close()


def test_the_generator_is_journaled_where_a_refused_draw_moved_it(folder: Path) -> None:
    container = Container(30, unit="episode", sampler=make_sampler("without-replacement"))
    journal = Journal(folder)
    journal.track(container)
    journal.start(container_state(container))
    counters = {"rows_committed": 0, "episodes_committed": 0}
    for _ in range(3):
        evict = container.plan(5).evict
        r = container.reserve_rows(5)
        journal.append_reserve(
            evict, container.pointer, container.rows_written, container.next_reservation
        )
        _commit_journaled(container, journal, r.id, None, counters)
    container.sample_episodes(2)
    with pytest.raises(EmptyBufferError):
        container.sample_slices(1, 6)  # a fresh epoch drawn (the generator moved), no 6 rows
    assert container.rng_unlogged
    container.sample_episodes(2)
    sizes = [len(f) for kind, f in records(journal.path.read_bytes()) if kind == SAMPLE]
    assert sizes == [6, 12]  # the second carries the generator's six words
    restored = restore_container(Journal(folder).load())
    assert restored.sampler.state_dict() == container.sampler.state_dict()
    assert restored.rng.bit_generator.state == container.rng.bit_generator.state
    journal.close()


def test_rng_words_round_trip() -> None:
    rng = np.random.default_rng(123)
    rng.random(7)
    rng.integers(0, 10, dtype=np.int32)  # a buffered 32-bit half
    words = rng_words(rng)
    assert words is not None and len(words) == 6
    assert all(-(2**63) <= w < 2**63 for w in words)
    other = np.random.default_rng(0)
    set_rng_words(other, words)
    assert other.bit_generator.state == rng.bit_generator.state
    with pytest.raises(ValueError, match="words"):
        set_rng_words(other, words[:5])


def test_use_counts_live_in_a_file_beside_the_journal(folder: Path) -> None:
    container = Container(16)
    journal = Journal(folder)
    journal.track(container)
    journal.start(container_state(container))
    counters = {"rows_committed": 0, "episodes_committed": 0}
    evict = container.plan(8).evict
    r = container.reserve_rows(8)
    journal.append_reserve(evict, container.pointer, container.rows_written, 2)
    _commit_journaled(container, journal, r.id, None, counters)
    container.count_use(np.array([1, 1, 5]))  # iterate counts uses without a SAMPLE
    evict = container.plan(4).evict
    container.reserve_rows(4)  # open at the crash: its rows were never committed
    saved = np.fromfile(folder / USE_COUNTS_FILE, dtype="<i4")
    assert np.array_equal(saved, container.use_counts)  # the file is the live array
    restored = restore_container(Journal(folder).load())
    assert restored.use_counts.tolist() == [0, 2, 0, 0, 0, 1, 0, 0] + [-1] * 8
    journal.close()


# -- leases: grants, renewals, releases replayed; expiries by wall clock -----------------------


def test_leases_replay_with_wall_clock_expiries(folder: Path) -> None:
    container = Container(16)
    journal = Journal(folder)
    leases = LeaseTable(ttl=30.0)
    journal.track(container, leases)
    journal.start(container_state(container))
    t = time.monotonic()  # the daemon's clock
    a = leases.grant(1, [3, 4], t)
    b = leases.grant(2, [5], t)
    c = leases.grant(2, [6], t)
    journal.snapshot(container_state(container))  # a and b in the snapshot
    leases.release(b.id, owner=2)
    leases.renew(a.id, owner=1, now=t + 10)
    d = leases.grant(1, [7, 7], t + 10)
    loaded = Journal(folder).load()
    held = {entry[0]: entry for entry in loaded["leases"]["held"]}
    assert sorted(held) == [a.id, c.id, d.id]
    assert held[d.id][4] == [7, 7]
    wall = time.time()
    assert abs(held[a.id][3] / 1e6 - (wall + 30.0)) < 5  # renewed "10 s later": 30 s more
    fresh = LeaseTable(ttl=1.0)
    restored = fresh.restore(loaded["leases"], now=50.0)
    assert sorted(lease.id for lease in restored) == [a.id, c.id, d.id]
    assert all(lease.owner == ORPHAN for lease in restored)
    assert fresh.pinned([3, 4, 5, 6, 7]) == [3, 4, 6, 7]
    by_id = {lease.id: lease for lease in restored}
    assert 50.0 + 25 < by_id[a.id].expires <= 50.0 + 30.5  # converted to the new clock
    assert fresh.grant(9, [1], 50.0).id == d.id + 1  # ids go on after the saved ones
    journal.close()


def test_expired_leases_are_not_restored(folder: Path) -> None:
    journal = Journal(folder)
    leases = LeaseTable(ttl=0.05)
    journal.track(Container(8), leases)
    journal.start(container_state(Container(8)))
    leases.grant(1, [0], time.monotonic())
    time.sleep(0.1)
    assert LeaseTable(ttl=5.0).restore(Journal(folder).load()["leases"], 0.0) == []
    journal.close()


def test_a_lease_record_cut_short_is_ignored(folder: Path) -> None:
    journal = Journal(folder)
    leases = LeaseTable(ttl=30.0)
    journal.track(Container(8), leases)
    journal.start(container_state(Container(8)))
    leases.grant(1, [0], 0.0)
    size = journal._offset
    leases.grant(1, [1, 2], 0.0)
    data = bytearray(journal.path.read_bytes())
    data[size + 20] ^= 0xFF
    journal.path.write_bytes(bytes(data))
    loaded = Journal(folder).load()
    assert [entry[4] for entry in loaded["leases"]["held"]] == [[0]]
    assert loaded["torn"] > 0
    journal.close()


def test_a_saved_sampler_of_another_kind_is_refused(folder: Path) -> None:
    container = Container(16, sampler=PrioritizedSampler())
    state = container_state(container)
    with pytest.raises(JournalError, match="prioritized"):
        restore_container(state, Container(16))
    assert isinstance(restore_container(state).sampler, PrioritizedSampler)  # the saved kind
    old = {k: v for k, v in state.items() if k not in ("sampler", "rate_limiter", "rng")}
    assert restore_container(old).sampler.name == "uniform"  # a state from before samplers


def test_pins_are_journaled_until_their_commit_or_abort(folder: Path) -> None:
    """RESERVE_PINNED records a writer's pin; the COMMIT of its episodes or an ABORT ends it;
    a snapshot in between keeps the pins still open. What ``load`` returns rebuilds them."""
    from shmbuffer.daemon.pins import Pin, PinTable, pins_from_state
    from shmbuffer.daemon.processes import Process

    container = Container(100, unit="episode")
    pins = PinTable()
    journal = Journal(folder)
    journal.track(container, pins=pins)
    journal.start(container_state(container))
    writer = Process(os.getpid(), 12345)

    def reserve(rows: int, split: int | list[int]) -> int:
        evict = container.plan(rows, split).evict
        r = container.reserve_rows(rows, split)
        pin = Pin(r.id, writer, r.ranges, split)
        pins.add(pin)
        journal.append_reserve(
            evict, container.pointer, container.rows_written, container.next_reservation, pin
        )
        return r.id

    committed, aborted, kept = reserve(10, 2), reserve(6, [1, 5]), reserve(9, [4, 5])
    bounds = container.reservations[committed].episodes
    ids = container.commit(committed)
    pins.pop(committed)
    journal.append_commit([(i, s, e) for i, (s, e) in zip(ids, bounds, strict=True)], 10, 2)
    journal.snapshot(container_state(container))  # aborted and kept are open here
    container.abort(aborted)
    pins.pop(aborted)
    journal.append_abort(aborted)
    loaded = Journal(folder).load()
    (held,) = pins_from_state(loaded["pins"])
    assert (held.reservation, held.process, held.split) == (kept, writer, [4, 5])
    assert held.ranges == container.reservations[kept].ranges
    again = restore_container(loaded)
    assert again.reservations == {}  # only a resumed daemon holds it, for a live writer
    reservation = again.hold(held.reservation, held.ranges, held.split)
    assert reservation.episodes == container.reservations[kept].episodes
    journal.close()
