"""Errors the client API raises. Each says whose fault it is and whether retrying can help."""

from __future__ import annotations


class ScrollError(Exception):
    retriable = False


class NoSuchStream(ScrollError):
    pass


class StreamExists(ScrollError):
    pass


class NoSuchTopic(NoSuchStream):
    pass


class TopicExists(StreamExists):
    pass


class InvalidArgument(ScrollError):
    pass


class StaleTermError(ScrollError):
    """This producer was taken over: another writer holds a newer term. Nothing it appended after
    the take-over is readable. Open a new producer to write again."""


class WriterWithdrawn(ScrollError):
    """The writer stopped (e.g. a bookie holding committed entries failed); unacknowledged appends
    have an unknown outcome. A new producer re-opens the stream through a take-over."""

    retriable = True


class TakeOverFailed(ScrollError):
    retriable = True


class DataRemovedError(ScrollError):
    """The position asked for was removed by retention."""

    def __init__(self, message: str, earliest: int):
        super().__init__(message)
        self.earliest = earliest


class PayloadTooLarge(InvalidArgument):
    pass


class KeyRequired(InvalidArgument, ValueError):
    """A record without a key appended to a compacted stream (cleanup_policy includes compact):
    compaction keeps the last record of each key, so a record without one cannot be kept (Kafka
    refuses it too, INVALID_RECORD). Nothing was appended."""


class AuthenticationFailed(ScrollError):
    """A bookie refused this client's credentials (no or a wrong token or client certificate, or
    TLS that does not match): pass ``security=ClientSecurity(...)`` to ``connect``. Not retriable."""


class NoBookiesAvailable(ScrollError):
    retriable = True


class ReadFailedError(ScrollError):
    """No replica could serve an entry that is below the LAC."""

    retriable = True


class TierReadError(ReadFailedError):
    """Entries of an offloaded fragment could not be read from the object store. As raised for an
    unreachable or slow store it is retriable; the message names the stream, the entries (and
    record offsets, when known) asked for and the object key."""

    def __init__(self, message: str, *, stream: str = "", key: str = "", first: int = -1, last: int = -1,
                 retriable: bool | None = None):
        super().__init__(message)
        self.stream, self.key, self.first, self.last = stream, key, first, last
        if retriable is not None:
            self.retriable = retriable


class ObjectDataLost(TierReadError):
    """An offloaded fragment's object is missing or corrupt while it is the only copy of those
    records (or every bookie copy is gone too): the records exist in the stream's metadata but
    cannot be read. Never skipped silently; retrying does not help."""

    retriable = False
