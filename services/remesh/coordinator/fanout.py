"""One topology written to many streams: encoded once per epoch, and once per delta base.

The coordinator's heartbeat streams (``servicer``) and a relay's followers (``relay``) each write a
new epoch to thousands of agents: encoding it for each would be N x N work for N members. Here each
epoch is encoded once whole, and once as a delta from each topology a stream held before it.
"""

from __future__ import annotations

from dataclasses import dataclass

from remesh.coordinator.model import Topology
from remesh.v1 import coordinator_pb2 as pb
from remesh.v1 import deltas

__all__ = ["EncodedTopology"]


@dataclass
class EncodedTopology:
    """One epoch's reply on a topology stream, encoded once for every stream: whole, and as a delta
    from each topology a stream held before it (None where the whole one is sent instead)."""

    topology: Topology | None  # the coordinator's own, where it encoded it
    message: pb.Topology
    whole: bytes
    deltas: dict[int, tuple[pb.Topology, bytes | None]]

    @classmethod
    def of(cls, message: pb.Topology, topology: Topology | None = None) -> EncodedTopology:
        return cls(topology, message, pb.HeartbeatResponse(topology=message).SerializeToString(), {})

    def reply(self, base: pb.Topology | None) -> bytes:
        """The reply for a stream that last sent ``base`` (None: it takes whole topologies)."""
        if base is None or not 0 < base.epoch < self.message.epoch:
            return self.whole
        cached = self.deltas.get(base.epoch)
        if cached is None or cached[0] is not base:
            d = deltas.delta(base, self.message)
            encoded = None if d is None else pb.HeartbeatResponse(topology_delta=d).SerializeToString()
            cached = self.deltas[base.epoch] = (base, encoded)
        return cached[1] or self.whole
