"""``DaemonSampler``: a TorchRL ``Sampler`` that leaves the draw to the daemon's sampler.

The daemon runs one sampler for every process of the job (``shmbuffer-daemon start
--sampler NAME``, any of ``shmbuffer.samplers.SAMPLERS``); this sampler asks it for each batch
(``Reader.sample(n, return_info=True)``: one round trip, the rows copied and checked by the
Reader), and ``update_priority`` sends new priorities to it (``Reader.update_priorities``),
so an update made by any learner process changes what every learner samples next: the one
shared sum tree that TorchRL's per-process ``PrioritizedSampler`` cannot give (pytorch/rl
#1397).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torchrl.data.replay_buffers.samplers import Sampler

from shmbuffer.clients.reader import Reader
from shmbuffer.errors import EmptyBufferError
from shmbuffer.samplers.base import check_beta
from shmbuffer.torchrl.storage import _ADAPTERS, daemon_storage_of
from shmbuffer.torchrl.writer import UNKNOWN

__all__ = ["DaemonSampler"]


class DaemonSampler(Sampler):  # type: ignore[misc]  # TorchRL has no type hints
    """Samples through the daemon's configured sampler (needs a :class:`DaemonStorage`).

    ``sample`` returns the daemon's physical rows as indices (indices of the storage, so
    ``rb[index]`` reads them again) and an info dict with TorchRL's ``"priority_weight"``
    (float32 importance weights ``(N * P) ** -beta`` over their largest value; 1 unless the
    daemon is prioritized) and shmbuffer's ``"probability"`` and ``"generation"`` (each row's
    stamp when drawn). ``ReplayBuffer.sample(return_info=True)`` adds ``"index"``.

    ``update_priority(index, priority)`` (``ReplayBuffer.update_priority``) sets priorities in
    the daemon, for rows of any learner's samples. When ``index`` is the index of this
    sampler's last sample, the update carries its stamps too, so rows overwritten since are
    skipped rather than given a priority meant for data that is gone.

    Args:
        beta: the importance exponent for the weights (None: the daemon's
            ``--importance-exponent``).
        alpha: TorchRL's priority exponent, which is the daemon's (``--priority-exponent``,
            set when it starts): a different one is warned of at the first sample (None: not
            checked).
        table: the daemon's table to draw from and set priorities in (``start --table``;
            None: the default one, through the storage's own Reader). Another table is read
            through a Reader of this sampler's, opened with the storage's target and options
            at the first sample.
    """

    def __init__(
        self, *, beta: float | None = None, table: str | None = None, alpha: float | None = None
    ) -> None:
        self.beta = None if beta is None else check_beta(beta)
        if alpha is not None and (isinstance(alpha, bool) or not isinstance(alpha, int | float)):
            raise TypeError(f"alpha must be a number, got {alpha!r}")
        self.alpha = None if alpha is None else float(alpha)
        self._alpha_checked = alpha is None
        if table is not None and not isinstance(table, str):
            raise TypeError(f"table must be a table's name (a str), got {table!r}")
        self.table = table
        self._reader: Reader | None = None  # of ``table``, once a sample needs it
        self._last: tuple[torch.Tensor, torch.Tensor] | None = None  # (index, generation)

    def _reader_of(self, daemon: Any) -> Reader:
        """The Reader that draws for this sampler: the storage's, or one of ``table``."""
        if self.table is None:
            reader: Reader = daemon.reader
            return reader
        if self._reader is None:
            self._reader = Reader(
                daemon.target,
                timeout=daemon.timeout,
                remote=daemon.remote,
                table=self.table,
                **daemon.reader_options,
            )
        return self._reader

    def sample(self, storage: Any, batch_size: int) -> tuple[torch.Tensor, dict[str, Any]]:
        daemon = daemon_storage_of(storage, "DaemonSampler")
        reader = self._reader_of(daemon)
        if not self._alpha_checked:
            self._check_alpha(reader)
        try:
            data, info = reader.sample(batch_size, return_info=True, beta=self.beta)
        except EmptyBufferError as exc:
            if len(daemon) == 0:  # TorchRL's words for it, as its own storages say
                raise RuntimeError(f"Cannot sample from an empty storage: {exc}") from exc
            raise
        index = info["index"]
        daemon._handed = (index, daemon._unwrap(data))  # the get(index) that follows takes it
        self._last = (index, info["generation"])
        return index, {
            "priority_weight": info["weight"],
            "probability": info["probability"],
            "generation": info["generation"],
        }

    def _check_alpha(self, reader: Reader) -> None:
        """Warn once if the daemon's priority exponent is not the ``alpha`` asked for."""
        self._alpha_checked = True
        sampler = reader.stats().get("sampler") or {}
        exponent = (sampler.get("settings") or {}).get("priority_exponent")
        if exponent is None or sampler.get("kind") != "prioritized":
            warnings.warn(
                f"DaemonSampler(alpha={self.alpha}): the daemon's sampler is "
                f"{sampler.get('kind')!r}, not prioritized: start it with `--sampler "
                f"prioritized --priority-exponent {self.alpha}`",
                UserWarning,
                stacklevel=3,
            )
        elif abs(float(exponent) - float(self.alpha or 0.0)) > 1e-9:
            warnings.warn(
                f"DaemonSampler(alpha={self.alpha}): the daemon draws with priority exponent "
                f"{exponent}; alpha is the daemon's, set when it starts "
                f"(`--priority-exponent {self.alpha}`)",
                UserWarning,
                stacklevel=3,
            )

    @property
    def device(self) -> torch.device:
        """Where a sample's indices and weights are (TorchRL's samplers' ``device``): the
        CPU; the daemon keeps the priorities."""
        return torch.device("cpu")

    def update_priority(
        self,
        index: int | torch.Tensor,
        priority: float | torch.Tensor,
        *,
        storage: Any = None,
    ) -> None:
        """Set the priority of rows ``index`` in the daemon (one value, or one per row).
        Indices ``-1`` (what :class:`DaemonWriter` returns for rows it wrote) are skipped:
        give written rows a priority with ``DaemonWriter(priority_key=...)``."""
        if storage is None:
            raise TypeError(
                "DaemonSampler.update_priority needs storage= (ReplayBuffer.update_priority "
                "passes it)"
            )
        daemon = daemon_storage_of(storage, "DaemonSampler")
        if isinstance(index, tuple):  # TorchRL's per-dimension form; this storage has one
            (index,) = index
        index = torch.as_tensor(index).reshape(-1)
        priority = torch.as_tensor(priority)
        if priority.numel() == index.numel():  # one per row, in any shape ([n, 1]: a column)
            priority = priority.reshape(-1)
        known = index != UNKNOWN
        if not bool(known.any()):
            return
        if not bool(known.all()):
            index = index[known]
            if priority.numel() > 1:
                priority = priority.reshape(-1)[known]
        generation = None
        if self._last is not None and torch.equal(self._last[0], index):
            generation = self._last[1]
        self._reader_of(daemon).update_priorities(index, priority, generation)

    def _empty(self) -> None:
        self._last = None

    def dumps(self, path: Any) -> None:
        """Nothing to save: the sampler's state (priorities included) is the daemon's, kept by
        its journal and checkpoints."""

    def loads(self, path: Any) -> None:
        """Nothing to load (see :meth:`dumps`)."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict:
            raise ValueError(f"DaemonSampler keeps no state, got {sorted(state_dict)}")

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.update(_last=None, _rng=None, _reader=None)
        return state

    def __repr__(self) -> str:
        table = "" if self.table is None else f", table={self.table!r}"
        alpha = "" if self.alpha is None else f", alpha={self.alpha}"
        return f"DaemonSampler(beta={self.beta}{alpha}{table})"


_ADAPTERS["sampler"] = DaemonSampler
