"""Hypothesis stateful test: the CAS semantics of a store against a dict model.

The model maps key -> (value, version), where versions are whatever the store returned (etcd's are
global revisions, so the model predicts *whether* a write succeeds and checks that versions only
grow, never their exact numbers). Runs against MemoryStore and, with fewer examples, EtcdStore.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from fragments.etcdstore import EtcdStore
from fragments.memstore import MemoryStore
from fragments.store import MetadataStore, Versioned

from .conftest import namespace

pytestmark = pytest.mark.timeout(120)

KEYS = ["/k/a", "/k/b", "/k/c"]
keys = st.sampled_from(KEYS)
values = st.binary(max_size=6)
# how a test picks the version it expects: the right one, 0 ("absent"), one seen before, or a future one
modes = st.sampled_from(["current", "zero", "seen", "future"])


class CasMachine(RuleBasedStateMachine):
    runner: asyncio.Runner
    open_store: Callable[[], Awaitable[MetadataStore]]

    def __init__(self) -> None:
        super().__init__()
        self.store = self.run(self.open_store())
        self.model: dict[str, tuple[bytes, int]] = {}
        self.seen: list[int] = [0]
        self.last = 0  # the largest version the store has returned

    def run(self, coro):
        return self.runner.run(asyncio.wait_for(coro, 10))

    def current(self, key: str) -> int:
        return self.model[key][1] if key in self.model else 0

    def pick(self, key: str, mode: str, n: int) -> int:
        if mode == "current":
            return self.current(key)
        if mode == "zero":
            return 0
        if mode == "seen":
            return self.seen[n % len(self.seen)]
        return self.last + 1 + n  # never returned yet, so never a key's version

    def wrote(self, version: int) -> None:
        assert version > self.last, "versions grow on every write"
        self.last = version
        self.seen.append(version)

    @rule(key=keys, value=values)
    def put(self, key, value):
        v = self.run(self.store.put(key, value))
        self.wrote(v)
        self.model[key] = (value, v)

    @rule(key=keys, value=values)
    def create(self, key, value):
        v = self.run(self.store.create(key, value))
        if key in self.model:
            assert v is None
        else:
            assert v is not None
            self.wrote(v)
            self.model[key] = (value, v)

    @rule(key=keys, value=values, mode=modes, n=st.integers(0, 50))
    def cas(self, key, value, mode, n):
        expected = self.pick(key, mode, n)
        v = self.run(self.store.cas(key, value, expected))
        if expected == self.current(key):
            assert v is not None
            self.wrote(v)
            self.model[key] = (value, v)
        else:
            assert v is None

    @rule(key=keys, mode=st.sampled_from(["none", "current", "zero", "seen", "future"]), n=st.integers(0, 50))
    def delete(self, key, mode, n):
        expected = None if mode == "none" else self.pick(key, mode, n)
        deleted = self.run(self.store.delete(key, expected))
        should = key in self.model and (expected is None or expected == self.current(key))
        assert deleted == should
        if should:
            del self.model[key]

    @rule(
        compared=st.dictionaries(keys, st.tuples(modes, st.integers(0, 50)), max_size=3),
        puts=st.dictionaries(keys, values, max_size=3),
        deletes=st.sets(keys, max_size=2),
    )
    def txn(self, compared, puts, deletes):
        deletes = tuple(sorted(deletes - set(puts)))
        compares = {k: self.pick(k, mode, n) for k, (mode, n) in compared.items()}
        result = self.run(self.store.txn(compares, puts, deletes))
        should = all(self.current(k) == v for k, v in compares.items())
        assert result.succeeded == should
        if not should:
            assert result.versions == {}
            return
        assert set(result.versions) == set(puts)
        if puts:
            assert len(set(result.versions.values())) == 1, "one transaction, one version"
            self.wrote(next(iter(result.versions.values())))
        elif any(k in self.model for k in deletes):
            self.last += 1  # a delete-only txn moves the revision without telling us to what
        for k, value in puts.items():
            self.model[k] = (value, result.versions[k])
        for k in deletes:
            self.model.pop(k, None)

    @invariant()
    def store_matches_model(self):
        listed = self.run(self.store.list_prefix("/k/"))
        assert listed == [(k, Versioned(*self.model[k])) for k in sorted(self.model)]

    def teardown(self):
        self.run(self.store.close())


def run_machine(open_store, max_examples: int, steps: int) -> None:
    class Machine(CasMachine):
        pass

    with asyncio.Runner() as runner:
        Machine.runner = runner
        Machine.open_store = staticmethod(open_store)
        run_state_machine_as_test(
            Machine,
            settings=settings(
                max_examples=max_examples,
                stateful_step_count=steps,
                deadline=None,
                database=None,
                suppress_health_check=[HealthCheck.too_slow],
            ),
        )


def test_memory_store_cas_matches_model():
    async def open_store():
        return MemoryStore()

    run_machine(open_store, max_examples=60, steps=30)


def test_etcd_store_cas_matches_model(etcd_server):
    async def open_store():
        return await EtcdStore.connect(etcd_server.url, namespace=namespace())

    run_machine(open_store, max_examples=15, steps=25)
