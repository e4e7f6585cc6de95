"""TorchRL interop: a TorchRL ``ReplayBuffer`` whose rows live in a shmbuffer daemon.

The one-line change: give a TorchRL replay buffer this storage and writer, in every process
of the job::

    rb = ReplayBuffer(storage=DaemonStorage("mybuf"), writer=DaemonWriter(), batch_size=256)

Workers ``extend`` it, learners ``sample`` it (with TorchRL's own client-side samplers, or with
:class:`DaemonSampler`, which hands the draw to the daemon's sampler, prioritized included,
so ``update_priority`` from any learner reaches the one shared sum tree). What is supported and
what differs from TorchRL's own storages: ``docs/torchrl.md``.

Needs the ``torchrl`` extra (``pip install 'shmbuffer[torchrl]'``); ``import shmbuffer`` never
imports TorchRL, only this package does.
"""

from __future__ import annotations

try:
    import torchrl  # noqa: F401  (checked first: without it nothing below can be imported)
except ImportError as exc:
    raise ImportError(
        "shmbuffer.torchrl needs TorchRL: install the extra with "
        "`pip install 'shmbuffer[torchrl]'` (torchrl==0.14.1)"
    ) from exc

from shmbuffer.torchrl.sampler import DaemonSampler
from shmbuffer.torchrl.storage import DaemonStorage
from shmbuffer.torchrl.writer import DaemonWriter

__all__ = ["DaemonSampler", "DaemonStorage", "DaemonWriter"]
