"""Filters over per-episode metadata: ``return > 100 and env_id in ("e3", "e7")``.

:func:`parse_where` turns a filter's text into a :class:`Where`, a small tree of nodes;
:meth:`Where.mask` walks that tree over one :class:`Column` per metadata name and returns a bool
per episode. No text is ever run as Python: a small tokenizer and a recursive-descent parser
accept this grammar and nothing else (precedence low to high)::

    where      := or
    or         := and ("or" and)*
    and        := not ("and" not)*
    not        := "not" not | "(" or ")" | comparison
    comparison := operand OP operand | operand ["not"] "in" list | NAME
    list       := "(" literal ("," literal)* [","] ")"   (or the same in "[" "]")
    operand    := NAME | literal
    literal    := number | 'string' | "string" | true | false

OP is one of ``== != < <= > >=``. A NAME (``[A-Za-z_][A-Za-z0-9_.]*``) is looked up whole in the
columns, dots included, so ``info.score`` is a nested key flattened by the caller and never an
attribute. Numbers take a sign, a fraction and an exponent; strings take ``\\\\`` and an escaped
quote as their only escapes. A NAME alone stands for ``NAME == true`` and must hold bools.

Semantics:

- Kinds: ints and floats are all *numbers* and compare with each other (numpy's promotion:
  an int64 beside a float compares as float64). *Strings* compare only with strings, with
  all six operators (code-point order). *Bools* compare only with bools, with ``==`` and
  ``!=``. Any other pairing is a :class:`~shmbuffer.errors.QueryError` naming the name, its
  kind and the position, raised by :meth:`Where.mask` because only the columns know kinds.
- Missing values: a comparison (``!=`` and ``not in`` included) involving a value the episode
  lacks (``present`` False) is false, and ``not`` negates whatever is under it: two-valued, as
  numpy and pandas treat NaN (``~(x > 1)`` is True where x is NaN). So ``not return > 1``
  keeps the episodes without a return while ``return <= 1`` drops them, and
  ``env_id != 'e3'`` drops those without an env_id while ``not env_id == 'e3'`` keeps them.
  A NaN that *is* present compares as numpy compares it.
- A comparison of two literals (``1 < 2``) is the same for every episode.

Every refusal is a QueryError whose message names the 0-based character position and shows it
under a caret. Names are checked at :meth:`Where.mask` time, against the columns given.
The text is capped (:data:`MAX_LENGTH`) and so is nesting (:data:`MAX_DEPTH`), which bounds the
parser's and the walk's recursion whatever a client sends.

``mask`` is vectorised: one numpy pass per comparison over the whole column, none per episode.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, TypeAlias

import numpy as np
import numpy.typing as npt

from shmbuffer.errors import QueryError

#: Longest filter text accepted, in characters.
MAX_LENGTH = 4096
#: Deepest nesting of parentheses and ``not`` accepted.
MAX_DEPTH = 64

_TOKEN = re.compile(
    r"""(?P<space>\s+)
    |(?P<number>[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?)
    |(?P<name>[A-Za-z_][A-Za-z0-9_.]*)
    |(?P<string>'(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*")
    |(?P<op>==|!=|<=|>=|<|>|[()\[\],])""",
    re.VERBOSE | re.DOTALL | re.ASCII,
)
_ESCAPE = re.compile(r"\\(.)", re.DOTALL)
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*", re.ASCII)
_WORDS = {"and", "or", "not", "in"}
_BOOLS = {"true": True, "false": False, "True": True, "False": False}
_COMPARE: dict[str, Callable[[Any, Any], Any]] = {
    "==": operator.eq,
    "!=": operator.ne,
    "<": operator.lt,
    "<=": operator.le,
    ">": operator.gt,
    ">=": operator.ge,
}
_INT64 = np.iinfo(np.int64)


class Column(NamedTuple):
    """One metadata name's values, one entry per episode. Strings may come coded:
    ``categories`` holds each distinct string once and ``values`` an integer index into it
    per episode, so a comparison with a literal runs over the few categories and then one
    lookup per episode instead of a string comparison per episode."""

    values: npt.NDArray[Any]  # int64, float64, bool, object (str), or codes into categories
    present: npt.NDArray[np.bool_]  # False where the episode has no value for this name
    categories: npt.NDArray[Any] | None = None  # the strings ``values`` index (coded only)


class _Token(NamedTuple):
    kind: str  # "value", "name", "word", "op" or "end"
    text: str
    pos: int
    value: Any = None


class _Name(NamedTuple):
    name: str
    pos: int


class _Literal(NamedTuple):
    value: bool | int | float | str
    pos: int


class _Compare(NamedTuple):
    op: str
    left: _Name | _Literal
    right: _Name | _Literal
    pos: int


class _Member(NamedTuple):
    left: _Name | _Literal
    first: _Literal  # the list's first item, which an error names
    items: npt.NDArray[Any]  # all of them, for np.isin
    negated: bool


class _Bare(NamedTuple):
    name: _Name


class _Not(NamedTuple):
    inner: _Node


class _Join(NamedTuple):
    word: str  # "and" or "or"
    parts: tuple[_Node, ...]


_Node: TypeAlias = _Compare | _Member | _Bare | _Not | _Join


def _fail(what: str, text: str, pos: int, message: str, note: str = "") -> QueryError:
    """The error for ``message`` at ``pos``, with the text around it and a caret under it."""
    start = max(0, pos - 40)
    excerpt = "".join(c if c.isprintable() else " " for c in text[start : pos + 40])
    lead = "..." if start else ""
    caret = " " * (len(lead) + pos - start)
    where = f"{what}: {message} at position {pos}{note}"
    return QueryError(f"{where}\n  {lead}{excerpt}\n  {caret}^")


def _kind(value: object) -> str:
    if isinstance(value, bool):  # before int: a bool is an int to Python
        return "bool"
    return "string" if isinstance(value, str) else "number"


def _tokenize(text: str) -> list[_Token]:
    tokens: list[_Token] = []
    pos = 0
    while pos < len(text):
        match = _TOKEN.match(text, pos)
        if match is None:
            char = text[pos]
            if char in "'\"":
                raise _fail("where", text, pos, "unterminated string")
            hint = " (write '==')" if char == "=" else ""
            raise _fail("where", text, pos, f"unexpected character {char!r}{hint}")
        kind, raw = match.lastgroup or "", match.group()
        if kind == "number":
            value: Any = float(raw) if any(c in raw for c in ".eE") else int(raw)
            if isinstance(value, int) and not _INT64.min <= value <= _INT64.max:
                raise _fail("where", text, pos, f"integer {raw} does not fit in 64 bits")
            tokens.append(_Token("value", raw, pos, value))
        elif kind == "string":
            for escape in _ESCAPE.finditer(raw, 1, len(raw) - 1):
                if escape.group(1) not in "\\'\"":
                    message = f"unknown escape '{escape.group()}' (only \\\\, \\' and \\\")"
                    raise _fail("where", text, pos + escape.start(), message)
            tokens.append(_Token("value", raw, pos, _ESCAPE.sub(r"\1", raw[1:-1])))
        elif kind == "name" and raw in _BOOLS:
            tokens.append(_Token("value", raw, pos, _BOOLS[raw]))
        elif kind == "name":
            tokens.append(_Token("word" if raw in _WORDS else "name", raw, pos))
        elif kind == "op":
            tokens.append(_Token("op", raw, pos))
        pos = match.end()
    tokens.append(_Token("end", "", len(text)))
    return tokens


class _Parser:
    """Recursive descent over the tokens, one method per grammar rule."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.tokens = _tokenize(text)
        self.at = 0
        self.depth = 0
        self.names: dict[str, int] = {}  # name -> first position

    def peek(self) -> _Token:
        return self.tokens[self.at]

    def accept(self, *texts: str) -> _Token | None:
        token = self.peek()
        if token.kind in ("word", "op") and token.text in texts:
            self.at += 1
            return token
        return None

    def expected(self, what: str) -> QueryError:
        token = self.peek()
        message = f"expected {what}"
        if self.at:
            message += f" after {self.tokens[self.at - 1].text!r}"
        if token.kind != "end":
            message += f", found {token.text!r}"
        return _fail("where", self.text, token.pos, message)

    def nest(self, token: _Token) -> None:
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise _fail("where", self.text, token.pos, f"nested deeper than {MAX_DEPTH} levels")

    def where(self) -> _Node:
        node = self.or_()
        if self.peek().kind != "end":
            raise self.expected("'and', 'or' or the end")
        return node

    def or_(self) -> _Node:
        parts = [self.and_()]
        while self.accept("or"):
            parts.append(self.and_())
        return parts[0] if len(parts) == 1 else _Join("or", tuple(parts))

    def and_(self) -> _Node:
        parts = [self.not_()]
        while self.accept("and"):
            parts.append(self.not_())
        return parts[0] if len(parts) == 1 else _Join("and", tuple(parts))

    def not_(self) -> _Node:
        token = self.accept("not", "(")
        if token is None:
            return self.comparison()
        self.nest(token)
        if token.text == "not":
            node: _Node = _Not(self.not_())
        else:
            node = self.or_()
            if not self.accept(")"):
                raise self.expected("')'")
        self.depth -= 1
        return node

    def operand(self) -> _Name | _Literal:
        token = self.peek()
        if token.kind == "name":
            self.at += 1
            self.names.setdefault(token.text, token.pos)
            return _Name(token.text, token.pos)
        if token.kind == "value":
            self.at += 1
            return _Literal(token.value, token.pos)
        raise self.expected("a value")

    def comparison(self) -> _Node:
        left = self.operand()
        token = self.peek()
        if token.kind == "op" and token.text in _COMPARE:
            self.at += 1
            return _Compare(token.text, left, self.operand(), token.pos)
        if self.accept("in"):
            return self.member(left, negated=False)
        if self.accept("not"):
            if not self.accept("in"):
                raise self.expected("'in'")
            return self.member(left, negated=True)
        if isinstance(left, _Name):
            return _Bare(left)
        raise self.expected("a comparison operator")

    def member(self, left: _Name | _Literal, negated: bool) -> _Member:
        opened = self.accept("(", "[")
        if opened is None:
            raise self.expected("a list in '(' or '['")
        close = ")" if opened.text == "(" else "]"
        items: list[_Literal] = []
        while True:
            token = self.peek()
            if token.kind != "value":
                raise self.expected("a value")
            self.at += 1
            item = _Literal(token.value, token.pos)
            if items and _kind(item.value) != _kind(items[0].value):
                message = f"a list of {_kind(items[0].value)}s holds a {_kind(item.value)}"
                raise _fail("where", self.text, item.pos, message)
            items.append(item)
            if self.accept(close):
                break
            if not self.accept(","):
                raise self.expected(f"',' or {close!r}")
            if self.accept(close):  # a trailing comma, as in Python's ("e3",)
                break
        values = [item.value for item in items]
        dtype = {"string": object, "bool": bool}.get(_kind(values[0]))
        if dtype is None:
            ints = all(isinstance(v, int) for v in values)
            dtype = np.int64 if ints else np.float64
        return _Member(left, items[0], np.array(values, dtype=dtype), negated)


class _Operand(NamedTuple):
    values: Any  # an array over the episodes, or a literal's Python value
    present: Any  # a bool array, or True for a literal
    kind: str
    name: str | None  # None for a literal
    pos: int
    categories: Any = None  # coded strings: ``values`` index these

    def decoded(self) -> Any:
        """The values as strings (a coded column decoded: the slow way, for name vs name)."""
        if self.categories is None:
            return self.values
        if not len(self.categories):  # nothing present: the result is masked anyway
            return np.full(len(self.values), "", dtype=object)
        return self.categories[self.values]

    def describe(self) -> str:
        if self.name is None:
            return f"a {self.kind}"
        return f"{self.name!r}, which holds {self.kind}s"


_KINDS = {"b": "bool", "i": "number", "u": "number", "f": "number", "O": "string", "U": "string"}


class _Walk:
    """One :meth:`Where.mask` call: the columns, and the tree walked over them."""

    def __init__(self, text: str, columns: Mapping[str, Column], size: int) -> None:
        self.text = text
        self.columns = columns
        self.size = size

    def fail(self, pos: int, message: str) -> QueryError:
        return _fail("where", self.text, pos, message)

    def operand(self, node: _Name | _Literal) -> _Operand:
        if isinstance(node, _Literal):
            return _Operand(node.value, True, _kind(node.value), None, node.pos)
        column = self.columns[node.name]
        values = np.asarray(column.values)
        present = np.asarray(column.present, dtype=bool)
        if values.shape != (self.size,) or present.shape != (self.size,):
            shapes = f"values of shape {values.shape} and present of shape {present.shape}"
            raise self.fail(node.pos, f"{node.name!r} has {shapes}, not ({self.size},)")
        if column.categories is not None:
            categories = np.asarray(column.categories, dtype=object)
            return _Operand(values, present, "string", node.name, node.pos, categories)
        kind = _KINDS.get(values.dtype.kind)
        if kind is None:
            raise self.fail(node.pos, f"{node.name!r} holds dtype {values.dtype}, not filterable")
        if kind == "string" and not present.all():
            # a lacking episode may hold None, which `<` refuses; its result is masked anyway
            values = np.where(present, values, "")
        return _Operand(values, present, kind, node.name, node.pos)

    def same_kind(self, left: _Operand, right: _Operand) -> None:
        if left.kind == right.kind:
            return
        named, other = (right, left) if left.name is None else (left, right)
        if named.name is None:  # two literals
            raise self.fail(right.pos, f"a {left.kind} compared with a {right.kind}")
        message = f"{named.name!r} holds {named.kind}s, compared with {other.describe()}"
        raise self.fail(other.pos, message)

    def walk(self, node: _Node) -> Any:
        """The node's result: a bool array over the episodes, or one bool for all of them."""
        if isinstance(node, _Join):
            combine: np.ufunc = np.logical_or if node.word == "or" else np.logical_and
            result = self.walk(node.parts[0])
            for part in node.parts[1:]:
                result = combine(result, self.walk(part))
            return result
        if isinstance(node, _Not):
            return np.logical_not(self.walk(node.inner))
        if isinstance(node, _Bare):
            column = self.operand(node.name)
            if column.kind != "bool":
                message = f"{node.name.name!r} holds {column.kind}s; alone it must hold bools"
                raise self.fail(node.name.pos, message)
            return np.logical_and(column.values, column.present)
        if isinstance(node, _Member):
            left = self.operand(node.left)
            self.same_kind(left, self.operand(node.first))
            if left.name is None:
                return np.bool_((left.values in node.items.tolist()) != node.negated)
            if left.categories is not None:  # over the categories, then a lookup each
                hits = np.isin(left.categories, node.items, invert=node.negated)
                found = _lookup(hits, left.values)
            else:
                found = np.isin(left.values, node.items, invert=node.negated)
            return np.logical_and(found, left.present)
        left, right = self.operand(node.left), self.operand(node.right)
        self.same_kind(left, right)
        if left.kind == "bool" and node.op not in ("==", "!="):
            raise self.fail(node.pos, f"bools compare only with == and !=, not {node.op!r}")
        compare = _COMPARE[node.op]
        try:
            if left.categories is not None and right.name is None:
                result = _lookup(np.asarray(compare(left.categories, right.values)), left.values)
            elif right.categories is not None and left.name is None:
                result = _lookup(np.asarray(compare(left.values, right.categories)), right.values)
            else:
                result = compare(left.decoded(), right.decoded())
        except TypeError as exc:  # an object column holding something other than strings
            raise self.fail(node.pos, f"cannot compare these values ({exc})") from None
        return np.logical_and(np.logical_and(result, left.present), right.present)


def _lookup(hits: npt.NDArray[np.bool_], codes: npt.NDArray[Any]) -> npt.NDArray[np.bool_]:
    """``hits[codes]``: each episode's category's result. A few categories hit (or missed)
    are compared directly, a pass each, cheaper than a lookup per episode."""
    found = np.flatnonzero(hits)
    if len(found) == 0 or len(found) == len(hits):
        return np.full(len(codes), len(found) > 0)
    out: npt.NDArray[np.bool_]
    if len(found) <= _DIRECT:
        out = codes == found[0]
        for code in found[1:]:
            out |= codes == code
        return out
    missed = np.flatnonzero(~hits)
    if len(missed) <= _DIRECT:
        out = codes != missed[0]
        for code in missed[1:]:
            out &= codes != code
        return out
    result: npt.NDArray[np.bool_] = hits[codes]
    return result


#: Categories hit (or missed) up to which a coded comparison compares codes directly.
_DIRECT = 4


class Where:
    """A parsed filter, reusable over any number of :meth:`mask` calls and columns."""

    __slots__ = ("_positions", "_root", "names", "text")

    def __init__(self, text: str, root: _Node, positions: dict[str, int]) -> None:
        self.text = text
        #: The metadata names the filter reads.
        self.names = frozenset(positions)
        self._root = root
        self._positions = positions

    def __repr__(self) -> str:
        return f"parse_where({self.text!r})"

    def mask(self, columns: Mapping[str, Column], size: int) -> npt.NDArray[np.bool_]:
        """A fresh bool array of ``size``: True for the episodes the filter keeps. Each column
        holds ``size`` entries; a name the filter reads that ``columns`` lacks, or a
        comparison of mismatched kinds, is a QueryError."""
        unknown = [name for name in self._positions if name not in columns]  # in text order
        if unknown:
            known = sorted(columns)
            listed = ", ".join(known[:50]) + (f" and {len(known) - 50} more" if known[50:] else "")
            note = f"; known names: {listed or 'none'}"
            pos = self._positions[unknown[0]]
            raise _fail("where", self.text, pos, f"unknown name {unknown[0]!r}", note)
        out = np.empty(size, dtype=bool)
        out[...] = _Walk(self.text, columns, size).walk(self._root)
        return out


def parse_where(text: str) -> Where:
    """Parse a filter (the grammar is in this module's docstring); QueryError if it is not
    one, naming the position."""
    if not isinstance(text, str):
        raise QueryError(f"where: expected a string, got {type(text).__name__}")
    if len(text) > MAX_LENGTH:
        raise QueryError(f"where: {len(text)} characters, over the limit of {MAX_LENGTH}")
    if not text.strip():
        raise QueryError("where: empty filter")
    parser = _Parser(text)
    root = parser.where()
    return Where(text, root, parser.names)


def parse_order(text: str) -> tuple[str, bool]:
    """``"-return"`` -> ``("return", True)``, descending; ``"return"`` or ``"+return"`` ->
    ``("return", False)``. Anything but an optional sign and a NAME is a QueryError."""
    if not isinstance(text, str):
        raise QueryError(f"order: expected a string, got {type(text).__name__}")
    if len(text) > MAX_LENGTH:
        raise QueryError(f"order: {len(text)} characters, over the limit of {MAX_LENGTH}")
    start = 1 if text[:1] in ("+", "-") else 0
    match = _NAME.match(text, start)
    end = match.end() if match else start
    if match is None or end != len(text):
        message = "expected a name, with an optional '+' or '-' before it"
        raise _fail("order", text, end, message)
    return match.group(), text[:1] == "-"
