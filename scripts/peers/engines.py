"""The local peer engines as data: how each installs, starts and what it lacks (issue 13 item 5).

    python scripts/peers/engines.py NAME FIELD      # print one field (scripts/peers/conform.sh reads them)

`launch` is a `decodespec conform --launch` command: {model} is a checkpoint folder, {gguf} its
model.gguf (llama.cpp's converter wrote it), {port} a free port on 127.0.0.1. `install` runs before
(idempotent, cached under .cache/peers/). `gguf` is the converter's --outtype (f32 writes model.gguf,
f16 / bf16 write model-f16.gguf / model-bf16.gguf) or empty. `without` lists request fields the
engine does not offer. `model` is the model name requests carry, when /v1/models does not list the
served one first. The -fp16 / -bf16 entries serve the same checkpoints in half precision (issue 22
item 6): their verdicts must equal the float32 ones.
"""

from __future__ import annotations

import sys

ENGINES: dict[str, dict[str, str]] = {
    "decodespec-serve": {
        "install": "",
        "gguf": "",
        "without": "",
        "model": "",
        "jobs": "4",
        "launch": ".venv/bin/decodespec serve --port {port} --model {model}",
        "context": ".venv/bin/decodespec serve --port {port} --model {model} --context-limit {context}",
    },
    "vllm": {
        "install": "scripts/peers/vllm.sh install",
        "gguf": "",
        "without": "",
        "model": "",
        "jobs": "4",
        "launch": "scripts/peers/vllm.sh serve {model} {port}",
        "context": "scripts/peers/vllm.sh serve {model} {port} --max-model-len {context}",
    },
    "vllm-fp16": {
        "install": "scripts/peers/vllm.sh install",
        "gguf": "",
        "without": "",
        "model": "",
        "jobs": "4",
        "launch": "scripts/peers/vllm.sh serve {model} {port} --dtype float16",
        "context": "scripts/peers/vllm.sh serve {model} {port} --dtype float16 --max-model-len {context}",
    },
    "vllm-bf16": {
        "install": "scripts/peers/vllm.sh install",
        "gguf": "",
        "without": "",
        "model": "",
        "jobs": "4",
        "launch": "scripts/peers/vllm.sh serve {model} {port} --dtype bfloat16",
        "context": "scripts/peers/vllm.sh serve {model} {port} --dtype bfloat16 --max-model-len {context}",
    },
    "llama-server": {
        "install": "scripts/peers/llama_cpp.sh install",
        "gguf": "f32",
        "without": "stop_token_ids",
        "model": "",
        "jobs": "4",
        "launch": "scripts/peers/llama_cpp.sh serve {gguf} {port}",
        "context": "SERVE_ARGS='--ctx-size {context} --parallel 1' scripts/peers/llama_cpp.sh serve {gguf} {port}",
    },
    "llama-server-f16": {
        "install": "scripts/peers/llama_cpp.sh install",
        "gguf": "f16",
        "without": "stop_token_ids",
        "model": "",
        "jobs": "4",
        "launch": "scripts/peers/llama_cpp.sh serve {model}/model-f16.gguf {port}",
        "context": "SERVE_ARGS='--ctx-size {context} --parallel 1' scripts/peers/llama_cpp.sh serve {model}/model-f16.gguf {port}",
    },
    "llama-server-bf16": {
        "install": "scripts/peers/llama_cpp.sh install",
        "gguf": "bf16",
        "without": "stop_token_ids",
        "model": "",
        "jobs": "4",
        "launch": "scripts/peers/llama_cpp.sh serve {model}/model-bf16.gguf {port}",
        "context": "SERVE_ARGS='--ctx-size {context} --parallel 1' scripts/peers/llama_cpp.sh serve {model}/model-bf16.gguf {port}",
    },
    "llama-cpp-python": {
        "install": "scripts/peers/llama_cpp.sh install",
        "gguf": "f32",
        "without": "stop_token_ids",
        "model": "",
        "jobs": "1",
        "launch": "scripts/peers/llama_cpp.sh serve-python {gguf} {port}",
        "context": "SERVE_ARGS='--n_ctx {context}' scripts/peers/llama_cpp.sh serve-python {gguf} {port}",
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
    "llama-cpp-python-chat": {
        "install": "scripts/peers/llama_cpp.sh install",
        "gguf": "f32",
        "without": "stop_token_ids",
        "model": "",
        "jobs": "1",
        "launch": "SERVE_ARGS='--chat_format chatml' scripts/peers/llama_cpp.sh serve-python {gguf} {port}",
        "context": "",
    },
    "transformers-serve": {
        "install": ".venv/bin/pip install -q -e .[peers]",
        "gguf": "",
        "without": "stop_token_ids",
        "model": "{model}",
        "jobs": "4",
        "launch": "HF_HUB_OFFLINE=1 .venv/bin/transformers serve --host 127.0.0.1 --port {port}",
        "context": "",
    },
}

if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ENGINES or sys.argv[2] not in ENGINES[sys.argv[1]]:
        sys.exit(f"usage: engines.py {{{'|'.join(ENGINES)}}} {{{'|'.join(ENGINES['vllm'])}}}")
    print(ENGINES[sys.argv[1]][sys.argv[2]])
