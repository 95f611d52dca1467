"""The remesh.v1 gRPC contract, generated from ``protos/remesh/v1/*.proto`` by ``protos/generate.sh``.

This package is the only code the coordinator, the agent and the trainer library share.
"""
