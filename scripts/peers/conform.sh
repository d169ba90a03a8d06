#!/usr/bin/env bash
# One command per engine: install it into .cache/peers/ (reused), build the forced checkpoints
# (reused while the cases and the construction are unchanged), start the engine on 127.0.0.1 once
# per checkpoint, run the conformance suite against it, stop it by PID, and write reports/<engine>/.
#   scripts/peers/conform.sh ENGINE [conform args...]    ENGINE: see scripts/peers/engines.py
# The engine's findings are the report's content, not errors of this script: conform's exit
# status is printed, then ignored.
set -euo pipefail
cd "$(dirname "$0")/../.."
ENGINE=${1:?usage: $0 ENGINE [conform args...] (engines: see scripts/peers/engines.py)}
shift
[ -x .venv/bin/decodespec ] || make setup >/dev/null
PY=.venv/bin/python
DS=.venv/bin/decodespec
field() { $PY scripts/peers/engines.py "$ENGINE" "$1"; }
launch=$(field launch)  # fails first on an unknown engine

CKPTS=$(scripts/peers/checkpoints.sh)
install=$(field install)
[ -z "$install" ] || bash -c "$install"

folders=()
outtype=$(field gguf)
if [ -n "$outtype" ]; then
  gguf=model.gguf
  [ "$outtype" = f32 ] || gguf=model-$outtype.gguf
  exec 9>.cache/peers/checkpoints.lock
  flock 9  # one converter at a time per set (see checkpoints.sh)
  for d in "$CKPTS"/*/; do  # llama.cpp's own converter, once per checkpoint and type
    d=${d%/}
    if [ ! -f "$d/$gguf" ]; then
      if scripts/peers/llama_cpp.sh convert "$d" "$d/$gguf.partial" "$outtype" >"$d/convert-$outtype.log" 2>&1; then
        mv "$d/$gguf.partial" "$d/$gguf"
      else
        echo "llama.cpp's converter refused $d (see $d/convert-$outtype.log); its cases are not run" >&2
        rm -f "$d/$gguf.partial"
      fi
    fi
    [ -f "$d/$gguf" ] && folders+=(--checkpoint "$d")
  done
  exec 9>&-
else
  folders=(--checkpoint "$CKPTS")
fi
extra=()
for w in $(field without); do extra+=(--without "$w"); done
[ -z "$(field model)" ] || extra+=(--model "$(field model)")
extra+=(-j "$(field jobs)")
[ -z "$(field context)" ] || extra+=(--launch-context "$(field context)")
[ -z "$(field tight)" ] || extra+=(--launch-tight "$(field tight)")

t0=$SECONDS
rc=0
$DS conform --launch "$launch" "${folders[@]}" "${extra[@]}" --name "$ENGINE" --report "reports/$ENGINE" "$@" || rc=$?
echo "$ENGINE: conform exit status $rc, $((SECONDS - t0)) s wall (server start-ups included)"
