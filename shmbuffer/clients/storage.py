"""``Storage``: a drop-in for the seed framework's (RLightning's) storage backend.

Code written against the seed's ``Storage`` ports by changing its import: the constructor takes
the seed's arguments (all optional here) and the methods keep the seed's names and behaviour —
EnvRet/PolicyResponse pairing (:meth:`Storage.add_transition`, :meth:`Storage.add_data_async`),
episode assembly ended by ``last_terminated``/``last_truncated`` or by hand
(:meth:`Storage.truncate_episodes`), the seed's default postprocess (N steps → N-1 rows), and
reads that return a ``dict`` for a single TensorDict result.

By default the rows live in an in-process :class:`~shmbuffer.Buffer`. With ``daemon=`` (a
buffer name or endpoint) they go to a daemon through a :class:`~shmbuffer.clients.writer.Writer`
instead; reading through a daemon is the job of ``shmbuffer.Reader``, so the read methods then
raise :class:`NotImplementedError`.

Where the seed was wrong this class is not: unknown modes are refused, an async pair is stored
once as a fresh dict, a second truncate of the same env is a no-op, indices are checked against
what is stored and episodes are indexed in the order they were written.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from tensordict import TensorDict

from shmbuffer.api.episodes import SEED_DONE_KEYS
from shmbuffer.api.hooks import (
    PreprocessFn,
    TransitionPairer,
    default_postprocess_fn,
    env_id_of,
    is_env_ret,
)
from shmbuffer.api.reads import Index, normalize_index
from shmbuffer.buffer import Buffer
from shmbuffer.clients.writer import Writer
from shmbuffer.names import MODES, UNITS, check_choice

__all__ = ["Storage"]

logger = logging.getLogger(__name__)

PostprocessFn = Callable[[dict[str, list[Any]]], Mapping[str, Any]]

#: Rows of the in-process buffer when no capacity is given.
DEFAULT_CAPACITY = 100_000


class Storage:
    """The seed's storage API over a :class:`~shmbuffer.Buffer` (or a daemon's Writer).

    Args:
        capacity: rows the buffer holds (None: 100,000).
        mode: ``"circular"`` or ``"fixed"`` (None: circular); anything else raises
            :class:`ValueError`.
        unit: ``"transition"`` or ``"episode"`` (None: transition).
        env_meta_list: objects with ``env_id`` and ``num_envs`` (vector envs); None: all single.
        device: where read results are put (rows are stored in host memory).
        obs_preprocessor, reward_preprocessor, env_ret_preprocess_fn,
        policy_resp_preprocess_fn, preprocess_fn: the seed's preprocess hooks
            (:mod:`shmbuffer.api.hooks`), any combination, as the seed: ``preprocess_fn`` gets
            the other four as arguments on every call.
        postprocess_fn: turns a finished episode's ``{key: [per-step values]}`` into rows;
            :func:`~shmbuffer.api.hooks.default_postprocess_fn` by default.
        auto_truncate_episode: end an env's episode when ``last_terminated`` or
            ``last_truncated`` is true; otherwise episodes end only by
            :meth:`truncate_episodes` / :meth:`truncate_one_episode`.
        name: with the in-process buffer, a shared-memory segment name (None: private memory).
        daemon: a daemon's buffer name or endpoint to write to instead of an in-process buffer.
            The daemon's buffer is already configured, so ``capacity``, ``mode`` and ``unit``
            given here must match it (:class:`ValueError` naming each that differs); leave
            them None to take whatever the daemon has.
        seed: seeds the in-process buffer's sampler.
    """

    def __init__(
        self,
        capacity: int | None = None,
        mode: str | None = None,
        unit: str | None = None,
        env_meta_list: Iterable[Any] | None = None,
        device: str | torch.device = "cpu",
        obs_preprocessor: Callable[[Any], Any] | None = None,
        reward_preprocessor: Callable[[Any], Any] | None = None,
        env_ret_preprocess_fn: Callable[[Any], Any] | None = None,
        policy_resp_preprocess_fn: Callable[[Any], Any] | None = None,
        preprocess_fn: PreprocessFn | None = None,
        postprocess_fn: PostprocessFn | None = None,
        auto_truncate_episode: bool = True,
        *,
        name: str | None = None,
        daemon: str | None = None,
        seed: int | None = None,
    ) -> None:
        requested = _requested_config(capacity, mode, unit)
        self.device = torch.device(device)
        self.auto_truncate_episode = auto_truncate_episode
        self.env_meta_list = None if env_meta_list is None else list(env_meta_list)
        num_envs = _num_envs_of(self.env_meta_list)
        self._pairer = TransitionPairer(
            preprocess_fn,
            obs_preprocessor=obs_preprocessor,
            reward_preprocessor=reward_preprocessor,
            env_ret_preprocess_fn=env_ret_preprocess_fn,
            policy_resp_preprocess_fn=policy_resp_preprocess_fn,
        )
        postprocess = default_postprocess_fn if postprocess_fn is None else postprocess_fn
        self.timing_raw: dict[str, dict[str, float]] = {}
        self.backend: Buffer | Writer
        if daemon is None:
            self.backend = Buffer(
                requested.get("capacity", DEFAULT_CAPACITY),
                unit=requested.get("unit", "transition"),
                mode=requested.get("mode", "circular"),
                name=name,
                num_envs=num_envs,
                auto_truncate=auto_truncate_episode,
                done_keys=SEED_DONE_KEYS,
                postprocess_fn=postprocess,
                seed=seed,
            )
        else:
            self.backend = Writer(
                daemon,
                num_envs=num_envs,
                auto_truncate=auto_truncate_episode,
                done_keys=SEED_DONE_KEYS,
                postprocess_fn=postprocess,
            )
            try:
                _check_daemon_config(daemon, requested, self.backend)
            except BaseException:
                self.backend.close()  # an unclosed Writer would hold its socket and context
                raise
        self.daemon = daemon
        self._closed = False

    # -- configuration ------------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        return self.backend.capacity

    @property
    def mode(self) -> str:
        return self.backend.mode

    @property
    def unit(self) -> str:
        return self.backend.unit

    @property
    def buffer(self) -> Buffer:
        """The in-process buffer; raises :class:`NotImplementedError` when writing to a daemon."""
        if not isinstance(self.backend, Buffer):
            raise NotImplementedError(
                f"this Storage writes to the daemon {self.daemon!r}: reads through a daemon "
                "are the job of shmbuffer.Reader (connect one to the same buffer)"
            )
        return self.backend

    # -- sizes ----------------------------------------------------------------------------------

    def __len__(self) -> int:
        """Stored transitions (transition unit) or episodes (episode unit)."""
        return len(self.buffer)

    def __bool__(self) -> bool:
        return True if self.daemon is not None else len(self) > 0

    @property
    def size(self) -> int:
        return len(self)

    def get_size(self) -> int:
        return len(self)

    # -- reading ------------------------------------------------------------------------------

    def __getitem__(self, idx: Index) -> dict[str, Any] | list[TensorDict]:
        """Logical indexing (0 the oldest, -1 the newest transition or episode): a ``dict``
        for a single TensorDict result as in the seed; unequal-length episodes stay a list."""
        buffer = self.buffer
        positions, scalar = normalize_index(idx, len(buffer))  # IndexError when out of range
        if not scalar and positions.size == 0:
            # Nothing selected: no episodes, or no keys before the first write (Buffer raises).
            if buffer.unit == "episode":
                return []
            if buffer.segment is None:
                return {}
        ret = self._to_device(buffer[idx])
        if isinstance(ret, TensorDict):
            out: dict[str, Any] = ret.to_dict()
            return out
        return ret

    def get_data(self) -> TensorDict | list[TensorDict]:
        """Everything stored, oldest first: ``[rows]`` in transition unit; in episode unit
        ``[episodes, L]`` when the lengths agree, else a list of episodes (as the seed)."""
        buffer = self.buffer
        if len(buffer) == 0:
            return TensorDict({}, batch_size=[0], device=self.device)
        return self._to_device(buffer.get_data())

    def _to_device(self, data: TensorDict | list[TensorDict]) -> TensorDict | list[TensorDict]:
        if self.device.type == "cpu":
            return data
        if isinstance(data, list):
            return [td.to(self.device) for td in data]
        return data.to(self.device)

    # -- writing ------------------------------------------------------------------------------

    def add_transition(self, env_ret: Any, policy_resp: Any) -> None:
        """Add the transition of a matching EnvRet / PolicyResponse pair (env ids must agree).
        With auto truncation, a done flag on it writes its finished episode."""
        with self._timed("add_transition"):
            transition = self._pairer.pair(env_ret, policy_resp)
            self.backend.add_transition(env_id_of(env_ret), transition)

    def add_data_async(self, item: Any) -> None:
        """Add an EnvRet (opens its env's transition) or a PolicyResponse (completes it, and
        the completed transition is added once). Raises TypeError for anything else."""
        with self._timed("add_data_async"):
            transition = self._pairer.add_async(item, is_env_ret=is_env_ret(item))
            if transition is not None:
                self.backend.add_transition(env_id_of(item), transition)

    def add_episode(self, episode: Mapping[str, Any] | TensorDict, num_envs: int = 1) -> None:
        """Write a finished episode of rows; with ``num_envs > 1`` leaves are
        ``[L, num_envs, ...]`` and each sub-env becomes its own episode."""
        with self._timed("add_episode"):
            self.backend.add_episode(episode, num_envs=num_envs)

    def truncate_episodes(self, env_ids: Iterable[str]) -> None:
        """End the pending episodes of ``env_ids`` now and write them."""
        for env_id in env_ids:
            self.truncate_one_episode(env_id)

    def truncate_one_episode(self, item: str | Any) -> None:
        """End one env's pending episode (``item``: an env id or an object with ``env_id``);
        a no-op when nothing is pending. All sub-envs of a vector env end together."""
        if isinstance(item, str):
            env_id = item
        elif hasattr(item, "env_id"):
            env_id = str(item.env_id)
        else:
            raise TypeError(
                f"expected an env id str or an object with an env_id attribute, "
                f"got {type(item).__name__}"
            )
        with self._timed("truncate_one_episode"):
            self.backend.end_episode(env_id)

    def flush(self) -> None:
        """Wait until everything written is visible (a no-op for the in-process buffer)."""
        if isinstance(self.backend, Writer):
            self.backend.flush()

    def clear(self) -> None:
        """Drop every stored row, pending step and half-paired transition."""
        self.buffer.clear()
        self._pairer.clear()

    # -- lifecycle ----------------------------------------------------------------------------

    def close(self) -> None:
        """Release the buffer's memory (or flush and disconnect the Writer). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.backend.close()

    def __enter__(self) -> Storage:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        where = f"daemon={self.daemon!r}" if self.daemon is not None else f"{self.backend!r}"
        return f"Storage({where})"

    # -- timing (the seed's print_timing_summary) ---------------------------------------------

    @contextmanager
    def _timed(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            stats = self.timing_raw.setdefault(name, {"count": 0, "total": 0.0, "avg": 0.0})
            stats["count"] += 1
            stats["total"] += time.perf_counter() - start
            stats["avg"] = stats["total"] / stats["count"]

    def print_timing_summary(self, reset: bool = False) -> None:
        """Log (at debug level) call counts and times of the write methods, in the seed's
        format: log scrapers and tests match on its header and lines."""
        logger.debug("Buffer storage timing:")
        for name, stats in dict(self.timing_raw).items():  # a snapshot, as the seed
            logger.debug(
                "%-28s count=%-3d total=%.6fs avg=%.6fs",
                name,
                stats["count"],
                stats["total"],
                stats["avg"],
            )
        if reset:
            self.timing_raw = {}


def _requested_config(capacity: Any, mode: Any, unit: Any) -> dict[str, Any]:
    """The settings the caller gave (None: not given), validated before anything is built."""
    requested: dict[str, Any] = {}
    if capacity is not None:
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 1:
            raise ValueError(f"capacity must be a positive int or None, got {capacity!r}")
        requested["capacity"] = capacity
    if mode is not None:
        requested["mode"] = check_choice("mode", mode, MODES)
    if unit is not None:
        requested["unit"] = check_choice("unit", unit, UNITS)
    return requested


def _check_daemon_config(daemon: str, requested: Mapping[str, Any], served: Writer) -> None:
    """Refuse a daemon whose buffer differs from what the caller asked for, naming each
    setting (the wording of ``start --resume``): a silent difference would have the program
    run on, say, 200 rows in transition unit where it asked for 10**6 episodes' worth."""
    conflicts = [
        f"{key}: requested {want}, daemon has {got}"
        for key, want in requested.items()
        if want != (got := getattr(served, key))
    ]
    if conflicts:
        flags = " ".join(f"--{key} {want}" for key, want in requested.items())
        raise ValueError(
            f"Storage(daemon={daemon!r}) does not match the daemon's buffer: "
            f"{'; '.join(conflicts)}. Pass None for a setting to take the daemon's, or start "
            f"the daemon with {flags}."
        )


def _num_envs_of(env_meta_list: Sequence[Any] | None) -> dict[str, int] | None:
    """``{env_id: num_envs}`` from duck-typed env metas (None when there are none)."""
    if env_meta_list is None:
        return None
    out: dict[str, int] = {}
    for meta in env_meta_list:
        if not hasattr(meta, "env_id") or not hasattr(meta, "num_envs"):
            raise TypeError(
                f"env_meta_list items need env_id and num_envs attributes, "
                f"got {type(meta).__name__}"
            )
        out[str(meta.env_id)] = meta.num_envs
    return out
