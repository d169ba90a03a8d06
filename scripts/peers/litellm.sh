#!/usr/bin/env bash
# LiteLLM's proxy in front of one worker, as one peer. Nothing is downloaded but PyPI packages; the
# worker serves a local model.
#   scripts/peers/litellm.sh install       venv .cache/peers/litellm/venv with litellm[proxy] (idempotent)
#   scripts/peers/litellm.sh serve [--workers N] MODEL_NAME PORT WORKER_COMMAND...
#        Starts WORKER_COMMAND N times (default 1; its @PORT@ replaced by a free port of 127.0.0.1 each
#        time), waits for each /v1/models, then the proxy on 127.0.0.1:PORT from a config that names
#        each worker as an OpenAI-compatible deployment of MODEL_NAME (model `openai/MODEL_NAME`, so
#        /v1/completions goes to the worker's own /v1/completions; several balanced least-busy), and the
#        first worker's /metrics, /props and /v1/models passed through as the proxy's /worker/metrics
#        (the running gauge the request-life cases read), /worker/props and /worker/v1/models (the
#        context length it runs with, for the context-limit cases). Stays in the foreground; on SIGTERM/SIGINT or when any exits, it
#        stops all by PID. With STACK_PIDS=FILE it writes the workers' and the proxy's PIDs into FILE
#        and stays up until the proxy exits (a worker killed on purpose: scripts/peers/failover.py).
set -euo pipefail
cd "$(dirname "$0")/../.."

# 1.106.12: the newest release whose [proxy] extra installs from PyPI alone (later ones require a
# `litellm-proxy` distribution PyPI does not have).
VERSION=1.106.12
mkdir -p .cache/peers
DIR=$(cd .cache/peers && pwd -P)/litellm
VENV=$DIR/venv

install() {
  if [ -x "$VENV/bin/litellm" ] && [ "$("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("litellm"))' 2>/dev/null)" = "$VERSION" ]; then
    echo "litellm $VERSION already installed in $VENV"
    return 0
  fi
  [ -x "$VENV/bin/python" ] || "${PEER_PYTHON:-python3.11}" -m venv "$VENV"
  "$VENV/bin/pip" install --quiet "litellm[proxy]==$VERSION"
}

free_port() { "$VENV/bin/python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

serve() {
  local workers=1
  if [ "${1:-}" = --workers ]; then workers=${2:-}; shift 2 || true; fi
  [[ "$workers" =~ ^[1-9][0-9]*$ ]] || { echo "--workers takes a positive count, not '$workers'" >&2; exit 2; }
  [ $# -ge 3 ] || { echo "usage: $0 serve [--workers N] MODEL_NAME PORT WORKER_COMMAND..." >&2; exit 2; }
  local name=$1 port=$2
  shift 2
  [ -x "$VENV/bin/litellm" ] || { echo "no litellm in $VENV; run: $0 install" >&2; exit 1; }
  local wports=() cmd config i w
  pids=()  # global: the EXIT trap runs after serve has returned
  config=$(mktemp "${TMPDIR:-/tmp}/litellm-XXXXXX.yaml")
  stop() { trap - EXIT TERM INT; for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done; wait; rm -f "$config"; }
  trap stop EXIT TERM INT
  for ((i = 0; i < workers; i++)); do
    wports+=("$(free_port)")
    cmd=()
    for w in "$@"; do cmd+=("${w//@PORT@/${wports[i]}}"); done
    "${cmd[@]}" &
    pids+=($!)
  done
  for ((i = 0; i < workers; i++)); do
    until curl -sf "http://127.0.0.1:${wports[i]}/v1/models" >/dev/null; do
      kill -0 "${pids[i]}" 2>/dev/null || { echo "worker $((i + 1)) exited before answering" >&2; exit 1; }
      sleep 1
    done
  done
  {
    echo "model_list:"
    for w in "${wports[@]}"; do
      cat <<EOF
  - model_name: "$name"
    litellm_params:
      model: "openai/$name"
      api_base: "http://127.0.0.1:$w/v1"
      api_key: "none"
EOF
    done
    cat <<EOF
router_settings:
  routing_strategy: least-busy
general_settings:
  dangerously_permit_weak_or_unset_master_key: true
  pass_through_endpoints:
    - path: "/worker/metrics"
      target: "http://127.0.0.1:${wports[0]}/metrics"
    - path: "/worker/props"
      target: "http://127.0.0.1:${wports[0]}/props"
    - path: "/worker/v1/models"
      target: "http://127.0.0.1:${wports[0]}/v1/models"
EOF
  } >"$config"
  LITELLM_LOG=ERROR DISABLE_SCHEMA_UPDATE=true LITELLM_TELEMETRY=False \
    "$VENV/bin/litellm" --config "$config" --host 127.0.0.1 --port "$port" --num_workers 1 &
  pids+=($!)
  echo "[litellm.sh] LiteLLM proxy on 127.0.0.1:$port in front of 127.0.0.1 port(s) ${wports[*]} ($*); PIDs ${pids[*]}" >&2
  if [ -n "${STACK_PIDS:-}" ]; then
    echo "${pids[*]}" >"$STACK_PIDS"
    wait "${pids[workers]}"  # the proxy ended: stop the workers left (the EXIT trap)
  else
    wait -n "${pids[@]}"  # one ended: stop the others (the EXIT trap)
  fi
}

case "${1:-}" in
  install) install ;;
  serve) shift; serve "$@" ;;
  *) sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2 ;;
esac
