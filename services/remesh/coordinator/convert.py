"""Translation between the domain model and the remesh.v1 protobuf messages, in one place."""

from __future__ import annotations

from remesh.coordinator.agent_stream import Command
from remesh.coordinator.model import Event, EventType, Member, MemberState, Role, Topology, TopologyMember
from remesh.coordinator.observations import (
    CollectiveFailureReport,
    Report,
    StallReport,
    TierMissingReport,
)
from remesh.v1 import coordinator_pb2 as pb

__all__ = [
    "command_to_pb",
    "event_from_pb",
    "event_to_pb",
    "event_type_from_pb",
    "legacy_report_from_pb",
    "member_from_pb",
    "member_state_from_pb",
    "member_to_pb",
    "report_from_pb",
    "role_from_pb",
    "topology_from_pb",
    "topology_to_pb",
]

_ROLE = {Role.ACTIVE: pb.ROLE_ACTIVE, Role.SPARE: pb.ROLE_SPARE}
_STATE = {
    MemberState.JOINING: pb.MEMBER_STATE_JOINING,
    MemberState.ALIVE: pb.MEMBER_STATE_ALIVE,
    MemberState.SUSPECT: pb.MEMBER_STATE_SUSPECT,
    MemberState.DEAD: pb.MEMBER_STATE_DEAD,
    MemberState.LEFT: pb.MEMBER_STATE_LEFT,
    MemberState.DRAINING: pb.MEMBER_STATE_DRAINING,
}
_ROLE_BACK = {v: k for k, v in _ROLE.items()}
_STATE_BACK: dict[int, MemberState] = {v: k for k, v in _STATE.items()}
_EVENT = {t: getattr(pb, f"EVENT_TYPE_{t.name}") for t in EventType}
_EVENT_BACK: dict[int, EventType] = {v: k for k, v in _EVENT.items()}
_COMMAND = {
    Command.REREGISTER: pb.COMMAND_REREGISTER,
    Command.DRAIN: pb.COMMAND_DRAIN,
    Command.FINISHED: pb.COMMAND_FINISHED,
}


def command_to_pb(command: Command) -> pb.Command:
    """A command as its agent receives it. NOT_LEADER has none: it ends the stream with a status."""
    try:
        return _COMMAND[command]
    except KeyError:
        raise ValueError(f"{command} is not sent to an agent: it ends the stream with a status") from None


def role_from_pb(value: int) -> Role:
    """ROLE_SPARE asks to stay in reserve; anything else makes the host eligible for a rank."""
    return Role.SPARE if value == pb.ROLE_SPARE else Role.ACTIVE


def member_state_from_pb(value: int) -> MemberState:
    try:
        return _STATE_BACK[value]
    except KeyError:
        raise ValueError(f"unknown member state {value}") from None


def report_from_pb(request: pb.ObserveRequest) -> Report:
    """The observation an ``Observe`` call carries; ValueError when it carries none."""
    which = request.WhichOneof("observation")
    if which == "stall":
        return StallReport(request.stall.step)
    if which == "collective_failure":
        return CollectiveFailureReport(request.collective_failure.detail)
    if which == "tier_missing":
        return TierMissingReport(request.tier_missing.tier, request.tier_missing.detail)
    raise ValueError("the request carries no observation: set one of stall, collective_failure, tier_missing")


def legacy_report_from_pb(request: pb.ReportFaultRequest) -> Report | None:
    """The observation a fault report of a deprecated kind carries (None: a fault of another kind).
    Agents of remesh 0.1.0 send their trainer's observations as fault reports; until remesh 0.3.0
    the coordinator handles them as the ``Observe`` call carrying them."""
    if request.kind == pb.FAULT_KIND_STALLED:
        return StallReport(request.step)
    if request.kind == pb.FAULT_KIND_COLLECTIVE_FAILED:
        return CollectiveFailureReport(request.detail)
    if request.kind == pb.FAULT_KIND_TIER_MISSING:
        return TierMissingReport(request.tier, request.detail)
    return None


def event_type_from_pb(value: int) -> EventType:
    try:
        return _EVENT_BACK[value]
    except KeyError:
        raise ValueError(f"unknown event type {value}") from None


def member_from_pb(msg: pb.Member) -> Member:
    """The stored member a message describes (its ``last_step`` is progress, not member state)."""
    try:
        role = _ROLE_BACK[msg.role]
    except KeyError:
        raise ValueError(f"unknown role {msg.role}") from None
    return Member(
        host_id=msg.host_id,
        incarnation=msg.incarnation,
        role=role,
        state=member_state_from_pb(msg.state),
        device_count=msg.device_count,
        address=msg.address,
        rank=msg.rank,
        reason=msg.reason,
        updated_at=msg.updated_at,
    )


def member_to_pb(member: Member, last_step: int = -1) -> pb.Member:
    return pb.Member(
        host_id=member.host_id,
        incarnation=member.incarnation,
        role=_ROLE[member.role],
        state=_STATE[member.state],
        device_count=member.device_count,
        address=member.address,
        rank=member.rank,
        reason=member.reason,
        updated_at=member.updated_at,
        last_step=last_step,
    )


def topology_to_pb(topology: Topology | None) -> pb.Topology:
    if topology is None:
        return pb.Topology(epoch=0, restore_step=-1, reason="no topology yet: waiting for hosts")
    return pb.Topology(
        epoch=topology.epoch,
        members=[
            pb.TopologyMember(host_id=m.host_id, rank=m.rank, device_count=m.device_count, address=m.address)
            for m in topology.members
        ],
        mesh_shape=list(topology.mesh_shape),
        jax_coordinator_address=topology.jax_coordinator_address,
        restore_step=topology.restore_step,
        reason=topology.reason,
        created_at=topology.created_at,
        halted=topology.halted,
        job_id=topology.job_id,
        commits=[pb.CheckpointCommit(step=step, epoch=epoch) for step, epoch in topology.commits],
        formed_at=topology.formed_at,
        recoveries=topology.recoveries,
    )


def topology_from_pb(msg: pb.Topology) -> Topology | None:
    if msg.epoch == 0:
        return None
    return Topology(
        epoch=msg.epoch,
        members=tuple(
            TopologyMember(host_id=m.host_id, rank=m.rank, device_count=m.device_count, address=m.address)
            for m in msg.members
        ),
        mesh_shape=tuple(msg.mesh_shape),
        jax_coordinator_address=msg.jax_coordinator_address,
        restore_step=msg.restore_step,
        reason=msg.reason,
        created_at=msg.created_at,
        halted=msg.halted,
        job_id=msg.job_id,
        commits=tuple((c.step, c.epoch) for c in msg.commits),
        formed_at=msg.formed_at,
        recoveries=msg.recoveries,
    )


def event_to_pb(event: Event) -> pb.Event:
    msg = pb.Event(
        id=event.id,
        type=_EVENT[event.type],
        time=event.time,
        host_id=event.host_id,
        incarnation=event.incarnation,
        epoch=event.epoch,
        reason=event.reason,
        details=dict(event.details),
    )
    if event.member is not None:
        msg.member.CopyFrom(member_to_pb(event.member))
    if event.topology is not None:
        msg.topology.CopyFrom(topology_to_pb(event.topology))
    return msg


def event_from_pb(msg: pb.Event) -> Event:
    """The inverse of ``event_to_pb``: the record replay folds, exactly as the store holds it."""
    return Event(
        type=event_type_from_pb(msg.type),
        time=msg.time,
        epoch=msg.epoch,
        reason=msg.reason,
        host_id=msg.host_id,
        incarnation=msg.incarnation,
        member=member_from_pb(msg.member) if msg.HasField("member") else None,
        topology=topology_from_pb(msg.topology) if msg.HasField("topology") else None,
        details=dict(msg.details),
        id=msg.id,
    )
