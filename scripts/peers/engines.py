"""The local peer engines as data: how each installs, starts and what it lacks (issue 13 item 5).

    python scripts/peers/engines.py NAME FIELD      # print one field (scripts/peers/conform.sh reads them)

`launch` is a `decodespec conform --launch` command: {model} is a checkpoint folder, {gguf} its
model.gguf (llama.cpp's converter wrote it), {port} a free port on 127.0.0.1. `install` runs before
(idempotent, cached under .cache/peers/). `gguf` is the converter's --outtype (f32 writes model.gguf,
f16 / bf16 write model-f16.gguf / model-bf16.gguf) or empty. `without` lists what the engine lacks
(properties/conformance/without.py: request fields, reasoning and tool-call parsers). `model` is the model name requests carry, when /v1/models does not list the
served one first. The -fp16 / -bf16 entries serve the same checkpoints in half precision (issue 22
item 6): their verdicts must equal the float32 ones. `context` starts the engine with a context of
{context} tokens (`conform --launch-context`). `tight` (issue 24, `conform --launch-tight`) starts it
with its concurrency limited to TIGHT_SLOTS sequences (the `slots` of the cases that ask for it) and a
KV budget too small for that many long scripts (480 tokens each), so that the load must preempt:
vLLM's KV blocks (`--num-gpu-blocks-override`, with `--block-size 32`: its CPU default is 128), decodespec's
`--cache-budget-tokens`; llama.cpp has no preemption (a slot owns its share of `--ctx-size`), so its
tight server only limits the slots and turns /metrics on; llama-cpp-python serves one request at a time.
"""

from __future__ import annotations

import sys

TIGHT_SLOTS = 4
# 1,024 tokens of KV for TIGHT_SLOTS sequences of up to 482: two long scripts fit, four do not.
TIGHT_KV_TOKENS = 1024
_VLLM_TIGHT = f"--max-num-seqs {TIGHT_SLOTS} --block-size 32 --num-gpu-blocks-override {TIGHT_KV_TOKENS // 32}"
# Behind a router each of the two workers has half: the pair has TIGHT_SLOTS places; a worker's KV holds one
# long script (vLLM keeps one block back: 17 blocks serve its 512-token context, 16 do not).
_PAIR_TIGHT = f"--max-num-seqs {TIGHT_SLOTS // 2} --block-size 32 --num-gpu-blocks-override {TIGHT_KV_TOKENS // 64 + 1}"

ENGINES: dict[str, dict[str, str]] = {
    # started without its parsers: the chat reasoning and tool cases are decodespec-serve-chat's
    "decodespec-serve": {
        "install": "",
        "gguf": "",
        "without": "reasoning tool_calls",
        "model": "",
        "jobs": "4",
        "launch": ".venv/bin/decodespec serve --port {port} --model {model}",
        "context": ".venv/bin/decodespec serve --port {port} --model {model} --context-limit {context}",
        "tight": f".venv/bin/decodespec serve --port {{port}} --model {{model}} --max-batch {TIGHT_SLOTS} "
                 f"--cache-budget-tokens {TIGHT_KV_TOKENS}",
    },
    "vllm": {
        "install": "scripts/peers/vllm.sh install",
        "gguf": "",
        "without": "",
        "model": "",
        "jobs": "4",
        "launch": "scripts/peers/vllm.sh serve {model} {port}",
        "context": "scripts/peers/vllm.sh serve {model} {port} --max-model-len {context}",
        "tight": f"scripts/peers/vllm.sh serve {{model}} {{port}} {_VLLM_TIGHT}",
    },
    "vllm-fp16": {
        "install": "scripts/peers/vllm.sh install",
        "gguf": "",
        "without": "",
        "model": "",
        "jobs": "4",
        "launch": "scripts/peers/vllm.sh serve {model} {port} --dtype float16",
        "context": "scripts/peers/vllm.sh serve {model} {port} --dtype float16 --max-model-len {context}",
        "tight": f"scripts/peers/vllm.sh serve {{model}} {{port}} --dtype float16 {_VLLM_TIGHT}",
    },
    "vllm-bf16": {
        "install": "scripts/peers/vllm.sh install",
        "gguf": "",
        "without": "",
        "model": "",
        "jobs": "4",
        "launch": "scripts/peers/vllm.sh serve {model} {port} --dtype bfloat16",
        "context": "scripts/peers/vllm.sh serve {model} {port} --dtype bfloat16 --max-model-len {context}",
        "tight": f"scripts/peers/vllm.sh serve {{model}} {{port}} --dtype bfloat16 {_VLLM_TIGHT}",
    },
    "llama-server": {
        "install": "scripts/peers/llama_cpp.sh install",
        "gguf": "f32",
        "without": "stop_token_ids",
        "model": "",
        "jobs": "4",
        "launch": "scripts/peers/llama_cpp.sh serve {gguf} {port}",
        "context": "SERVE_ARGS='--ctx-size {context} --parallel 1' scripts/peers/llama_cpp.sh serve {gguf} {port}",
        "tight": f"SERVE_ARGS='--parallel {TIGHT_SLOTS} --ctx-size 2048 --metrics' scripts/peers/llama_cpp.sh serve {{gguf}} {{port}}",
    },
    "llama-server-f16": {
        "install": "scripts/peers/llama_cpp.sh install",
        "gguf": "f16",
        "without": "stop_token_ids",
        "model": "",
        "jobs": "4",
        "launch": "scripts/peers/llama_cpp.sh serve {model}/model-f16.gguf {port}",
        "context": "SERVE_ARGS='--ctx-size {context} --parallel 1' scripts/peers/llama_cpp.sh serve {model}/model-f16.gguf {port}",
        "tight": f"SERVE_ARGS='--parallel {TIGHT_SLOTS} --ctx-size 2048 --metrics' scripts/peers/llama_cpp.sh serve {{model}}/model-f16.gguf {{port}}",
    },
    "llama-server-bf16": {
        "install": "scripts/peers/llama_cpp.sh install",
        "gguf": "bf16",
        "without": "stop_token_ids",
        "model": "",
        "jobs": "4",
        "launch": "scripts/peers/llama_cpp.sh serve {model}/model-bf16.gguf {port}",
        "context": "SERVE_ARGS='--ctx-size {context} --parallel 1' scripts/peers/llama_cpp.sh serve {model}/model-bf16.gguf {port}",
        "tight": f"SERVE_ARGS='--parallel {TIGHT_SLOTS} --ctx-size 2048 --metrics' scripts/peers/llama_cpp.sh serve {{model}}/model-bf16.gguf {{port}}",
    },
    "llama-cpp-python": {
        "install": "scripts/peers/llama_cpp.sh install",
        "gguf": "f32",
        "without": "stop_token_ids",
        "model": "",
        "jobs": "1",
        "launch": "scripts/peers/llama_cpp.sh serve-python {gguf} {port}",
        "context": "SERVE_ARGS='--n_ctx {context}' scripts/peers/llama_cpp.sh serve-python {gguf} {port}",
        "tight": "scripts/peers/llama_cpp.sh serve-python {gguf} {port}",
    },
    # issue 24 item 7: two vLLM workers (float32) behind a router, started and stopped as one server
    "vllm-router": {
        "install": "scripts/peers/routers.sh install",
        "gguf": "",
        "without": "",
        "model": "",
        "jobs": "4",
        "launch": "scripts/peers/routers.sh serve vllm-router {model} {port}",
        "context": "scripts/peers/routers.sh serve vllm-router {model} {port} --max-model-len {context}",
        "tight": f"scripts/peers/routers.sh serve vllm-router {{model}} {{port}} {_PAIR_TIGHT}",
    },
    "smg": {
        "install": "scripts/peers/routers.sh install",
        "gguf": "",
        "without": "",
        "model": "",
        "jobs": "4",
        "launch": "scripts/peers/routers.sh serve smg {model} {port}",
        "context": "scripts/peers/routers.sh serve smg {model} {port} --max-model-len {context}",
        "tight": f"scripts/peers/routers.sh serve smg {{model}} {{port}} {_PAIR_TIGHT}",
    },
    # The chat cases (issue 25: `--select chat`) with each engine's reasoning and tool-call parsers on.
    "decodespec-serve-chat": {
        "install": "",
        "gguf": "",
        "without": "",
        "model": "",
        "jobs": "4",
        "launch": ".venv/bin/decodespec serve --port {port} --model {model} --reasoning-parser think --tool-call-parser hermes",
        "context": "",
    },
    "vllm-chat": {
        "install": "scripts/peers/vllm.sh install",
        "gguf": "",
        "without": "",
        "model": "",
        "jobs": "4",
        "launch": "scripts/peers/vllm.sh serve {model} {port} --reasoning-parser qwen3 --enable-auto-tool-choice "
                  "--tool-call-parser hermes",
        "context": "",
    },
    "llama-server-chat": {
        "install": "scripts/peers/llama_cpp.sh install",
        "gguf": "f32",
        "without": "stop_token_ids",
        "model": "",
        "jobs": "4",
        "launch": "SERVE_ARGS='--jinja --reasoning-format deepseek' scripts/peers/llama_cpp.sh serve {gguf} {port}",
        "context": "",
    },
    # no --chat_format: with none, the server renders the GGUF's own chat template (transformers'
    # prompt); its `chatml` format adds an empty system turn (33 prompt tokens for 23). It has no
    # reasoning or tool-call parser: those cases are n/a there (properties/conformance/without.py).
    "llama-cpp-python-chat": {
        "install": "scripts/peers/llama_cpp.sh install",
        "gguf": "f32",
        "without": "stop_token_ids reasoning tool_calls",
        "model": "",
        "jobs": "1",
        "launch": "scripts/peers/llama_cpp.sh serve-python {gguf} {port}",
        "context": "SERVE_ARGS='--n_ctx {context}' scripts/peers/llama_cpp.sh serve-python {gguf} {port}",
    },
    "transformers-serve": {
        "install": ".venv/bin/pip install -q -e .[peers]",
        "gguf": "",
        "without": "stop_token_ids",
        "model": "{model}",
        "jobs": "4",
        "launch": "HF_HUB_OFFLINE=1 .venv/bin/transformers serve --host 127.0.0.1 --port {port}",
        "context": "",
        "tight": "",
    },
}

if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ENGINES or sys.argv[2] not in ENGINES[sys.argv[1]]:
        sys.exit(f"usage: engines.py {{{'|'.join(ENGINES)}}} {{{'|'.join(ENGINES['vllm'])}}}")
    print(ENGINES[sys.argv[1]][sys.argv[2]])
