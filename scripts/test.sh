#!/usr/bin/env bash
# Install what the tests need into .venv (exact versions from constraints.txt) and run the
# checks: ruff and mypy on fastdata/, then pytest without the slow tests, in two processes
# (pytest-xdist; `-n 0` runs them in this one). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_venv.sh
ensure_venv ".[test,turbo]"
.venv/bin/ruff check fastdata
.venv/bin/ruff format --check fastdata
.venv/bin/mypy fastdata
# the tests marked slow (kill cycles, pixel bombs) run with `-m slow` (or
# `-m "slow or not slow"` for all): a later -m given here replaces this one
exec .venv/bin/python -m pytest -m "not slow" -n 2 "$@"
