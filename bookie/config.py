"""The bookie's configuration: one frozen dataclass, validated once at start.

How this works: every limit the bookie enforces lives here (entry and batch sizes, cache bytes,
journal group commit, file sizes, GC thresholds, the free-space floor, read and long-poll limits).
``BookieConfig.__post_init__`` rejects nonsense (negative sizes, a batch larger than a journal file)
with a ``ConfigError`` naming the field, so a bad value fails at start rather than at the first add.
``with_overrides`` builds a copy from ``key=value`` strings (the CLI's ``--set``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB


class ConfigError(ValueError):
    retriable = False


@dataclass(frozen=True)
class BookieConfig:
    data_dir: Path
    journal_dir: Path | None = None  # defaults to <data_dir>/journal
    bookie_id: str = ""  # defaults to host:port when served

    # --- limits on requests ---
    max_entry_bytes: int = 1 * MiB
    max_batch_adds: int = 10_000
    max_batch_bytes: int = 16 * MiB
    max_inflight_batches_per_stream: int = 64  # a stream stops being read past this (back-pressure)
    max_add_streams: int = 1024
    max_read_entries: int = 10_000
    max_read_bytes: int = 16 * MiB
    max_lac_waiters: int = 10_000
    long_poll_max_s: float = 60.0
    verify_digest_on_add: bool = False  # reads always verify; True also rejects bad CRC32C digests at ingest (~1 us/add)

    # --- journal ---
    journal_group_wait_s: float = 0.0  # extra wait for more records before an fsync (0: fsync at once)
    journal_group_bytes_max: int = 4 * MiB  # at most this much per write+fsync
    journal_inline_sync_bytes: int = 64 * KiB  # groups up to this size sync on the event loop (0: always the writer thread)
    journal_file_bytes: int = 64 * MiB
    journal_preallocate: str = "zero"  # "zero" (fill with zeros), "fallocate" or "none"
    journal_spare_sync_bytes: int = 1 * MiB  # a spare's zero fill fdatasyncs every this many bytes (0: once, at the end)
    journal_retry_interval_s: float = 1.0  # retry a failed journal write this often

    # --- write cache, flush, entry logs ---
    write_cache_bytes: int = 128 * MiB  # adds wait (back-pressure) when the unflushed bytes reach this
    flush_interval_s: float = 1.0
    entry_log_bytes_max: int = 256 * MiB
    read_cache_bytes: int = 64 * MiB
    read_threads: int = 2

    # --- garbage collection ---
    gc_interval_s: float = 60.0
    gc_live_threshold: float = 0.5  # compact an entry log when its live share falls under this

    # --- disk space ---
    min_free_bytes: int = 256 * MiB  # under this much free space the bookie turns read-only
    disk_check_interval_s: float = 2.0

    # --- scrubbing (bookie/scrub.py): read every stored entry back and verify it ---
    scrub_interval_s: float = 86_400.0  # from the end of one pass to the start of the next (0: never scrub)
    scrub_first_delay_s: float = 600.0  # the first pass this long after start (not in a restart storm)
    scrub_bytes_per_s: int = 8 * MiB  # read rate of a pass (it shares the disk with the flush and reads)

    def __post_init__(self) -> None:
        object.__setattr__(self, "data_dir", Path(self.data_dir))
        if self.journal_dir is not None:
            object.__setattr__(self, "journal_dir", Path(self.journal_dir))
        for name in (
            "max_entry_bytes",
            "max_batch_adds",
            "max_batch_bytes",
            "max_inflight_batches_per_stream",
            "max_add_streams",
            "max_read_entries",
            "max_read_bytes",
            "max_lac_waiters",
            "journal_group_bytes_max",
            "journal_file_bytes",
            "write_cache_bytes",
            "entry_log_bytes_max",
            "read_cache_bytes",
            "read_threads",
            "scrub_bytes_per_s",
        ):
            _positive(name, getattr(self, name))
        for name in ("journal_group_wait_s", "min_free_bytes", "journal_inline_sync_bytes", "journal_spare_sync_bytes",
                     "scrub_interval_s", "scrub_first_delay_s"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        for name in ("long_poll_max_s", "flush_interval_s", "gc_interval_s", "disk_check_interval_s",
                     "journal_retry_interval_s"):
            _positive(name, getattr(self, name))
        self._check_relations()

    def _check_relations(self) -> None:
        if self.journal_preallocate not in ("zero", "fallocate", "none"):
            raise ConfigError(f"journal_preallocate must be zero|fallocate|none, got {self.journal_preallocate!r}")
        if not 0.0 <= self.gc_live_threshold <= 1.0:
            raise ConfigError("gc_live_threshold must be within [0, 1]")
        if self.max_entry_bytes > self.max_batch_bytes:
            raise ConfigError("max_entry_bytes must be <= max_batch_bytes")
        # One journal record holds one batch and never spans files.
        if self.max_journal_record_bytes + 4 * KiB > self.journal_file_bytes:
            raise ConfigError(
                f"journal_file_bytes must exceed the largest journal record "
                f"(max_batch_bytes + 128 bytes per add of max_batch_adds + 8 KiB = {self.max_journal_record_bytes + 4 * KiB})"
            )
        if self.max_entry_bytes + 4 * KiB > self.entry_log_bytes_max:
            raise ConfigError("entry_log_bytes_max must exceed max_entry_bytes + 4 KiB")
        if self.max_batch_bytes > self.write_cache_bytes:
            raise ConfigError("write_cache_bytes must be >= max_batch_bytes")

    @property
    def journal_path(self) -> Path:
        return self.journal_dir if self.journal_dir is not None else self.data_dir / "journal"

    @property
    def max_journal_record_bytes(self) -> int:
        # a batch's payload, plus per add its replay fields, entry-log head and digest
        return self.max_batch_bytes + self.max_batch_adds * 128 + 4 * KiB

    @property
    def grpc_max_message_bytes(self) -> int:
        # A batch plus its per-add columns; reads are bounded by max_read_bytes the same way.
        return max(self.max_batch_bytes, self.max_read_bytes) + 1 * MiB

    def with_overrides(self, pairs: dict[str, str]) -> BookieConfig:
        """A copy with fields replaced from strings (``{"min_free_bytes": "0"}``)."""
        fields = {f.name: f for f in dataclasses.fields(self)}
        changes: dict[str, object] = {}
        for key, raw in pairs.items():
            if key not in fields:
                raise ConfigError(f"unknown config field {key!r}")
            changes[key] = _parse(key, raw, getattr(self, key))
        return dataclasses.replace(self, **changes)


def _positive(name: str, value: float) -> None:
    if not value > 0:
        raise ConfigError(f"{name} must be > 0, got {value!r}")


def _parse(key: str, raw: str, current: object) -> object:
    try:
        if isinstance(current, bool):
            if raw.lower() in ("1", "true", "yes", "on"):
                return True
            if raw.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(raw)
        if isinstance(current, int):
            return int(raw, 0)
        if isinstance(current, float):
            return float(raw)
        if isinstance(current, Path) or current is None:
            return Path(raw)
        return raw
    except ValueError as exc:
        raise ConfigError(f"bad value for {key}: {raw!r}") from exc
