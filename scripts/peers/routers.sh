#!/usr/bin/env bash
# Two vLLM workers behind a router, as one peer. Nothing is downloaded but PyPI
# packages (binary wheels of the Rust routers); the model is a local directory.
#   scripts/peers/routers.sh install                       venv .cache/peers/routers/venv: vllm-router, smg
#   scripts/peers/routers.sh serve ROUTER MODEL_DIR PORT [VLLM_FLAG...]
#        ROUTER: vllm-router | smg. Starts two workers (scripts/peers/vllm.sh serve, the flags appended)
#        on free ports of 127.0.0.1, waits for both, then runs the router on 127.0.0.1:PORT in front of
#        them (round robin; its Prometheus endpoint on another free port of 127.0.0.1). Stays in the
#        foreground; on SIGTERM/SIGINT or when any of the three exits, it stops all three by PID.
#        With STACK_PIDS=FILE it writes the workers' and the router's PIDs into FILE and stays up
#        until the router exits (a worker killed on purpose: scripts/peers/failover.py).
set -euo pipefail
cd "$(dirname "$0")/../.."

VLLM_ROUTER=0.1.17
SMG=1.13.0
mkdir -p .cache/peers
DIR=$(cd .cache/peers && pwd -P)/routers
VENV=$DIR/venv

install() {
  if [ -x "$VENV/bin/vllm-router" ] && [ -x "$VENV/bin/smg" ]; then
    echo "vllm-router and smg already installed in $VENV"
    return 0
  fi
  [ -x "$VENV/bin/python" ] || "${PEER_PYTHON:-python3.11}" -m venv "$VENV"
  "$VENV/bin/pip" install --quiet "vllm-router==$VLLM_ROUTER" "smg==$SMG"
  scripts/peers/vllm.sh install
}

free_port() { "$VENV/bin/python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

serve() {
  [ $# -ge 3 ] || { echo "usage: $0 serve vllm-router|smg MODEL_DIR PORT [VLLM_FLAG...]" >&2; exit 2; }
  local router=$1 model=$2 port=$3
  shift 3
  [ -x "$VENV/bin/$router" ] || { echo "no $router in $VENV; run: $0 install" >&2; exit 1; }
  local p1 p2 prom
  pids=()  # global: the EXIT trap runs after serve has returned
  p1=$(free_port); p2=$(free_port)
  stop() { trap - EXIT TERM INT; for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done; wait; }
  trap stop EXIT TERM INT
  for p in "$p1" "$p2"; do
    scripts/peers/vllm.sh serve "$model" "$p" "$@" &
    pids+=($!)
  done
  for p in "$p1" "$p2"; do
    until curl -sf "http://127.0.0.1:$p/v1/models" >/dev/null; do
      for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null || { echo "a worker exited before answering" >&2; exit 1; }; done
      sleep 1
    done
  done
  # the Prometheus port is picked once the workers are up: picked before, a worker's own ports
  # (vLLM's engine sockets) could take it first and the router would fail to bind it
  prom=$(free_port)
  local urls=("http://127.0.0.1:$p1" "http://127.0.0.1:$p2")
  case "$router" in
    vllm-router)
      "$VENV/bin/vllm-router" --worker-urls "${urls[@]}" --host 127.0.0.1 --port "$port" --policy round_robin \
        --prometheus-host 127.0.0.1 --prometheus-port "$prom" &
      ;;
    smg)
      # smg detects each HTTP worker's engine itself (/v1/models owned_by, /version): no --backend
      "$VENV/bin/smg" launch --worker-urls "${urls[@]}" --host 127.0.0.1 --port "$port" --policy round_robin \
        --prometheus-host 127.0.0.1 --prometheus-port "$prom" &
      ;;
    *) echo "unknown router $router (vllm-router | smg)" >&2; exit 2 ;;
  esac
  pids+=($!)
  echo "[routers.sh] $router on 127.0.0.1:$port (Prometheus :$prom) in front of ${urls[*]}; PIDs ${pids[*]}" >&2
  if [ -n "${STACK_PIDS:-}" ]; then
    echo "${pids[*]}" >"$STACK_PIDS"
    wait "${pids[2]}"  # the router ended: stop the workers left (the EXIT trap)
  else
    wait -n "${pids[@]}"  # one of the three ended: stop the others (the EXIT trap)
  fi
}

case "${1:-}" in
  install) install ;;
  serve) shift; serve "$@" ;;
  *) sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2 ;;
esac
