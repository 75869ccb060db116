"""Sans-IO Kafka framing and message coding, on top of ``kio`` (pinned: kio==0.6.5).

How this works. On the wire every request and response is a frame: a 4-byte big-endian size, then
that many bytes. ``FrameDecoder`` turns a byte stream into frames and refuses a frame over the
size limit before buffering it. A request frame starts with its header: api key (int16), api
version (int16), correlation id (int32), client id (nullable int16 string) and, for flexible
versions (header v2), tagged fields; then the body. Which header version and body schema apply
is known from (api key, version), so ``decode_request`` reads the fixed prefix first, checks the
pair against ``SUPPORTED``, and only then lets kio parse. ``encode_response`` writes the size,
the response header kio names for the schema (always v0 for ApiVersions) and the body.

An ApiVersions request outside our range gets a v0-encoded UNSUPPORTED_VERSION answer carrying the
ApiVersions range (clients then retry at a version we speak); any other unknown key or version is a
``UnsupportedRequest``, after which the server closes the connection, as a Kafka broker does (its
``RequestContext.parseRequest`` fails, and ``SocketServer`` closes the channel). Versions kio lacks
(the oldest ones, which Kafka 3.9 still serves) are derived from its oldest schema (``_OLD_VERSIONS``).
"""

from __future__ import annotations

import contextvars
import dataclasses
import datetime
import functools
import io
import struct
from dataclasses import dataclass
from typing import Any

from kio.index import load_request_schema, load_response_schema
from kio.schema.api_versions.v0.response import ApiVersion as ApiVersionV0
from kio.schema.api_versions.v0.response import ApiVersionsResponse as ApiVersionsResponseV0
from kio.schema.errors import ErrorCode
from kio.serial import entity_reader, entity_writer

from . import guard, produce
from .errors import CorruptRequest, FrameTooLarge, UnsupportedRequest

API_PRODUCE = 0
API_FETCH = 1
API_LIST_OFFSETS = 2
API_METADATA = 3
API_OFFSET_COMMIT = 8
API_OFFSET_FETCH = 9
API_FIND_COORDINATOR = 10
API_JOIN_GROUP = 11
API_HEARTBEAT = 12
API_LEAVE_GROUP = 13
API_SYNC_GROUP = 14
API_DESCRIBE_GROUPS = 15
API_LIST_GROUPS = 16
API_SASL_HANDSHAKE = 17
API_API_VERSIONS = 18
API_SASL_AUTHENTICATE = 36
API_CREATE_TOPICS = 19
API_DELETE_TOPICS = 20
API_DELETE_RECORDS = 21
API_INIT_PRODUCER_ID = 22
API_DESCRIBE_CONFIGS = 32
API_ALTER_CONFIGS = 33
API_CREATE_PARTITIONS = 37
API_DELETE_GROUPS = 42
API_OFFSET_DELETE = 47
API_INCREMENTAL_ALTER_CONFIGS = 44
API_DESCRIBE_CLUSTER = 60
API_CONSUMER_GROUP_HEARTBEAT = 68
API_CONSUMER_GROUP_DESCRIBE = 69
API_ADD_PARTITIONS_TO_TXN = 24
API_ADD_OFFSETS_TO_TXN = 25
API_END_TXN = 26
API_WRITE_TXN_MARKERS = 27
API_TXN_OFFSET_COMMIT = 28
API_DESCRIBE_TRANSACTIONS = 65
API_LIST_TRANSACTIONS = 66
API_DESCRIBE_ACLS = 29
API_CREATE_ACLS = 30
API_DELETE_ACLS = 31
API_DESCRIBE_CLIENT_QUOTAS = 48
API_ALTER_CLIENT_QUOTAS = 49
API_DESCRIBE_USER_SCRAM_CREDENTIALS = 50
API_ALTER_USER_SCRAM_CREDENTIALS = 51

# The versions we serve, per api key: every version Apache Kafka 3.9 serves (the last release before
# KIP-896 dropped the oldest ones; clients that pin a version from a configured broker version, not
# from ApiVersions, send those: Faust sends CreateTopics v1, kafka-python with api_version=(0, 10, 2)
# Produce v2 / Fetch v3), and a few newer ones Scroll already spoke. Kafka 3.9's ranges, from
# clients/src/main/resources/common/message/*Request.json "validVersions" at tag 3.9.0:
#   Produce 0-11, Fetch 0-17, ListOffsets 0-9, Metadata 0-12, OffsetCommit 0-9, OffsetFetch 0-9,
#   FindCoordinator 0-6, JoinGroup 0-9, Heartbeat 0-4, LeaveGroup 0-5, SyncGroup 0-5,
#   DescribeGroups 0-5, ListGroups 0-5, SaslHandshake 0-1, ApiVersions 0-4, CreateTopics 0-7,
#   DeleteTopics 0-6, DeleteRecords 0-2, InitProducerId 0-5, AddPartitionsToTxn 0-5,
#   AddOffsetsToTxn 0-4, EndTxn 0-4, WriteTxnMarkers 0-1, TxnOffsetCommit 0-4, DescribeAcls 0-3,
#   CreateAcls 0-3, DeleteAcls 0-3, DescribeConfigs 0-4, AlterConfigs 0-2, SaslAuthenticate 0-2,
#   CreatePartitions 0-3, DeleteGroups 0-2, IncrementalAlterConfigs 0-1, OffsetDelete 0,
#   DescribeClientQuotas 0-1, AlterClientQuotas 0-1,
#   DescribeUserScramCredentials 0, AlterUserScramCredentials 0, DescribeCluster 0-1,
#   DescribeTransactions 0, ListTransactions 0-1, ConsumerGroupHeartbeat 0, ConsumerGroupDescribe 0.
# Above 3.9 we also serve Produce 12, ListTransactions 2, ConsumerGroupHeartbeat/Describe 1 (4.x).
# kio 0.6.5 is generated from Kafka 4.x, which dropped the oldest versions: the ones it lacks
# (Produce 0-2, Fetch 0-3, ListOffsets 0, OffsetCommit 0-1, OffsetFetch 0, CreateTopics 0-1,
# DeleteTopics 0, WriteTxnMarkers 0, Describe/Create/DeleteAcls 0, DescribeConfigs 0) are derived
# here from kio's oldest one (``_OLD_VERSIONS``). Fetch 13-17 name topics by id (resolved by
# ``Broker.topic_names``).
SUPPORTED: dict[int, tuple[int, int]] = {
    API_PRODUCE: (0, 12),  # v0-2: magic 0/1 message sets, converted (batches.py)
    API_FETCH: (0, 17),  # v0-3: down-converted to magic 0/1 messages (batches.py); v13+: topics by id
    API_LIST_OFFSETS: (0, 9),
    API_METADATA: (0, 12),
    API_API_VERSIONS: (0, 4),
    # SASL (sasl.py; answered by the server itself, before any handler)
    API_SASL_HANDSHAKE: (0, 1),
    API_SASL_AUTHENTICATE: (0, 2),
    API_CREATE_TOPICS: (0, 7),
    API_DELETE_TOPICS: (0, 6),
    # consumer groups (groups.py)
    API_FIND_COORDINATOR: (0, 6),
    API_JOIN_GROUP: (0, 9),
    API_SYNC_GROUP: (0, 5),
    API_HEARTBEAT: (0, 4),
    API_LEAVE_GROUP: (0, 5),
    API_OFFSET_COMMIT: (0, 9),  # v0 (ZooKeeper offsets in Kafka): stored by the coordinator like v1
    API_OFFSET_FETCH: (0, 9),  # v0 likewise: read from the coordinator
    API_LIST_GROUPS: (0, 5),
    API_DESCRIBE_GROUPS: (0, 5),
    API_DELETE_GROUPS: (0, 2),
    API_OFFSET_DELETE: (0, 0),
    API_CONSUMER_GROUP_HEARTBEAT: (0, 1),  # KIP-848 (consumer_groups.py)
    API_CONSUMER_GROUP_DESCRIBE: (0, 1),
    # admin (admin.py)
    API_DESCRIBE_CONFIGS: (0, 4),
    API_ALTER_CONFIGS: (0, 2),
    API_INCREMENTAL_ALTER_CONFIGS: (0, 1),
    API_CREATE_PARTITIONS: (0, 3),
    API_DESCRIBE_CLUSTER: (0, 1),
    API_DELETE_RECORDS: (0, 2),
    # idempotent producers (producer_ids.py)
    API_INIT_PRODUCER_ID: (0, 5),
    # transactions (transactions.py); AddPartitionsToTxn v4+ is the brokers' batch form (KIP-890)
    API_ADD_PARTITIONS_TO_TXN: (0, 5),
    API_ADD_OFFSETS_TO_TXN: (0, 4),
    API_END_TXN: (0, 4),
    API_WRITE_TXN_MARKERS: (0, 1),
    API_TXN_OFFSET_COMMIT: (0, 4),
    API_DESCRIBE_TRANSACTIONS: (0, 0),
    API_LIST_TRANSACTIONS: (0, 2),
    # ACLs and SCRAM credentials (authorizer.py)
    API_DESCRIBE_ACLS: (0, 3),
    API_CREATE_ACLS: (0, 3),
    API_DELETE_ACLS: (0, 3),
    API_DESCRIBE_USER_SCRAM_CREDENTIALS: (0, 0),
    API_ALTER_USER_SCRAM_CREDENTIALS: (0, 0),
    # client quotas (quotas.py)
    API_DESCRIBE_CLIENT_QUOTAS: (0, 1),
    API_ALTER_CLIENT_QUOTAS: (0, 1),
}

# ---------------------------------------------------------------- versions kio 0.6.5 lacks
# Derived schemas: kio's oldest version of the API with fields dropped (``-name``; a request field
# keeps the value the old version implies, readable as a class attribute, e.g. Fetch v0-3's
# isolation_level 0) or added (``+name``, after a field: what only the old version has), per
# entity class, checked against Kafka 3.9's message JSON files. WriteTxnMarkers v0 is v1 without
# flexible encoding (tagged fields; header v1 / response header v0).
_I64 = "int64"
_OLD_VERSIONS: dict[tuple[int, int], tuple[int, dict, dict]] = {}


def _old(api_key: int, versions, base: int, request: dict | None = None, response: dict | None = None) -> None:
    for v in versions:  # several calls for one version add up
        _, req, resp = _OLD_VERSIONS.setdefault((api_key, v), (base, {}, {}))
        for edits, more in ((req, request or {}), (resp, response or {})):
            for cls, ops in more.items():
                edits.setdefault(cls, []).extend(ops)


_old(API_PRODUCE, (0, 1, 2), 3, {"ProduceRequest": [("-transactional_id", None)]})
_old(API_PRODUCE, (0,), 3, None, {"ProduceResponse": [("-throttle_time",)],
                                  "PartitionProduceResponse": [("-log_append_time",)]})
_old(API_PRODUCE, (1,), 3, None, {"PartitionProduceResponse": [("-log_append_time",)]})
_old(API_PRODUCE, (2,), 3)
_old(API_FETCH, (0, 1, 2), 4, {"FetchRequest": [("-max_bytes", 0x7FFFFFFF), ("-isolation_level", 0)]})
_old(API_FETCH, (3,), 4, {"FetchRequest": [("-isolation_level", 0)]})
_old(API_FETCH, (0, 1, 2, 3), 4, None, {"PartitionData": [("-last_stable_offset",), ("-aborted_transactions",)]})
_old(API_FETCH, (0,), 4, None, {"FetchResponse": [("-throttle_time",)]})
_old(API_LIST_OFFSETS, (0,), 1, {"ListOffsetsPartition": [("+max_num_offsets", "timestamp", "int32", 1)]},
     {"ListOffsetsPartitionResponse": [("-timestamp",), ("-offset",),
                                       ("+old_style_offsets", "error_code", _I64, ())]})
_old(API_OFFSET_COMMIT, (0,), 2, {"OffsetCommitRequest": [("-generation_id_or_member_epoch", -1), ("-member_id", ""),
                                                          ("-retention_time", None)]})
_old(API_OFFSET_COMMIT, (1,), 2, {"OffsetCommitRequest": [("-retention_time", None)],
                                  "OffsetCommitRequestPartition": [("+commit_timestamp", "committed_offset", _I64, -1)]})
_old(API_OFFSET_FETCH, (0,), 1)
_old(API_CREATE_TOPICS, (0,), 2, {"CreateTopicsRequest": [("-validate_only", False)]},
     {"CreateTopicsResponse": [("-throttle_time",)], "CreatableTopicResult": [("-error_message",)]})
_old(API_CREATE_TOPICS, (1,), 2, None, {"CreateTopicsResponse": [("-throttle_time",)]})
_old(API_DELETE_TOPICS, (0,), 1, None, {"DeleteTopicsResponse": [("-throttle_time",)]})
_old(API_WRITE_TXN_MARKERS, (0,), 1)
_old(API_DESCRIBE_ACLS, (0,), 1, {"DescribeAclsRequest": [("-pattern_type_filter", 3)]},  # 3: LITERAL
     {"DescribeAclsResource": [("-pattern_type",)]})
_old(API_CREATE_ACLS, (0,), 1, {"AclCreation": [("-resource_pattern_type", 3)]})
_old(API_DELETE_ACLS, (0,), 1, {"DeleteAclsFilter": [("-pattern_type_filter", 3)]},
     {"DeleteAclsMatchingAcl": [("-pattern_type",)]})
_old(API_DESCRIBE_CONFIGS, (0,), 1, {"DescribeConfigsRequest": [("-include_synonyms", False)]},
     {"DescribeConfigsResourceResult": [("-config_source",), ("-synonyms",), ("+is_default", "read_only", "bool", False)]})

_PRIMITIVE = {"int32": "i32", "int64": "i64", "bool": None}


def _derive(base: type, version: int, edits: dict, flexible: bool | None, header: type | None) -> type:
    """A kio entity class like ``base`` (and its nested classes, recursively) at ``version``."""
    import typing

    from kio.static import primitive

    made: dict[type, type] = {}
    names: dict[str, type] = {}

    def swap(hint):
        if dataclasses.is_dataclass(hint):
            return make(hint)
        args = typing.get_args(hint)
        if not args:
            return hint
        new = tuple(swap(a) if a is not Ellipsis else a for a in args)
        if new == args:
            return hint
        origin = typing.get_origin(hint)
        if origin is tuple:
            return tuple[new]
        import operator

        return functools.reduce(operator.or_, new)  # a union (X | None)

    def make(cls: type) -> type:
        if cls in made:
            return made[cls]
        hints = typing.get_type_hints(cls)
        ops = edits.get(cls.__name__, [])
        drops = {op[0][1:]: op for op in ops if op[0].startswith("-")}
        adds = [op for op in ops if op[0].startswith("+")]
        flex = cls.__flexible__ if flexible is None else flexible
        specs, implied = [], {}
        for f in dataclasses.fields(cls):
            if f.name in drops:
                if len(drops[f.name]) > 1:
                    implied[f.name] = drops[f.name][1]
            elif not flex and "tag" in f.metadata:
                pass  # tagged fields exist in flexible versions only
            else:
                kw: dict[str, Any] = {"metadata": f.metadata}
                if f.default is not dataclasses.MISSING:
                    kw["default"] = f.default
                if f.default_factory is not dataclasses.MISSING:
                    kw["default_factory"] = f.default_factory
                specs.append((f.name, swap(hints[f.name]), dataclasses.field(**kw)))
            for op in adds:
                if op[1] == f.name:
                    name, kafka_type, default = op[0][1:], op[2], op[3]
                    t = bool if kafka_type == "bool" else getattr(primitive, _PRIMITIVE[kafka_type])
                    if isinstance(default, tuple):
                        t = tuple[t, ...]
                    specs.append((name, t, dataclasses.field(metadata={"kafka_type": kafka_type}, default=default)))
        ns = {k: getattr(cls, k) for k in ("__type__", "__api_key__", "__header_schema__")}
        ns.update(implied, __flexible__=flex, __version__=primitive.i16(version))
        if header is not None:
            ns["__header_schema__"] = header
        new = dataclasses.make_dataclass(cls.__name__, specs, namespace=ns, frozen=True, slots=True, kw_only=True)
        new.__module__ = cls.__module__
        new.__qualname__ = f"{cls.__name__}[v{version}]"
        made[cls] = names[cls.__name__] = new
        return new

    top = make(base)
    top.__nested__ = names
    return top


@functools.cache
def _old_schema(api_key: int, version: int, request: bool) -> type | None:
    spec = _OLD_VERSIONS.get((api_key, version))
    if spec is None:
        return None
    base_version, req_edits, resp_edits = spec
    flexible = header = None
    if api_key == API_WRITE_TXN_MARKERS and version == 0:
        from kio.schema.request_header.v1.header import RequestHeader
        from kio.schema.response_header.v0.header import ResponseHeader

        flexible, header = False, RequestHeader if request else ResponseHeader
    base = (load_request_schema if request else load_response_schema)(api_key, base_version)
    return _derive(base, version, req_edits if request else resp_edits, flexible, header)


@functools.cache  # kio resolves the module path on every call: each request would pay it
def request_schema(api_key: int, version: int) -> type:
    """The request schema of (api key, version): kio's, or derived for a version kio lacks."""
    return _old_schema(api_key, version, True) or load_request_schema(api_key, version)


# The client id of the request being handled (set by ``Broker.handle``; each request runs in its
# own task, so its own context): group members are named after it, as Kafka does.
_CLIENT_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar("kafka_client_id", default=None)


def set_client_id(client_id: str | None) -> None:
    _CLIENT_ID.set(client_id)


def current_client_id() -> str | None:
    return _CLIENT_ID.get()


# Requests of one connection take effect in the order sent (as in Kafka, which handles one request
# of a connection at a time): the server starts a request's handler only once the previous one has
# applied its effects. By default that is when the handler returns; a handler whose answer waits on
# something that does not change state (a produce's acknowledgements, a fetch's long poll) calls
# ``effects_applied()`` first, so the next request is handled meanwhile. Set per request (its task's
# own context) by the server.
_APPLIED: contextvars.ContextVar[Any] = contextvars.ContextVar("kafka_effects_applied", default=None)


def set_effects_applied_callback(callback) -> None:
    _APPLIED.set(callback)


def effects_applied() -> None:
    """The request being handled has made every change it will make: the next one may start."""
    cb = _APPLIED.get()
    if cb is not None:
        cb()


# The peer address of the connection a request came on (set once per connection by the server;
# request tasks inherit it): group members' client host, "/<ip>" as Kafka shows it.
_CLIENT_HOST: contextvars.ContextVar[str] = contextvars.ContextVar("kafka_client_host", default="")


def set_client_host(peer) -> None:
    _CLIENT_HOST.set(f"/{peer[0]}" if isinstance(peer, tuple) and peer else "")


def current_client_host() -> str:
    return _CLIENT_HOST.get()


# The name of the listener a request came in on (``PLAINTEXT``, ``SSL``, ``SASL_SSL``, ...): Metadata
# and FindCoordinator answer with each broker's address on that same listener, as Kafka does.
_LISTENER: contextvars.ContextVar[str | None] = contextvars.ContextVar("kafka_listener", default=None)


def set_listener(name: str | None) -> None:
    _LISTENER.set(name)


def current_listener() -> str | None:
    return _LISTENER.get()


# The SASL principal of the connection a request came on (None: SASL off, or not authenticated).
# The server sets a mutable holder once per connection; request tasks inherit it and see the
# principal once the connection has authenticated.
@dataclass
class ConnectionAuth:
    principal: str | None = None
    tls_subject: Any = None  # the verified TLS client certificate's subject (ssl getpeercert form), if any
    expires_at: float | None = None  # KIP-368: loop time the SASL session ends (None: never)


_AUTH: contextvars.ContextVar[ConnectionAuth | None] = contextvars.ContextVar("kafka_connection_auth", default=None)


def set_connection_auth(auth: ConnectionAuth) -> None:
    _AUTH.set(auth)


def current_principal() -> str | None:
    auth = _AUTH.get()
    return None if auth is None else auth.principal


def current_tls_subject() -> Any:
    auth = _AUTH.get()
    return None if auth is None else auth.tls_subject


MAX_FRAME_BYTES = 64 << 20
_SIZE = struct.Struct(">i")
_PREFIX = struct.Struct(">hhi")  # api key, api version, correlation id
_I16 = struct.Struct(">h")


@dataclass(frozen=True, slots=True)
class Request:
    api_key: int
    api_version: int
    correlation_id: int
    client_id: str | None
    body: Any  # the kio request entity


class FrameDecoder:
    """Bytes in, whole frames out. Raises ``FrameTooLarge`` on a size over the limit (or negative)."""

    def __init__(self, max_frame_bytes: int = MAX_FRAME_BYTES):
        if max_frame_bytes < 64:
            raise ValueError("max_frame_bytes must be at least 64")
        self.max_frame_bytes = max_frame_bytes
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        self._buf += data
        frames = []
        while len(self._buf) >= 4:
            (size,) = _SIZE.unpack_from(self._buf, 0)
            check_frame_size(size, self.max_frame_bytes)
            if len(self._buf) < 4 + size:
                break
            frames.append(bytes(self._buf[4 : 4 + size]))
            del self._buf[: 4 + size]
        return frames

    @property
    def pending_bytes(self) -> int:
        """Bytes of an incomplete frame (non-zero at end of stream means a truncated frame)."""
        return len(self._buf)


def check_frame_size(size: int, max_frame_bytes: int) -> None:
    if size < _PREFIX.size + 2 or size > max_frame_bytes:
        raise FrameTooLarge(f"frame size {size} outside 10..{max_frame_bytes} bytes")


def frame(payload: bytes) -> bytes:
    return _SIZE.pack(len(payload)) + payload


# ---------------------------------------------------------------- requests
def read_prefix(data: bytes) -> tuple[int, int, int]:
    if len(data) < _PREFIX.size:
        raise CorruptRequest(f"request of {len(data)} bytes is shorter than a request header")
    return _PREFIX.unpack_from(data, 0)


def _client_id(data: bytes) -> str | None:
    """The client id of a header v1/v2 (the same non-compact string in both)."""
    (n,) = _I16.unpack_from(data, _PREFIX.size)
    if n < 0:
        return None
    return bytes(data[_PREFIX.size + 2 : _PREFIX.size + 2 + n]).decode("utf-8", "replace")


def decode_request(data: bytes) -> Request:
    """One request frame (without its size) -> ``Request``.

    Raises ``UnsupportedRequest`` for a key/version outside ``SUPPORTED`` (ApiVersions included:
    the caller answers that one with ``unsupported_api_versions_response``) and ``CorruptRequest``
    for bytes kio cannot parse.
    """
    api_key, version, correlation_id = read_prefix(data)
    rng = SUPPORTED.get(api_key)
    if rng is None or not rng[0] <= version <= rng[1]:
        raise UnsupportedRequest(f"api key {api_key} version {version} is not supported", api_key, version,
                                 correlation_id)
    if api_key == API_PRODUCE and produce.FIRST <= version <= produce.LAST:  # the hot path: produce.py
        fast = produce.decode_request(data, version)
        if fast is not None:
            return Request(api_key, version, correlation_id, fast[0], fast[1])
    return decode_request_generic(data, api_key, version, correlation_id)


def decode_request_generic(data: bytes, api_key: int, version: int, correlation_id: int) -> Request:
    """``decode_request`` through kio, for every request (the size guard first)."""
    schema = request_schema(api_key, version)
    guard.check(schema, data)  # before kio: it allocates an array's claimed length up front
    try:
        header, hsize = entity_reader(schema.__header_schema__)(data, 0)
        body, bsize = entity_reader(schema)(data, hsize)
    except Exception as exc:  # kio raises several decode errors, and ValueError on bad enum values
        raise CorruptRequest(f"api key {api_key} v{version} correlation {correlation_id}: {exc!r}") from exc
    return Request(api_key, version, correlation_id, header.client_id, body)


def encode_request(body: Any, correlation_id: int, client_id: str | None = "scroll") -> bytes:
    """A whole request frame (for tests and tools): size, header, body."""
    header_cls = body.__header_schema__
    fields = {f.name for f in dataclasses.fields(header_cls)}
    kw = dict(request_api_key=body.__api_key__, request_api_version=body.__version__,
              correlation_id=correlation_id, client_id=client_id)
    header = header_cls(**{k: v for k, v in kw.items() if k in fields})
    buf = io.BytesIO()
    entity_writer(header_cls)(buf, header)
    entity_writer(type(body))(buf, body)
    return frame(buf.getvalue())


# ---------------------------------------------------------------- responses
@functools.cache
def response_schema(api_key: int, version: int) -> type:
    return _old_schema(api_key, version, False) or load_response_schema(api_key, version)


def encode_response(correlation_id: int, body: Any) -> bytes:
    """A whole response frame: size, the response header of the body's schema, body."""
    fast = produce.encode_response(correlation_id, body)  # Produce v3-v12: produce.py; None for the rest
    if fast is not None:
        return fast
    return encode_response_generic(correlation_id, body)


def encode_response_generic(correlation_id: int, body: Any) -> bytes:
    """``encode_response`` through kio's writer, for every entity."""
    header_cls = body.__header_schema__
    buf = io.BytesIO()
    entity_writer(header_cls)(buf, header_cls(correlation_id=correlation_id))
    entity_writer(type(body))(buf, body)
    return frame(buf.getvalue())


def decode_response(data: bytes, api_key: int, version: int) -> tuple[int, Any]:
    """A response frame without its size -> (correlation id, kio entity). For tests and tools."""
    schema = response_schema(api_key, version)
    header, hsize = entity_reader(schema.__header_schema__)(data, 0)
    body, _ = entity_reader(schema)(data, hsize)
    return header.correlation_id, body


def our_api_ranges() -> list[tuple[int, int, int]]:
    return [(k, lo, hi) for k, (lo, hi) in sorted(SUPPORTED.items())]


def unsupported_api_versions_response(correlation_id: int) -> bytes:
    """The v0-encoded UNSUPPORTED_VERSION answer to an ApiVersions request outside our range: as Kafka's
    (``ApiVersionsRequest.getErrorResponse``, KIP-511), it lists the ApiVersions range only; the client
    retries at the highest version it shares with that and learns the rest from the answer."""
    lo, hi = SUPPORTED[API_API_VERSIONS]
    body = ApiVersionsResponseV0(
        error_code=ErrorCode.unsupported_version,
        api_keys=(ApiVersionV0(api_key=API_API_VERSIONS, min_version=lo, max_version=hi),),
    )
    return encode_response(correlation_id, body)


def build(cls: type, **values: Any) -> Any:
    """Construct a kio entity of any version from the superset of fields we know: values for fields
    this version does not have are dropped; missing ones take the schema default."""
    names = _field_names(cls)
    return cls(**{k: v for k, v in values.items() if k in names})


@functools.cache
def _field_names(cls: type) -> frozenset[str]:
    return frozenset(f.name for f in dataclasses.fields(cls))


@functools.cache  # a handler asks on every request (Produce: twice per request)
def nested(body_cls: type, name: str) -> type:
    """A nested entity class of the same schema module (e.g. ``PartitionData`` of Fetch v12)."""
    import sys

    derived = getattr(body_cls, "__nested__", None)  # a version kio lacks (``_derive``)
    if derived is not None and name in derived:
        return derived[name]
    return getattr(sys.modules[body_cls.__module__], name)


ZERO_MS = datetime.timedelta(0)
