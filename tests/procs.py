"""The tests' view of a local job: real coordinator and agent processes (see remesh.embedded.cluster)."""

from remesh.embedded.cluster import LocalCluster as Cluster
from remesh.embedded.cluster import Proc, wait_for

__all__ = ["Cluster", "Proc", "wait_for"]
