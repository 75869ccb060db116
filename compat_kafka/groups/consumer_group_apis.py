"""ConsumerGroupHeartbeat (API 68) and ConsumerGroupDescribe (API 69): the KIP-848 consumer groups of
``consumer_groups.py`` served by the shim's ``GroupCoordinator``.

How this works. The coordinator keeps a ``ConsumerGroup`` per group id next to its classic groups
(``GroupCoordinator.consumer_groups``); a group id is either kind, never both: a heartbeat for a
classic group with members answers GROUP_ID_NOT_FOUND ("not a consumer group"), a JoinGroup for a
consumer group with members INCONSISTENT_GROUP_PROTOCOL (groups.py), as Kafka does without its
migration policy. An Empty group of either kind may become the other. The requests name topics by
id; the topics of the cluster (name, id, partitions) are read from the store at most once a second
(``TopicsView``), which is also how new partitions and new topics matching a regex reach the groups.
The coordinator's timer task runs the groups' session and revocation timeouts.
"""

from __future__ import annotations

import datetime
import logging
import uuid
from dataclasses import dataclass

from kio.schema.errors import ErrorCode

from ..wire import codec
from ..wire.codec import ZERO_MS, build, nested
from .consumer_groups import TP, ConsumerGroup, Heartbeat, by_topic
from .records import GroupKind

log = logging.getLogger(__name__)

TOPICS_MAX_AGE_S = 1.0


@dataclass(frozen=True)
class TopicsView:
    by_name: dict[str, tuple[uuid.UUID, int]]  # name -> (topic id, partitions)
    by_id: dict[uuid.UUID, str]
    at: float
    partitions: dict[str, int]  # name -> partitions: one object per snapshot (groups skip re-resolving it)


class ConsumerGroupApis:
    def __init__(self, coordinator):
        self.c = coordinator
        self._topics: TopicsView | None = None

    async def topics(self, now: float, fresh: bool = False) -> TopicsView:
        view = self._topics
        if view is None or fresh or now - view.at > TOPICS_MAX_AGE_S:
            metas = await self.c.broker.topics()
            view = self._topics = TopicsView({m.name: (m.topic_id, m.partitions) for m in metas},
                                             {m.topic_id: m.name for m in metas}, now,
                                             {m.name: m.partitions for m in metas})
        return view

    # ------------------------------------------------------------ ConsumerGroupHeartbeat
    async def heartbeat(self, req, resp_cls):
        assignment_cls = nested(resp_cls, "Assignment")
        tps_cls = nested(resp_cls, "TopicPartitions")
        interval = self.c.config.consumer.heartbeat_interval_ms

        def answer(error: ErrorCode, message: str | None = None, member_id: str | None = None, epoch: int = 0,
                   assignment=None, view: TopicsView | None = None):
            asg = None
            if assignment is not None:
                asg = assignment_cls(topic_partitions=tuple(
                    tps_cls(topic_id=view.by_name[t][0], partitions=tuple(ps))
                    for t, ps in by_topic(assignment).items() if t in view.by_name))
            return build(resp_cls, throttle_time=ZERO_MS, error_code=error, error_message=message,
                         member_id=member_id, member_epoch=epoch,
                         heartbeat_interval=_ms(interval if error == ErrorCode.none else 0), assignment=asg)

        gid = req.group_id
        err = await self.c._group_error(gid)
        if err is not None:
            return answer(err)
        classic = self.c.groups.get(gid)
        if classic is not None and classic.members:
            return answer(ErrorCode.group_id_not_found, f"Group {gid} is not a consumer group.")
        if resp_cls.__version__ >= 1 and req.member_epoch == 0 and not req.member_id:
            return answer(ErrorCode.invalid_request, "MemberId can't be empty.")
        now = self.c._now()
        try:
            view = await self.topics(now)
            if req.subscribed_topic_names and any(t not in view.by_name for t in req.subscribed_topic_names):
                view = await self.topics(now, fresh=True)  # a topic created a moment ago, say
            owned = None
            if req.topic_partitions is not None:
                missing = [t.topic_id for t in req.topic_partitions if t.topic_id not in view.by_id]
                if missing:
                    view = await self.topics(now, fresh=True)
                owned = frozenset((view.by_id[t.topic_id], p) for t in req.topic_partitions
                                  if t.topic_id in view.by_id for p in t.partitions)
        except Exception as exc:
            log.warning("group=%s: topics for a heartbeat: %r", gid, exc)
            return answer(ErrorCode.coordinator_not_available, str(exc))
        g = self.c.consumer_groups.get(gid)
        if g is None:
            if req.member_epoch != 0:
                return answer(ErrorCode.unknown_member_id, f"member {req.member_id} is not in group {gid}")
            g = self.c.consumer_groups[gid] = ConsumerGroup(gid, self.c.config.consumer)
        names = req.subscribed_topic_names
        res = g.heartbeat(now, Heartbeat(
            member_id=req.member_id, member_epoch=req.member_epoch, instance_id=req.instance_id, rack_id=req.rack_id,
            rebalance_timeout_ms=int(req.rebalance_timeout.total_seconds() * 1000),
            subscribed_topic_names=tuple(names) if names is not None else None,
            subscribed_topic_regex=getattr(req, "subscribed_topic_regex", None),
            server_assignor=req.server_assignor, owned=owned, client_id=codec.current_client_id() or "",
            client_host=codec.current_client_host()),
            view.partitions)
        self.c._kick()
        if res.error == ErrorCode.none and req.member_epoch == 0:
            await self.c.remember_kind(gid, GroupKind("consumer", "consumer"))
        if res.error != ErrorCode.none:
            log.info("group=%s member %s epoch %d: %s %s", gid, req.member_id, req.member_epoch, res.error.name,
                     res.message or "")
        return answer(res.error, res.message, res.member_id, res.member_epoch, res.assignment, view)

    # ------------------------------------------------------------ ConsumerGroupDescribe
    async def describe(self, req, resp_cls):
        group_cls = nested(resp_cls, "DescribedGroup")
        member_cls = nested(resp_cls, "Member")
        assignment_cls = nested(resp_cls, "Assignment")
        tps_cls = nested(resp_cls, "TopicPartitions")
        out = []
        try:
            view = await self.topics(self.c._now())
        except Exception as exc:
            view, err0 = None, exc
        for gid in req.group_ids:
            def failed(code: ErrorCode, msg: str | None = None, gid=gid):
                return build(group_cls, error_code=code, error_message=msg, group_id=gid, group_state="",
                             group_epoch=-1, assignment_epoch=-1, assignor_name="", members=())

            err = await self.c._group_error(gid)
            if err is not None:
                out.append(failed(err))
                continue
            if view is None:
                out.append(failed(ErrorCode.coordinator_not_available, str(err0)))
                continue
            g = self.c.consumer_groups.get(gid)
            if g is None:
                kind = await self.c.stored_kind(gid)
                if kind is not None and kind.group_type == "consumer":
                    out.append(build(group_cls, error_code=ErrorCode.none, error_message=None, group_id=gid,
                                     group_state="Empty", group_epoch=0, assignment_epoch=0,
                                     assignor_name=self.c.config.consumer.assignors[0], members=()))
                elif kind is not None or gid in self.c.groups:
                    out.append(failed(ErrorCode.group_id_not_found, f"Group {gid} is not a consumer group."))
                else:
                    out.append(failed(ErrorCode.group_id_not_found, f"Group {gid} not found."))
                continue

            def asg(tps: frozenset[TP]):
                return assignment_cls(topic_partitions=tuple(
                    tps_cls(topic_id=view.by_name[t][0], topic_name=t, partitions=tuple(ps))
                    for t, ps in by_topic(tps).items() if t in view.by_name))

            members = tuple(build(
                member_cls, member_id=m.member_id, instance_id=m.instance_id, rack_id=m.rack_id, member_epoch=m.epoch,
                client_id=m.client_id, client_host=m.client_host, subscribed_topic_names=m.subscribed_names,
                subscribed_topic_regex=m.subscribed_regex, assignment=asg(m.assigned),
                target_assignment=asg(g.target.get(m.member_id, frozenset())), member_type=1)
                for m in g.members.values())
            out.append(build(group_cls, error_code=ErrorCode.none, error_message=None, group_id=gid,
                             group_state=g.state, group_epoch=g.group_epoch, assignment_epoch=g.assignment_epoch,
                             assignor_name=g.assignor, members=members))
        return build(resp_cls, throttle_time=ZERO_MS, groups=tuple(out))


def _ms(ms: int) -> datetime.timedelta:
    return datetime.timedelta(milliseconds=ms)
