"""Option parsing for the ``scroll`` Spark data source, with errors that name the option.

Spark hands a data source its options as a case-insensitive dict of strings. They are parsed once
on the driver into frozen dataclasses (``ReadOptions``, ``WriteOptions``) that travel to the
executors inside the reader/writer objects. Options Spark adds on its own (``path``,
``checkpointLocation``, ``queryName``) and unknown ones are ignored, as Spark's Kafka source does.

The option names and meanings mirror Spark's Kafka source:

=====================  ==========================================================================
``metadata``           the metadata store URL (``etcd://127.0.0.1:2379``); required
``streams``            comma-separated stream names (Kafka: ``subscribe``)
``streamPattern``      a regular expression matched against whole stream names (``subscribePattern``)
``startingOffsets``    ``earliest`` | ``latest`` | JSON ``{"stream": position}`` (-2 earliest, -1 latest)
``endingOffsets``      batch only: ``latest`` | JSON (-1 latest)
``maxRecordsPerTrigger`` streaming admission control, in stream positions (see docs/spark.md)
``failOnDataLoss``     ``true`` (default) | ``false``
``minPartitions``      split large ranges so at least this many tasks read in parallel
``includeHeaders``     ``false`` (default) | ``true``: add the ``headers`` column
=====================  ==========================================================================
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass

EARLIEST = "earliest"
LATEST = "latest"
# A position in a JSON offsets option may be -2 (earliest) or -1 (latest), as in Kafka.
JSON_EARLIEST = -2
JSON_LATEST = -1

# Streams the writer creates for staging; never matched by ``streamPattern``.
STAGING_PREFIX = "_spark."


class ScrollOptionError(ValueError):
    """An option of the scroll data source is missing or does not parse."""


def _get(options: Mapping[str, str], name: str) -> str | None:
    # Spark passes a CaseInsensitiveDict; a plain dict (tests, callers) is looked up by lower case too.
    v = options.get(name)
    if v is None:
        for k, val in options.items():
            if k.lower() == name.lower():
                return val
    return v


def _bool(options: Mapping[str, str], name: str, default: bool) -> bool:
    v = _get(options, name)
    if v is None:
        return default
    s = str(v).strip().lower()
    if s in ("true", "1", "yes"):
        return True
    if s in ("false", "0", "no"):
        return False
    raise ScrollOptionError(f"option {name!r} must be true or false, got {v!r}")


def _int(options: Mapping[str, str], name: str, default: int | None, minimum: int) -> int | None:
    v = _get(options, name)
    if v is None:
        return default
    try:
        n = int(str(v).strip())
    except ValueError:
        raise ScrollOptionError(f"option {name!r} must be an integer, got {v!r}") from None
    if n < minimum:
        raise ScrollOptionError(f"option {name!r} must be >= {minimum}, got {n}")
    return n


def _metadata(options: Mapping[str, str]) -> str:
    url = _get(options, "metadata")
    if not url:
        raise ScrollOptionError("option 'metadata' is required: the metadata store URL, e.g. etcd://127.0.0.1:2379")
    if "://" not in url:
        raise ScrollOptionError(f"option 'metadata' must be a URL such as etcd://127.0.0.1:2379, got {url!r}")
    return url


def parse_offsets(name: str, value: str | None, default: str, allowed_words: tuple[str, ...]) -> str | dict[str, int]:
    """``earliest``/``latest`` (as allowed) or a JSON object of stream -> position (-2/-1 allowed)."""
    if value is None:
        return default
    s = value.strip()
    if s.lower() in allowed_words:
        return s.lower()
    if s.lower() in (EARLIEST, LATEST):
        raise ScrollOptionError(f"option {name!r} cannot be {s.lower()!r} here (allowed: {', '.join(allowed_words)}"
                                " or a JSON object)")
    try:
        parsed = json.loads(s)
    except ValueError:
        raise ScrollOptionError(
            f"option {name!r} must be {' or '.join(allowed_words)} or a JSON object like "
            f'{{"orders": 42}}, got {value!r}') from None
    if not isinstance(parsed, dict):
        raise ScrollOptionError(f"option {name!r}: the JSON must be an object of stream -> position, got {value!r}")
    out: dict[str, int] = {}
    for stream, pos in parsed.items():
        if isinstance(pos, bool) or not isinstance(pos, int) or pos < JSON_EARLIEST:
            raise ScrollOptionError(f"option {name!r}: position of stream {stream!r} must be an integer >= 0 "
                                    f"(or -2 earliest, -1 latest), got {pos!r}")
        out[str(stream)] = pos
    return out


@dataclass(frozen=True)
class ReadOptions:
    metadata: str
    streams: tuple[str, ...] | None
    pattern: str | None
    starting: str | dict[str, int]
    ending: str | dict[str, int]
    max_records_per_trigger: int | None
    fail_on_data_loss: bool
    min_partitions: int | None
    include_headers: bool

    @classmethod
    def parse(cls, options: Mapping[str, str], *, streaming: bool) -> ReadOptions:
        metadata = _metadata(options)
        names = _get(options, "streams")
        pattern = _get(options, "streamPattern")
        if (names is None) == (pattern is None):
            raise ScrollOptionError("set exactly one of the options 'streams' (comma-separated names) and "
                                    "'streamPattern' (a regular expression)")
        streams = None
        if names is not None:
            streams = tuple(dict.fromkeys(n.strip() for n in names.split(",") if n.strip()))
            if not streams:
                raise ScrollOptionError("option 'streams' names no stream")
        if pattern is not None:
            try:
                re.compile(pattern)
            except re.error as exc:
                raise ScrollOptionError(f"option 'streamPattern' is not a valid regular expression: {exc}") from None
        if streaming:
            starting = parse_offsets("startingOffsets", _get(options, "startingOffsets"), LATEST, (EARLIEST, LATEST))
            if _get(options, "endingOffsets") is not None:
                raise ScrollOptionError("option 'endingOffsets' is for batch queries only")
            ending: str | dict[str, int] = LATEST
        else:
            starting = parse_offsets("startingOffsets", _get(options, "startingOffsets"), EARLIEST, (EARLIEST,))
            ending = parse_offsets("endingOffsets", _get(options, "endingOffsets"), LATEST, (LATEST,))
            if isinstance(starting, dict) and JSON_LATEST in starting.values():
                raise ScrollOptionError("option 'startingOffsets': -1 (latest) is not allowed in batch queries")
            if isinstance(ending, dict) and JSON_EARLIEST in ending.values():
                raise ScrollOptionError("option 'endingOffsets': -2 (earliest) is not allowed")
        return cls(
            metadata=metadata,
            streams=streams,
            pattern=pattern,
            starting=starting,
            ending=ending,
            max_records_per_trigger=_int(options, "maxRecordsPerTrigger", None, 1),
            fail_on_data_loss=_bool(options, "failOnDataLoss", True),
            min_partitions=_int(options, "minPartitions", None, 1),
            include_headers=_bool(options, "includeHeaders", False),
        )


@dataclass(frozen=True)
class WriteOptions:
    metadata: str
    stream: str
    create: bool
    ensemble: int
    write_quorum: int
    ack_quorum: int
    inline_bytes: int  # task output up to this size travels in the commit message, beyond it a staging stream
    test_fail: str | None  # test-only fault hook, see sink.py

    @classmethod
    def parse(cls, options: Mapping[str, str]) -> WriteOptions:
        metadata = _metadata(options)
        stream = _get(options, "stream")
        if not stream:
            raise ScrollOptionError("option 'stream' is required: the stream to append to")
        if stream.startswith(STAGING_PREFIX):
            raise ScrollOptionError(f"option 'stream': names starting with {STAGING_PREFIX!r} are reserved for staging")
        ensemble = _int(options, "ensemble", 3, 1)
        wq = _int(options, "writeQuorum", min(3, ensemble), 1)
        aq = _int(options, "ackQuorum", min(2, wq), 1)
        if not ensemble >= wq >= aq:
            raise ScrollOptionError(f"need ensemble >= writeQuorum >= ackQuorum, got {ensemble}/{wq}/{aq}")
        return cls(
            metadata=metadata,
            stream=stream,
            create=_bool(options, "createStream", False),
            ensemble=ensemble,
            write_quorum=wq,
            ack_quorum=aq,
            inline_bytes=_int(options, "stageInlineBytes", 1 << 20, 0),
            test_fail=_get(options, "testFailpoint"),
        )
