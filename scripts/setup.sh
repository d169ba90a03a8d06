#!/usr/bin/env bash
# Idempotent set-up for decodespec: a virtual environment with the CPU torch wheel, the project
# (editable) with its test and server extras, and graphviz's `dot` for the diagrams.
# Re-running is cheap: the install step is skipped while pyproject.toml and setup.py are unchanged.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=.venv
STAMP="$VENV/.decodespec-setup"

if [ ! -x "$VENV/bin/python" ]; then
    echo "setup: creating $VENV"
    python3 -m venv "$VENV"
fi

# torch first, pinned, so nothing later pulls a multi-GB CUDA build (pip finds the CPU wheel
# on this disk through its find-links).
if ! "$VENV/bin/python" -c "import torch" >/dev/null 2>&1; then
    echo "setup: installing torch 2.13.0 (CPU)"
    find_links=()
    [ -d /opt/wheels ] && find_links=(--find-links /opt/wheels)
    "$VENV/bin/pip" install --quiet "${find_links[@]}" "torch==2.13.0"
fi

want="$(cat pyproject.toml setup.py | sha256sum | cut -d" " -f1) $(pwd)"
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$want" ] || ! "$VENV/bin/python" -c "import decodespec" >/dev/null 2>&1; then
    echo "setup: installing decodespec with extras test, serve"
    "$VENV/bin/pip" install --quiet -e ".[test,serve]"
    echo "$want" > "$STAMP"
fi

# Debian's apt and dpkg locks (another `make setup`, unattended-upgrades) are waited for, at most
# this long: apt-get install waits by itself (DPkg::Lock::Timeout); apt-get update does not, so it
# is retried while its error is the lock.
APT_LOCK_WAIT_S=600

apt_update() {
    local deadline=$((SECONDS + APT_LOCK_WAIT_S)) out
    until out="$("${sudo[@]}" apt-get update -qq 2>&1)"; do
        if ! grep -q "Could not get lock" <<<"$out" || [ "$SECONDS" -ge "$deadline" ]; then
            echo "$out" >&2
            return 1
        fi
        echo "setup: waiting for apt's lock ($(grep -m1 -o "held by process.*" <<<"$out" || echo "held"))"
        sleep 5
    done
}

if ! command -v dot >/dev/null 2>&1; then
    echo "setup: installing graphviz (dot)"
    sudo=()
    [ "$(id -u)" -ne 0 ] && sudo=(sudo)
    apt_update
    "${sudo[@]}" apt-get -o DPkg::Lock::Timeout="$APT_LOCK_WAIT_S" install -y -qq graphviz
fi
echo "setup: ready ($("$VENV/bin/python" -c 'import torch, decodespec; print("torch", torch.__version__, "decodespec", decodespec.__version__)'))"
