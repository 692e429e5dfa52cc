#!/usr/bin/env bash
# Side-by-side benchmark of metrale and llama.cpp on the random-weight models
# of benches/configs/, at the same precision, thread count, prompt and
# generation lengths. Run by hand (not in CI): the first run builds
# llama-cpp-python from source, which takes many minutes on 2 cores.
#
#   benches/compare/compare.sh [--threads T] [--prompt-len N] [--gen-len M]
#                              [--dtype bf16|f32] [--shapes "a b c"] [--repeat R]
#                              [--no-amx]
#
# llama.cpp is built the way a user of this host gets its best: natively
# (GGML_NATIVE), with AMX where the CPU and kernel run it (ggml's AMX
# matmuls cover its quantized types). --no-amx builds and runs a second
# copy without AMX (benches/compare/.venv-noamx), the baseline for metrale
# with METRALE_CPU_KERNEL=dot (what an AVX-512 host without AMX runs).
# Every result records llama.cpp's system_info line.
#
# With --repeat R each shape runs R rounds (metrale, metrale with bf16 dot
# products, llama.cpp, in turn) and the report gives medians: on a shared
# machine single figures move by 10-40% between runs.
#
# Everything it downloads or builds stays in benches/compare/.venv and
# benches/compare/work (both ignored by git).
set -euo pipefail

HERE="$(cd "$(dirname "$0")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
THREADS=2 PROMPT=512 GEN=64 DTYPE=bf16 REPEAT=1 NO_AMX=""
SHAPES="granite-4.0-h-350m mamba2-370m nemotron-h-400m qwen3-next-400m llama-370m"
while [ $# -gt 0 ]; do
  case "$1" in
    --threads) THREADS="$2"; shift 2 ;;
    --prompt-len) PROMPT="$2"; shift 2 ;;
    --gen-len) GEN="$2"; shift 2 ;;
    --dtype) DTYPE="$2"; shift 2 ;;
    --shapes) SHAPES="$2"; shift 2 ;;
    --repeat) REPEAT="$2"; shift 2 ;;
    --no-amx) NO_AMX=1; shift ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done

VENV="$HERE/.venv${NO_AMX:+-noamx}" WORK="$HERE/work"
mkdir -p "$WORK/models"
PY="$VENV/bin/python"

# 1. Python side: llama.cpp's sources (the llama-cpp-python source
#    distribution: its vendor/llama.cpp has the converter too), then
#    llama-cpp-python built from them for this machine's vector
#    instructions (AMX included where the CPU has it, unless --no-amx),
#    and what the converter needs.
VERSION=0.3.36
if [ ! -x "$PY" ]; then python3 -m venv "$VENV"; fi
LLAMA_SRC="$WORK/llama_cpp_python-$VERSION/vendor/llama.cpp"
if [ ! -d "$LLAMA_SRC" ]; then
  "$VENV/bin/pip" download --no-deps --no-binary llama-cpp-python "llama-cpp-python==$VERSION" -d "$WORK/dl"
  tar xzf "$WORK/dl/llama_cpp_python-$VERSION.tar.gz" -C "$WORK"
fi
# ggml's AMX matmuls crash (SIGSEGV at ldtilecfg) when built by GCC 12:
# its _tile_loadconfig declares that the asm reads 8 bytes of the tile
# config, so the stores of the tiles' shapes are dropped as dead and the
# config loaded is invalid (ggml-org/llama.cpp#20824, fix proposed in
# ggml-org/llama.cpp#26954). One line makes the whole config an input of an asm first.
MMQ="$LLAMA_SRC/ggml/src/ggml-cpu/amx/mmq.cpp"
if ! grep -qF '__asm__ volatile("" : : "m"(tc))' "$MMQ"; then
  sed -i 's|^    _tile_loadconfig(&tc);|    __asm__ volatile("" : : "m"(tc));\n    _tile_loadconfig(\&tc);|' "$MMQ"
fi
if ! "$PY" -c "import llama_cpp" 2>/dev/null; then
  FLAGS=""
  [ -n "$NO_AMX" ] && FLAGS="-DCMAKE_C_FLAGS='-mno-amx-tile -mno-amx-int8 -mno-amx-bf16' -DCMAKE_CXX_FLAGS='-mno-amx-tile -mno-amx-int8 -mno-amx-bf16'"
  CMAKE_ARGS="-DGGML_NATIVE=ON -DGGML_BLAS=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF $FLAGS" \
    "$VENV/bin/pip" install --no-cache-dir "$WORK/llama_cpp_python-$VERSION"
fi
echo "llama.cpp: $("$PY" -c 'from llama_cpp import llama_cpp as L; print(L.llama_print_system_info().decode())')" >&2
"$PY" -c "import gguf, torch, numpy, safetensors, sentencepiece" 2>/dev/null ||
  "$VENV/bin/pip" install gguf torch numpy safetensors sentencepiece transformers

# 2. metrale.
(cd "$ROOT" && cargo build --release -p metrale)
METRALE="${CARGO_TARGET_DIR:-$ROOT/target}/release/metrale"

# 3. Each shape: one random checkpoint, converted, run by both engines.
OUT="$WORK/results.jsonl"
: > "$OUT"
echo "load before the runs: $(cut -d' ' -f1-3 /proc/loadavg)" >&2
for shape in $SHAPES; do
  cfg="$ROOT/benches/configs/$shape.json"
  dir="$WORK/models/$shape-$DTYPE"
  gguf="$dir.gguf"
  [ -f "$dir/model.safetensors" ] || "$METRALE" export-random --config "$cfg" --out "$dir" --weight-dtype "$DTYPE"
  [ -f "$gguf" ] || "$PY" "$HERE/convert.py" "$LLAMA_SRC" "$dir" "$gguf" "$DTYPE" > "$WORK/convert-$shape.log" 2>&1 ||
    { echo "converting $shape failed; see $WORK/convert-$shape.log" >&2; continue; }
  for round in $(seq 1 "$REPEAT"); do
  echo "== $shape (round $round of $REPEAT)" >&2
  m="$("$METRALE" bench --model "$dir" --weight-dtype "$DTYPE" --threads "$THREADS" --prompt-len "$PROMPT" --gen-len "$GEN" --json)" ||
    { echo "metrale failed on $shape" >&2; continue; }
  # The same with bf16 dot products in prefill (llama.cpp's arithmetic for
  # bf16 weights); its prefill figure is reported beside the f32 one.
  mb="$("$METRALE" bench --model "$dir" --weight-dtype "$DTYPE" --threads "$THREADS" --prompt-len "$PROMPT" --gen-len 1 --no-probe --dtype bf16 --json)" || mb=null
  l="$("$PY" "$HERE/llama_bench.py" "$gguf" --threads "$THREADS" --prompt-len "$PROMPT" --gen-len "$GEN" 2> "$WORK/llama-$shape.log")" ||
    { echo "llama.cpp failed on $shape; see $WORK/llama-$shape.log" >&2; continue; }
  printf '{"shape": "%s", "round": %s, "metrale": %s, "metrale_bf16_dot": %s, "llama": %s}\n' "$shape" "$round" "$m" "$mb" "$l" >> "$OUT"
  done
done
echo "load after the runs: $(cut -d' ' -f1-3 /proc/loadavg)" >&2
"$PY" "$HERE/report.py" "$OUT"
