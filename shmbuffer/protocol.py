"""Public import path of :mod:`shmbuffer.wire.protocol` (where it lives); import from either."""

from shmbuffer.wire.protocol import *  # noqa: F403
