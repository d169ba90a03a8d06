"""The local peer engines: the shipped presets (properties/conformance/presets.toml) with this
checkout's cached installs under .cache/peers/, and the peers that are no shipped preset
(scripts/peers/presets.toml).

    python scripts/peers/engines.py NAME FIELD      # print one field (scripts/peers/conform.sh reads them)

A preset's own fields (launch, context, tight, gguf, without, jobs, model, cases) are the shipped
ones: a local run differs only in where the engine's program comes from. LOCAL says, per engine,
`install` (the idempotent command that installs it under .cache/peers/), `path` (the folder put first
on PATH, so that the preset's `vllm`, `llama-server` or `python` is the cached one) and `env` (what
the run adds: the CPU threads of this 2-core machine, llama-cpp-python's libraries). The llama.cpp
engines run on THREADS CPU threads: 2, or the environment's DECODESPEC_PEER_THREADS (on a machine
shared with other work, 1 thread can be much faster than 2 under load). `launch` here is
the preset's launch with those put in front, as benchmarks/bench_peers.py runs it; `llama_cpp` is the
llama.cpp checkout whose converter writes the GGUF files.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from decodespec.properties.conformance.presets import load_presets

ROOT = Path(__file__).resolve().parent.parent.parent

PEERS = (ROOT / ".cache" / "peers").resolve()  # physical, as scripts/peers/*.sh name it
LOCAL_PRESETS = ROOT / "scripts" / "peers" / "presets.toml"


def _threads() -> int:
    """The llama.cpp engines' CPU threads: DECODESPEC_PEER_THREADS, else 2; anything but a positive integer is refused."""
    raw = os.environ.get("DECODESPEC_PEER_THREADS", "2")
    if not raw.isdigit() or int(raw) < 1:
        sys.exit(f"DECODESPEC_PEER_THREADS must be a positive integer of CPU threads, not {raw!r}")
    return int(raw)


THREADS = _threads()
_VLLM = {"install": "scripts/peers/vllm.sh install", "path": f"{PEERS}/vllm/venv/bin", "env": ""}
_LLAMA_SERVER = {"install": "scripts/peers/llama_cpp.sh install", "path": f"{PEERS}/llama.cpp/build/bin",
                 "env": f"LLAMA_ARG_THREADS={THREADS}"}
_LLAMA_PYTHON = {"install": "scripts/peers/llama_cpp.sh install", "path": f"{PEERS}/llama.cpp/venv/bin",
                 "env": f"N_THREADS={THREADS} LLAMA_CPP_LIB_PATH={PEERS}/llama.cpp/build/bin "
                        f"MTMD_CPP_LIB={PEERS}/llama.cpp/build/bin"}
_DECODESPEC = {"install": "", "path": f"{ROOT}/.venv/bin", "env": ""}
_ROUTER = {"install": "scripts/peers/routers.sh install", "path": "", "env": ""}
_LITELLM_VLLM = {"install": "scripts/peers/litellm.sh install && scripts/peers/vllm.sh install", "path": "", "env": ""}
_LITELLM_LLAMA = {**_LLAMA_SERVER, "install": "scripts/peers/litellm.sh install && scripts/peers/llama_cpp.sh install"}
LOCAL: dict[str, dict[str, str]] = {
    "decodespec-serve": _DECODESPEC, "decodespec-serve-chat": _DECODESPEC,
    "vllm": _VLLM, "vllm-fp16": _VLLM, "vllm-bf16": _VLLM, "vllm-chat": _VLLM, "vllm-align": _VLLM,
    "llama-server": _LLAMA_SERVER, "llama-server-f16": _LLAMA_SERVER, "llama-server-bf16": _LLAMA_SERVER,
    "llama-server-chat": _LLAMA_SERVER, "llama-server-align": _LLAMA_SERVER, "llama-cpp-python": _LLAMA_PYTHON, "llama-cpp-python-chat": _LLAMA_PYTHON,
    "transformers-serve": {"install": ".venv/bin/pip install -q -e .[peers]", "path": f"{ROOT}/.venv/bin", "env": ""},
    "vllm-router": _ROUTER, "smg": _ROUTER, "litellm-vllm": _LITELLM_VLLM, "litellm-vllm-pair": _LITELLM_VLLM,
    "litellm-llama-server": _LITELLM_LLAMA,
}


def _llama_cpp() -> str:
    """The llama.cpp source tree scripts/peers/llama_cpp.sh unpacked (llama-cpp-python's vendor/llama.cpp)."""
    found = sorted(PEERS.glob("llama.cpp/llama_cpp_python-*/vendor/llama.cpp"))
    return str(found[-1]) if found else ""


def engines() -> dict[str, dict[str, str]]:
    """Every local peer's fields, as strings (lists space-separated, ints as digits)."""
    presets = load_presets([LOCAL_PRESETS])
    out = {}
    for name, local in LOCAL.items():
        p = presets[name]
        front = " ".join(w for w in (local["env"], f"PATH={local['path']}:$PATH" if local["path"] else "") if w)
        out[name] = {
            **local, "launch": f"{front} {p.launch}".strip(), "context": p.context, "tight": p.tight, "gguf": p.gguf,
            "without": " ".join(p.without), "jobs": str(p.jobs), "model": p.model, "cases": p.cases,
            "llama_cpp": _llama_cpp() if p.gguf else "",
        }
    return out


ENGINES = engines()

if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ENGINES or sys.argv[2] not in ENGINES[sys.argv[1]]:
        sys.exit(f"usage: engines.py {{{'|'.join(ENGINES)}}} {{{'|'.join(ENGINES['vllm'])}}}")
    print(ENGINES[sys.argv[1]][sys.argv[2]])
