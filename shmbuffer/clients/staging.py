"""The Writer's staging area: small writes gathered to be stored in one reservation.

A small write (a chunk of transitions of small rows) is copied here as it arrives, so the
caller may reuse its arrays, and stored later with the writes around it in one round trip.
Each column has one preallocated array (``capacity`` rows, the column's dtype), and a write is
copied into the next free rows with the cast to that dtype (validated already: the values
fit), so storing the gathered rows is one copy per column that cannot fail, not one per write.
A write numpy cannot view (bfloat16, a CUDA tensor, one that requires grad) or one that would
not fit is kept as a private copy of its own instead (:func:`~shmbuffer.storage.rows.owned_slice`).

Measured with one small-row writer into a daemon (f32[64] + three scalars, chunks of 200
rows): 6.0 M rows/s with a fresh copy per leaf and one store per chunk, 6.8 M with this.

Not thread-safe; the Writer holds its lock around every call.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from shmbuffer.storage import rows
from shmbuffer.storage.schema import Schema

#: A run of staged rows: ``(leaves, first_row, num_rows)``, as :func:`shmbuffer.storage.rows.write`
#: takes them (the leaves hold rows ``first_row:first_row + num_rows`` of the run).
Piece = tuple[dict[Any, Any], int, int]


class Staging:
    """Rows of small writes, in arrival order; see the module docstring."""

    def __init__(self, schema: Schema, capacity: int) -> None:
        self._schema = schema
        self._capacity = max(1, capacity)
        # numpy has no bfloat16: such a column's writes are kept as copies of their own
        self._preallocate = all(f.dtype != torch.bfloat16 for f in schema.fields)
        self._columns: dict[Any, np.ndarray] | None = None  # allocated on first use
        self._used = 0  # rows of the columns holding staged data
        self._pieces: list[Piece] = []
        self.rows = 0

    def add(self, leaves: dict[Any, Any], first_row: int, num_rows: int) -> None:
        """Copy rows ``first_row:first_row + num_rows`` of validated ``leaves``."""
        sources = self._viewable(leaves)
        if sources is None or self._used + num_rows > self._capacity:
            schema = self._schema
            copy = {
                k: rows.owned_slice(v, first_row, num_rows, schema[k].dtype)
                for k, v in leaves.items()
            }
            self._pieces.append((copy, 0, num_rows))
        else:
            columns = self._allocated()
            at, end = self._used, self._used + num_rows
            for key, src in sources.items():
                np.copyto(columns[key][at:end], src[first_row : first_row + num_rows], "unsafe")
            self._used = end
            last = self._pieces[-1] if self._pieces else None
            if last is not None and last[0] is columns and last[1] + last[2] == at:
                self._pieces[-1] = (columns, last[1], last[2] + num_rows)  # one run, grown
            else:
                self._pieces.append((columns, at, num_rows))
        self.rows += num_rows

    def take(self) -> list[Piece]:
        """The staged runs, oldest first, and an empty staging area. The runs in the
        preallocated columns stay valid until the next :meth:`add`."""
        pieces, self._pieces = self._pieces, []
        self._used = self.rows = 0
        return pieces

    def __bool__(self) -> bool:
        return bool(self._pieces)

    def _viewable(self, leaves: dict[Any, Any]) -> dict[Any, np.ndarray] | None:
        """Every leaf as a numpy view, or None if one has none."""
        if not self._preallocate:
            return None
        out = {}
        for key, value in leaves.items():
            array = rows.as_numpy(value)
            if array is None:
                return None
            out[key] = array
        return out

    def _allocated(self) -> dict[Any, np.ndarray]:
        if self._columns is None:
            self._columns = {
                field.key: np.empty((self._capacity, *field.shape), rows.numpy_dtype(field.dtype))
                for field in self._schema.fields
            }
        return self._columns
