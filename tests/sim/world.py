"""The simulated world: one process, virtual time, every source of nondeterminism seeded.

How this works. A ``Sim`` is a discrete-event loop over a heap of (time, seq, action). The network
delivers each message after a random delay, FIFO per directed link, and may drop, duplicate or
partition (a drop is a lost message, and later messages on the link still arrive: a reconnect).
Bookies run the real bookie rules (``terms.bookie_rules.decide``) over a disk model: every change
is journaled and answered only after a group "fsync"; a crash loses what was not synced. Writers
are the real ``terms.writer.LedgerWriter`` driven by ``SimClient``; several clients take a ledger
over from each other at random moments, and superseded writers (zombies) keep writing until a bookie
tells them their term is stale. The metadata store is a versioned record with CAS.
"""

from __future__ import annotations

import heapq
import random
from dataclasses import dataclass, field

from fragments.model import Fragment, LedgerConfig, LedgerMeta, LedgerStatus
from fragments.placement import BookieInfo, Placement
from terms import entry as entry_codec
from terms.bookie_rules import Accept, LedgerState, changes_state, decide
from terms.commands import (
    Aborted,
    Acknowledge,
    CasLedger,
    Closed,
    Opened,
    SendAdd,
    SendFence,
    SendLacWrite,
    SendRecoveryRead,
    UnsafeSwitches,
    Withdraw,
    WriterConfig,
)
from terms.messages import (
    AddOk,
    AddRequest,
    CasConflict,
    CasOk,
    FenceFailed,
    FenceOk,
    FenceRequest,
    InvalidTerm,
    LacWriteRequest,
    NotTruncated,
    ReadFailed,
    ReadMissing,
    ReadOk,
    ReadRequest,
    RecoveryReadRequest,
    Tick,
    WriteFailed,
)
from terms.quorum import write_set
from terms.reader import copy_is_current
from terms.writer import LedgerWriter, Phase

LEDGER = 1
MS = 0.001


@dataclass
class SimOptions:
    seed: int
    ensemble: int
    write_quorum: int
    ack_quorum: int
    bookies: int
    clients: int
    readers: int
    fragment_entries_max: int
    inflight: int
    values: int
    drop_p: float
    dup_p: float
    spike_p: float
    crash_p: float
    partition_p: float
    takeover_p: float
    max_events: int
    unsafe: UnsafeSwitches = field(default_factory=UnsafeSwitches)
    lac_push_eager: bool = False  # the driver's default: push the LAC at once when no add is in flight

    @classmethod
    def from_seed(cls, seed: int, unsafe: UnsafeSwitches | None = None, scale: float = 1.0) -> SimOptions:
        r = random.Random(seed * 7919 + 17)
        e = r.choice([3, 3, 4, 5])
        wq = r.choice([w for w in range(2, e + 1)])
        aq = r.choice([a for a in range(1, wq + 1)] + [wq])  # AQ = WQ often
        return cls(
            seed=seed,
            ensemble=e,
            write_quorum=wq,
            ack_quorum=aq,
            bookies=e + r.choice([1, 2, 2, 3]),
            clients=r.choice([2, 2, 3]),
            readers=r.choice([1, 2]),
            fragment_entries_max=r.choice([4, 7, 12, 1000]),
            inflight=r.choice([2, 4, 8, 16]),
            values=int(r.choice([30, 60, 90]) * scale),
            drop_p=r.choice([0.0, 0.01, 0.03, 0.08]),
            dup_p=r.choice([0.0, 0.02]),
            spike_p=r.choice([0.0, 0.02, 0.1]),
            crash_p=r.choice([0.0, 0.0005, 0.002]),
            partition_p=r.choice([0.0, 0.0005, 0.002]),
            takeover_p=r.choice([0.005, 0.02, 0.05]),
            max_events=int(r.choice([1500, 2500, 4000]) * scale),
            unsafe=unsafe or UnsafeSwitches(),
            lac_push_eager=r.random() < 0.5,  # drawn last: the other choices of a seed stay as they were
        )


@dataclass
class Stats:
    events: int = 0
    takeovers_started: int = 0
    takeovers_done: int = 0
    truncations: int = 0  # take-overs that discarded at least one unacknowledged entry of the old term
    aborted: int = 0
    withdrawn: int = 0
    ensemble_changes: int = 0
    rollovers: int = 0
    acked: int = 0
    crashes: int = 0
    partitions: int = 0
    dropped: int = 0
    reads: int = 0


class Sim:
    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        self.now = 0.0
        self._heap: list = []
        self._seq = 0

    def after(self, delay: float, fn, *args) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (self.now + delay, self._seq, fn, args))

    def step(self) -> bool:
        if not self._heap:
            return False
        t, _, fn, args = heapq.heappop(self._heap)
        self.now = max(self.now, t)
        fn(*args)
        return True


class Network:
    def __init__(self, sim: Sim, world: World):
        self.sim, self.world = sim, world
        self.link_last: dict[tuple[str, str], float] = {}
        self.partitioned: set[frozenset] = set()
        self.faults = True

    def cut(self, a: str, b: str) -> bool:
        return frozenset((a, b)) in self.partitioned

    def send(self, src: str, dst: str, fn, *args) -> None:
        o, r = self.world.opts, self.sim.rng
        if self.faults and (self.cut(src, dst) or r.random() < o.drop_p):
            self.world.stats.dropped += 1
            return
        delay = r.uniform(0.05, 1.0) * MS
        if self.faults and r.random() < o.spike_p:
            delay += r.uniform(10, 60) * MS
        t = max(self.sim.now + delay, self.link_last.get((src, dst), 0.0) + 1e-9)
        self.link_last[(src, dst)] = t
        self.sim.after(t - self.sim.now, self._deliver, src, dst, fn, args)
        if self.faults and r.random() < o.dup_p:
            t2 = t + 1e-9
            self.link_last[(src, dst)] = t2
            self.sim.after(t2 - self.sim.now, self._deliver, src, dst, fn, args)

    def _deliver(self, src: str, dst: str, fn, args) -> None:
        if self.faults and self.cut(src, dst):
            self.world.stats.dropped += 1
            return
        node = self.world.bookies.get(dst)
        if node is not None and not node.up:
            return
        fn(*args)


class SimBookie:
    """A bookie: the real term rules over a journal that loses unsynced changes on a crash."""

    def __init__(self, name: str, world: World):
        self.name, self.world = name, world
        self.up = True
        self.epoch = 0
        self.state: LedgerState | None = None
        self.entries: dict[int, tuple[int, bytes]] = {}  # id -> (entry term, data)
        self.d_state: LedgerState | None = None
        self.d_entries: dict[int, tuple[int, bytes]] = {}
        self.journal: list[tuple] = []  # unsynced ops, each with its reply
        self.syncing = False
        self.dirty_from = 0  # lowest id changed since the checker last looked

    @property
    def lac(self) -> int:
        return self.state.lac if self.state else -1

    def receive(self, client: str, req, reply) -> None:
        if isinstance(req, ReadRequest):
            e = self.entries.get(req.entry_id)
            reply(("read", req.entry_id, e, self.lac, self.state.term if self.state else -1))
            return
        before = self.state
        d = decide(before, req)
        if not isinstance(d, Accept):
            if d.not_truncated:
                reply(NotTruncated(self.name, LEDGER, getattr(req, "entry_id", -1), req.term))
            else:
                reply(InvalidTerm(self.name, LEDGER, req.term, d.bookie_term))
            return
        ops: list[tuple] = []
        if d.truncate_from is not None:
            self._truncate(d.truncate_from)
            ops.append(("truncate", d.truncate_from))
        if isinstance(req, AddRequest):
            self._put(req.entry_id, (req.term, req.data))
            ops.append(("put", req.entry_id, (req.term, req.data)))
            answer = AddOk(self.name, LEDGER, req.entry_id, req.term)
        elif isinstance(req, FenceRequest):
            answer = FenceOk(self.name, LEDGER, req.term, d.state.lac, d.state.lafr)
        elif isinstance(req, RecoveryReadRequest):
            e = self.entries.get(req.entry_id)
            if e is None:
                answer = ReadMissing(self.name, LEDGER, req.entry_id, req.term)
            else:
                answer = ReadOk(self.name, LEDGER, req.entry_id, req.term, e[0], e[1])
        else:  # LAC write
            answer = None
        if d.state.lac != self.lac:
            self.dirty_from = min(self.dirty_from, self.lac + 1)
        self.state = d.state
        ops.append(("state", d.state))
        lac_only = (isinstance(req, LacWriteRequest) and before is not None and d.truncate_from is None
                    and d.state.term == before.term and d.state.clean_term == before.clean_term)
        # as the bookie: a write that only moves the LAC/LAFR hint is not journaled (a crash forgets it)
        if not lac_only and (isinstance(req, AddRequest) or changes_state(before, d)):
            self.journal.append((ops, reply, answer))
            self._schedule_sync()
        elif answer is not None:
            reply(answer)

    def _put(self, entry_id: int, e: tuple[int, bytes]) -> None:
        self.entries[entry_id] = e
        self.dirty_from = min(self.dirty_from, entry_id)

    def _truncate(self, from_id: int) -> None:
        for i in [i for i in self.entries if i >= from_id]:
            del self.entries[i]
        self.dirty_from = min(self.dirty_from, from_id)

    def _schedule_sync(self) -> None:
        if not self.syncing and self.journal:
            self.syncing = True
            n = len(self.journal)
            self.world.sim.after(self.world.sim.rng.uniform(0.05, 0.5) * MS, self._synced, self.epoch, n)

    def _synced(self, epoch: int, n: int) -> None:
        if epoch != self.epoch:
            return
        batch, self.journal = self.journal[:n], self.journal[n:]
        for ops, reply, answer in batch:
            for op in ops:
                if op[0] == "truncate":
                    for i in [i for i in self.d_entries if i >= op[1]]:
                        del self.d_entries[i]
                elif op[0] == "put":
                    self.d_entries[op[1]] = op[2]
                else:
                    self.d_state = op[1]
            if answer is not None:
                reply(answer)
        self.syncing = False
        self._schedule_sync()

    def crash(self) -> None:
        self.up = False
        self.epoch += 1
        self.journal, self.syncing = [], False
        self.state, self.entries = self.d_state, dict(self.d_entries)
        self.dirty_from = 0

    def restart(self) -> None:
        self.up = True


class SimMeta:
    def __init__(self, world: World, config: LedgerConfig, ensemble: tuple[str, ...]):
        self.world = world
        self.ledger = LedgerMeta(LEDGER, "sim", LedgerStatus.OPEN, 0, config)
        self.version = 1
        self.fragments = {0: Fragment(0, 0, ensemble, created_term=0)}
        self.changed = True

    def foreign_touch(self) -> None:
        """A non-writer (retention, a layer above) changes a field it owns: the version moves, the
        term does not. Writers must rebase over it, not withdraw."""
        n = self.ledger.extra.get("touches", 0) + 1
        self.ledger = self.ledger.with_(extra={**self.ledger.extra, "touches": n})
        self.version += 1
        self.changed = True

    def current_fragments(self) -> list[Fragment]:
        lm = self.ledger
        return [self.fragments[i] for i in range(lm.first_fragment_index, lm.last_fragment_index + 1)]

    def last_fragment(self) -> Fragment:
        return self.fragments[self.ledger.last_fragment_index]

    def cas(self, cmd: CasLedger, reply) -> None:
        if cmd.expected_version != self.version:
            reply(CasConflict(self.ledger, self.version))
            return
        self.version += 1
        self.ledger = cmd.ledger
        for f in cmd.fragments:
            self.fragments[f.index] = f
        self.changed = True
        reply(CasOk(self.version))


@dataclass
class Appended:
    client: str
    term: int
    entry_id: int
    value: bytes


class SimClient:
    """Drives one LedgerWriter at a time, as the asyncio driver does with real bookies."""

    def __init__(self, name: str, world: World):
        self.name, self.world = name, world
        self.writer: LedgerWriter | None = None
        self.appended: dict[int, dict[int, bytes]] = {}  # per writer object: entry id -> value
        self.active = True
        self.counter = 0
        self.want_takeover = False
        self.retry_at = 0.0
        self.backoff = 2 * MS

    # -- actions
    def act(self) -> None:
        w, world = self.writer, self.world
        r = world.sim.rng
        if w is not None and w.engaged:
            self.execute(w, w.handle(Tick(world.sim.now)))
        if self.active:
            idle = w is None or not w.engaged
            # An external leader election would pick one writer; the sim lets clients disagree now and then.
            nobody = not any(c.writer is not None and c.writer.engaged for c in world.clients)
            p = (0.2 if nobody else world.opts.takeover_p) if idle else world.opts.takeover_p / 8
            if idle and self.want_takeover:
                p = 1.0 if world.sim.now >= self.retry_at else 0.0
            if r.random() < p:
                if world.stats.takeovers_started < world.max_takeovers or self.want_takeover:
                    self.take_over()
            w = self.writer
            if w is not None and w.phase is Phase.OPEN and world.values_left > 0:
                for _ in range(r.randint(1, 3)):
                    if world.values_left <= 0 or not w.can_append(16):
                        break
                    self.append_one(w)
        world.sim.after(r.uniform(0.2, 3.0) * MS, self.act)

    def take_over(self) -> None:
        m = self.world.meta
        if m.ledger.status is LedgerStatus.CLOSED:
            return
        placement = Placement(self.world.sim.rng, [BookieInfo(b) for b in self.world.bookies])
        cfg = WriterConfig(max_inflight_entries=self.world.opts.inflight, unsafe=self.world.opts.unsafe,
                           lac_push_eager=self.world.opts.lac_push_eager)
        self.writer = w = LedgerWriter(m.ledger, m.version, m.last_fragment(), placement, cfg, now=self.world.sim.now)
        self.appended[id(w)] = {}
        self.world.stats.takeovers_started += 1
        self.world.writers = [(n, x) for n, x in self.world.writers if x.phase is not Phase.ABORTED]
        self.world.writers.append((self.name, w))
        self.retry_at = self.world.sim.now + self.backoff
        self.backoff = min(self.backoff * 2, 100 * MS)
        self.execute(w, w.start())

    def append_one(self, w: LedgerWriter) -> None:
        self.counter += 1
        self.world.values_left -= 1
        value = f"{self.name}/t{w.term}/v{self.counter}".encode()
        entry_id, cmds = w.append(value)
        self.appended[id(w)][entry_id] = value
        self.world.sent_values[value] = (self.name, w.term, entry_id)
        self.execute(w, cmds)

    # -- commands
    def execute(self, w: LedgerWriter, cmds) -> None:
        for c in cmds:
            self._dispatch(w, c)

    def _dispatch(self, w: LedgerWriter, c) -> None:
        world = self.world
        if isinstance(c, SendAdd):
            self._request(w, c.bookie, c.request, lambda ev, sid=c.send_id: w.handle_add_answer(ev, sid),
                          WriteFailed(c.bookie, LEDGER, c.request.entry_id, c.request.term))
        elif isinstance(c, SendFence):
            self._request(w, c.bookie, c.request, w.handle, FenceFailed(c.bookie, LEDGER, c.request.term))
        elif isinstance(c, SendRecoveryRead):
            r = c.request
            on_answer = w.handle
            if isinstance(r, ReadRequest):  # the unsafe skip-fencing switch reads without a term
                def on_answer(ev, b=c.bookie, eid=r.entry_id):
                    if isinstance(ev, tuple):
                        _, _, e, *_ = ev
                        ev = ReadMissing(b, LEDGER, eid, w.term) if e is None else ReadOk(b, LEDGER, eid, w.term, *e)
                    return w.handle(ev)
            self._request(w, c.bookie, r, on_answer, ReadFailed(c.bookie, LEDGER, r.entry_id, w.term))
        elif isinstance(c, SendLacWrite):
            self._request(w, c.bookie, c.request, lambda ev: w.handle(ev) if isinstance(ev, InvalidTerm) else [], None)
        elif isinstance(c, CasLedger):
            if c.reason == "ensemble change":
                world.stats.ensemble_changes += 1
            elif c.reason == "rollover":
                world.stats.rollovers += 1
            delay = world.sim.rng.uniform(0.1, 2.0) * MS
            world.sim.after(delay, world.meta.cas, c, lambda ev: world.sim.after(delay, self._feed, w, w.handle, ev))
        elif isinstance(c, Acknowledge):
            mine = self.appended[id(w)]
            for i in range(c.last_entry_id, w.open_entry_id - 1, -1):
                if i not in mine:
                    break
                world.acknowledge(Appended(self.name, w.term, i, mine.pop(i)))
        elif isinstance(c, Opened):
            world.stats.takeovers_done += 1
            self.backoff = 2 * MS
            if c.truncate_entry_id is not None and world.max_lap_before(c.truncate_entry_id):
                world.stats.truncations += 1
        elif isinstance(c, Withdraw):
            world.stats.withdrawn += 1
        elif isinstance(c, Aborted):
            world.stats.aborted += 1
        elif isinstance(c, Closed):
            pass

    def _request(self, w: LedgerWriter, bookie: str, req, on_answer, failure) -> None:
        world = self.world
        done = [False]

        def answer(ev) -> None:  # runs on the bookie: send the answer back over the network
            world.net.send(bookie, self.name, got, ev)

        def got(ev) -> None:
            done[0] = True
            self._feed(w, on_answer, ev)

        def timeout() -> None:
            if not done[0] and failure is not None:
                self._feed(w, on_answer, failure)

        world.net.send(self.name, bookie, world.bookies[bookie].receive, self.name, req, answer)
        world.sim.after(world.timeout, timeout)

    def _feed(self, w: LedgerWriter, fn, ev) -> None:
        self.execute(w, fn(ev))


class SimReader:
    """A tailing reader: learns the LAC from bookies, reads below it, checks what it reads."""

    def __init__(self, name: str, world: World):
        self.name, self.world = name, world
        self.next_id = 0
        self.lac = -1
        self.seen_term = -1  # the highest term any bookie answered with
        self.view_term = -1  # the ledger term of the metadata view the reader uses
        self.busy = False

    def _view(self, entry_id: int) -> Fragment:
        """A metadata snapshot (what the real consumer's refresh reads): the fragment of entry_id."""
        world = self.world
        self.view_term = world.meta.ledger.term
        frags = world.meta.current_fragments()
        return next((f for f in frags if f.contains(entry_id)), frags[-1])

    def act(self) -> None:
        world = self.world
        if not self.busy:
            self.busy = True
            target = self._view(self.next_id)
            order = list(write_set(self.next_id, target.ensemble, world.opts.write_quorum))
            world.sim.rng.shuffle(order)
            self._try(target, order, self.next_id)
        world.sim.after(world.sim.rng.uniform(0.5, 4.0) * MS, self.act)

    def _try(self, frag: Fragment, order: list[str], entry_id: int) -> None:
        world = self.world
        if not order:
            self.busy = False
            return
        bookie, rest = order[0], order[1:]
        done = [False]

        def answer(ev) -> None:
            world.net.send(bookie, self.name, got, ev)

        def got(ev) -> None:
            if done[0]:
                return
            done[0] = True
            _, eid, e, lac, bookie_term = ev
            self.lac = max(self.lac, lac)
            self.seen_term = max(self.seen_term, bookie_term)
            if eid > self.lac:
                self.busy = False
                return
            f, left = frag, rest
            if self.seen_term > self.view_term:
                # A newer term exists than our view knows: the ensemble may have changed and the
                # entry been truncated since. Re-read the metadata and take the copy only from a
                # bookie still in the entry's write set (a replaced member may keep a dirty copy
                # that the new term's truncation never reached); only such bookies are tried next.
                f = self._view(entry_id)
                ws = write_set(entry_id, f.ensemble, world.opts.write_quorum)
                left = [b for b in ws if b != bookie and (b in rest or b not in order)]
                if bookie not in ws:
                    self._try(f, left, entry_id)
                    return
            if e is None or not copy_is_current(f, e[0]):
                self._try(f, left, entry_id)
                return
            world.stats.reads += 1
            world.observe_read(self.name, eid, e[1])
            self.next_id = eid + 1
            self.busy = False

        def timeout() -> None:
            if not done[0]:
                done[0] = True
                self._try(frag, rest, entry_id)

        world.net.send(self.name, bookie, world.bookies[bookie].receive, self.name, ReadRequest(LEDGER, entry_id), answer)
        world.sim.after(world.timeout, timeout)


class World:
    def __init__(self, opts: SimOptions, autonomous: bool = True):
        self.opts = opts
        self.sim = Sim(opts.seed)
        self.stats = Stats()
        self.timeout = 25 * MS
        self.max_takeovers = 25
        self.values_left = opts.values
        names = [f"b{i}" for i in range(opts.bookies)]
        self.bookies = {n: SimBookie(n, self) for n in names}
        self.net = Network(self.sim, self)
        cfg = LedgerConfig(
            ensemble_size=opts.ensemble,
            write_quorum=opts.write_quorum,
            ack_quorum=opts.ack_quorum,
            fragment_entries_max=opts.fragment_entries_max,
        )
        ens = tuple(self.sim.rng.sample(names, opts.ensemble))
        self.meta = SimMeta(self, cfg, ens)
        self.clients = [SimClient(f"c{i}", self) for i in range(opts.clients)]
        self.readers = [SimReader(f"r{i}", self) for i in range(opts.readers)]
        self.writers: list[tuple[str, LedgerWriter]] = []
        self.acked: dict[int, Appended] = {}  # entry id -> the acknowledged append
        self.acked_by_value: dict[bytes, Appended] = {}
        self.sent_values: dict[bytes, tuple[str, int, int]] = {}
        self.read_values: dict[int, bytes] = {}
        self.violations: list[str] = []
        if autonomous:  # otherwise a test drives every action (tests/sim/test_stateful.py)
            for c in self.clients:
                self.sim.after(self.sim.rng.uniform(0, 2) * MS, c.act)
            for rd in self.readers:
                self.sim.after(self.sim.rng.uniform(0, 2) * MS, rd.act)
            self.sim.after(1 * MS, self.fault_tick)

    # -- observations
    def acknowledge(self, a: Appended) -> None:
        prev = self.acked.get(a.entry_id)
        if prev is not None and prev.value != a.value:
            self.violations.append(
                f"AckedTwice: entry {a.entry_id} acknowledged as {prev.value!r} and later as {a.value!r}"
            )
        self.acked[a.entry_id] = a
        self.acked_by_value[a.value] = a
        self.stats.acked += 1

    def observe_read(self, reader: str, entry_id: int, data: bytes) -> None:
        prev = self.read_values.get(entry_id)
        if prev is not None and prev != data:
            self.violations.append(f"ReadDivergence: {reader} read entry {entry_id} as {data!r}, earlier {prev!r}")
        self.read_values.setdefault(entry_id, data)
        a = self.acked.get(entry_id)
        if a is not None and entry_codec.encode_data(a.value) != data:
            self.violations.append(f"ReadDivergence: {reader} read entry {entry_id} as {data!r}, acked {a.value!r}")

    def max_lap_before(self, truncate_id: int) -> bool:
        return any(w.lap >= truncate_id and w.phase is not Phase.ABORTED for _, w in self.writers[:-1])

    # -- faults
    def fault_tick(self) -> None:
        o, r = self.opts, self.sim.rng
        if self.net.faults:
            if r.random() < o.crash_p * 10:
                up = [b for b in self.bookies.values() if b.up]
                if len(up) > o.ensemble - 1:
                    b = r.choice(up)
                    b.crash()
                    self.stats.crashes += 1
                    self.sim.after(r.uniform(5, 60) * MS, b.restart)
            if r.random() < o.partition_p * 10:
                nodes = list(self.bookies) + [c.name for c in self.clients]
                a, b = r.sample(nodes, 2)
                self.net.partitioned.add(frozenset((a, b)))
                self.stats.partitions += 1
                self.sim.after(r.uniform(5, 80) * MS, self.net.partitioned.discard, frozenset((a, b)))
        if r.random() < 0.05:
            self.meta.foreign_touch()
        self.sim.after(r.uniform(0.5, 2.0) * MS, self.fault_tick)

    def heal(self) -> None:
        """Start a fault-free stretch: no drops, no partitions, every bookie up."""
        self.net.faults = False
        self.net.partitioned.clear()
        for b in self.bookies.values():
            if not b.up:
                b.restart()
