#!/usr/bin/env bash
# Regenerate reports/<engine>/{report.json,junit.xml,report.md,report.html} for every local peer,
# then reports/matrix.{md,html} across them. Nothing is downloaded but PyPI
# packages; every model and tokenizer is made here.
#   reference           this project's generate() in process
#   hf-generate         transformers generate (greedy, stop_strings, a streamer) on the forced checkpoints
#   decode-stream       tokenizers' DecodeStream on the forced checkpoints' tokenizers (byte tables included)
#   the HTTP engines    scripts/peers/conform.sh ENGINE, each on the forced checkpoints: decodespec-serve,
#                       vllm (float32, -fp16, -bf16), llama-server (f32, -f16, -bf16 GGUF), llama-cpp-python,
#                       transformers-serve (PEERS="..." picks some)
# SAME_CASES=1 re-runs each report on its own snapshot's cases (conform --cases-of reports/NAME/report.json,
# where that report exists): a refresh after a judge change, without the suite's newer cases joining it.
# A peer's failures are findings, not errors of this script: conform's exit status is ignored here.
set -u
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
CONFORM="$PY -m decodespec conform"
HTTP_PEERS=${PEERS:-"decodespec-serve vllm vllm-fp16 vllm-bf16 llama-server llama-server-f16 llama-server-bf16 llama-cpp-python transformers-serve"}

same() { [ -n "${SAME_CASES:-}" ] && [ -f "reports/$1/report.json" ] && echo "--cases-of reports/$1/report.json"; }

CKPTS=$(scripts/peers/checkpoints.sh)

$CONFORM --engine reference --name reference --report reports/reference $(same reference) || true
$CONFORM --engine "hf:$CKPTS" --name hf-generate --report reports/hf-generate $(same hf-generate) || true
$CONFORM --engine "decode-stream:$CKPTS" --name decode-stream --select detok/ --select stop/ --select finish/ \
  --select stream/ --report reports/decode-stream $(same decode-stream) || true
for engine in $HTTP_PEERS; do
  # shellcheck disable=SC2046  # same() is one option and its path, or nothing
  scripts/peers/conform.sh "$engine" $(same "$engine") || echo "$engine: could not be run (see above)" >&2
done
$PY -m decodespec.properties.conformance.matrix reports
