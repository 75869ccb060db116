"""Status codes and typed errors of the bookie, one table for both sides of the wire.

How this works: every answer the bookie gives carries a ``Status`` (the same numbers as the
``Status`` enum of ``bookie.proto``). Protocol answers (INVALID_TERM, NOT_TRUNCATED, NO_SUCH_ENTRY)
are normal outcomes; the rest are errors. Each error code has one exception class with a
``retriable`` flag (aiokafka style) and ``error_for(code, message)`` maps a code back to its class,
so the server raises typed errors internally and the client re-raises the same types.
"""

from __future__ import annotations

import enum


class Status(enum.IntEnum):
    OK = 0
    INVALID_TERM = 1  # the bookie holds a higher term: the sender was taken over
    NOT_TRUNCATED = 2  # normal add/LAC write in a term this bookie has not truncated in yet
    NO_SUCH_ENTRY = 3
    NO_SUCH_LEDGER = 4
    CORRUPT = 5  # stored bytes fail their checksum: read another replica
    READ_ONLY = 6  # disk full or under the free-space floor
    TOO_LARGE = 7  # entry, batch or read over a configured limit
    BAD_REQUEST = 8  # malformed request (negative ids, mismatched columns, ...)
    BAD_DIGEST = 9  # the add's digest does not match its header and payload
    TOO_BUSY = 10  # a server-side limit (waiters, streams) is reached
    SHUTTING_DOWN = 11
    STORAGE_ERROR = 12  # journal or entry-log IO failed
    INTERNAL = 13
    UNAUTHENTICATED = 14  # the bookie requires authentication: no, or a wrong, token or client certificate


class BookieError(Exception):
    """Base of every operating error of a bookie (server side or seen by the client)."""

    status: Status = Status.INTERNAL
    retriable: bool = False

    def __init__(self, message: str = "") -> None:
        super().__init__(message or self.__class__.__name__)
        self.message = message


class InvalidTermError(BookieError):
    status = Status.INVALID_TERM

    def __init__(self, message: str = "", bookie_term: int = -1) -> None:
        super().__init__(message)
        self.bookie_term = bookie_term


class NotTruncatedError(BookieError):
    status = Status.NOT_TRUNCATED


class NoSuchEntryError(BookieError):
    status = Status.NO_SUCH_ENTRY


class NoSuchLedgerError(BookieError):
    status = Status.NO_SUCH_LEDGER


class CorruptEntryError(BookieError):
    status = Status.CORRUPT
    retriable = True  # another replica may hold a good copy


class ReadOnlyError(BookieError):
    status = Status.READ_ONLY
    retriable = True  # comes back when disk space does


class TooLargeError(BookieError):
    status = Status.TOO_LARGE


class BadRequestError(BookieError):
    status = Status.BAD_REQUEST


class BadDigestError(BookieError):
    status = Status.BAD_DIGEST


class TooBusyError(BookieError):
    status = Status.TOO_BUSY
    retriable = True


class ShuttingDownError(BookieError):
    status = Status.SHUTTING_DOWN
    retriable = True


class StorageError(BookieError):
    status = Status.STORAGE_ERROR
    retriable = True


class InternalError(BookieError):
    status = Status.INTERNAL
    retriable = True


class BookieAuthError(BookieError):
    """The bookie refused the caller: no or a wrong token, no or an untrusted client certificate,
    or a TLS handshake that failed. Not retriable: the credentials must change first."""

    status = Status.UNAUTHENTICATED
    retriable = False

    def __init__(self, message: str = "", definite: bool = True) -> None:
        super().__init__(message)
        # False: the client inferred it (a TLS connection closed right after its handshake), which a
        # bookie that was stopping at that moment can also cause; True: the bookie said so
        self.definite = definite


class BookieUnavailableError(BookieError):
    """Client side: the connection to the bookie failed or timed out."""

    status = Status.INTERNAL
    retriable = True


ERRORS: dict[Status, type[BookieError]] = {
    cls.status: cls
    for cls in (
        InvalidTermError,
        NotTruncatedError,
        NoSuchEntryError,
        NoSuchLedgerError,
        CorruptEntryError,
        ReadOnlyError,
        TooLargeError,
        BadRequestError,
        BadDigestError,
        TooBusyError,
        ShuttingDownError,
        StorageError,
        InternalError,
        BookieAuthError,
    )
}


def error_for(code: int, message: str = "", bookie_term: int = -1) -> BookieError:
    """The typed exception for a non-OK status code received over the wire."""
    try:
        status = Status(code)
    except ValueError:
        return InternalError(f"unknown status {code}: {message}")
    cls = ERRORS.get(status, InternalError)
    if cls is InvalidTermError:
        return InvalidTermError(message, bookie_term)
    return cls(message)
