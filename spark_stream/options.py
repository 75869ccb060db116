"""Option parsing for the ``scroll`` Spark data source, with errors that name the option.

Spark hands a data source its options as a case-insensitive dict of strings. They are parsed once
on the driver into frozen dataclasses (``ReadOptions``, ``WriteOptions``) that travel to the
executors inside the reader/writer objects. Options Spark adds on its own (``path``,
``checkpointLocation``, ``queryName``) and unknown ones are ignored, as Spark's Kafka source does.

The option names and meanings mirror Spark's Kafka source:

=====================  ==========================================================================
``metadata``           the metadata store URL (``etcd://127.0.0.1:2379``); required
``topics``             comma-separated topic names: every partition stream of each (Kafka: ``subscribe``)
``topicPattern``       a regular expression matched against whole topic names (``subscribePattern``)
``streams``            comma-separated stream names (a partition stream ``orders:2`` included)
``streamPattern``      a regular expression matched against whole stream names
``startingOffsets``    ``earliest`` | ``latest`` | JSON of record offsets, by stream ``{"orders": 42}`` or by
                       topic and partition ``{"orders": {"0": 42, "1": 7}}`` (-2 earliest, -1 latest)
``endingOffsets``      batch only: ``latest`` | JSON as above (exclusive; -1 latest)
``startingTimestamp``  epoch ms: start every stream at its first record whose timestamp is >= it
``startingOffsetsByTimestamp`` JSON of epoch ms, by stream or by topic and partition as above
``startingOffsetsByTimestampStrategy`` ``error`` (default) | ``latest``: when a stream has no record at or
                       after its timestamp, fail the query, or start at the end
``endingTimestamp``    batch only: end every stream before its first record whose timestamp is >= it
``endingOffsetsByTimestamp`` batch only: JSON of epoch ms as above (no such record: the end)
``maxRecordsPerTrigger`` streaming admission control: records per micro-batch
``failOnDataLoss``     ``true`` (default) | ``false``
``minPartitions``      split large ranges so at least this many tasks read in parallel
``includeHeaders``     ``false`` (default) | ``true``: add the ``headers`` column
``tls.ca``             a secured cluster: the CA (PEM) bookies' (and etcd's, ``etcds://``) certificates chain to
``tls.cert``/``tls.key`` client certificate and key (PEM) for mutual TLS
``token``/``token.file`` the bookie token, or a file holding it
``user``/``password``  etcd credentials (else those in the metadata URL); Spark redacts ``password``/``token``
=====================  ==========================================================================

The credential options mean the same in the source and the sink, and the same as in
``streams.connect(url, security=ClientSecurity(...))`` (``fragments.security``); files are read
where the client runs (driver and executors alike), so they must exist at that path on every host.

As in Spark's Kafka source, ``startingTimestamp`` wins over ``startingOffsetsByTimestamp``, which wins
over ``startingOffsets`` (the same for the ending options), and a timestamp finds the first *record*
whose timestamp is >= it (``Consumer.seek_timestamp``), not the first record of the batch holding it.
Streams a by-timestamp JSON leaves out start (end) as ``startingOffsets`` (``endingOffsets``) says.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from fragments.security import ClientSecurity, SecurityConfigError
from streams.batches import COMPRESSION
from streams.topics import partition_stream

EARLIEST = "earliest"
LATEST = "latest"
# An offset in a JSON offsets option may be -2 (earliest) or -1 (latest), as in Kafka.
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


SECURITY_OPTIONS = ("tls.ca", "tls.cert", "tls.key", "token", "token.file", "user", "password")


def _security(options: Mapping[str, str]) -> ClientSecurity:
    try:
        return ClientSecurity.from_options({k: _get(options, k) for k in SECURITY_OPTIONS})
    except SecurityConfigError as exc:
        raise ScrollOptionError(f"credential options: {exc}") from None


def _offset_value(name: str, where: str, v) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < JSON_EARLIEST:
        raise ScrollOptionError(f"option {name!r}: the offset of {where} must be an integer >= 0 "
                                f"(or -2 earliest, -1 latest), got {v!r}")
    return v


def parse_offsets(name: str, value: str | None, default: str, allowed_words: tuple[str, ...]) -> str | dict[str, int]:
    """``earliest``/``latest`` (as allowed) or JSON record offsets, returned by stream name: either
    ``{"stream": offset}`` or, as Spark's Kafka source, ``{"topic": {"partition": offset}}`` (partition
    p of topic t is the stream ``t`` for p = 0 and ``t:p`` after; -2 earliest and -1 latest allowed)."""
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
            f'{{"orders": 42}} or {{"orders": {{"0": 42, "1": 7}}}}, got {value!r}') from None
    if not isinstance(parsed, dict):
        raise ScrollOptionError(f"option {name!r}: the JSON must be an object of stream -> offset or "
                                f"topic -> {{partition -> offset}}, got {value!r}")
    out: dict[str, int] = {}
    for key, v in parsed.items():
        if isinstance(v, dict):  # Kafka's form: topic -> partition -> offset
            for part, off in v.items():
                try:
                    p = int(part)
                except ValueError:
                    p = -1
                if p < 0:
                    raise ScrollOptionError(f"option {name!r}: partition {part!r} of topic {key!r} must be an "
                                            "integer >= 0")
                out[partition_stream(str(key), p)] = _offset_value(name, f"topic {key!r} partition {p}", off)
        else:
            out[str(key)] = _offset_value(name, f"stream {key!r}", v)
    return out


_SOURCES = ("topics", "topicPattern", "streams", "streamPattern")
TS_ERROR = "error"


@dataclass(frozen=True)
class ByTimestamp:
    """Offsets to be found by record timestamp (epoch ms): ``every`` for every stream, else
    ``per_stream`` (streams left out get ``fallback``, an offsets spec); ``if_none``: ``error`` or
    ``latest`` when a stream has no record at or after its timestamp."""

    every: int | None
    per_stream: dict[str, int]
    fallback: str | dict[str, int]
    if_none: str


def _timestamp(name: str, v) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ScrollOptionError(f"option {name!r}: a timestamp must be an integer >= 0 (epoch ms), got {v!r}")
    return v


def parse_by_timestamp(options: Mapping[str, str], prefix: str, fallback, if_none: str) -> ByTimestamp | None:
    """``<prefix>Timestamp`` / ``<prefix>OffsetsByTimestamp`` (``prefix`` starting or ending), or None."""
    every = _get(options, f"{prefix}Timestamp")
    if every is not None:
        try:
            n = int(str(every).strip())
        except ValueError:
            raise ScrollOptionError(f"option '{prefix}Timestamp' must be an integer (epoch ms), got {every!r}") from None
        return ByTimestamp(_timestamp(f"{prefix}Timestamp", n), {}, fallback, if_none)
    raw = _get(options, f"{prefix}OffsetsByTimestamp")
    if raw is None:
        return None
    name = f"{prefix}OffsetsByTimestamp"
    parsed = parse_offsets(name, raw, "", ())
    return ByTimestamp(None, {s: _timestamp(name, v) for s, v in parsed.items()}, fallback, if_none)


@dataclass(frozen=True)
class ReadOptions:
    metadata: str = field(repr=False)  # the URL may carry etcd's password
    topics: tuple[str, ...] | None
    topic_pattern: str | None
    streams: tuple[str, ...] | None
    pattern: str | None
    starting: str | dict[str, int] | ByTimestamp
    ending: str | dict[str, int] | ByTimestamp
    max_records_per_trigger: int | None
    fail_on_data_loss: bool
    min_partitions: int | None
    include_headers: bool
    security: ClientSecurity = ClientSecurity()

    @classmethod
    def parse(cls, options: Mapping[str, str], *, streaming: bool) -> ReadOptions:
        metadata = _metadata(options)
        given = {k: _get(options, k) for k in _SOURCES}
        if sum(v is not None for v in given.values()) != 1:
            raise ScrollOptionError("set exactly one of the options 'topics', 'topicPattern', 'streams' and "
                                    "'streamPattern' (names are comma-separated, patterns regular expressions)")

        def names(opt: str) -> tuple[str, ...] | None:
            v = given[opt]
            if v is None:
                return None
            out = tuple(dict.fromkeys(n.strip() for n in v.split(",") if n.strip()))
            if not out:
                raise ScrollOptionError(f"option {opt!r} names nothing")
            return out

        for opt in ("topicPattern", "streamPattern"):
            if given[opt] is not None:
                try:
                    re.compile(given[opt])
                except re.error as exc:
                    raise ScrollOptionError(f"option {opt!r} is not a valid regular expression: {exc}") from None
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
        strategy = (_get(options, "startingOffsetsByTimestampStrategy") or TS_ERROR).strip().lower()
        if strategy not in (TS_ERROR, LATEST):
            raise ScrollOptionError("option 'startingOffsetsByTimestampStrategy' must be error or latest, "
                                    f"got {strategy!r}")
        starting = parse_by_timestamp(options, "starting", starting, strategy) or starting
        if streaming:
            if _get(options, "endingTimestamp") is not None or _get(options, "endingOffsetsByTimestamp") is not None:
                raise ScrollOptionError("options 'endingTimestamp' and 'endingOffsetsByTimestamp' are for batch "
                                        "queries only")
        else:
            ending = parse_by_timestamp(options, "ending", ending, LATEST) or ending
        return cls(
            metadata=metadata,
            topics=names("topics"),
            topic_pattern=given["topicPattern"],
            streams=names("streams"),
            pattern=given["streamPattern"],
            starting=starting,
            ending=ending,
            max_records_per_trigger=_int(options, "maxRecordsPerTrigger", None, 1),
            fail_on_data_loss=_bool(options, "failOnDataLoss", True),
            min_partitions=_int(options, "minPartitions", None, 1),
            include_headers=_bool(options, "includeHeaders", False),
            security=_security(options),
        )


DEFAULT_INLINE_BYTES = 16 << 20  # a task's output up to this goes to the driver in its commit message
MAX_BATCH_BYTES = (1 << 20) - 512  # a built record batch must fit one entry (1 MiB) with its envelope


@dataclass(frozen=True)
class WriteOptions:
    metadata: str = field(repr=False)  # the URL may carry etcd's password
    stream: str  # a stream, or a topic of several partitions (rows go to partitions by key)
    create: bool
    partitions: int  # for createStream
    ensemble: int
    write_quorum: int
    ack_quorum: int
    inline_bytes: int  # task output up to this size travels in the commit message, beyond it a staging stream
    stage_replicas: int  # copies of a staging stream (it lives only until the commit has read it)
    batch_bytes: int  # the size a task's record batches grow to before the next one starts
    compression: str  # of the record batches: none, gzip, snappy, lz4, zstd
    test_fail: str | None  # test-only fault hook, see sink.py
    security: ClientSecurity = ClientSecurity()

    @classmethod
    def parse(cls, options: Mapping[str, str]) -> WriteOptions:
        metadata = _metadata(options)
        stream, topic = _get(options, "stream"), _get(options, "topic")
        if stream and topic:
            raise ScrollOptionError("set one of the options 'stream' and 'topic' (the same thing), not both")
        stream = stream or topic
        if not stream:
            raise ScrollOptionError("option 'stream' (or 'topic') is required: the stream or topic to append to")
        if stream.startswith(STAGING_PREFIX):
            raise ScrollOptionError(f"option 'stream': names starting with {STAGING_PREFIX!r} are reserved for staging")
        ensemble = _int(options, "ensemble", 3, 1)
        wq = _int(options, "writeQuorum", min(3, ensemble), 1)
        aq = _int(options, "ackQuorum", min(2, wq), 1)
        if not ensemble >= wq >= aq:
            raise ScrollOptionError(f"need ensemble >= writeQuorum >= ackQuorum, got {ensemble}/{wq}/{aq}")
        batch_bytes = _int(options, "batchBytes", MAX_BATCH_BYTES, 1)
        if batch_bytes > MAX_BATCH_BYTES:
            raise ScrollOptionError(f"option 'batchBytes' must be <= {MAX_BATCH_BYTES} (one entry), got {batch_bytes}")
        compression = (_get(options, "compression") or "none").strip().lower()
        if compression not in COMPRESSION:
            raise ScrollOptionError(f"option 'compression' must be one of {', '.join(COMPRESSION)}, got {compression!r}")
        return cls(
            metadata=metadata,
            stream=stream,
            create=_bool(options, "createStream", False),
            partitions=_int(options, "partitions", 1, 1),
            ensemble=ensemble,
            write_quorum=wq,
            ack_quorum=aq,
            inline_bytes=_int(options, "stageInlineBytes", DEFAULT_INLINE_BYTES, 0),
            stage_replicas=_int(options, "stageReplicas", 1, 1),
            batch_bytes=batch_bytes,
            compression=compression,
            test_fail=_get(options, "testFailpoint"),
            security=_security(options),
        )
