# Sourced by the scripts: create .venv if needed and install fastdata with the given extras,
# pinned by constraints.txt (torch==2.13.0 there keeps pip on the CPU build).
ensure_venv() {
    local extras="$1"
    if [ ! -x .venv/bin/python ]; then
        "${PYTHON:-python3}" -m venv .venv
    fi
    .venv/bin/python -m pip install --quiet --disable-pip-version-check \
        -c constraints.txt -e "$extras"
}
