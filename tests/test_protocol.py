"""The wire protocol: spec and code agree; validation refuses bad requests by naming the field;
the codec never raises anything but ShmBufferError subclasses on hostile input."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shmbuffer.errors import (
    ProtocolError,
    ShmBufferError,
    VersionMismatchError,
    all_codes,
    error_from_code,
)
from shmbuffer.wire.protocol import (
    MAX_HEADER_BYTES,
    MAX_INT,
    PROTOCOL_MAJOR,
    PROTOCOL_VERSION,
    REPLIES,
    REQUESTS,
    Spec,
    decode,
    encode,
    error_reply,
    ok_reply,
    request,
    validate_request,
)

SPEC = Path(__file__).resolve().parent.parent / "docs" / "protocol.md"

#: One valid request per op (required fields only, plus every optional one in GOOD_FULL).
GOOD: dict[str, dict[str, Any]] = {
    "hello": {"role": "writer", "pid": 123, "host": "h"},
    "bye": {},
    "ping": {},
    "stats": {},
    "define_schema": {"schema": {"obs": {"dtype": "float32", "shape": [3]}}},
    "reserve": {"rows": 4},
    "commit": {"reservation": 1},
    "abort": {"reservation": 1},
    "write": {"rows": 4},
    "sample": {"kind": "rows", "n": 8},
    "update_priorities": {"index": bytes(16), "priority": bytes(16)},
    "iterate": {"rank": 0, "world_size": 1},
    "read": {"rows": bytes(8), "gens": bytes(8)},
    "rewrite": {"rows": bytes(8)},
    "drawn": {"rows": 2, "samples": 1},
    "episodes": {},
    "release": {"lease": 1},
    "renew": {"lease": 1},
    "clear": {},
    "shutdown": {},
    "checkpoint": {"to": "/tmp/ckpt"},
    "configure": {"min_size": 3},
}
GOOD_FULL: dict[str, dict[str, Any]] = {
    **GOOD,
    "hello": {"role": "reader", "pid": 0, "host": "h", "remote": True},
    "reserve": {
        "rows": 4,
        "episodes": 2,
        "commit": 3,
        "timeout_ms": 0,
        "priority": bytes(32),
        "metas": [[3, {"ret": 1.5}]],
        "tables": ["replay"],
    },
    "commit": {"reservation": 1, "priority": 0.5, "meta": {"env": "e3"}},
    "write": {
        "rows": 4,
        "episodes": 4,
        "timeout_ms": 3_600_000,
        "priority": 2,
        "meta": {},
        "tables": ["a", "b"],
    },
    "sample": {
        "kind": "slices",
        "n": 1 << 20,
        "length": 5,
        "lease": False,
        "payload": True,
        "release": 7,
        "strict": False,
        "beta": 0.4,
        "info": True,
        "timeout_ms": 100,
        "where": "ret > 1",
    },
    "episodes": {"where": "ret > 1 and env == 'e3'", "order_by": "-ret", "limit": 10},
    "update_priorities": {"index": bytes(16), "priority": bytes(16), "generation": bytes(16)},
    "iterate": {"rank": 3, "world_size": 4, "shuffle": False, "drop_last": True, "epoch": 7},
    "shutdown": {"keep": True},
    "configure": {"samples_per_insert": 2.5, "min_size": 0, "error_buffer": 10},
    "rewrite": {"rows": bytes(16), "keys": ["obs"], "generation": bytes(16), "timeout_ms": 0},
}


def spec_text() -> str:
    return SPEC.read_text()


# -- spec <-> code ---------------------------------------------------------------------------


def test_good_tables_cover_every_op() -> None:
    assert set(GOOD) == set(REQUESTS) == set(GOOD_FULL)


def test_spec_version_matches_code() -> None:
    lines = [line for line in spec_text().splitlines() if line.strip()]
    assert lines[0].startswith("# ")
    match = re.fullmatch(r"Protocol version: (\d+\.\d+)", lines[1].strip())
    assert match, f"second non-empty line must be 'Protocol version: X.Y', got {lines[1]!r}"
    assert match.group(1) == PROTOCOL_VERSION
    assert int(PROTOCOL_VERSION.split(".")[0]) == PROTOCOL_MAJOR


@pytest.mark.parametrize("op", sorted(REQUESTS))
def test_spec_documents_every_op_and_its_fields(op: str) -> None:
    text = spec_text()
    assert re.search(rf"^#+ `{op}`\s*$", text, re.MULTILINE), f"no heading for op {op!r}"
    section = text.split(f"`{op}`\n", 1)[1].split("\n#", 1)[0]
    for name in REQUESTS[op]:
        assert f"`{name}`" in section, f"op {op!r}: field {name!r} is not documented"


@pytest.mark.parametrize("code", all_codes())
def test_spec_documents_every_error_code(code: str) -> None:
    assert f"`{code}`" in spec_text()


def test_error_codes_round_trip_to_classes() -> None:
    for code in all_codes():
        exc = error_from_code(code, "boom")
        assert exc.code == code
        assert str(exc) == "boom"
    assert type(error_from_code("no-such-code", "x")) is ShmBufferError


def test_every_error_class_is_a_top_level_name() -> None:
    """A caller catches ``shmbuffer.WaitTimeoutError``, the name the docs use, and it is the
    class a reply's code turns into."""
    import shmbuffer
    from shmbuffer import errors

    classes = {
        name: cls
        for name, cls in vars(errors).items()
        if isinstance(cls, type) and issubclass(cls, ShmBufferError)
    }
    assert "WaitTimeoutError" in classes and "EmptyBufferError" in classes
    for name, cls in classes.items():
        assert getattr(shmbuffer, name) is cls, name
        assert name in shmbuffer.__all__, name


# -- spec <-> code, both ways: ops, request and reply fields with their types, error codes ---

#: The type words of the spec's tables (`X or Y` for either) and the Python types they mean.
DOC_TYPES: dict[str, tuple[type, ...]] = {
    "int": (int,),
    "float": (float,),
    "number": (float, int),
    "bool": (bool,),
    "str": (str,),
    "map": (dict,),
    "bin": (bytes,),
    "list": (list,),
    "nil": (type(None),),
}


def op_sections() -> dict[str, str]:
    """The text under each ``### `op``` heading of the spec's Ops chapter."""
    chapter = spec_text().split("\n## Ops\n", 1)[1].split("\n## ", 1)[0]
    parts = re.split(r"^### `(\w+)`[ \t]*$", chapter, flags=re.MULTILINE)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def doc_table(text: str, first_column: str) -> dict[str, tuple[set[type], str]]:
    """The rows of the tables in ``text`` whose header starts with ``first_column``:
    name -> (the Python types of its type cell, its last cell)."""
    rows: dict[str, tuple[set[type], str]] = {}
    inside = False
    for line in text.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if not line.startswith("|"):
            inside = False
        elif cells[0] == first_column:
            inside = True
        elif inside and not set(cells[0]) <= {"-", " "}:
            name = cells[0].strip("`")
            assert name not in rows, f"{name!r} documented twice"
            words = [part.split()[0] for part in cells[1].split(" or ")]
            unknown = [w for w in words if w not in DOC_TYPES]
            assert not unknown, f"{name!r}: type {cells[1]!r} is not one of {sorted(DOC_TYPES)}"
            rows[name] = ({t for w in words for t in DOC_TYPES[w]}, cells[-1])
    return rows


def doc_replies(sections: dict[str, str], op: str) -> dict[str, set[type]]:
    """The reply table of ``op``; a map row saying "as in `OTHER`" holds OTHER's fields."""
    rows = doc_table(sections[op], "reply field")
    fields = {name: types for name, (types, _) in rows.items()}
    for name, (types, meaning) in rows.items():
        same = re.match(r"as in `(\w+)`", meaning)
        if same and types == {dict}:
            other = doc_replies(sections, same.group(1))
            fields |= {n: t for n, t in other.items() if n.startswith(name + ".")}
    return fields


def code_types(specs: dict[str, Spec]) -> dict[str, set[type]]:
    return {name: set(spec.types) for name, spec in specs.items()}


def test_spec_documents_exactly_the_ops_of_the_code() -> None:
    assert set(op_sections()) == set(REQUESTS) == set(REPLIES)


@pytest.mark.parametrize("op", sorted(REQUESTS))
def test_spec_request_fields_match_code_both_ways(op: str) -> None:
    documented = {name: types for name, (types, _) in doc_table(op_sections()[op], "field").items()}
    assert documented == code_types(REQUESTS[op]), f"op {op!r}: docs/protocol.md vs REQUESTS"


@pytest.mark.parametrize("op", sorted(REPLIES))
def test_spec_reply_fields_match_code_both_ways(op: str) -> None:
    sections = op_sections()
    assert doc_replies(sections, op) == code_types(REPLIES[op]), (
        f"op {op!r}: docs/protocol.md vs REPLIES"
    )
    if not REPLIES[op]:
        assert "Reply: empty" in sections[op]


def test_spec_error_codes_match_code_both_ways() -> None:
    chapter = spec_text().split("\n## Error codes\n", 1)[1].split("\n## ", 1)[0]
    documented = {}
    for line in chapter.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if line.startswith("| `"):
            documented[cells[0].strip("`")] = cells[1].split()[0].strip("`")
    assert set(documented) == set(all_codes())
    for code, name in documented.items():
        assert type(error_from_code(code, "")).__name__ == name, f"code {code!r}"


# -- validate_request: accepts ---------------------------------------------------------------


@pytest.mark.parametrize("table", [GOOD, GOOD_FULL], ids=["required", "full"])
@pytest.mark.parametrize("op", sorted(REQUESTS))
def test_accepts_good_requests(op: str, table: dict[str, dict[str, Any]]) -> None:
    header = request(op, 5, **table[op])
    assert validate_request(header) == table[op]
    # and after a trip through the codec
    assert validate_request(decode(encode(header))) == table[op]


@pytest.mark.parametrize("version", ["1.0", "1.7", "1", "1.0.3"])
def test_accepts_same_major(version: str) -> None:
    assert validate_request({"v": version, "op": "ping", "seq": 0}) == {}


def test_accepts_seq_bounds() -> None:
    validate_request({"v": PROTOCOL_VERSION, "op": "ping", "seq": 0})
    validate_request({"v": PROTOCOL_VERSION, "op": "ping", "seq": MAX_INT - 1})


# -- validate_request: refuses ---------------------------------------------------------------


def refuse(header: dict[str, Any], *words: str, exc: type[Exception] = ProtocolError) -> None:
    with pytest.raises(exc) as info:
        validate_request(header)
    for word in words:
        assert word in str(info.value), f"{word!r} not in {info.value}"


@pytest.mark.parametrize(
    "op", [op for op in REQUESTS if any(s.required for s in REQUESTS[op].values())]
)
def test_refuses_missing_required_field(op: str) -> None:
    for name, spec in REQUESTS[op].items():
        if spec.required:
            fields = {k: v for k, v in GOOD[op].items() if k != name}
            refuse(request(op, 1, **fields), "missing", repr(name))


@pytest.mark.parametrize("op", sorted(REQUESTS))
def test_refuses_extra_field(op: str) -> None:
    refuse(request(op, 1, **GOOD[op], bogus=1), "unknown field", "'bogus'")


@pytest.mark.parametrize(
    ("op", "name", "value"),
    [
        ("reserve", "rows", True),  # bool is not an int
        ("reserve", "rows", 4.0),
        ("reserve", "rows", "4"),
        ("reserve", "timeout_ms", False),
        ("commit", "reservation", True),
        ("sample", "n", 1.5),
        ("sample", "lease", 1),  # int is not a bool
        ("sample", "payload", 0),
        ("shutdown", "keep", 1),
        ("hello", "remote", 0),
        ("hello", "pid", "1"),
        ("hello", "role", b"writer"),
        ("hello", "host", None),
        ("define_schema", "schema", [1, 2]),
        ("sample", "kind", 1),
        ("sample", "beta", True),  # a bool is not a number
        ("sample", "info", 1),
        ("reserve", "priority", "1.0"),
        ("commit", "priority", [1.0]),
        ("update_priorities", "index", [1, 2]),
        ("iterate", "rank", 0.0),
        ("configure", "min_size", 1.0),
    ],
)
def test_refuses_wrong_type(op: str, name: str, value: Any) -> None:
    refuse(request(op, 1, **{**GOOD[op], name: value}), repr(name), "must be")


@pytest.mark.parametrize(
    ("op", "name", "value"),
    [
        ("reserve", "rows", 0),
        ("reserve", "rows", -1),
        ("reserve", "rows", MAX_INT + 1),
        ("reserve", "episodes", 0),
        ("reserve", "commit", 0),
        ("reserve", "timeout_ms", -1),
        ("reserve", "timeout_ms", 3_600_001),
        ("write", "rows", 0),
        ("commit", "reservation", 0),
        ("abort", "reservation", -5),
        ("release", "lease", 0),
        ("sample", "n", 0),
        ("sample", "n", (1 << 20) + 1),
        ("sample", "length", 0),
        ("sample", "release", 0),
        ("drawn", "rows", (1 << 27) + 1),
        ("drawn", "samples", -1),
        ("hello", "pid", -1),
        ("hello", "pid", 2**31 + 1),
    ],
)
def test_refuses_out_of_range(op: str, name: str, value: int) -> None:
    refuse(request(op, 1, **{**GOOD[op], name: value}), repr(name), "out of range")


@pytest.mark.parametrize(
    ("op", "name", "value"),
    [("hello", "role", "root"), ("sample", "kind", "transitions"), ("sample", "kind", "")],
)
def test_refuses_bad_choice(op: str, name: str, value: str) -> None:
    refuse(request(op, 1, **{**GOOD[op], name: value}), repr(name), "not one of")


@pytest.mark.parametrize(
    ("op", "fields", "words"),
    [
        ("reserve", {"rows": 5, "episodes": 2}, ["'rows'=5", "multiple", "'episodes'=2"]),
        ("write", {"rows": 3, "episodes": 2}, ["'rows'=3", "multiple"]),
        ("reserve", {"rows": 6, "lengths": [2, 2]}, ["'lengths'", "adds up to 4"]),
        ("reserve", {"rows": 6, "lengths": [0, 6]}, ["'lengths'", "positive ints"]),
        ("reserve", {"rows": 6, "lengths": []}, ["'lengths'", "positive ints"]),
        ("reserve", {"rows": 6, "lengths": ["3", 3]}, ["'lengths'", "positive ints"]),
        ("reserve", {"rows": 2, "lengths": [True, 1]}, ["'lengths'", "positive ints"]),
        ("reserve", {"rows": 6, "lengths": [3, 3], "episodes": 2}, ["exclusive"]),
        ("sample", {"kind": "slices", "n": 2}, ["'slices'", "'length'"]),
        ("sample", {"kind": "rows", "n": 2, "strict": False}, ["'strict'", "'slices' only"]),
        ("reserve", {"rows": 2, "priority": b""}, ["'priority'", "no values"]),
        ("reserve", {"rows": 2, "priority": bytes(7)}, ["'priority'", "8-byte values"]),
        ("commit", {"reservation": 1, "priority": bytes(8 * 4097)}, ["'priority'", "4096"]),
        ("update_priorities", {"index": bytes(16), "priority": bytes(8)}, ["'priority'", "1"]),
        (
            "update_priorities",
            {"index": bytes(8), "priority": bytes(8), "generation": bytes(16)},
            ["'generation'", "one per index"],
        ),
        ("update_priorities", {"index": bytes(9), "priority": bytes(8)}, ["'index'", "8-byte"]),
        (
            "update_priorities",
            {"index": bytes(8 * 2049), "priority": bytes(8 * 2049)},
            ["'index'", "2048"],
        ),
        ("read", {"rows": bytes(16), "gens": bytes(8)}, ["'rows'", "'gens'"]),
        ("rewrite", {"rows": b""}, ["'rows'", "no rows"]),
        ("rewrite", {"rows": bytes(16), "generation": bytes(8)}, ["'generation'", "one stamp"]),
        ("rewrite", {"rows": bytes(8), "keys": []}, ["'keys'"]),
        ("iterate", {"rank": 2, "world_size": 2}, ["'rank'=2", "'world_size'=2"]),
        ("configure", {}, ["at least one"]),
    ],
)
def test_refuses_fields_that_do_not_fit_together(
    op: str, fields: dict[str, Any], words: list[str]
) -> None:
    """The op's VALIDATORS entry, run before the request reaches the daemon's state."""
    refuse(request(op, 1, **fields), f"op {op!r}", *words)


def test_accepts_fields_that_fit_together() -> None:
    assert validate_request(request("reserve", 1, rows=6, lengths=[1, 3, 2]))["lengths"]
    validate_request(request("write", 1, rows=6, episodes=3))
    validate_request(request("sample", 1, kind="rows", n=2))  # length is for slices only


@pytest.mark.parametrize("op", ["nope", "", "op_hello", "Hello", None, 3, ["ping"]])
def test_refuses_unknown_op(op: Any) -> None:
    refuse({"v": PROTOCOL_VERSION, "op": op, "seq": 1}, "'op'", "unknown op")


def test_refuses_missing_op() -> None:
    refuse({"v": PROTOCOL_VERSION, "seq": 1}, "'op'")


@pytest.mark.parametrize("seq", [None, -1, MAX_INT, True, False, 1.0, "1", b"1", [1]])
def test_refuses_bad_seq(seq: Any) -> None:
    refuse({"v": PROTOCOL_VERSION, "op": "ping", "seq": seq}, "'seq'")


def test_refuses_missing_seq() -> None:
    refuse({"v": PROTOCOL_VERSION, "op": "ping"}, "'seq'")


@pytest.mark.parametrize("version", ["0.9", "2.0", "10.0", "2"])
def test_refuses_major_mismatch(version: str) -> None:
    refuse({"v": version, "op": "ping", "seq": 1}, version, exc=VersionMismatchError)


@pytest.mark.parametrize("version", [None, 1, 1.0, "", "x.0", ".1", "v1.0", b"1.0", "-1.0"])
def test_refuses_malformed_version(version: Any) -> None:
    with pytest.raises(ProtocolError) as info:
        validate_request({"v": version, "op": "ping", "seq": 1})
    assert type(info.value) is ProtocolError  # not a VersionMismatchError
    assert "'v'" in str(info.value)


def test_version_checked_first() -> None:
    refuse({"v": "9.0", "op": "nope", "seq": -1}, exc=VersionMismatchError)


@pytest.mark.parametrize("version", ["².0", "³", "①.0"])
def test_non_decimal_digit_version_is_a_protocol_error(version: str) -> None:
    with pytest.raises(ShmBufferError):
        validate_request({"v": version, "op": "ping", "seq": 1})


# -- codec -----------------------------------------------------------------------------------


def test_encode_decode_round_trip() -> None:
    header = {"v": PROTOCOL_VERSION, "op": "sample", "seq": 3, "rows": b"\x00" * 16, "x": [1]}
    assert decode(encode(header)) == header
    assert decode(memoryview(encode(header))) == header


@pytest.mark.parametrize(
    "frame",
    [
        b"",
        b"\xc1",  # never-used msgpack byte
        b"\x81",  # truncated map
        b"not msgpack at all",
        msgpack.packb({"a": 1}) + b"\x00",  # trailing data
    ],
)
def test_decode_refuses_non_msgpack(frame: bytes) -> None:
    with pytest.raises(ProtocolError, match="msgpack"):
        decode(frame)


@pytest.mark.parametrize("value", [[1, 2], 1, "op", None, b"bytes", 1.5, True])
def test_decode_refuses_non_map(value: Any) -> None:
    with pytest.raises(ProtocolError, match="map"):
        decode(msgpack.packb(value))


@pytest.mark.parametrize("value", [{1: 2}, {b"op": "ping"}, {"a": {2: 3}}, {(1, 2): 3}])
def test_decode_refuses_non_string_keys(value: Any) -> None:
    with pytest.raises(ProtocolError):
        decode(msgpack.packb(value, use_bin_type=True))


def test_decode_refuses_oversized_header() -> None:
    big = encode({"v": PROTOCOL_VERSION, "op": "ping", "seq": 1, "pad": "x" * MAX_HEADER_BYTES})
    assert len(big) > MAX_HEADER_BYTES
    with pytest.raises(ProtocolError, match=str(MAX_HEADER_BYTES)):
        decode(big)
    just = encode({"pad": "x" * (MAX_HEADER_BYTES - 16)})
    assert len(just) <= MAX_HEADER_BYTES
    assert decode(just)["pad"]


def test_replies() -> None:
    assert ok_reply(4, a=1) == {"v": PROTOCOL_VERSION, "seq": 4, "ok": True, "a": 1}
    err = error_reply(9, ProtocolError("bad"))
    assert err == {
        "v": PROTOCOL_VERSION,
        "seq": 9,
        "ok": False,
        "error": {"code": "protocol", "message": "bad"},
    }
    assert error_reply(None, ProtocolError("x"))["seq"] == -1
    assert error_reply(True, ProtocolError("x"))["seq"] == -1
    assert decode(encode(err)) == err


# -- hostile input never raises anything but ShmBufferError ----------------------------------


def _known_version_bug(header: Any) -> bool:
    """The isdigit/int mismatch pinned by the xfail test above; kept out of the fuzzers so they
    stay deterministic while that bug is open."""
    v = header.get("v") if isinstance(header, dict) else None
    if not isinstance(v, str):
        return False
    major = v.partition(".")[0]
    return major.isdigit() and not major.isdecimal()


def _parse(frame: bytes) -> None:
    try:
        header = decode(frame)
    except ShmBufferError:
        return
    try:
        validate_request(header)
    except ShmBufferError:
        return
    except Exception:
        if _known_version_bug(header):
            return
        raise


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=256))
def test_fuzz_arbitrary_bytes(frame: bytes) -> None:
    _parse(frame)


msgpack_leaves = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=True)
    | st.text(max_size=12)
    | st.binary(max_size=12)
)
msgpack_values = st.recursive(
    msgpack_leaves,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=12,
)
field_names = st.sampled_from(
    ["v", "op", "seq", *sorted({name for spec in REQUESTS.values() for name in spec})]
) | st.text(max_size=8)


@settings(max_examples=500, deadline=None)
@given(st.dictionaries(field_names, msgpack_values, max_size=8))
def test_fuzz_arbitrary_maps(header: dict[str, Any]) -> None:
    _parse(encode(header))


@settings(max_examples=500, deadline=None)
@given(
    op=st.sampled_from(sorted(REQUESTS)),
    seq=st.integers(min_value=-5, max_value=MAX_INT + 5) | msgpack_leaves,
    v=st.sampled_from([PROTOCOL_VERSION, "1.9", "2.0", "0.1", ""]) | st.text(max_size=6),
    fields=st.dictionaries(field_names, msgpack_values, max_size=6),
)
def test_fuzz_plausible_requests(op: str, seq: Any, v: Any, fields: dict[str, Any]) -> None:
    """Near-valid requests: a real op and real field names with arbitrary values."""
    _parse(encode({**fields, "v": v, "op": op, "seq": seq}))


@settings(max_examples=300, deadline=None)
@given(
    op=st.sampled_from(sorted(REQUESTS)),
    seq=st.integers(min_value=0, max_value=MAX_INT - 1),
)
def test_valid_requests_survive_codec(op: str, seq: int) -> None:
    header = request(op, seq, **GOOD_FULL[op])
    assert validate_request(decode(encode(header))) == GOOD_FULL[op]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"min_size": 99999999999999999999}, "field 'min_size'=99999999999999999999"),
        ({"schema": {"obs": {"shape": [1, -(2**64)]}}}, r"field 'schema.obs.shape\[1\]'"),
        ({"n": np.int64(3)}, "field 'n' cannot be sent: a value of type int64"),
    ],
)
def test_a_value_msgpack_cannot_carry_is_refused_naming_its_field(
    fields: dict[str, Any], message: str
) -> None:
    with pytest.raises(ProtocolError, match=message):
        encode(request("configure", 1, **fields))
