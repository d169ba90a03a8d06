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

if ! command -v dot >/dev/null 2>&1; then
    echo "setup: installing graphviz (dot)"
    sudo=()
    [ "$(id -u)" -ne 0 ] && sudo=(sudo)
    "${sudo[@]}" apt-get update -qq
    "${sudo[@]}" apt-get install -y -qq graphviz
fi
echo "setup: ready ($("$VENV/bin/python" -c 'import torch, decodespec; print("torch", torch.__version__, "decodespec", decodespec.__version__)'))"
