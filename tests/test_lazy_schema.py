"""The in-process Buffer's lazy schema is fixed by the first batch it accepts, never by one it
refuses (the daemon's Writer keeps the same rule: tests/e2e/test_writer_promises.py)."""

from __future__ import annotations

import numpy as np
import pytest

from shmbuffer import Buffer
from shmbuffer.errors import CapacityError, InvalidArgumentError, SchemaError


@pytest.mark.parametrize("named", [False, True])
def test_a_refused_first_batch_leaves_the_schema_open(named, tmp_path):
    kwargs = {"name": f"lazy-{tmp_path.name}"[:40], "storage_dir": str(tmp_path)} if named else {}
    buf = Buffer(10, **kwargs)
    try:
        with pytest.raises(SchemaError, match="batch dims"):
            buf.extend({"a": np.zeros((5, 1)), "b": np.zeros((3, 2))})
        assert buf.schema is None
        buf.extend({"x": np.arange(3, dtype=np.float32)})
        assert [f.key for f in buf.schema] == [("x",)]
        assert len(buf) == 3
    finally:
        buf.close()


def test_a_first_batch_over_a_fixed_buffers_capacity_leaves_the_schema_open():
    buf = Buffer(10, mode="fixed")
    with pytest.raises(CapacityError):
        buf.extend({"a": np.zeros((15, 2), dtype=np.float32)})
    assert buf.schema is None
    buf.extend({"x": np.arange(3, dtype=np.float32)})
    assert len(buf) == 3


def test_a_first_batch_with_a_bad_priority_leaves_the_schema_open():
    buf = Buffer(10, sampler="prioritized")
    with pytest.raises(InvalidArgumentError):
        buf.extend({"a": np.zeros(3, dtype=np.float32)}, priority=-1.0)
    assert buf.schema is None
    buf.extend({"x": np.arange(3, dtype=np.float32)}, priority=1.0)
    assert len(buf) == 3
