#!/usr/bin/env bash
# The main job on a fresh machine: install fastdata into .venv, build a small sample image
# folder, convert it to LMDB, read it back and print a summary with throughput.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_venv.sh
ensure_venv ".[turbo]"
exec .venv/bin/python scripts/quickstart.py "$@"
