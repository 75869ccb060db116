"""A pre-check of a request's array lengths, before kio parses it.

Why. kio's native reader allocates room for an array from its length prefix before reading any
element: a 30-byte request whose array claims 2**31 elements makes it allocate ~100 GB, and
Rust aborts the whole process on a failed allocation (no Python exception: the listener dies,
with every connection). So ``check(schema, data)`` walks the frame the way kio will (header,
body, nested entities, arrays, known tagged fields) and raises ``CorruptRequest`` when an array
claims more elements than the bytes left could hold (each element takes at least the smallest
encoding of its type). Strings and bytes are skipped by their lengths, and a length that runs past
the frame stops the walk (kio then answers it with its own decode error). The walk only reads
lengths: it never allocates per element. It also refuses a null in a field that is not nullable
(kio reads it as None, and the handlers then fail on it), as Kafka's generated readers do
("non-nullable field ... was serialized as null"); a nullable one stays None.
"""

from __future__ import annotations

import dataclasses
import functools
import struct
import typing

from kio.static.constants import EntityType

from .errors import CorruptRequest

_FIXED = {"bool": 1, "int8": 1, "int16": 2, "uint16": 2, "error_code": 2, "int32": 4, "timedelta_i32": 4,
          "int64": 8, "timedelta_i64": 8, "datetime_i64": 8, "float64": 8, "uuid": 16}
_I16 = struct.Struct(">h").unpack_from
_I32 = struct.Struct(">i").unpack_from

# A plan is (flexible, the untagged fields' steps, tag -> step); a step is ("fixed", size),
# ("str" | "bytes", legacy even when flexible), ("entity", class) or ("array", element step).


class _Stop(Exception):
    """The walk cannot go on (bytes run out): kio decides."""


def _uvarint(data, off: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if off >= len(data) or shift > 63:
            raise _Stop
        b = data[off]
        off += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, off
        shift += 7


@functools.cache
def _plan(cls: type) -> tuple:
    flexible = bool(getattr(cls, "__flexible__", False))
    hints = typing.get_type_hints(cls)
    fields, tagged = [], {}
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        kafka_type = f.metadata.get("kafka_type")
        is_array, elem = False, hint
        args = [a for a in typing.get_args(hint) if a is not type(None)] if typing.get_origin(hint) in (
            typing.Union, __import__("types").UnionType) else None
        if args:
            elem = args[0]
        if typing.get_origin(elem) is tuple:
            is_array, elem = True, typing.get_args(elem)[0]
        if dataclasses.is_dataclass(elem):
            item = ("entity", elem)
        elif kafka_type in _FIXED:
            item = ("fixed", _FIXED[kafka_type])
        elif kafka_type in ("string", "bytes", "records"):
            # a request header's client id is a legacy string even in header v2 (flexible)
            legacy = getattr(cls, "__type__", None) is EntityType.header
            item = ("str" if kafka_type == "string" else "bytes", legacy)
        else:
            raise TypeError(f"{cls.__name__}.{f.name}: unknown kafka type {kafka_type!r}")
        nullable = args is not None  # ``X | None``: null is a value; otherwise null is an error, as in Kafka
        step = ("array", item, nullable) if is_array else (*item, nullable)
        tag = f.metadata.get("tag")
        if tag is not None:
            tagged[tag] = step
        elif step[0] == "fixed" and fields and fields[-1][0] == "fixed":  # runs of fixed-size fields: one step
            fields[-1] = ("fixed", fields[-1][1] + step[1], False)
        else:
            fields.append(step)
    return flexible, tuple(fields), tagged


@functools.cache
def _min_size(cls: type) -> int:
    flexible, fields, _tagged = _plan(cls)
    size = 1 if flexible else 0  # the tagged-field count
    for kind, arg, _nullable in fields:
        if kind == "fixed":
            size += arg
        elif kind == "entity":
            size += _min_size(arg)
        else:  # a string, bytes or an array: its length (1 compact, 2 or 4 legacy)
            size += 1 if flexible else 2
    return size


def _elem_min(item: tuple, flexible: bool) -> int:
    kind, arg = item[0], item[1]
    if kind == "fixed":
        return arg
    if kind == "entity":
        return max(1, _min_size(arg))
    return 1 if flexible else 2


def _walk(cls: type, data, off: int, end: int) -> int:
    flexible, fields, tagged = _plan(cls)
    for step in fields:
        off = _step(step, flexible, data, off, end)
    if flexible:
        n, off = _uvarint(data, off)
        for _ in range(n):
            tag, off = _uvarint(data, off)
            size, off = _uvarint(data, off)
            if tag in tagged:  # kio reads a known tagged field's value as it comes, ignoring its size
                off = _step(tagged[tag], flexible, data, off, end)
            else:
                off += size
                if off > end:
                    raise _Stop
    return off


def _null(n: int, nullable: bool) -> None:
    if n < -1 or (n == -1 and not nullable):
        raise CorruptRequest("a non-nullable field is null" if n == -1 else f"a length of {n}")


def _step(step: tuple, flexible: bool, data, off: int, end: int) -> int:
    kind, arg, nullable = step
    if kind == "fixed":
        off += arg
    elif kind in ("str", "bytes"):
        if flexible and not arg:
            n, off = _uvarint(data, off)
            n -= 1
        elif kind == "str":
            if off + 2 > end:
                raise _Stop
            (n,) = _I16(data, off)
            off += 2
        else:
            if off + 4 > end:
                raise _Stop
            (n,) = _I32(data, off)
            off += 4
        if n < 0:
            _null(n, nullable)
        off += max(n, 0)
    elif kind == "entity":
        off = _walk(arg, data, off, end)
    else:  # an array
        if flexible:
            n, off = _uvarint(data, off)
            n -= 1
        else:
            if off + 4 > end:
                raise _Stop
            (n,) = _I32(data, off)
            off += 4
        if n < 0:
            _null(n, nullable)
        elif n > 0:
            if n * _elem_min(arg, flexible) > end - off:
                raise CorruptRequest(f"an array of {n} elements in the {end - off} bytes left of the request")
            item = (*arg, False)
            for _ in range(n):
                off = _step(item, flexible, data, off, end)
    if off > end:
        raise _Stop
    return off


def walk_end(schema: type, data: bytes) -> int | None:
    """Where the walk of header and body ends (None: it stopped early). Tests compare it with kio's."""
    try:
        off = _walk(schema.__header_schema__, data, 0, len(data))
        return _walk(schema, data, off, len(data))
    except _Stop:
        return None


def check(schema: type, data: bytes) -> None:
    """Raise ``CorruptRequest`` if an array of this request claims more elements than can fit."""
    try:
        off = _walk(schema.__header_schema__, data, 0, len(data))
        _walk(schema, data, off, len(data))
    except _Stop:
        pass
