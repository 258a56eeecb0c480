# Sourced by the scripts: check the interpreter, create .venv if needed and install fastdata with
# the given extras, pinned by constraints.txt (torch==2.13.0 there; from PyPI on Linux that is
# the CUDA build, gigabytes: install the CPU wheel into .venv first to keep it, docs/development.md).
ensure_venv() {
    local extras="$1"
    local python="${PYTHON:-python3}"
    if ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
        local version
        version=$("$python" -V 2>&1 | head -n 1)
        echo "fastdata needs Python 3.11 or newer; $python is ${version:-missing}." \
            "Set PYTHON=/path/to/python3.11 and run again." >&2
        exit 2
    fi
    if [ ! -x .venv/bin/python ]; then
        "$python" -m venv .venv
    fi
    if ! .venv/bin/python -c 'import fastdata, torch' 2>/dev/null; then
        echo "installing fastdata and its dependencies into .venv (about a minute the first time) ..." >&2
    fi
    .venv/bin/python -m pip install --quiet --disable-pip-version-check \
        -c constraints.txt -e "$extras"
}
