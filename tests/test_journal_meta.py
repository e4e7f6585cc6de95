"""Episode metadata in the daemon's journal: a COMMIT carries its time and its writer's code,
a WRITER record names the code once per journal generation, a META record what the writer
attached; replaying them gives back every value, across a snapshot that starts a new
generation."""

from __future__ import annotations

from shmbuffer.daemon.journal import Journal
from shmbuffer.daemon.saved_state import restore_container
from tests.test_service import SPEC, Harness, storage  # noqa: F401  (fixture)


def commit(h: Harness, who: bytes, value: float, **fields: object) -> None:
    reply = h(who, "reserve", rows=4)
    h.fill(reply["ranges"], value)
    h(who, "commit", reservation=reply["reservation"], **fields)


def test_writers_and_times_replay_across_journal_generations(storage: str) -> None:  # noqa: F811
    h = Harness(storage, capacity=64, unit="episode")
    try:
        for who, pid in ((b"w1", 11), (b"w2", 22)):
            h(who, "hello", role="writer", pid=pid, host="h")
        h(b"w1", "define_schema", schema=SPEC)
        commit(h, b"w1", 1.0)
        commit(h, b"w2", 2.0, meta={"ret": 2.5})
        journal = h.service.journal
        assert journal is not None
        journal.snapshot(h.service.persistent_state())  # a new generation: codes start over
        commit(h, b"w2", 3.0)
        commit(h, b"w1", 4.0, meta={"ret": 4.5, "env": "e1"})
        live = h.service.meta.select().rows()
        assert [(r["writer"], r.get("ret")) for r in live] == [
            ("11@h", None),
            ("22@h", 2.5),
            ("22@h", None),
            ("11@h", 4.5),
        ]
        replayed = restore_container(Journal(journal.folder).load()).meta
        assert replayed is not None
        assert replayed.select().rows() == live  # commit times to the bit, writers, values
    finally:
        h.close()
