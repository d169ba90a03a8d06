#!/usr/bin/env bash
# Regenerate reports/<engine>/{report.json,junit.xml,report.md,report.html} for every local peer
# (issue 7 item 4). Everything is made on this machine; nothing is downloaded.
#   reference           this project's generate() in process
#   hf-generate         transformers generate on the tiny local Llama (scripts/peers/build_tiny_llama.py)
#   decode-stream-*     tokenizers' DecodeStream on the three fixture tokenizers
#   decodespec-serve    this project's OpenAI-compatible server, black box
#   transformers-serve  `transformers serve` on the tiny Llama (needs fastapi + accelerate; skipped if missing)
# A peer's failures are findings, not errors of this script: conform's exit status is ignored here.
set -u
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
PEERS=.cache/peers
CONFORM="$PY -m decodespec conform"

[ -f "$PEERS/tiny-llama/model.safetensors" ] || $PY scripts/peers/build_tiny_llama.py --out "$PEERS/tiny-llama"
$PY -c "from decodespec.properties import fixtures as f; [b('$PEERS/tokenizers') for b in f.BUILDERS.values()]"

free_port() { $PY -c "import socket; s=socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])"; }
wait_up() { for _ in $(seq 1 300); do curl -sf "$1/v1/models" >/dev/null && return 0; sleep 0.5; done; return 1; }

$CONFORM --engine reference --name reference --report reports/reference || true
$CONFORM --engine "hf:$PEERS/tiny-llama" --name hf-generate --report reports/hf-generate || true
for kind in byte_level_bpe sentencepiece_byte_fallback wordpiece; do
  $CONFORM --engine "decode-stream:$PEERS/tokenizers/$kind/tokenizer.json" --name "decode-stream-$kind" \
    --select detok/ --select stop/ --select finish/ --select stream/ --report "reports/decode-stream-$kind" || true
done

port=$(free_port)
$PY -m decodespec serve --port "$port" >"$PEERS/decodespec-serve.log" 2>&1 &
pid=$!
if wait_up "http://127.0.0.1:$port"; then
  $CONFORM --engine "openai:http://127.0.0.1:$port" --name decodespec-serve --report reports/decodespec-serve || true
else
  echo "decodespec serve did not come up; see $PEERS/decodespec-serve.log" >&2
fi
kill "$pid"; wait "$pid" 2>/dev/null

if $PY -c "import fastapi, accelerate" 2>/dev/null; then
  port=$(free_port)
  model="$(cd "$PEERS/tiny-llama" && pwd)"
  HF_HUB_OFFLINE=1 .venv/bin/transformers serve --port "$port" "$model" >"$PEERS/transformers-serve.log" 2>&1 &
  pid=$!
  if wait_up "http://localhost:$port"; then
    $CONFORM --engine "openai:http://localhost:$port" --model "$model" --name transformers-serve \
      --report reports/transformers-serve || true
  else
    echo "transformers serve did not come up; see $PEERS/transformers-serve.log" >&2
  fi
  kill "$pid"; wait "$pid" 2>/dev/null
else
  echo "transformers serve needs fastapi and accelerate (pip install 'transformers[serving]' accelerate); skipped" >&2
fi
ls reports/*/report.json
