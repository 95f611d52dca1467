"""The ``remesh`` command: one entry point for the coordinator, the agent and the operator tools.

Flags and environment variables are read here and nowhere deeper: each subcommand builds its
component's settings object and hands it over.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from remesh.cli import _agent, _certs, _coordinator, _demo, _ops, _relay
from remesh.cli.logs import configure_logging

__all__ = ["main"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="remesh",
        description="Keep distributed JAX training alive when a host dies.",
    )
    parser.add_argument("--log-json", action="store_true", help="write logs as JSON lines (for log shippers)")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _coordinator.add_parser(sub)
    _agent.add_parser(sub)
    _relay.add_parser(sub)
    _ops.add_parsers(sub)
    _demo.add_parser(sub)
    _certs.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    configure_logging(json=args.log_json, level=args.log_level, background=args.command == "agent")
    try:
        return int(args.run(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
