#!/usr/bin/env bash
# llama.cpp peers, built locally from the llama-cpp-python sdist (nothing but PyPI packages is fetched;
# no model weights are downloaded):
#   scripts/peers/llama_cpp.sh install                  build llama-server + shared libllama/libggml,
#                                                       venv with the HF->GGUF converter and
#                                                       llama-cpp-python[server] (reusing those libs)
#   scripts/peers/llama_cpp.sh convert HF_DIR OUT_GGUF [OUTTYPE]
#                                                       vendored convert_hf_to_gguf.py through properties/conformance/
#                                                       convert_gguf.py, --outtype OUTTYPE
#                                                       (f32 by default; f16, bf16 for half precision)
#   scripts/peers/llama_cpp.sh serve GGUF PORT          exec llama-server on 127.0.0.1:PORT
#   scripts/peers/llama_cpp.sh serve-python GGUF PORT   exec llama-cpp-python's server on 127.0.0.1:PORT
# Everything lives under .cache/peers/llama.cpp/ (sdist, build/, venv/); `install` is idempotent.
# Env: LLAMA_CPP_PY_VERSION (default 0.3.36), JOBS (default nproc), SERVE_ARGS (extra server flags).
set -euo pipefail
cd "$(dirname "$0")/../.."

ROOT=$PWD
# .cache may be a symlink that several checkouts share: name the cache by its physical path, so CMake
# and the venv record the same paths whichever checkout runs this (other paths would rebuild it all).
mkdir -p .cache/peers
DIR=$(cd .cache/peers && pwd -P)/llama.cpp
VERSION=${LLAMA_CPP_PY_VERSION:-0.3.36}
SRC=$DIR/llama_cpp_python-$VERSION
LLAMA=$SRC/vendor/llama.cpp
BUILD=$DIR/build
VENV=$DIR/venv
PY=$VENV/bin/python
LIBDIR=$BUILD/bin
SERVER=$BUILD/bin/llama-server
JOBS=${JOBS:-$(nproc)}
BASE_PY=${BASE_PY:-python3.11}
command -v "$BASE_PY" >/dev/null || BASE_PY=python3

log() { echo "[llama_cpp.sh] $*" >&2; }

step_sdist() {
  mkdir -p "$DIR"
  [ -f "$LLAMA/convert_hf_to_gguf.py" ] && return 0
  local tgz=$DIR/llama_cpp_python-$VERSION.tar.gz
  if [ ! -f "$tgz" ]; then
    log "downloading llama-cpp-python==$VERSION sdist from PyPI"
    "$BASE_PY" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$DIR" >&2
  fi
  tar -xzf "$tgz" -C "$DIR"
}

step_venv() {
  if [ ! -x "$PY" ]; then
    log "creating $VENV"
    "$BASE_PY" -m venv "$VENV"
    "$PY" -m pip install -q --upgrade pip wheel >&2
  fi
  command -v cmake >/dev/null || [ -x "$VENV/bin/cmake" ] || "$PY" -m pip install -q cmake >&2
  command -v ninja >/dev/null || [ -x "$VENV/bin/ninja" ] || "$PY" -m pip install -q ninja >&2
}

step_build() {
  local t0=$SECONDS
  export PATH=$PATH:$VENV/bin   # cmake / ninja from PyPI if the system has none
  # Same flags every time: a re-run reconfigures nothing and ninja is a no-op.
  cmake -S "$LLAMA" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF \
    -DBUILD_SHARED_LIBS=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
    -DLLAMA_BUILD_UI=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON >"$DIR/configure.log" 2>&1 ||
    { tail -30 "$DIR/configure.log" >&2; return 1; }
  log "building llama-server, libllama, libmtmd (-j$JOBS; ~15 min on 2 cores the first time)"
  cmake --build "$BUILD" -j "$JOBS" --target llama-server llama mtmd ggml >"$DIR/build.log" 2>&1 ||
    { tail -30 "$DIR/build.log" >&2; return 1; }
  log "build up to date ($((SECONDS - t0)) s this run)"
}

step_deps() {
  local stamp=$VENV/.deps-$VERSION
  if [ ! -f "$stamp" ]; then
    log "installing converter deps into $VENV"
    # torch first, from the local CPU wheel: a bare `torch` requirement would pull a CUDA build.
    "$PY" -m pip install -q --find-links /opt/wheels "torch==2.13.0" >&2
    # transformers 5: the HF dirs of this project are written by transformers 5 (tokenizer_class
    # TokenizersBackend), which the converter's pinned 4.57 cannot load.
    "$PY" -m pip install -q numpy safetensors sentencepiece protobuf "transformers>=5" tqdm pyyaml requests >&2
    "$PY" -m pip install -q "$LLAMA/gguf-py" >&2
    touch "$stamp"
  fi
}

step_bindings() {
  local stamp2=$VENV/.llama-cpp-python-$VERSION
  if [ ! -f "$stamp2" ]; then
    log "installing llama-cpp-python[server]==$VERSION without compiling llama.cpp again"
    PATH=$PATH:$VENV/bin CMAKE_ARGS="-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF" \
      "$PY" -m pip install -q "$SRC[server]" >&2
    touch "$stamp2"
  fi
  # llama_cpp loads lib{llama,ggml,mtmd}.so from its package lib/ dir (LLAMA_CPP_LIB_PATH and
  # MTMD_CPP_LIB override two of them, llama_cpp/_ggml.py has no override): link our build there.
  local pkg
  pkg=$("$PY" -c 'import importlib.util, os; print(os.path.dirname(importlib.util.find_spec("llama_cpp").origin))')
  mkdir -p "$pkg/lib"
  local so
  for so in "$LIBDIR"/lib*.so*; do ln -sfn "$so" "$pkg/lib/$(basename "$so")"; done
  LLAMA_CPP_LIB_PATH=$LIBDIR "$PY" -c 'import llama_cpp; print("llama_cpp", llama_cpp.__version__, "system info:", llama_cpp.llama_print_system_info().decode())' >&2
}

cmd_install() {
  local t0=$SECONDS
  step_sdist
  step_venv
  step_deps
  step_build
  step_bindings
  [ -x "$SERVER" ] || { log "no $SERVER"; return 1; }
  log "install done in $((SECONDS - t0)) s: $SERVER, $PY"
}

need_install() {
  [ -x "$SERVER" ] && [ -f "$VENV/.llama-cpp-python-$VERSION" ] ||
    { log "not installed; run: scripts/peers/llama_cpp.sh install"; exit 1; }
}

cmd_convert() {
  [ $# -eq 2 ] || [ $# -eq 3 ] || { echo "usage: $0 convert HF_DIR OUT_GGUF [f32|f16|bf16]" >&2; exit 2; }
  need_install
  mkdir -p "$(dirname "$2")"
  HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 LLAMA_CPP_DIR=$LLAMA \
    "$PY" "$ROOT/properties/conformance/convert_gguf.py" "$1" --outfile "$2" --outtype "${3:-f32}"
}

alias_of() { local b; b=$(basename "$1"); echo "${b%.*}"; }

cmd_serve() {
  [ $# -eq 2 ] || { echo "usage: $0 serve GGUF PORT" >&2; exit 2; }
  need_install
  # --parallel 2 slots share --ctx-size (512 tokens each); --no-warmup skips the empty warm-up run.
  # shellcheck disable=SC2086
  exec "$SERVER" -m "$1" --host 127.0.0.1 --port "$2" --alias "$(alias_of "$1")" \
    --ctx-size 1024 --parallel 2 --no-warmup --threads "${THREADS:-2}" ${SERVE_ARGS:-}
}

cmd_serve_python() {
  [ $# -eq 2 ] || { echo "usage: $0 serve-python GGUF PORT" >&2; exit 2; }
  need_install
  export LLAMA_CPP_LIB_PATH=$LIBDIR MTMD_CPP_LIB=$LIBDIR
  # shellcheck disable=SC2086
  exec "$PY" -m llama_cpp.server --model "$1" --host 127.0.0.1 --port "$2" \
    --model_alias "$(alias_of "$1")" --n_ctx 512 --n_threads "${THREADS:-2}" ${SERVE_ARGS:-}
}

case "${1:-}" in
  install) shift; cmd_install "$@" ;;
  convert) shift; cmd_convert "$@" ;;
  serve) shift; cmd_serve "$@" ;;
  serve-python) shift; cmd_serve_python "$@" ;;
  _step) shift; "step_$1" ;;   # debugging: run one install step
  *) sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2 ;;
esac
