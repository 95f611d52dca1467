from remesh.v1 import coordinator_pb2 as _coordinator_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Assignment(_message.Message):
    __slots__ = ("topology", "host_id", "rank", "world_size")
    TOPOLOGY_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    topology: _coordinator_pb2.Topology
    host_id: str
    rank: int
    world_size: int
    def __init__(self, topology: _Optional[_Union[_coordinator_pb2.Topology, _Mapping]] = ..., host_id: _Optional[str] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ...) -> None: ...

class WatchAssignmentsRequest(_message.Message):
    __slots__ = ("after_epoch", "slot")
    AFTER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    after_epoch: int
    slot: int
    def __init__(self, after_epoch: _Optional[int] = ..., slot: _Optional[int] = ...) -> None: ...

class ReportProgressRequest(_message.Message):
    __slots__ = ("step", "epoch", "totals", "tiers_missing")
    class TiersMissingEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    STEP_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    TOTALS_FIELD_NUMBER: _ClassVar[int]
    TIERS_MISSING_FIELD_NUMBER: _ClassVar[int]
    step: int
    epoch: int
    totals: TrainerTotals
    tiers_missing: _containers.ScalarMap[str, str]
    def __init__(self, step: _Optional[int] = ..., epoch: _Optional[int] = ..., totals: _Optional[_Union[TrainerTotals, _Mapping]] = ..., tiers_missing: _Optional[_Mapping[str, str]] = ...) -> None: ...

class TrainerTotals(_message.Message):
    __slots__ = ("steps", "step_seconds", "snapshots", "snapshot_seconds", "snapshot_bytes", "checkpoints", "checkpoint_save_seconds", "checkpoint_wait_seconds", "peer_failures", "checkpoint_bytes", "snapshot_failures", "snapshot_every", "snapshot_every_kept")
    class SnapshotFailuresEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    STEPS_FIELD_NUMBER: _ClassVar[int]
    STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOTS_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINTS_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_SAVE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PEER_FAILURES_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_BYTES_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FAILURES_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_EVERY_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_EVERY_KEPT_FIELD_NUMBER: _ClassVar[int]
    steps: int
    step_seconds: float
    snapshots: int
    snapshot_seconds: float
    snapshot_bytes: int
    checkpoints: int
    checkpoint_save_seconds: float
    checkpoint_wait_seconds: float
    peer_failures: int
    checkpoint_bytes: int
    snapshot_failures: _containers.ScalarMap[str, int]
    snapshot_every: int
    snapshot_every_kept: int
    def __init__(self, steps: _Optional[int] = ..., step_seconds: _Optional[float] = ..., snapshots: _Optional[int] = ..., snapshot_seconds: _Optional[float] = ..., snapshot_bytes: _Optional[int] = ..., checkpoints: _Optional[int] = ..., checkpoint_save_seconds: _Optional[float] = ..., checkpoint_wait_seconds: _Optional[float] = ..., peer_failures: _Optional[int] = ..., checkpoint_bytes: _Optional[int] = ..., snapshot_failures: _Optional[_Mapping[str, int]] = ..., snapshot_every: _Optional[int] = ..., snapshot_every_kept: _Optional[int] = ...) -> None: ...

class ReportProgressResponse(_message.Message):
    __slots__ = ("current_epoch",)
    CURRENT_EPOCH_FIELD_NUMBER: _ClassVar[int]
    current_epoch: int
    def __init__(self, current_epoch: _Optional[int] = ...) -> None: ...

class LocalAckRequest(_message.Message):
    __slots__ = ("epoch", "restored_step", "restore_source", "phases", "restored_bytes", "reached_step")
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
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    RESTORED_STEP_FIELD_NUMBER: _ClassVar[int]
    RESTORE_SOURCE_FIELD_NUMBER: _ClassVar[int]
    PHASES_FIELD_NUMBER: _ClassVar[int]
    RESTORED_BYTES_FIELD_NUMBER: _ClassVar[int]
    REACHED_STEP_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    restored_step: int
    restore_source: str
    phases: _containers.ScalarMap[str, float]
    restored_bytes: _containers.ScalarMap[str, int]
    reached_step: int
    def __init__(self, epoch: _Optional[int] = ..., restored_step: _Optional[int] = ..., restore_source: _Optional[str] = ..., phases: _Optional[_Mapping[str, float]] = ..., restored_bytes: _Optional[_Mapping[str, int]] = ..., reached_step: _Optional[int] = ...) -> None: ...

class LocalAckResponse(_message.Message):
    __slots__ = ("live",)
    LIVE_FIELD_NUMBER: _ClassVar[int]
    live: bool
    def __init__(self, live: _Optional[bool] = ...) -> None: ...

class LocalCommitRequest(_message.Message):
    __slots__ = ("epoch", "step", "tier")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    step: int
    tier: str
    def __init__(self, epoch: _Optional[int] = ..., step: _Optional[int] = ..., tier: _Optional[str] = ...) -> None: ...

class LocalCommitResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LocalStallRequest(_message.Message):
    __slots__ = ("epoch", "step", "blocked_s")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    BLOCKED_S_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    step: int
    blocked_s: float
    def __init__(self, epoch: _Optional[int] = ..., step: _Optional[int] = ..., blocked_s: _Optional[float] = ...) -> None: ...

class LocalStallResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LocalCollectiveFailureRequest(_message.Message):
    __slots__ = ("epoch", "step", "detail")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    step: int
    detail: str
    def __init__(self, epoch: _Optional[int] = ..., step: _Optional[int] = ..., detail: _Optional[str] = ...) -> None: ...

class LocalCollectiveFailureResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LocalFinishRequest(_message.Message):
    __slots__ = ("epoch", "step")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    step: int
    def __init__(self, epoch: _Optional[int] = ..., step: _Optional[int] = ...) -> None: ...

class LocalFinishResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
