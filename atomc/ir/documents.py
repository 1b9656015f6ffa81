"""IR documents as JSON: a tree of frozen dataclasses to plain data and back, every field
checked against its type as it is read (an error names the file and the field), and the
`Document` base of the IR types written to files of their own with `kind` and
`schema_version`.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Union

from atomc.errors import IRError
from atomc.jsonio import canonical_hash, read_json, write_json

if TYPE_CHECKING:
    from typing_extensions import Self

SCHEMA_VERSION = 1


def to_data(obj: Any) -> Any:
    """Plain JSON data for a dataclass tree (tuples become lists)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        # fields a class names OPTIONAL are written only when set, so that data without
        # them (and data written before they existed) reads and hashes as before
        skip = getattr(obj, "OPTIONAL", ())
        return {f.name: to_data(getattr(obj, f.name)) for f in dataclasses.fields(obj)
                if not (f.name in skip and getattr(obj, f.name) is None)}
    if isinstance(obj, (list, tuple)):
        return [to_data(x) for x in obj]
    if isinstance(obj, dict):
        return {str(k): to_data(v) for k, v in obj.items()}
    return obj


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    # resolving the string annotations costs a compile each: a profile has 10^5 objects
    return typing.get_type_hints(cls)


def from_data(tp: Any, data: Any, where: str) -> Any:
    """Build a value of type `tp` from JSON data; IRError names `where` on mismatch."""
    return _reader(tp)(data, where)


# A reader builds one type from JSON data. Where it is in the document travels as nested
# (parent, key) pairs and becomes text only for an error message: formatting the path of each
# of a profile's 10^5 objects cost more than reading them.
_Where = Any
_Reader = Callable[[Any, _Where], Any]


def _where(w: _Where) -> str:
    parts = []
    while isinstance(w, tuple):
        w, key = w
        parts.append(f"[{key}]" if isinstance(key, int) else f".{key}")
    return w + "".join(reversed(parts))


@functools.cache
def _reader(tp: Any) -> _Reader:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return lambda data, w: data
    if origin in (Union, types.UnionType):
        return _union_reader(args)
    if dataclasses.is_dataclass(tp):
        return _dataclass_reader(tp)
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return _sequence_reader(args[0])
        return _fixed_tuple_reader(args)
    if origin is dict:
        return _dict_reader(args[1])
    if tp is float:
        def read_float(data, w):
            if isinstance(data, bool) or not isinstance(data, (int, float)):
                raise IRError(f"{_where(w)}: expected a number, got {data!r}")
            return float(data)
        return read_float
    if tp is int:
        def read_int(data, w):
            if isinstance(data, bool) or not isinstance(data, int):
                raise IRError(f"{_where(w)}: expected an integer, got {data!r}")
            return data
        return read_int
    if tp in (str, bool):
        def read_plain(data, w):
            if not isinstance(data, tp):
                raise IRError(f"{_where(w)}: expected {tp.__name__}, got {data!r}")
            return data
        return read_plain
    raise IRError(f"cannot read type {tp!r}")  # a bug in the IR definition


def _union_reader(args: tuple) -> _Reader:
    optional = type(None) in args
    readers = [_reader(a) for a in args if a is not type(None)]

    def read(data, w):
        if data is None and optional:
            return None
        errors = []
        for r in readers:
            try:
                return r(data, w)
            except IRError as e:
                errors.append(str(e))
        raise IRError(errors[0] if errors else f"{_where(w)}: unexpected null")
    return read


def _dataclass_reader(tp: type) -> _Reader:
    hints = _hints(tp)
    fields = [(f.name, _reader(hints[f.name]),
               f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
              for f in dataclasses.fields(tp) if f.init]

    def read(data, w):
        if not isinstance(data, dict):
            raise IRError(f"{_where(w)}: expected an object for {tp.__name__}, "
                          f"got {type(data).__name__}")
        kwargs = {}
        for name, r, required in fields:
            if name in data:
                kwargs[name] = r(data[name], (w, name))
            elif required:
                raise IRError(f"{_where(w)}: missing field '{name}' of {tp.__name__}")
        return tp(**kwargs)
    return read


def _sequence_reader(item: Any) -> _Reader:
    r = _reader(item)

    def read(data, w):
        _expect(data, list, "a list", w)
        return tuple(r(x, (w, i)) for i, x in enumerate(data))
    return read


def _fixed_tuple_reader(args: tuple) -> _Reader:
    readers = [_reader(a) for a in args]

    def read(data, w):
        _expect(data, list, "a list", w)
        if len(readers) != len(data):
            raise IRError(f"{_where(w)}: expected {len(readers)} items, got {len(data)}")
        return tuple(r(x, (w, i)) for i, (r, x) in enumerate(zip(readers, data)))
    return read


def _dict_reader(value: Any) -> _Reader:
    r = _reader(value)

    def read(data, w):
        _expect(data, dict, "an object", w)
        return {k: r(v, (w, str(k))) for k, v in data.items()}
    return read


def _expect(data: Any, kind: type, what: str, w: _Where) -> None:
    if not isinstance(data, kind):
        raise IRError(f"{_where(w)}: expected {what}, got {type(data).__name__}")


class Document:
    """A top-level IR type written to its own JSON file."""

    KIND: ClassVar[str] = ""
    OPTIONAL: ClassVar[tuple[str, ...]] = ()  # written only when not None (see to_data)

    def to_json(self) -> dict[str, Any]:
        data = to_data(self)
        return {"kind": self.KIND, "schema_version": SCHEMA_VERSION, **data}

    @classmethod
    def from_json(cls, data: Any, source: str = "<data>") -> Self:
        kind = cls.KIND  # type: ignore[attr-defined]
        if not isinstance(data, dict):
            raise IRError(f"{source}: expected a JSON object for a {kind}, "
                          f"got {type(data).__name__}")
        seen_kind = data.get("kind")
        if seen_kind != kind:
            raise IRError(
                f"{source} is a {seen_kind or 'document without a kind'}, expected a {kind}; "
                f"give the file that `atomc` wrote for this stage"
            )
        version = data.get("schema_version")
        if version != SCHEMA_VERSION:
            raise IRError(
                f"{source} has schema_version {version!r}; this atomc reads version "
                f"{SCHEMA_VERSION}: regenerate it with this atomc"
            )
        body = {k: v for k, v in data.items() if k not in ("kind", "schema_version")}
        return from_data(cls, body, source)

    def save(self, path: str | Path) -> Path:
        return write_json(path, self.to_json())

    @classmethod
    def load(cls, path: str | Path) -> Self:
        return cls.from_json(read_json(path, cls.KIND), str(path))  # type: ignore[attr-defined]

    def content_hash(self) -> str:
        """sha256 of the canonical JSON; names this exact document in later stages."""
        return canonical_hash(self.to_json())
