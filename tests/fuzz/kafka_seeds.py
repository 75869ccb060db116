"""Valid Kafka request frames for every supported (api key, version): the fuzzers' seeds.

``default_request(api_key, version)`` builds a request entity from the schema alone (numbers 0,
strings ``"fuzz"``, one element in every array, nested entities filled the same way), so every
pair of ``codec.SUPPORTED`` has at least one well-formed encoding to start mutating from. A few
hand-written bodies with meaningful values (a produce with a record batch, a metadata request
that names a topic) are added by ``extra_requests``.
"""

from __future__ import annotations

import dataclasses
import datetime
import enum
import functools
import types
import typing
import uuid

from compat_kafka.wire import codec


def _value(hint, kafka_type: str | None, depth: int):
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if kafka_type == "records" or depth > 3:
            return None
        return _value(args[0], kafka_type, depth)
    if origin is tuple:
        (elem, *_rest) = typing.get_args(hint)
        return (_value(elem, kafka_type, depth + 1),)
    if dataclasses.is_dataclass(hint):
        return _instance(hint, depth + 1)
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return next(iter(hint))
    if hint is datetime.timedelta or (kafka_type or "").startswith("timedelta"):
        return datetime.timedelta(0)
    if hint is uuid.UUID or kafka_type == "uuid":
        return uuid.UUID(int=0)
    if kafka_type == "bool" or hint is bool:
        return False
    if kafka_type == "float64":
        return hint(0.0)
    if kafka_type in ("bytes", "records"):
        return hint(b"") if isinstance(hint, type) else b""
    if kafka_type == "string" or (isinstance(hint, type) and issubclass(hint, str)):
        return hint("fuzz") if isinstance(hint, type) else "fuzz"
    if isinstance(hint, type) and issubclass(hint, int):
        return hint(0)
    raise TypeError(f"no default for {hint!r} ({kafka_type})")


def _instance(cls: type, depth: int = 0):
    hints = typing.get_type_hints(cls)
    kw = {}
    for f in dataclasses.fields(cls):
        kw[f.name] = _value(hints[f.name], f.metadata.get("kafka_type"), depth)
    return cls(**kw)


@functools.cache
def default_request(api_key: int, version: int):
    return _instance(codec.request_schema(api_key, version))


def supported_pairs() -> list[tuple[int, int]]:
    return [(k, v) for k, (lo, hi) in sorted(codec.SUPPORTED.items()) for v in range(lo, hi + 1)]


def request_frame_body(body, correlation_id: int = 7, client_id: str | None = "fuzz") -> bytes:
    """The frame without its size prefix (what ``codec.decode_request`` takes)."""
    return codec.encode_request(body, correlation_id, client_id)[4:]


def seeds() -> dict[str, bytes]:
    """name -> a valid request frame body, one per supported (api key, version)."""
    out = {}
    for key, version in supported_pairs():
        out[f"k{key:02d}v{version:02d}"] = request_frame_body(default_request(key, version))
    return out
