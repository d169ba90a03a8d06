#!/usr/bin/env bash
# What each gateway does with SSE ids a worker sends (D42), by hand: two `decodespec serve` workers (they
# send `id:` lines and resume at GET /v1/requests/{X-Request-Id}/events) on the forced byte_level_bpe
# checkpoint, then vllm-router and smg in front of both and LiteLLM's proxy in front of the first, each
# in turn: a short stream's raw lines (headers, id:, data:) and http/stream/resume/001 through it, then
# the same directly. Everything on 127.0.0.1, stopped by PID; reports and logs under OUT.
#   scripts/peers/gateway_ids.sh OUT
set -u
cd "$(dirname "$0")/../.."
OUT=${1:?usage: $0 OUT}
mkdir -p "$OUT"
CK=$(scripts/peers/checkpoints.sh)/byte_level_bpe
RV=$(cd .cache/peers && pwd -P)/routers/venv
LV=$(cd .cache/peers && pwd -P)/litellm/venv
fp() { .venv/bin/python -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
P1=$(fp); P2=$(fp)
pids=()
.venv/bin/decodespec serve --model "$CK" --port $P1 --threads 1 > $OUT/w1.log 2>&1 & pids+=($!)
.venv/bin/decodespec serve --model "$CK" --port $P2 --threads 1 > $OUT/w2.log 2>&1 & pids+=($!)
for p in $P1 $P2; do until curl -sf http://127.0.0.1:$p/v1/models >/dev/null; do sleep 1; done; done
MODEL=$(curl -s http://127.0.0.1:$P1/v1/models | .venv/bin/python -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])')
echo "workers on $P1 $P2, model $MODEL"
BODY='{"model":"'$MODEL'","prompt":"Once upon a time","max_tokens":3,"temperature":0,"stream":true}'
show() {  # name url
  echo "=== $1: POST /v1/completions $BODY"
  curl -s -D - -N -X POST "$2/v1/completions" -H 'Content-Type: application/json' -d "$BODY" | grep -i -E '^(HTTP|x-request-id|id:|data:)' | cut -c1-160
  DECODESPEC_PEER_THREADS=1 .venv/bin/decodespec conform --engine "openai:$2" --checkpoint "$CK" --select http/stream/resume/ --report $OUT/$1 --name "$1" >$OUT/$1.conform 2>&1
  .venv/bin/python -c "
import json; r=json.load(open('$OUT/$1/report.json')); c=r['cases'][0]
print('http/stream/resume/001:', c['verdict'], c['reason'], [(f['symptom'], f['message'][:240]) for f in c['failures']], c['notes'][:1])"
}
show direct http://127.0.0.1:$P1
# vllm-router
P3=$(fp); P4=$(fp)
$RV/bin/vllm-router --worker-urls http://127.0.0.1:$P1 http://127.0.0.1:$P2 --host 127.0.0.1 --port $P3 --policy round_robin --prometheus-host 127.0.0.1 --prometheus-port $P4 > $OUT/vllm-router.log 2>&1 & R=$!
for i in $(seq 60); do curl -sf http://127.0.0.1:$P3/v1/models >/dev/null && break; sleep 1; done
show vllm-router http://127.0.0.1:$P3
kill $R; wait $R 2>/dev/null
# smg
P3=$(fp); P4=$(fp)
$RV/bin/smg launch --worker-urls http://127.0.0.1:$P1 http://127.0.0.1:$P2 --host 127.0.0.1 --port $P3 --policy round_robin --prometheus-host 127.0.0.1 --prometheus-port $P4 > $OUT/smg.log 2>&1 & R=$!
for i in $(seq 60); do curl -sf http://127.0.0.1:$P3/v1/models >/dev/null && break; sleep 1; done
show smg http://127.0.0.1:$P3
kill $R; wait $R 2>/dev/null
# LiteLLM in front of worker 1
P3=$(fp)
CFG=$OUT/litellm.yaml
cat > $CFG <<YAML
model_list:
  - model_name: "$MODEL"
    litellm_params:
      model: "openai/$MODEL"
      api_base: "http://127.0.0.1:$P1/v1"
      api_key: "none"
general_settings:
  dangerously_permit_weak_or_unset_master_key: true
YAML
LITELLM_LOG=ERROR DISABLE_SCHEMA_UPDATE=true LITELLM_TELEMETRY=False $LV/bin/litellm --config $CFG --host 127.0.0.1 --port $P3 --num_workers 1 > $OUT/litellm.log 2>&1 & R=$!
for i in $(seq 120); do curl -sf http://127.0.0.1:$P3/v1/models >/dev/null && break; sleep 1; done
show litellm http://127.0.0.1:$P3
kill $R; wait $R 2>/dev/null
kill "${pids[@]}"; wait
