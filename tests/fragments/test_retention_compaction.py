"""Retention of compacted streams (fragments/retention.py with the compaction key ``cleanup_policy``):
``compact`` alone removes nothing by age or size (Kafka applies retention.ms/bytes to ``delete``
topics only); ``keep_from`` (DeleteRecords) still applies; ``compact,delete`` applies both."""

from __future__ import annotations

import pytest

from fragments.retention import InvalidPolicy, Policy, evaluate

from .test_retention_policy import NOW, chain


def _old(frags):
    return {f.index: 0 for f in frags}  # every batch is ancient


@pytest.mark.parametrize("cleanup", ["compact", " compact ", "COMPACT"])
def test_compact_alone_ignores_age_and_size(cleanup):
    frags = chain([100] * 5)
    p = Policy.from_dict({"cleanup_policy": cleanup, "max_age_s": 1, "max_bytes": 1})
    assert not p.delete and not p.active and p.age_s is None and p.size is None
    d = evaluate(p, frags, NOW, last_timestamps=_old(frags))
    assert d.remove == ()
    assert "compact" in d.kept_because


def test_compact_alone_still_honours_keep_from():
    frags = chain([100] * 5)
    p = Policy.from_dict({"cleanup_policy": "compact", "max_age_s": 1, "max_bytes": 1, "keep_from": 25})
    d = evaluate(p, frags, NOW, last_timestamps=_old(frags))
    assert [f.index for f in d.remove] == [0, 1]  # keep_from only: 20..29 holds 25


@pytest.mark.parametrize("cleanup", ["compact,delete", "delete,compact", "delete", None])
def test_delete_in_the_policy_applies_age_and_size(cleanup):
    frags = chain([100] * 5)
    d = {"max_bytes": 200}
    if cleanup is not None:
        d["cleanup_policy"] = cleanup
    p = Policy.from_dict(d)
    assert p.delete and p.active
    assert [f.index for f in evaluate(p, frags, NOW).remove] == [0, 1]  # fragments 2 and 3 hold 200 bytes
    p = Policy.from_dict({**d, "max_bytes": None, "max_age_s": 60})
    assert [f.index for f in evaluate(p, frags, NOW, last_timestamps=_old(frags)).remove] == [0, 1, 2, 3]


def test_a_bad_cleanup_policy_is_an_invalid_policy():
    with pytest.raises(InvalidPolicy):
        Policy.from_dict({"cleanup_policy": "shred"})


def test_to_dict_does_not_write_the_compaction_key():
    assert "cleanup_policy" not in Policy.from_dict({"cleanup_policy": "compact", "max_age_s": 5}).to_dict()
