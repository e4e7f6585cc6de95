"""A versioned weights channel: one learner publishes a flat state dict, many workers read it.

The learner's :class:`WeightsPublisher` owns a named shared-memory segment (a
:class:`~shmbuffer.storage.segment.Segment` of one row, one column per tensor, in the same storage
folder as the buffers) and copies its tensors into it on :meth:`~WeightsPublisher.publish`.
Each worker's :class:`WeightsSubscriber` maps the same segment. Checking for new weights is
one int64 read (:attr:`WeightsSubscriber.version`); a worker calls
:meth:`~WeightsSubscriber.poll` every step and copies only when the version changed, so
weights cost nothing per step and one copy per publication.

Consistency is a seqlock on the segment's one generation stamp, ``seq``:

* the publisher sets ``seq`` odd, copies every tensor, then sets it to the next even value, so
  ``seq // 2`` is the number of completed publications (the *version*) and an odd ``seq``
  means one is being written;
* a subscriber reads ``seq``, gives up at once if it is odd (the worker keeps its current
  weights and tries again next step), copies, then reads ``seq`` again: if it changed, the
  copy may mix two publications and it copies again, until it gets a clean one.

So a subscriber never reports a torn state as current, never blocks a publisher, and never
waits on one that died mid-publish (``seq`` stays odd; ``poll`` keeps returning False). The
orderings this needs (the stamp store before the data stores, the data loads before the second
stamp load) hold on x86, whose stores and whose loads are each kept in order (the same reasoning
as the rows' generation stamps, ``docs/architecture.md``); there is no fence in Python for
weaker memory models.

State-dict names may contain ``.`` (``net.0.weight``), which a schema key may not; the columns
are therefore named ``p0000``, ``p0001``, ... and the manifest's ``extra`` keeps the names.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path
from typing import Self

import numpy as np
import torch

from shmbuffer.errors import SchemaError, SegmentError, SegmentNotFoundError, WaitTimeoutError
from shmbuffer.storage.schema import Field, Schema, dtype_name
from shmbuffer.storage.segment import Segment

KIND = "weights"
#: How long a subscriber keeps re-copying while publications overlap its copy: far longer
#: than one publication of any model that fits in memory takes.
RETRY_TIMEOUT_S = 10.0

StateDict = Mapping[str, torch.Tensor]


def _flat(state: torch.nn.Module | StateDict) -> dict[str, torch.Tensor]:
    """The tensors of a module (its ``state_dict``: parameters and buffers, sharing their
    storage) or of a mapping of names to tensors."""
    if isinstance(state, torch.nn.Module):
        return dict(state.state_dict(keep_vars=False))
    if not isinstance(state, Mapping):
        raise TypeError(f"expected an nn.Module or a mapping of tensors, got {type(state)}")
    flat = {}
    for name, value in state.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(
                f"weights entry {name!r}: expected a torch.Tensor, got {type(value).__name__}"
            )
        flat[str(name)] = value
    return flat


def _column(i: int) -> str:
    return f"p{i:04d}"


class _Channel:
    """What both ends share: the mapped segment, its tensor views and the ``seq`` stamp."""

    segment: Segment
    names: list[str]
    views: dict[str, torch.Tensor]  # name -> shared tensor of the state's own shape

    def _bind(self, segment: Segment) -> None:
        extra = segment.manifest.get("extra", {})
        if extra.get("kind") != KIND or not isinstance(extra.get("names"), list):
            raise SegmentError(
                f"segment {segment.name!r} is not a weights channel (no 'kind': {KIND!r} in its "
                "manifest); is it a buffer's name?"
            )
        self.segment = segment
        self.names = [str(n) for n in extra["names"]]
        self.views = {name: segment.columns[(_column(i),)][0] for i, name in enumerate(self.names)}
        self._seq: np.ndarray = segment.generations  # int64 [1]: the seqlock counter

    @property
    def name(self) -> str:
        return self.segment.name

    @property
    def version(self) -> int:
        """Completed publications so far (0: none yet). One int read."""
        return int(self._seq[0]) // 2

    @property
    def nbytes(self) -> int:
        return sum(v.nbytes for v in self.views.values())

    def _check_state(self, flat: Mapping[str, torch.Tensor], what: str) -> None:
        missing = [n for n in self.names if n not in flat]
        unknown = [n for n in flat if n not in self.views]
        if missing or unknown:
            raise SchemaError(
                f"weights channel {self.name!r}: {what} does not match the published layout"
                + (f"; missing {missing}" if missing else "")
                + (f"; not in the channel {unknown}" if unknown else "")
            )
        for name in self.names:
            mine, theirs = self.views[name], flat[name]
            if theirs.dtype != mine.dtype or tuple(theirs.shape) != tuple(mine.shape):
                raise SchemaError(
                    f"weights channel {self.name!r}: {what} entry {name!r} is "
                    f"{dtype_name(theirs.dtype)}{list(theirs.shape)}, the channel holds "
                    f"{dtype_name(mine.dtype)}{list(mine.shape)}"
                )

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class WeightsPublisher(_Channel):
    """The learner's end: creates the channel named ``name`` with the layout (names, dtypes,
    shapes) of ``state`` and publishes it at once (version 1). ``close`` unlinks the channel;
    subscribers keep their last copy.

    Args:
        name: the channel's segment name (1-64 of ``[A-Za-z0-9_.-]``), e.g. ``"<buffer>.weights"``.
        state: an ``nn.Module`` or a flat mapping of names to tensors (any device).
        storage_dir: where the segment lives (default: the buffers' default storage folder).
        exist_ok: replace a channel of that name left behind by a publisher that died.
    """

    def __init__(
        self,
        name: str,
        state: torch.nn.Module | StateDict,
        *,
        storage_dir: str | Path | None = None,
        exist_ok: bool = False,
    ) -> None:
        flat = _flat(state)
        if not flat:
            raise SchemaError(f"weights channel {name!r}: the state has no tensors to publish")
        names = list(flat)
        for entry, tensor in flat.items():
            try:
                dtype_name(tensor.dtype)
            except SchemaError:
                raise SchemaError(
                    f"weights channel {name!r}: entry {entry!r} is {tensor.dtype}, which a "
                    "segment cannot hold; convert it (e.g. to int64) first"
                ) from None
        fields = [
            Field((_column(i),), flat[n].dtype, tuple(flat[n].shape)) for i, n in enumerate(names)
        ]
        segment = Segment.create(
            name,
            Schema(fields),
            1,
            storage_dir=storage_dir,
            extra={"kind": KIND, "names": names},
            exist_ok=exist_ok,
        )
        self._storage_dir = storage_dir
        self._closed = False
        self._bind(segment)
        self.publish(flat)

    def publish(self, state: torch.nn.Module | StateDict) -> int:
        """Copy ``state`` into the channel; returns the new version. Same names, dtypes and
        shapes as at creation (refused, naming the entry, before anything is written)."""
        if self._closed:
            raise SegmentError(f"weights channel {self.name!r} is closed")
        flat = _flat(state)
        self._check_state(flat, "the state to publish")
        # Odd while writing. A copy that broke half way (an interrupt) leaves it odd, so that
        # torn state is never offered; the next publication starts from there.
        writing = int(self._seq[0]) | 1
        self._seq[0] = writing
        with torch.no_grad():
            for name in self.names:
                self.views[name].copy_(flat[name].detach())
        self._seq[0] = writing + 1
        return (writing + 1) // 2

    def close(self) -> None:
        """Unlink the channel (safe twice). Subscribers' mappings stay valid; they see no
        further versions."""
        if self._closed:
            return
        self._closed = True
        self.segment.close()
        Segment.unlink(self.name, self._storage_dir)


class WeightsSubscriber(_Channel):
    """A worker's end: maps the channel ``name``, waiting up to ``timeout`` seconds for the
    publisher to create it.

    ``poll(into)`` copies the newest complete version into ``into`` (an ``nn.Module`` or a
    mapping of tensors with the channel's layout) if it is newer than the one this subscriber
    last copied, and says whether it did; :attr:`seen` is that version.
    """

    def __init__(
        self, name: str, *, timeout: float = 10.0, storage_dir: str | Path | None = None
    ) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                segment = Segment.attach(name, storage_dir=storage_dir, prefault=False)
                break
            except SegmentError as e:  # not there yet, or its manifest not written yet
                if time.monotonic() >= deadline:
                    raise (
                        SegmentNotFoundError
                        if isinstance(e, SegmentNotFoundError)
                        else SegmentError
                    )(f"weights channel {name!r}: not available after {timeout:g}s: {e}") from e
                time.sleep(0.02)
        self._bind(segment)
        self.seen = 0  # the version last copied out (0: none yet)

    def changed(self) -> bool:
        """Whether a newer complete version than :attr:`seen` is published. One int read."""
        return self.version > self.seen

    def poll(self, into: torch.nn.Module | StateDict, *, timeout: float = RETRY_TIMEOUT_S) -> bool:
        """Copy the newest version into ``into`` if it is newer than :attr:`seen`; True if it
        copied. Returns False at once, copying nothing, when nothing changed or a publication
        is being written (try again at the next step).

        Once a copy started, a publication that overlaps it makes it copy again; if that keeps
        happening for ``timeout`` seconds, :class:`WaitTimeoutError` is raised and ``into`` may
        hold a mix of versions (only a publisher in a tight loop over a huge state gets here).
        """
        seq = int(self._seq[0])
        if seq // 2 <= self.seen or seq % 2:
            return False
        targets = _flat(into)
        self._check_state(targets, "the target")
        deadline = time.monotonic() + timeout
        with torch.no_grad():
            while True:
                for name in self.names:
                    targets[name].copy_(self.views[name])
                after = int(self._seq[0])
                if after == seq:
                    self.seen = seq // 2
                    return True
                if time.monotonic() >= deadline:
                    raise WaitTimeoutError(
                        f"weights channel {self.name!r}: every copy for {timeout:g}s overlapped "
                        f"a publication; {type(into).__name__} may hold a mix of versions"
                    )
                while after % 2:  # our target is already dirty: wait for the writer to finish
                    time.sleep(0)
                    after = int(self._seq[0])
                    if time.monotonic() >= deadline:
                        raise WaitTimeoutError(
                            f"weights channel {self.name!r}: a publication has been in progress "
                            f"for {timeout:g}s (did its publisher die?); "
                            f"{type(into).__name__} may hold a mix of versions"
                        )
                seq = after

    def read(self, *, timeout: float = RETRY_TIMEOUT_S) -> tuple[int, dict[str, torch.Tensor]]:
        """A fresh copy of the newest complete version and its number, waiting for a
        publication in progress to finish (up to ``timeout``)."""
        out = {name: torch.empty_like(view) for name, view in self.views.items()}
        deadline = time.monotonic() + timeout
        while True:
            seq = int(self._seq[0])
            if not seq % 2:
                for name, view in self.views.items():
                    out[name].copy_(view)
                if int(self._seq[0]) == seq:
                    return seq // 2, out
            if time.monotonic() >= deadline:
                raise WaitTimeoutError(
                    f"weights channel {self.name!r}: no clean copy within {timeout:g}s"
                )
            time.sleep(0)

    def close(self) -> None:
        """Drop the mapping (safe twice); what was copied out stays."""
        self.segment.close()


__all__ = ["WeightsPublisher", "WeightsSubscriber"]
