"""Errors of the Kafka shim, each tied to one Kafka wire error code, and the one table that maps
Scroll's own errors onto those codes.

Two families: ``KafkaError`` is answered to the client inside a response (per topic or partition,
with the code and ``retriable`` Kafka gives it); ``ProtocolError`` means the connection itself is
broken (a frame we cannot read), and the server closes it — that is what a Kafka broker does too.
"""

from __future__ import annotations

from kio.schema.errors import ErrorCode

from fragments.store import MetadataUnavailable
from streams.batches import RecordFormatError
from streams.errors import (
    DataRemovedError,
    InvalidArgument,
    NoBookiesAvailable,
    NoSuchStream,
    NoSuchTopic,
    PayloadTooLarge,
    ReadFailedError,
    StaleTermError,
    StreamExists,
    TakeOverFailed,
    TopicExists,
    WriterWithdrawn,
)


class KafkaError(Exception):
    """An error answered to the client with a Kafka error code."""

    code: ErrorCode = ErrorCode.unknown_server_error
    retriable = False


class OffsetOutOfRange(KafkaError):
    code = ErrorCode.offset_out_of_range


class CorruptMessage(KafkaError):
    code = ErrorCode.corrupt_message
    retriable = True


class UnknownTopicOrPartition(KafkaError):
    code = ErrorCode.unknown_topic_or_partition
    retriable = True


class UnknownTopicId(KafkaError):
    code = ErrorCode.unknown_topic_id
    retriable = True


class NotLeaderOrFollower(KafkaError):
    code = ErrorCode.not_leader_or_follower
    retriable = True


class RequestTimedOut(KafkaError):
    code = ErrorCode.request_timed_out
    retriable = True


class MessageTooLarge(KafkaError):
    code = ErrorCode.message_too_large


class InvalidTopic(KafkaError):
    code = ErrorCode.invalid_topic_exception


class NotEnoughReplicas(KafkaError):
    code = ErrorCode.not_enough_replicas
    retriable = True


class TopicAlreadyExists(KafkaError):
    code = ErrorCode.topic_already_exists


class InvalidPartitions(KafkaError):
    code = ErrorCode.invalid_partitions


class InvalidRequiredAcks(KafkaError):
    code = ErrorCode.invalid_required_acks


class UnsupportedVersion(KafkaError):
    code = ErrorCode.unsupported_version


class InvalidRequest(KafkaError):
    code = ErrorCode.invalid_request


class InvalidRecord(KafkaError):
    code = ErrorCode.invalid_record


class UnsupportedForMessageFormat(KafkaError):
    code = ErrorCode.unsupported_for_message_format


class KafkaStorageError(KafkaError):
    code = ErrorCode.kafka_storage_error
    retriable = True


class OutOfOrderSequenceNumber(KafkaError):
    """An idempotent batch whose first sequence does not follow the producer's last one."""

    code = ErrorCode.out_of_order_sequence_number


class InvalidProducerEpoch(KafkaError):
    """An idempotent batch from an older epoch of its producer id (a fenced producer instance)."""

    code = ErrorCode.invalid_producer_epoch


class UnknownProducerId(KafkaError):
    """A non-zero sequence from a producer id this partition has no state for."""

    code = ErrorCode.unknown_producer_id


class CoordinatorNotAvailable(KafkaError):
    code = ErrorCode.coordinator_not_available
    retriable = True


# Kafka code -> our exception class (for tests and for clients of this package).
ERROR_CLASSES: dict[ErrorCode, type[KafkaError]] = {
    cls.code: cls
    for cls in (
        OffsetOutOfRange, CorruptMessage, UnknownTopicOrPartition, NotLeaderOrFollower, RequestTimedOut,
        MessageTooLarge, InvalidTopic, NotEnoughReplicas, TopicAlreadyExists, InvalidPartitions,
        InvalidRequiredAcks, UnsupportedVersion, InvalidRequest, UnsupportedForMessageFormat, KafkaStorageError,
        OutOfOrderSequenceNumber, InvalidProducerEpoch, UnknownProducerId, CoordinatorNotAvailable,
    )
}

# Scroll's errors (and the metadata store's) -> the Kafka error a client should see. Take-over
# problems become NOT_LEADER_OR_FOLLOWER so the client refreshes metadata and retries.
SCROLL_ERRORS: dict[type[Exception], type[KafkaError]] = {
    NoSuchStream: UnknownTopicOrPartition,
    NoSuchTopic: UnknownTopicOrPartition,
    StreamExists: TopicAlreadyExists,
    TopicExists: TopicAlreadyExists,
    PayloadTooLarge: MessageTooLarge,
    InvalidArgument: InvalidRequest,
    StaleTermError: NotLeaderOrFollower,
    WriterWithdrawn: NotLeaderOrFollower,
    TakeOverFailed: NotLeaderOrFollower,
    NoBookiesAvailable: NotEnoughReplicas,
    DataRemovedError: OffsetOutOfRange,
    ReadFailedError: KafkaStorageError,
    MetadataUnavailable: RequestTimedOut,
    RecordFormatError: CorruptMessage,  # a stream entry that is not a record batch: refused, not served
}


def code_for(exc: BaseException) -> ErrorCode:
    """The Kafka error code to answer for ``exc`` (UNKNOWN_SERVER_ERROR for anything unmapped)."""
    if isinstance(exc, KafkaError):
        return exc.code
    for cls in type(exc).__mro__:
        mapped = SCROLL_ERRORS.get(cls)
        if mapped is not None:
            return mapped.code
    return ErrorCode.unknown_server_error


class ProtocolError(Exception):
    """The connection cannot go on (unreadable or oversize frame): the server closes it."""

    retriable = False


class FrameTooLarge(ProtocolError):
    pass


class CorruptRequest(ProtocolError):
    pass


class DropConnection(ProtocolError):
    """Test-only fault injection: close the connection instead of answering (the work is done)."""


class UnsupportedRequest(ProtocolError):
    """An API key or version we do not serve (other than ApiVersions, which gets an answer)."""

    def __init__(self, message: str, api_key: int, api_version: int, correlation_id: int):
        super().__init__(message)
        self.api_key = api_key
        self.api_version = api_version
        self.correlation_id = correlation_id
