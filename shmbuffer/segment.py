"""Public import path of :mod:`shmbuffer.storage.segment` (where it lives); import from either."""

from shmbuffer.storage.segment import *  # noqa: F403
