#!/usr/bin/env bash
# Regenerate the Python code for the remesh.v1 protos (committed, so an install needs no protoc).
# With --check, generate into a temporary folder and fail if the committed code differs.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out="$here"
if [[ "${1:-}" == "--check" ]]; then
  out=$(mktemp -d)
  trap 'rm -rf "$out"' EXIT
fi
python -m grpc_tools.protoc -I"$here" --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" \
  "$here"/remesh/v1/*.proto
if [[ "${1:-}" == "--check" ]]; then
  for f in "$out"/remesh/v1/*.py "$out"/remesh/v1/*.pyi; do
    if ! cmp -s "$f" "$here/remesh/v1/$(basename "$f")"; then
      echo "protos/remesh/v1/$(basename "$f") is out of date: run protos/generate.sh and commit" >&2
      exit 1
    fi
  done
  echo "generated protobuf code matches protos/"
fi
