"""Episodes to and from Minari datasets (local ones, under ``MINARI_DATASETS_PATH``).

Minari keeps, per episode of N steps, N+1 observations and N actions, rewards, terminations
and truncations, plus ``infos``. A buffer's episode maps onto it by key (:data:`ROLES`, the
first key of each list present in the schema):

- observations: the ``obs`` rows (a ``Box``; a ``Dict`` of them for nested keys such as
  ``obs.pos``) and, as the N+1-th, the last row of ``next.obs`` (the last ``obs`` again where
  the buffer has no ``next.obs``);
- actions, rewards, terminations, truncations: ``action``; ``reward`` or ``next.reward``;
  ``terminated``, ``next.terminated``, ``done`` or ``next.done``; ``truncated`` or
  ``next.truncated`` (zeros where absent);
- every other key in ``infos`` under its dotted name, N+1 rows as Gymnasium's infos are (row 0
  the reset's: zeros; row t+1 step t's), and ``next.obs`` there too: a buffer's ``next.obs``
  need not be the next row's ``obs`` (a relabelled goal, an episode cut by the ring), and a
  round trip keeps every byte. Every episode has the same infos (one Arrow schema per
  dataset), so ``next.obs`` is kept whole for all, at the cost of its size again.

The schema, which key took which role and the buffer's own names go in the dataset's metadata
(``shmbuffer``); each episode's metadata in its episode metadata (``shmbuffer``). Written with
Minari's ``arrow`` storage, without JPEG (lossless), a batch of episodes at a time.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from shmbuffer.errors import ConfigError
from shmbuffer.offline.cut import Episode, array_dtype
from shmbuffer.storage.schema import Schema, key_str

#: Minari's name -> the buffer keys that may fill it, first present wins.
ROLES = {
    "actions": ("action",),
    "rewards": ("reward", "next.reward"),
    "terminations": ("terminated", "next.terminated", "done", "next.done"),
    "truncations": ("truncated", "next.truncated"),
}
OBS, NEXT_OBS = "obs", "next.obs"
FORMAT = "shmbuffer-minari"
VERSION = 1
BATCH_EPISODES = 256


def _minari() -> Any:
    try:
        import minari
    except ImportError as exc:
        raise ConfigError(
            "Minari export and import need minari: pip install 'shmbuffer[offline]'"
        ) from exc
    return minari


def _group(schema: Schema, prefix: str) -> list[str]:
    """The dotted keys at or under ``prefix``."""
    keys = [key_str(f.key) for f in schema]
    return [k for k in keys if k == prefix or k.startswith(prefix + ".")]


def _space(schema: Schema, keys: list[str], prefix: str) -> Any:
    import gymnasium as gym

    def box(key: str) -> Any:
        f = schema[key]
        dtype = array_dtype(f)
        if dtype.kind == "f":
            low, high = -np.inf, np.inf
        elif dtype.kind == "b":
            low, high = 0, 1
        else:
            info = np.iinfo(dtype)
            low, high = info.min, info.max
        return gym.spaces.Box(low, high, shape=tuple(f.shape), dtype=dtype)

    if keys == [prefix]:
        return box(prefix)
    return gym.spaces.Dict({k[len(prefix) + 1 :]: box(k) for k in keys})


def _values(keys: list[str], prefix: str, columns: dict[str, np.ndarray]) -> Any:
    if keys == [prefix]:
        return columns[prefix]
    return {k[len(prefix) + 1 :]: columns[k] for k in keys}


def roles(schema: Schema) -> dict[str, str | None]:
    keys = {key_str(f.key) for f in schema}
    return {role: next((k for k in names if k in keys), None) for role, names in ROLES.items()}


def write_minari(
    episodes: Iterator[list[Episode]],
    dataset_id: str,
    schema: Schema,
    meta_kinds: dict[str, str],
    source: dict[str, Any],
    progress: Callable[[int], None] | None = None,
) -> str:
    """Write every batch of ``episodes`` as the local Minari dataset ``dataset_id``; its path."""
    minari = _minari()
    from minari.data_collector.episode_buffer import EpisodeBuffer
    from minari.dataset.minari_storage import MinariStorage
    from minari.storage.datasets_root_dir import get_dataset_path

    obs = _group(schema, OBS)
    if not obs:
        raise ConfigError(f"minari:{dataset_id}: the schema has no {OBS!r} key for observations")
    role = roles(schema)
    if role["actions"] is None:
        raise ConfigError(f"minari:{dataset_id}: the schema has no 'action' key for actions")
    nxt = _group(schema, NEXT_OBS)
    nxt_sub = [k[len("next.") :] for k in nxt]
    if nxt and sorted(nxt_sub) != sorted(obs):
        raise ConfigError(f"minari:{dataset_id}: {NEXT_OBS} keys {nxt} do not match {obs}")
    taken = {*obs, *nxt, *(k for k in role.values() if k)}
    extra = [key_str(f.key) for f in schema if key_str(f.key) not in taken]

    path = get_dataset_path(dataset_id)
    if path.exists():
        raise ConfigError(f"minari:{dataset_id}: a dataset with that id exists at {path}")
    (path / "data").mkdir(parents=True)
    storage = MinariStorage.new(
        path / "data",
        observation_space=_space(schema, obs, OBS),
        action_space=_space(schema, [role["actions"]], role["actions"]),
        data_format="arrow",
        jpeg_encoding=False,
    )
    done, count = 0, 0
    for batch in episodes:
        buffers, metas = [], []
        for ep in batch:
            cols, n = ep.columns, ep.length
            final = {k: (cols["next." + k] if nxt else cols[k])[-1:] for k in obs}
            observations = {k: np.concatenate([cols[k], final[k]]) for k in obs}
            infos: dict[str, np.ndarray] = {}
            for key in extra:
                infos[key] = _shifted(cols[key])
            for k in nxt:  # whole, every episode: Minari's columns are one per dataset
                infos[k] = _shifted(cols[k])
            zeros = np.zeros(n, dtype=bool)
            buffers.append(
                EpisodeBuffer(
                    id=count,
                    observations=_values(obs, OBS, observations),
                    actions=cols[role["actions"]],
                    rewards=cols[role["rewards"]] if role["rewards"] else np.zeros(n),
                    terminations=cols[role["terminations"]] if role["terminations"] else zeros,
                    truncations=cols[role["truncations"]] if role["truncations"] else zeros,
                    infos=infos or None,
                )
            )
            metas.append({"shmbuffer": ep.meta})
            count += 1
            done += n * schema.row_nbytes
        storage.update_episodes(buffers)
        storage.update_episode_metadata(metas, range(count - len(batch), count))
        if progress is not None:
            progress(done)
    storage.update_metadata(
        {
            "dataset_id": dataset_id,
            "minari_version": str(minari.__version__),
            "shmbuffer": {
                "format": FORMAT,
                "version": VERSION,
                "schema": schema.to_spec(),
                "roles": role,
                "meta_kinds": meta_kinds,
                "source": source,
            },
        }
    )
    return str(path)


def _shifted(values: np.ndarray) -> np.ndarray:
    """``values`` as infos rows: a row of zeros (the reset's) first; a scalar's as rows of
    one (minari 0.5 cannot read back the infos of one-dimensional arrays)."""
    values = values.reshape(len(values), -1) if values.ndim == 1 else values
    return np.concatenate([np.zeros_like(values[:1]), values])


class MinariSource:
    """A local Minari dataset read as a buffer's episodes, a batch at a time."""

    def __init__(self, dataset_id: str) -> None:
        _minari()
        from minari.dataset.minari_storage import MinariStorage
        from minari.storage.datasets_root_dir import get_dataset_path

        path = get_dataset_path(dataset_id) / "data"
        if not path.is_dir():
            root = os.environ.get("MINARI_DATASETS_PATH", "~/.minari/datasets")
            raise ConfigError(f"minari:{dataset_id}: no local dataset of that id under {root}")
        self.storage = MinariStorage.read(path)
        info = self.storage.metadata.get("shmbuffer")
        if not isinstance(info, dict) or info.get("format") != FORMAT:
            raise ConfigError(
                f"minari:{dataset_id}: not written by shmbuffer's export (no 'shmbuffer' "
                "metadata: the schema and which key is which)"
            )
        self.schema = Schema.from_spec(info["schema"])
        self.roles: dict[str, str | None] = dict(info["roles"])
        self.meta_kinds: dict[str, str] = dict(info.get("meta_kinds") or {})
        self.num_episodes = int(self.storage.total_episodes)
        self._nbytes = int(self.storage.total_steps) * self.schema.row_nbytes

    @property
    def nbytes(self) -> int:
        return self._nbytes

    def batches(self) -> Iterator[list[Episode]]:
        obs = _group(self.schema, OBS)
        nxt = _group(self.schema, NEXT_OBS)
        keys = [key_str(f.key) for f in self.schema]
        for first in range(0, self.num_episodes, BATCH_EPISODES):
            ids = range(first, min(first + BATCH_EPISODES, self.num_episodes))
            metas = list(self.storage.get_episode_metadata(ids))
            batch = []
            for data, meta in zip(self.storage.get_episodes(ids), metas, strict=True):
                batch.append(self._episode(data, meta, obs, nxt, keys))
            yield batch

    def _episode(
        self,
        data: dict[str, Any],
        meta: dict[str, Any],
        obs: list[str],
        nxt: list[str],
        keys: list[str],
    ) -> Episode:
        observations = data["observations"]
        if not isinstance(observations, dict):
            observations = {OBS: observations}
        else:
            observations = {f"{OBS}.{k}": v for k, v in observations.items()}
        infos = data.get("infos") or {}
        cols: dict[str, np.ndarray] = {}
        for k in obs:
            cols[k] = observations[k][:-1]
        for k in nxt:
            cols[k] = infos[k][1:] if k in infos else observations[k[len("next.") :]][1:]
        for role, key in self.roles.items():
            if key is not None:
                cols[key] = data[role]
        for k in keys:
            if k not in cols:
                cols[k] = infos[k][1:]
        length = len(cols[obs[0]])
        cols = {
            k: np.asarray(cols[k], dtype=array_dtype(self.schema[k])).reshape(
                length, *self.schema[k].shape
            )
            for k in keys
        }
        return Episode([(0, length)], dict(meta.get("shmbuffer") or {}), cols)
