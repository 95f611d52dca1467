from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Role(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROLE_UNSPECIFIED: _ClassVar[Role]
    ROLE_ACTIVE: _ClassVar[Role]
    ROLE_SPARE: _ClassVar[Role]

class MemberState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MEMBER_STATE_UNSPECIFIED: _ClassVar[MemberState]
    MEMBER_STATE_JOINING: _ClassVar[MemberState]
    MEMBER_STATE_ALIVE: _ClassVar[MemberState]
    MEMBER_STATE_SUSPECT: _ClassVar[MemberState]
    MEMBER_STATE_DEAD: _ClassVar[MemberState]
    MEMBER_STATE_LEFT: _ClassVar[MemberState]
    MEMBER_STATE_DRAINING: _ClassVar[MemberState]

class EventType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    EVENT_TYPE_UNSPECIFIED: _ClassVar[EventType]
    EVENT_TYPE_MEMBER_JOINED: _ClassVar[EventType]
    EVENT_TYPE_MEMBER_ALIVE: _ClassVar[EventType]
    EVENT_TYPE_MEMBER_SUSPECT: _ClassVar[EventType]
    EVENT_TYPE_MEMBER_DEAD: _ClassVar[EventType]
    EVENT_TYPE_MEMBER_LEFT: _ClassVar[EventType]
    EVENT_TYPE_MEMBER_DRAINING: _ClassVar[EventType]
    EVENT_TYPE_TOPOLOGY_CHANGED: _ClassVar[EventType]
    EVENT_TYPE_EPOCH_ACKED: _ClassVar[EventType]
    EVENT_TYPE_EPOCH_LIVE: _ClassVar[EventType]
    EVENT_TYPE_JOB_WAITING: _ClassVar[EventType]
    EVENT_TYPE_JOB_HALTED: _ClassVar[EventType]
    EVENT_TYPE_FAULT_REPORTED: _ClassVar[EventType]
    EVENT_TYPE_MEMBER_REJOINED: _ClassVar[EventType]
    EVENT_TYPE_MEMBER_ASSIGNED: _ClassVar[EventType]
    EVENT_TYPE_CHECKPOINT_COMMITTED: _ClassVar[EventType]
    EVENT_TYPE_JOB_FINISHED: _ClassVar[EventType]
    EVENT_TYPE_MEMBER_FORGOTTEN: _ClassVar[EventType]
    EVENT_TYPE_LOG_COMPACTED: _ClassVar[EventType]
    EVENT_TYPE_TIER_MISSING: _ClassVar[EventType]

class TrainerStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRAINER_STATUS_UNSPECIFIED: _ClassVar[TrainerStatus]
    TRAINER_STATUS_NOT_STARTED: _ClassVar[TrainerStatus]
    TRAINER_STATUS_RUNNING: _ClassVar[TrainerStatus]
    TRAINER_STATUS_EXITED: _ClassVar[TrainerStatus]
    TRAINER_STATUS_HUNG: _ClassVar[TrainerStatus]

class Command(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    COMMAND_UNSPECIFIED: _ClassVar[Command]
    COMMAND_REREGISTER: _ClassVar[Command]
    COMMAND_DRAIN: _ClassVar[Command]
    COMMAND_FINISHED: _ClassVar[Command]

class FaultKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FAULT_KIND_UNSPECIFIED: _ClassVar[FaultKind]
    FAULT_KIND_TRAINER_EXITED: _ClassVar[FaultKind]
    FAULT_KIND_TRAINER_HUNG: _ClassVar[FaultKind]
    FAULT_KIND_HOST: _ClassVar[FaultKind]
    FAULT_KIND_ADDRESS_IN_USE: _ClassVar[FaultKind]
    FAULT_KIND_STALLED: _ClassVar[FaultKind]
    FAULT_KIND_STATE_LOST: _ClassVar[FaultKind]
    FAULT_KIND_COLLECTIVE_FAILED: _ClassVar[FaultKind]
    FAULT_KIND_TIER_MISSING: _ClassVar[FaultKind]
    FAULT_KIND_TRAINER_RESTARTED: _ClassVar[FaultKind]
ROLE_UNSPECIFIED: Role
ROLE_ACTIVE: Role
ROLE_SPARE: Role
MEMBER_STATE_UNSPECIFIED: MemberState
MEMBER_STATE_JOINING: MemberState
MEMBER_STATE_ALIVE: MemberState
MEMBER_STATE_SUSPECT: MemberState
MEMBER_STATE_DEAD: MemberState
MEMBER_STATE_LEFT: MemberState
MEMBER_STATE_DRAINING: MemberState
EVENT_TYPE_UNSPECIFIED: EventType
EVENT_TYPE_MEMBER_JOINED: EventType
EVENT_TYPE_MEMBER_ALIVE: EventType
EVENT_TYPE_MEMBER_SUSPECT: EventType
EVENT_TYPE_MEMBER_DEAD: EventType
EVENT_TYPE_MEMBER_LEFT: EventType
EVENT_TYPE_MEMBER_DRAINING: EventType
EVENT_TYPE_TOPOLOGY_CHANGED: EventType
EVENT_TYPE_EPOCH_ACKED: EventType
EVENT_TYPE_EPOCH_LIVE: EventType
EVENT_TYPE_JOB_WAITING: EventType
EVENT_TYPE_JOB_HALTED: EventType
EVENT_TYPE_FAULT_REPORTED: EventType
EVENT_TYPE_MEMBER_REJOINED: EventType
EVENT_TYPE_MEMBER_ASSIGNED: EventType
EVENT_TYPE_CHECKPOINT_COMMITTED: EventType
EVENT_TYPE_JOB_FINISHED: EventType
EVENT_TYPE_MEMBER_FORGOTTEN: EventType
EVENT_TYPE_LOG_COMPACTED: EventType
EVENT_TYPE_TIER_MISSING: EventType
TRAINER_STATUS_UNSPECIFIED: TrainerStatus
TRAINER_STATUS_NOT_STARTED: TrainerStatus
TRAINER_STATUS_RUNNING: TrainerStatus
TRAINER_STATUS_EXITED: TrainerStatus
TRAINER_STATUS_HUNG: TrainerStatus
COMMAND_UNSPECIFIED: Command
COMMAND_REREGISTER: Command
COMMAND_DRAIN: Command
COMMAND_FINISHED: Command
FAULT_KIND_UNSPECIFIED: FaultKind
FAULT_KIND_TRAINER_EXITED: FaultKind
FAULT_KIND_TRAINER_HUNG: FaultKind
FAULT_KIND_HOST: FaultKind
FAULT_KIND_ADDRESS_IN_USE: FaultKind
FAULT_KIND_STALLED: FaultKind
FAULT_KIND_STATE_LOST: FaultKind
FAULT_KIND_COLLECTIVE_FAILED: FaultKind
FAULT_KIND_TIER_MISSING: FaultKind
FAULT_KIND_TRAINER_RESTARTED: FaultKind

class Member(_message.Message):
    __slots__ = ("host_id", "incarnation", "role", "state", "device_count", "address", "rank", "reason", "updated_at", "last_step")
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_COUNT_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    UPDATED_AT_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_FIELD_NUMBER: _ClassVar[int]
    host_id: str
    incarnation: int
    role: Role
    state: MemberState
    device_count: int
    address: str
    rank: int
    reason: str
    updated_at: float
    last_step: int
    def __init__(self, host_id: _Optional[str] = ..., incarnation: _Optional[int] = ..., role: _Optional[_Union[Role, str]] = ..., state: _Optional[_Union[MemberState, str]] = ..., device_count: _Optional[int] = ..., address: _Optional[str] = ..., rank: _Optional[int] = ..., reason: _Optional[str] = ..., updated_at: _Optional[float] = ..., last_step: _Optional[int] = ...) -> None: ...

class TopologyMember(_message.Message):
    __slots__ = ("host_id", "rank", "device_count", "address")
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    DEVICE_COUNT_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    host_id: str
    rank: int
    device_count: int
    address: str
    def __init__(self, host_id: _Optional[str] = ..., rank: _Optional[int] = ..., device_count: _Optional[int] = ..., address: _Optional[str] = ...) -> None: ...

class Topology(_message.Message):
    __slots__ = ("epoch", "members", "mesh_shape", "jax_coordinator_address", "restore_step", "reason", "created_at", "halted", "job_id", "commits", "formed_at", "recoveries")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    MESH_SHAPE_FIELD_NUMBER: _ClassVar[int]
    JAX_COORDINATOR_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    RESTORE_STEP_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    HALTED_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    COMMITS_FIELD_NUMBER: _ClassVar[int]
    FORMED_AT_FIELD_NUMBER: _ClassVar[int]
    RECOVERIES_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    members: _containers.RepeatedCompositeFieldContainer[TopologyMember]
    mesh_shape: _containers.RepeatedScalarFieldContainer[int]
    jax_coordinator_address: str
    restore_step: int
    reason: str
    created_at: float
    halted: bool
    job_id: str
    commits: _containers.RepeatedCompositeFieldContainer[CheckpointCommit]
    formed_at: float
    recoveries: int
    def __init__(self, epoch: _Optional[int] = ..., members: _Optional[_Iterable[_Union[TopologyMember, _Mapping]]] = ..., mesh_shape: _Optional[_Iterable[int]] = ..., jax_coordinator_address: _Optional[str] = ..., restore_step: _Optional[int] = ..., reason: _Optional[str] = ..., created_at: _Optional[float] = ..., halted: _Optional[bool] = ..., job_id: _Optional[str] = ..., commits: _Optional[_Iterable[_Union[CheckpointCommit, _Mapping]]] = ..., formed_at: _Optional[float] = ..., recoveries: _Optional[int] = ...) -> None: ...

class TopologyDelta(_message.Message):
    __slots__ = ("base_epoch", "topology", "removed", "changed", "member_count")
    BASE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    TOPOLOGY_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    CHANGED_FIELD_NUMBER: _ClassVar[int]
    MEMBER_COUNT_FIELD_NUMBER: _ClassVar[int]
    base_epoch: int
    topology: Topology
    removed: _containers.RepeatedScalarFieldContainer[str]
    changed: _containers.RepeatedCompositeFieldContainer[TopologyMember]
    member_count: int
    def __init__(self, base_epoch: _Optional[int] = ..., topology: _Optional[_Union[Topology, _Mapping]] = ..., removed: _Optional[_Iterable[str]] = ..., changed: _Optional[_Iterable[_Union[TopologyMember, _Mapping]]] = ..., member_count: _Optional[int] = ...) -> None: ...

class CheckpointCommit(_message.Message):
    __slots__ = ("step", "epoch")
    STEP_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    step: int
    epoch: int
    def __init__(self, step: _Optional[int] = ..., epoch: _Optional[int] = ...) -> None: ...

class Event(_message.Message):
    __slots__ = ("id", "type", "time", "host_id", "incarnation", "epoch", "reason", "member", "topology", "details")
    class DetailsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ID_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    MEMBER_FIELD_NUMBER: _ClassVar[int]
    TOPOLOGY_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    id: str
    type: EventType
    time: float
    host_id: str
    incarnation: int
    epoch: int
    reason: str
    member: Member
    topology: Topology
    details: _containers.ScalarMap[str, str]
    def __init__(self, id: _Optional[str] = ..., type: _Optional[_Union[EventType, str]] = ..., time: _Optional[float] = ..., host_id: _Optional[str] = ..., incarnation: _Optional[int] = ..., epoch: _Optional[int] = ..., reason: _Optional[str] = ..., member: _Optional[_Union[Member, _Mapping]] = ..., topology: _Optional[_Union[Topology, _Mapping]] = ..., details: _Optional[_Mapping[str, str]] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("host_id", "role", "device_count", "address", "job_id")
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_COUNT_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    host_id: str
    role: Role
    device_count: int
    address: str
    job_id: str
    def __init__(self, host_id: _Optional[str] = ..., role: _Optional[_Union[Role, str]] = ..., device_count: _Optional[int] = ..., address: _Optional[str] = ..., job_id: _Optional[str] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("member", "topology", "heartbeat_interval_s", "heartbeat_timeout_s", "keepalive_s", "acks_on_stream", "job_id")
    MEMBER_FIELD_NUMBER: _ClassVar[int]
    TOPOLOGY_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    KEEPALIVE_S_FIELD_NUMBER: _ClassVar[int]
    ACKS_ON_STREAM_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    member: Member
    topology: Topology
    heartbeat_interval_s: float
    heartbeat_timeout_s: float
    keepalive_s: float
    acks_on_stream: bool
    job_id: str
    def __init__(self, member: _Optional[_Union[Member, _Mapping]] = ..., topology: _Optional[_Union[Topology, _Mapping]] = ..., heartbeat_interval_s: _Optional[float] = ..., heartbeat_timeout_s: _Optional[float] = ..., keepalive_s: _Optional[float] = ..., acks_on_stream: _Optional[bool] = ..., job_id: _Optional[str] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("host_id", "incarnation", "step", "trainer_status", "probe", "topology_deltas", "ack", "topology_from_relay")
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TRAINER_STATUS_FIELD_NUMBER: _ClassVar[int]
    PROBE_FIELD_NUMBER: _ClassVar[int]
    TOPOLOGY_DELTAS_FIELD_NUMBER: _ClassVar[int]
    ACK_FIELD_NUMBER: _ClassVar[int]
    TOPOLOGY_FROM_RELAY_FIELD_NUMBER: _ClassVar[int]
    host_id: str
    incarnation: int
    step: int
    trainer_status: TrainerStatus
    probe: float
    topology_deltas: bool
    ack: AckEpochRequest
    topology_from_relay: bool
    def __init__(self, host_id: _Optional[str] = ..., incarnation: _Optional[int] = ..., step: _Optional[int] = ..., trainer_status: _Optional[_Union[TrainerStatus, str]] = ..., probe: _Optional[float] = ..., topology_deltas: _Optional[bool] = ..., ack: _Optional[_Union[AckEpochRequest, _Mapping]] = ..., topology_from_relay: _Optional[bool] = ...) -> None: ...

class AckReply(_message.Message):
    __slots__ = ("epoch", "live", "code", "details")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    LIVE_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    live: bool
    code: int
    details: str
    def __init__(self, epoch: _Optional[int] = ..., live: _Optional[bool] = ..., code: _Optional[int] = ..., details: _Optional[str] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("topology", "command", "reason", "echo", "echo_held_s", "topology_delta", "ack_reply")
    TOPOLOGY_FIELD_NUMBER: _ClassVar[int]
    COMMAND_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    ECHO_FIELD_NUMBER: _ClassVar[int]
    ECHO_HELD_S_FIELD_NUMBER: _ClassVar[int]
    TOPOLOGY_DELTA_FIELD_NUMBER: _ClassVar[int]
    ACK_REPLY_FIELD_NUMBER: _ClassVar[int]
    topology: Topology
    command: Command
    reason: str
    echo: float
    echo_held_s: float
    topology_delta: TopologyDelta
    ack_reply: AckReply
    def __init__(self, topology: _Optional[_Union[Topology, _Mapping]] = ..., command: _Optional[_Union[Command, str]] = ..., reason: _Optional[str] = ..., echo: _Optional[float] = ..., echo_held_s: _Optional[float] = ..., topology_delta: _Optional[_Union[TopologyDelta, _Mapping]] = ..., ack_reply: _Optional[_Union[AckReply, _Mapping]] = ...) -> None: ...

class LeaveRequest(_message.Message):
    __slots__ = ("host_id", "incarnation", "reason")
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    host_id: str
    incarnation: int
    reason: str
    def __init__(self, host_id: _Optional[str] = ..., incarnation: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class LeaveResponse(_message.Message):
    __slots__ = ("member",)
    MEMBER_FIELD_NUMBER: _ClassVar[int]
    member: Member
    def __init__(self, member: _Optional[_Union[Member, _Mapping]] = ...) -> None: ...

class GetTopologyRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WatchTopologyRequest(_message.Message):
    __slots__ = ("after_epoch",)
    AFTER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    after_epoch: int
    def __init__(self, after_epoch: _Optional[int] = ...) -> None: ...

class FollowTopologyRequest(_message.Message):
    __slots__ = ("host_id", "topology_deltas")
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    TOPOLOGY_DELTAS_FIELD_NUMBER: _ClassVar[int]
    host_id: str
    topology_deltas: bool
    def __init__(self, host_id: _Optional[str] = ..., topology_deltas: _Optional[bool] = ...) -> None: ...

class ListMembersRequest(_message.Message):
    __slots__ = ("states",)
    STATES_FIELD_NUMBER: _ClassVar[int]
    states: _containers.RepeatedScalarFieldContainer[MemberState]
    def __init__(self, states: _Optional[_Iterable[_Union[MemberState, str]]] = ...) -> None: ...

class ListMembersResponse(_message.Message):
    __slots__ = ("members", "epoch")
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    members: _containers.RepeatedCompositeFieldContainer[Member]
    epoch: int
    def __init__(self, members: _Optional[_Iterable[_Union[Member, _Mapping]]] = ..., epoch: _Optional[int] = ...) -> None: ...

class GetMemberRequest(_message.Message):
    __slots__ = ("host_id",)
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    host_id: str
    def __init__(self, host_id: _Optional[str] = ...) -> None: ...

class ReplayEventsRequest(_message.Message):
    __slots__ = ("after_id", "since", "host_ids", "types", "follow")
    AFTER_ID_FIELD_NUMBER: _ClassVar[int]
    SINCE_FIELD_NUMBER: _ClassVar[int]
    HOST_IDS_FIELD_NUMBER: _ClassVar[int]
    TYPES_FIELD_NUMBER: _ClassVar[int]
    FOLLOW_FIELD_NUMBER: _ClassVar[int]
    after_id: str
    since: float
    host_ids: _containers.RepeatedScalarFieldContainer[str]
    types: _containers.RepeatedScalarFieldContainer[EventType]
    follow: bool
    def __init__(self, after_id: _Optional[str] = ..., since: _Optional[float] = ..., host_ids: _Optional[_Iterable[str]] = ..., types: _Optional[_Iterable[_Union[EventType, str]]] = ..., follow: _Optional[bool] = ...) -> None: ...

class AckEpochRequest(_message.Message):
    __slots__ = ("host_id", "incarnation", "epoch", "restored_step", "restore_source", "phases", "restored_bytes", "reached_step")
    class PhasesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class RestoredBytesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    RESTORED_STEP_FIELD_NUMBER: _ClassVar[int]
    RESTORE_SOURCE_FIELD_NUMBER: _ClassVar[int]
    PHASES_FIELD_NUMBER: _ClassVar[int]
    RESTORED_BYTES_FIELD_NUMBER: _ClassVar[int]
    REACHED_STEP_FIELD_NUMBER: _ClassVar[int]
    host_id: str
    incarnation: int
    epoch: int
    restored_step: int
    restore_source: str
    phases: _containers.ScalarMap[str, float]
    restored_bytes: _containers.ScalarMap[str, int]
    reached_step: int
    def __init__(self, host_id: _Optional[str] = ..., incarnation: _Optional[int] = ..., epoch: _Optional[int] = ..., restored_step: _Optional[int] = ..., restore_source: _Optional[str] = ..., phases: _Optional[_Mapping[str, float]] = ..., restored_bytes: _Optional[_Mapping[str, int]] = ..., reached_step: _Optional[int] = ...) -> None: ...

class AckEpochResponse(_message.Message):
    __slots__ = ("live",)
    LIVE_FIELD_NUMBER: _ClassVar[int]
    live: bool
    def __init__(self, live: _Optional[bool] = ...) -> None: ...

class ReportFaultRequest(_message.Message):
    __slots__ = ("host_id", "incarnation", "kind", "epoch", "exit_code", "detail", "step", "tier")
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    host_id: str
    incarnation: int
    kind: FaultKind
    epoch: int
    exit_code: int
    detail: str
    step: int
    tier: str
    def __init__(self, host_id: _Optional[str] = ..., incarnation: _Optional[int] = ..., kind: _Optional[_Union[FaultKind, str]] = ..., epoch: _Optional[int] = ..., exit_code: _Optional[int] = ..., detail: _Optional[str] = ..., step: _Optional[int] = ..., tier: _Optional[str] = ...) -> None: ...

class ReportFaultResponse(_message.Message):
    __slots__ = ("member_dead", "reason")
    MEMBER_DEAD_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    member_dead: bool
    reason: str
    def __init__(self, member_dead: _Optional[bool] = ..., reason: _Optional[str] = ...) -> None: ...

class ObserveRequest(_message.Message):
    __slots__ = ("host_id", "incarnation", "epoch", "stall", "collective_failure", "tier_missing")
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    STALL_FIELD_NUMBER: _ClassVar[int]
    COLLECTIVE_FAILURE_FIELD_NUMBER: _ClassVar[int]
    TIER_MISSING_FIELD_NUMBER: _ClassVar[int]
    host_id: str
    incarnation: int
    epoch: int
    stall: StallObservation
    collective_failure: CollectiveFailureObservation
    tier_missing: TierMissingObservation
    def __init__(self, host_id: _Optional[str] = ..., incarnation: _Optional[int] = ..., epoch: _Optional[int] = ..., stall: _Optional[_Union[StallObservation, _Mapping]] = ..., collective_failure: _Optional[_Union[CollectiveFailureObservation, _Mapping]] = ..., tier_missing: _Optional[_Union[TierMissingObservation, _Mapping]] = ...) -> None: ...

class StallObservation(_message.Message):
    __slots__ = ("step",)
    STEP_FIELD_NUMBER: _ClassVar[int]
    step: int
    def __init__(self, step: _Optional[int] = ...) -> None: ...

class CollectiveFailureObservation(_message.Message):
    __slots__ = ("detail",)
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    detail: str
    def __init__(self, detail: _Optional[str] = ...) -> None: ...

class TierMissingObservation(_message.Message):
    __slots__ = ("tier", "detail")
    TIER_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    tier: str
    detail: str
    def __init__(self, tier: _Optional[str] = ..., detail: _Optional[str] = ...) -> None: ...

class ObserveResponse(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class CommitCheckpointRequest(_message.Message):
    __slots__ = ("host_id", "incarnation", "epoch", "step", "tier")
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    host_id: str
    incarnation: int
    epoch: int
    step: int
    tier: str
    def __init__(self, host_id: _Optional[str] = ..., incarnation: _Optional[int] = ..., epoch: _Optional[int] = ..., step: _Optional[int] = ..., tier: _Optional[str] = ...) -> None: ...

class CommitCheckpointResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class FinishRequest(_message.Message):
    __slots__ = ("host_id", "incarnation", "epoch", "step")
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    host_id: str
    incarnation: int
    epoch: int
    step: int
    def __init__(self, host_id: _Optional[str] = ..., incarnation: _Optional[int] = ..., epoch: _Optional[int] = ..., step: _Optional[int] = ...) -> None: ...

class FinishResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("host_id", "reason")
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    host_id: str
    reason: str
    def __init__(self, host_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ("member",)
    MEMBER_FIELD_NUMBER: _ClassVar[int]
    member: Member
    def __init__(self, member: _Optional[_Union[Member, _Mapping]] = ...) -> None: ...
