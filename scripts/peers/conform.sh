#!/usr/bin/env bash
# One command per engine, with this checkout's cached installs: install it into .cache/peers/ (reused),
# build the forced checkpoints (reused while the cases and the construction are unchanged), then
# `decodespec conform --preset ENGINE`, the shipped preset (or scripts/peers/presets.toml's), with the
# cached engine first on PATH: it converts the checkpoints to GGUF where the engine needs it, starts
# the engine on 127.0.0.1 once per checkpoint, runs its cases, stops it by PID and writes
# reports/<engine>/ (the launch logs go to .cache/peers/logs/<engine>/).
#   scripts/peers/conform.sh ENGINE [conform args...]    ENGINE: see scripts/peers/engines.py
# The engine's findings are the report's content, not errors of this script: conform's exit
# status is printed, then ignored.
set -euo pipefail
cd "$(dirname "$0")/../.."
ENGINE=${1:?usage: $0 ENGINE [conform args...] (engines: see scripts/peers/engines.py)}
shift
[ -x .venv/bin/decodespec ] || make setup >/dev/null
PY=.venv/bin/python
field() { $PY scripts/peers/engines.py "$ENGINE" "$1"; }
install=$(field install)  # fails first on an unknown engine

CKPTS=$(scripts/peers/checkpoints.sh)
[ -z "$install" ] || bash -c "$install"
extra=()
if [ -n "$(field gguf)" ]; then  # llama.cpp's converter runs in decodespec's Python
  $PY -c 'import sentencepiece' 2>/dev/null || .venv/bin/pip install -q -e '.[gguf]'
  extra+=(--llama-cpp "$(field llama_cpp)")
fi
path=$(field path)
t0=$SECONDS
rc=0
# shellcheck disable=SC2046  # env: VAR=value words
env $(field env) DECODESPEC_CACHE=.cache/peers PATH="${path:+$path:}$PATH" \
  .venv/bin/decodespec conform --preset "$ENGINE" --presets scripts/peers/presets.toml --checkpoint "$CKPTS" "${extra[@]}" --report "reports/$ENGINE" "$@" || rc=$?
echo "$ENGINE: conform exit status $rc, $((SECONDS - t0)) s wall (server start-ups included)"
