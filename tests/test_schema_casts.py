"""Validation decides every cast before a row is reserved.

A value is stored in a column of another dtype only when the cast is of the same kind *and*
the value fits: integers in the column's range, floats that stay finite. Everything else is a
SchemaError naming the key, raised before anything is evicted; odd inputs (strings, None,
objects, a dotted name for a nested key, a missing batch dimension) get an error that says
what is wrong.
"""

from __future__ import annotations

import warnings
from types import MappingProxyType
from typing import Any

import numpy as np
import pytest
import torch

import shmbuffer.storage.schema as schema_module
from shmbuffer import Buffer
from shmbuffer.errors import SchemaError
from shmbuffer.storage.schema import Schema

SPEC = {
    "u8": {"dtype": "uint8", "shape": []},
    "i32": {"dtype": "int32", "shape": []},
    "f32": {"dtype": "float32", "shape": []},
    "f16": {"dtype": "float16", "shape": []},
    "bf16": {"dtype": "bfloat16", "shape": []},
    "c64": {"dtype": "complex64", "shape": []},
}


def batch(**override: Any) -> dict[str, Any]:
    """Two rows that fit every column, with some keys replaced."""
    base: dict[str, Any] = {
        "u8": np.array([1, 2], dtype=np.uint8),
        "i32": np.array([1, 2], dtype=np.int32),
        "f32": np.array([1.0, 2.0], dtype=np.float32),
        "f16": np.array([1.0, 2.0], dtype=np.float16),
        "bf16": torch.tensor([1.0, 2.0], dtype=torch.bfloat16),
        "c64": np.array([1, 2], dtype=np.complex64),
    }
    return {**base, **override}


def full_buffer() -> Buffer:
    buf = Buffer(6, unit="episode", schema=SPEC)
    for _ in range(3):
        buf.add_episode(batch())
    return buf


def snapshot(buf: Buffer) -> tuple[Any, ...]:
    return (list(buf.container.registry), buf.container.pointer, buf[:][0]["u8"].tolist())


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("u8", np.array([300, -1])),  # int64 into uint8, wrapped: [44, 255]
        ("u8", torch.tensor([300, -1])),
        ("u8", np.array([-1, 3], dtype=np.int8)),
        ("i32", np.array([2**40 + 5, 2**31])),  # would be stored as [5, -2**31]
        ("i32", torch.tensor([1, 2**40])),
        ("f32", np.array([1e300, 1.0])),  # would be stored as inf
        ("f16", np.array([1e6, 1.0])),
        ("f16", np.array([70_000, 1])),  # an int too large for float16
        ("bf16", np.array([1e300, 1.0])),
        ("bf16", torch.tensor([1.0, -1e300], dtype=torch.float64)),
        ("c64", np.array([1 + 1e300j, 2])),
    ],
)
def test_a_value_that_does_not_fit_is_refused_before_anything_is_evicted(
    key: str, value: Any
) -> None:
    buf = full_buffer()
    before = snapshot(buf)
    with pytest.raises(SchemaError, match=rf"key '{key}'.*{SPEC[key]['dtype']}"):
        buf.add_episode(batch(**{key: value}))
    assert snapshot(buf) == before  # nothing evicted, nothing overwritten


@pytest.mark.parametrize(
    ("key", "value", "stored"),
    [
        # numpy's same_kind rule refuses these casts; values that fit are stored all the same
        ("u8", np.array([255, 0]), [255, 0]),
        ("u8", torch.tensor([3, 4]), [3, 4]),
        ("u8", np.array([5, 6], dtype=np.int8), [5, 6]),
        ("i32", np.array([-(2**31), 2**31 - 1]), [-(2**31), 2**31 - 1]),
        ("f16", np.array([65504.0, -65504.0]), [65504.0, -65504.0]),
    ],
)
def test_a_value_that_fits_a_narrower_column_is_stored(key: str, value: Any, stored: Any) -> None:
    buf = full_buffer()
    buf.add_episode(batch(**{key: value}))
    assert buf[-1][key].tolist() == stored
    assert buf.num_rows == 6


def test_rounding_and_nan_and_inf_already_there_are_kept_without_warnings() -> None:
    buf = Buffer(4, schema=SPEC)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # numpy's "overflow encountered in cast" included
        buf.extend(
            batch(
                f32=np.array([0.1, np.nan]),
                f16=np.array([-np.inf, 1e-10]),  # underflow to 0 is rounding, not overflow
                bf16=np.array([np.inf, 3.0e38]),
                c64=np.array([complex(np.nan, 1), complex(1, np.inf)]),
            )
        )
        with pytest.raises(SchemaError, match=r"'f32'.*1e\+300"):  # inf hides no overflow
            buf.extend(batch(f32=np.array([np.inf, 1e300])))
    row = buf[:]
    assert row["f32"][0].item() == pytest.approx(0.1) and np.isnan(row["f32"][1].item())
    assert row["f16"].tolist() == [-np.inf, 0.0]
    assert row["bf16"][0].item() == np.inf and np.isfinite(row["bf16"][1].item())
    assert row["bf16"][1].item() == pytest.approx(3.0e38, rel=1e-2)  # real bits, not garbage
    c64 = row["c64"].numpy()
    assert np.isnan(c64[0].real) and np.isinf(c64[1].imag)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "complex64"])
def test_the_overflow_threshold_is_exact(dtype: str) -> None:
    # Just below it every cast (numpy's, torch's) stays finite; from it on, one would be inf.
    from shmbuffer.storage.schema import _inf_threshold

    column = getattr(torch, dtype)
    limit = _inf_threshold(column)
    below = float(np.nextafter(limit, 0))
    buf = Buffer(4, schema={"x": {"dtype": dtype, "shape": []}})
    buf.extend({"x": np.array([below, -below])})
    assert torch.isfinite(buf[:]["x"].real if buf[:]["x"].is_complex() else buf[:]["x"]).all()
    with pytest.raises(SchemaError, match="overflow"):
        buf.extend({"x": np.array([limit, 0.0])})
    with pytest.raises(SchemaError, match="overflow"):
        buf.extend({"x": np.array([0.0, -limit])})


def test_same_dtype_values_are_not_scanned(monkeypatch: pytest.MonkeyPatch) -> None:
    # The hot path (a batch already in the column's dtype) pays no data pass: only a narrowing
    # cast needs the values' range, on the one-pass check of a plain dict and on the full one.
    scanned: list[Any] = []
    extremes = schema_module._extremes

    def spy(value: Any) -> Any:
        scanned.append(value)
        return extremes(value)

    monkeypatch.setattr(schema_module, "_extremes", spy)
    schema = Schema.from_spec(
        {"x": {"dtype": "int64", "shape": []}, "y": {"dtype": "float32", "shape": []}}
    )
    same = {"x": np.array([2**62, -(2**62)]), "y": np.array([1.0, np.nan], dtype=np.float32)}
    schema.validate(same)  # a plain dict: the one-pass check
    schema.validate(MappingProxyType(same))  # any other mapping: the full check
    schema.validate({"x": torch.tensor([2**62, 1]), "y": torch.tensor([1.0, np.inf])})
    assert scanned == []
    # The spy sees the scan when there is one: float64 values into the float32 column.
    schema.validate({"x": np.array([1, 2]), "y": np.array([1.0, 2.0])})
    assert [value.dtype for value in scanned] == [np.float64]


# -- odd inputs: an error that says what is wrong ----------------------------------------------


def nested_buffer() -> Buffer:
    return Buffer(4, schema={"info.x": {"dtype": "int64", "shape": []}})


def test_a_dotted_batch_key_for_a_nested_schema_key_says_what_differs() -> None:
    with pytest.raises(SchemaError, match=r"'info\.x' is one name.*nested.*\{'info': \{'x'"):
        nested_buffer().extend({"info.x": np.arange(2)})


def test_a_dotted_name_cannot_define_a_schema() -> None:
    # It would come back nested from the manifest (and from a daemon), then never match.
    with pytest.raises(SchemaError, match=r"'a\.b' contains '\.'.*\{'a': \{'b'"):
        Buffer(4).extend({"a.b": np.arange(2)})


@pytest.mark.parametrize("value", [np.array(3), 3, torch.tensor(2.0)])
def test_a_zero_d_value_says_the_batch_dimension_is_missing(value: Any) -> None:
    buf = Buffer(4, schema={"x": {"dtype": "float64", "shape": []}})
    with pytest.raises(SchemaError, match=r"'x'.*without a batch dimension.*value\[None\]"):
        buf.extend({"x": value})
    with pytest.raises(SchemaError, match=r"'x'.*no batch dimension"):
        Buffer(4).extend({"x": value})  # the same when the schema is taken from it


def test_one_row_without_its_batch_dimension_says_so() -> None:
    buf = Buffer(4, schema={"obs": {"dtype": "float32", "shape": [3]}})
    with pytest.raises(SchemaError, match=r"'obs'.*one row.*\[1, 3\]"):
        buf.extend({"obs": np.zeros(3)})


@pytest.mark.parametrize(
    ("value", "what"),
    [
        (["a", "b"], "str"),
        (np.array([b"a", b"b"]), "bytes"),
        ([object(), object()], "Python object"),
        (np.array([1, None], dtype=object), "Python object"),
        (None, "None"),
        ([[1], [1, 2]], "not an array"),
    ],
)
def test_non_numeric_values_name_the_key(value: Any, what: str) -> None:
    buf = nested_buffer()
    with pytest.raises(SchemaError, match=rf"'info\.x'.*{what}"):
        buf.add_episode({"info": {"x": value}})
    with pytest.raises(SchemaError, match=rf"'y'.*{what}"):
        Buffer(4).add_episode({"y": value})  # and when it would define the schema


@pytest.mark.parametrize("episode", [[1, 2], "obs", None, np.zeros(3)])
def test_a_non_mapping_episode_is_a_schema_error(episode: Any) -> None:
    for buf in (Buffer(4), nested_buffer()):
        with pytest.raises(SchemaError, match="must be a mapping"):
            buf.add_episode(episode)
    with pytest.raises(SchemaError, match="must be a mapping"):
        Buffer(4).add_episode(episode, num_envs=2)
    with pytest.raises(SchemaError, match=r"'x'.*not an array"):
        Buffer(4).add_episode({"x": ["a", "b"]}, num_envs=2)


@pytest.mark.parametrize("declared", [False, True], ids=["lazy", "declared"])
def test_arrays_in_the_other_byte_order_are_stored_as_their_values(declared: bool) -> None:
    """A big-endian array (``>f4``, as from a file or a network) holds the same values as a
    native one: it is converted (exactly) and stored, never refused with torch's error."""
    values = {
        "f": np.array([1.5, -2.25, 3e38], dtype=">f4"),
        "i": np.array([1, -2, 2**40], dtype=">i8"),
        "c": np.array([1 + 2j, 3 - 4j, 0j], dtype=">c8"),
        "s": np.array([[1, 2], [3, -32768], [0, 7]], dtype=">i2"),
    }
    spec = {
        "f": {"dtype": "float32", "shape": []},
        "i": {"dtype": "int64", "shape": []},
        "c": {"dtype": "complex64", "shape": []},
        "s": {"dtype": "int16", "shape": [2]},
    }
    buf = Buffer(8, schema=spec if declared else None)
    buf.extend(values)
    buf.extend({k: v.astype(v.dtype.newbyteorder("=")) for k, v in values.items()})
    assert buf.schema is not None and buf.schema.to_spec() == Schema.from_spec(spec).to_spec()
    stored = buf[:]
    for key, value in values.items():
        expected = np.concatenate([value, value]).astype(value.dtype.newbyteorder("="))
        assert np.array_equal(stored[key].numpy(), expected), key
