"""Ledger metadata on top of any ``MetadataStore``: one key per ledger, one key per fragment.

Key layout (see docs/metadata.md)::

    /scroll/ids/ledger                                   counter: the last ledger id allocated
    /scroll/ledgers/by-name/<name>                       -> ledger id (decimal)
    /scroll/ledgers/<id:012d>/meta                       -> LedgerMeta JSON
    /scroll/ledgers/<id:012d>/fragments/<index:012d>     -> Fragment JSON
    /scroll/bookies/<bookie_id>                          -> BookieRegistration JSON, under a lease

The meta record never holds per-entry or per-fragment lists, so its size does not grow with the
stream; only the fragment keys do, one per fragment. Every ledger write is a compare-and-set on
the meta key's version (``cas_ledger``), which also writes the fragment records in the same
transaction: a lost CAS means someone else acted, and nothing was written.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

from fragments.model import Fragment, InvalidConfig, LedgerConfig, LedgerMeta, LedgerStatus
from fragments.store import MetadataError, MetadataStore

ROOT = "/scroll"
LEDGER_ID_COUNTER = f"{ROOT}/ids/ledger"
LEDGERS = f"{ROOT}/ledgers/"
BY_NAME = f"{ROOT}/ledgers/by-name/"
BOOKIES = f"{ROOT}/bookies/"
MAX_NAME_LEN = 512
_TXN_WRITES = 128  # etcd's default --max-txn-ops
_LIST_CONCURRENCY = 32
_LIST_CHUNK = 128  # meta records read in one request (etcd's default --max-txn-ops)


def ledger_prefix(ledger_id: int) -> str:
    return f"{LEDGERS}{ledger_id:012d}/"


def meta_key(ledger_id: int) -> str:
    return f"{ledger_prefix(ledger_id)}meta"


def fragments_prefix(ledger_id: int) -> str:
    return f"{ledger_prefix(ledger_id)}fragments/"


def fragment_key(ledger_id: int, index: int) -> str:
    return f"{fragments_prefix(ledger_id)}{index:012d}"


def by_name_key(name: str) -> str:
    return f"{BY_NAME}{name}"


def bookie_key(bookie_id: str) -> str:
    return f"{BOOKIES}{bookie_id}"


class LedgerError(MetadataError):
    """A ledger-level error (not retriable unless stated)."""


class LedgerExists(LedgerError):
    def __init__(self, name: str) -> None:
        super().__init__(f"ledger {name!r} already exists")
        self.name = name


class NoSuchLedger(LedgerError, LookupError):
    def __init__(self, name_or_id: str | int) -> None:
        what = f"id {name_or_id}" if isinstance(name_or_id, int) else repr(name_or_id)
        super().__init__(f"no ledger {what}")
        self.name_or_id = name_or_id


class NoSuchFragment(LedgerError, LookupError):
    def __init__(self, ledger_id: int, index: int) -> None:
        super().__init__(f"ledger {ledger_id} has no fragment {index}")
        self.ledger_id = ledger_id
        self.index = index


class CorruptMetadata(LedgerError):
    """A record that does not parse: a bug or a foreign writer, never retried."""


def validate_name(name: str) -> None:
    if not isinstance(name, str) or not name:
        raise ValueError("a ledger name is a non-empty string")
    if len(name) > MAX_NAME_LEN:
        raise ValueError(f"a ledger name is at most {MAX_NAME_LEN} characters")
    if any(ord(c) < 0x20 or c == "\x7f" for c in name):
        raise ValueError(f"a ledger name has no control characters: {name!r}")


def _parse_meta(raw: bytes, key: str) -> LedgerMeta:
    try:
        return LedgerMeta.from_json(raw)
    except (ValueError, TypeError, KeyError) as e:
        raise CorruptMetadata(f"{key}: cannot parse ledger metadata: {e}") from e


def _parse_fragment(raw: bytes, key: str) -> Fragment:
    try:
        return Fragment.from_json(raw)
    except (ValueError, TypeError, KeyError) as e:
        raise CorruptMetadata(f"{key}: cannot parse fragment: {e}") from e


def _common_prefix(a: str, b: str) -> str:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return a[:n]


_ID_CACHE_MAX = 100_000  # names whose ledger id is remembered
FEW_FRAGMENTS = 32  # a range of at most this many fragments is read by key (one transaction of gets)
ID_BLOCK = 32  # ledger ids a store takes from the counter at once for creates of a few streams


def fragment_zero(ensemble: tuple[str, ...]) -> Fragment:
    """A new ledger's first fragment (what ``create_ledger`` writes) on ``ensemble``."""
    return Fragment(index=0, first_entry_id=0, ensemble=tuple(ensemble), created_term=0, first_offset=0)


class LedgerStore:
    """Ledger metadata operations; every method is one or a few store round trips."""

    def __init__(self, store: MetadataStore) -> None:
        self.store = store
        # name -> ledger id, as created or looked up here. Ids are never reused and a name's record
        # goes with its meta record (one transaction), so a cached id whose meta is still there
        # under the same name is the name's ledger; otherwise the name is looked up again.
        self._ids: dict[str, int] = {}
        # Ledger ids taken from the counter and not yet used: creates share one compare-and-set
        # per ID_BLOCK instead of racing each other (and other clients) for every id.
        self._free_ids: list[int] = []
        self._id_lock = asyncio.Lock()

    async def allocate_ids(self, n: int) -> list[int]:
        """``n`` fresh ledger ids, never handed out before by any store. Small requests come out of
        a block of ``ID_BLOCK`` this store took from the counter with one compare-and-set; a
        request of a block or more takes its own. Ids are unique, not dense: a block's unused ids
        are skipped when the process exits (a ledger id is a name for a ledger, nothing counts them)."""
        if n < 1:
            raise ValueError(f"n must be >= 1, not {n}")
        if n >= ID_BLOCK:
            return list(await self.store.next_ids(LEDGER_ID_COUNTER, n))
        async with self._id_lock:
            if len(self._free_ids) < n:
                self._free_ids += list(await self.store.next_ids(LEDGER_ID_COUNTER, ID_BLOCK))
            out, self._free_ids = self._free_ids[:n], self._free_ids[n:]
            return out

    async def create_ledger(
        self,
        name: str,
        config: LedgerConfig,
        ensemble: tuple[str, ...],
        retention: dict | None = None,
        ledger_id: int | None = None,
        also_create: dict[str, bytes] | None = None,
    ) -> tuple[LedgerMeta, int]:
        """Allocate an id (or use ``ledger_id``, one the caller took with ``allocate_ids``) and create the ledger (OPEN, term 0) with fragment 0 on ``ensemble``.

        One transaction claims the name and writes the meta and fragment 0; ``LedgerExists`` if the
        name is taken (an id allocated for a lost race is simply skipped). ``also_create``: keys
        that must not exist yet, written in the same transaction (a one-partition topic's record);
        ``LedgerExists`` too if one of them exists (the caller tells which by reading it).
        """
        validate_name(name)
        ensemble = tuple(ensemble)
        if len(ensemble) != config.ensemble_size or len(set(ensemble)) != len(ensemble):
            raise InvalidConfig(
                f"fragment 0 needs {config.ensemble_size} distinct bookies, got {list(ensemble)!r}"
            )
        if ledger_id is None:
            (ledger_id,) = await self.allocate_ids(1)
        meta = LedgerMeta(
            ledger_id=ledger_id,
            name=name,
            status=LedgerStatus.OPEN,
            term=0,
            config=config,
            first_fragment_index=0,
            last_fragment_index=0,
            retention=dict(retention or {}),
        )
        frag0 = fragment_zero(ensemble)
        mkey = meta_key(ledger_id)
        extra = dict(also_create or {})
        result = await self.store.txn(
            compares={by_name_key(name): 0, mkey: 0, **dict.fromkeys(extra, 0)},
            puts={
                by_name_key(name): str(ledger_id).encode(),
                mkey: meta.to_json().encode(),
                fragment_key(ledger_id, 0): frag0.to_json().encode(),
                **extra,
            },
        )
        if not result.succeeded:  # the id is fresh, so only the name (or an ``also_create`` key) was taken
            raise LedgerExists(name)
        self._remember(name, ledger_id)
        return meta, result.versions[mkey]

    def _remember(self, name: str, ledger_id: int) -> None:
        if len(self._ids) >= _ID_CACHE_MAX:
            self._ids.clear()
        self._ids[name] = ledger_id

    async def ledger_id(self, name: str) -> int:
        got = await self.store.get(by_name_key(name))
        if got is None:
            raise NoSuchLedger(name)
        try:
            ledger_id = int(got.value)
        except ValueError as e:
            raise CorruptMetadata(f"{by_name_key(name)}: not a ledger id: {got.value!r}") from e
        self._remember(name, ledger_id)
        return ledger_id

    async def get_ledger(self, name_or_id: str | int) -> tuple[LedgerMeta, int]:
        """The ledger's meta and its version (for ``cas_ledger``); ``NoSuchLedger`` if absent."""
        if isinstance(name_or_id, str) and (cached := self._ids.get(name_or_id)) is not None:
            got = await self.store.get(meta_key(cached))
            if got is not None:
                meta = _parse_meta(got.value, meta_key(cached))
                if meta.name == name_or_id:
                    return meta, got.version
            self._ids.pop(name_or_id, None)  # deleted (and perhaps created again): look the name up
        ledger_id = name_or_id if isinstance(name_or_id, int) else await self.ledger_id(name_or_id)
        got = await self.store.get(meta_key(ledger_id))
        if got is None:
            raise NoSuchLedger(name_or_id)
        return _parse_meta(got.value, meta_key(ledger_id)), got.version

    async def get_fragment(self, ledger_id: int, index: int) -> Fragment:
        key = fragment_key(ledger_id, index)
        got = await self.store.get(key)
        if got is None:
            raise NoSuchFragment(ledger_id, index)
        return _parse_fragment(got.value, key)

    async def fragments(
        self, ledger_id: int, first_index: int | None = None, last_index: int | None = None
    ) -> list[Fragment]:
        """Fragments ``first_index..last_index`` (inclusive; None: unbounded), by index, in one
        round trip: one range read of the prefix the two bounds have in common, or, for a few
        (up to ``FEW_FRAGMENTS``) whose common prefix spans many more indexes than asked for, the
        keys themselves at one revision. A reader refreshing the tail of a long stream reads one or
        two records, not every record that shares their prefix (9999..10000 share ``.../0000000``)."""
        prefix = fragments_prefix(ledger_id)
        if first_index is not None and last_index is not None:
            if last_index < first_index:
                return []
            prefix = _common_prefix(fragment_key(ledger_id, first_index), fragment_key(ledger_id, last_index))
            wanted = last_index - first_index + 1
            span = 10 ** (len(fragment_key(ledger_id, 0)) - len(prefix))  # indexes the prefix covers
            if wanted <= FEW_FRAGMENTS and span > 4 * wanted:
                keys = [fragment_key(ledger_id, i) for i in range(first_index, last_index + 1)]
                return [_parse_fragment(v.value, k) for k, v in zip(keys, await self.store.get_many(keys), strict=True)
                        if v is not None]
        out = []
        for key, v in await self.store.list_prefix(prefix):
            frag = _parse_fragment(v.value, key)
            if first_index is not None and frag.index < first_index:
                continue
            if last_index is not None and frag.index > last_index:
                continue
            out.append(frag)
        return out

    async def cas_ledger(
        self,
        meta: LedgerMeta,
        fragments: tuple[Fragment, ...],
        expected_version: int,
        *,
        drop_fragments: Iterable[int] = (),
    ) -> int | None:
        """One transaction: if the meta key is at ``expected_version``, write ``meta`` and every
        fragment record (and delete the fragments ``drop_fragments``, for retention). The meta's
        new version, or None if someone else wrote it first (nothing is written then)."""
        puts = {meta_key(meta.ledger_id): meta.to_json().encode()}
        for frag in fragments:
            puts[fragment_key(meta.ledger_id, frag.index)] = frag.to_json().encode()
        drops = tuple(fragment_key(meta.ledger_id, i) for i in drop_fragments)
        if len(puts) + len(drops) > _TXN_WRITES:
            raise ValueError(f"cas_ledger writes at most {_TXN_WRITES} records per transaction")
        result = await self.store.txn({meta_key(meta.ledger_id): expected_version}, puts, drops)
        return result.versions[meta_key(meta.ledger_id)] if result.succeeded else None

    async def list_ledgers(self) -> list[LedgerMeta]:
        """Every ledger, by id (one range read of the names, then the meta records, read
        ``_LIST_CHUNK`` to a request: 30,000 streams took one request each, 18 s)."""
        names = await self.store.list_prefix(BY_NAME)
        keys = []
        for key, v in names:
            try:
                keys.append(meta_key(int(v.value)))
            except ValueError as e:
                raise CorruptMetadata(f"{key}: not a ledger id: {v.value!r}") from e
        sem = asyncio.Semaphore(_LIST_CONCURRENCY)

        async def chunk(part: list[str]) -> list[LedgerMeta]:
            async with sem:
                got = await self.store.get_many(part)
            return [_parse_meta(g.value, k) for k, g in zip(part, got, strict=True) if g is not None]

        chunks = await asyncio.gather(*(chunk(keys[i:i + _LIST_CHUNK]) for i in range(0, len(keys), _LIST_CHUNK)))
        return sorted((m for c in chunks for m in c), key=lambda m: m.ledger_id)

    async def delete_ledger(self, name: str) -> None:
        """Remove the ledger: name and meta atomically (the ledger is gone for everyone at once,
        and a writer's pending CAS fails), then its fragment records in batches."""
        for _ in range(100):
            name_rec = await self.store.get(by_name_key(name))
            if name_rec is None:
                raise NoSuchLedger(name)
            ledger_id = int(name_rec.value)
            mkey = meta_key(ledger_id)
            meta_rec = await self.store.get(mkey)
            compares = {by_name_key(name): name_rec.version, mkey: meta_rec.version if meta_rec else 0}
            result = await self.store.txn(compares, {}, (by_name_key(name), mkey) if meta_rec else (by_name_key(name),))
            if result.succeeded:
                break
        else:
            raise LedgerError(f"could not delete ledger {name!r}: it keeps changing")
        while True:
            keys = [k for k, _ in await self.store.list_prefix(fragments_prefix(ledger_id))]
            if not keys:
                return
            for i in range(0, len(keys), _TXN_WRITES):
                await self.store.txn({}, {}, tuple(keys[i:i + _TXN_WRITES]))
