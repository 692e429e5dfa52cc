#!/usr/bin/env bash
# metrale against llama.cpp on GGUF files: each shape's random-weight
# checkpoint converted by llama.cpp's converter (bf16), then quantized by
# llama.cpp's own quantizer (quantize.py: llama_model_quantize) to each of
# --quant's types; both engines run the same .gguf file, one after the
# other, round after round (the order alternates between rounds), so that
# each round's ratio compares them under the same load. Run by hand.
#
#   benches/compare/compare_quant.sh [--threads T] [--prompt-len N] [--gen-len M]
#        [--shapes "granite-4.0-h-350m llama-370m"] [--quant "bf16 Q8_0 Q4_K_M"]
#        [--repeat R] [--metrale PATH] [--venv DIR] [--cpu-kernel amx|dot|fma]
#        [--out FILE]
#
# --venv: the llama-cpp-python to run (default benches/compare/.venv, the
# native build with AMX where the CPU has it; compare.sh --no-amx builds
# .venv-noamx, the same without AMX). --cpu-kernel sets METRALE_CPU_KERNEL
# for metrale's runs (dot on an AMX host runs what a Zen 4 host runs).
# "bf16" is the converter's bf16 file itself (metrale's default --dtype auto:
# bf16 dot products). Needs compare.sh's setup (benches/compare/.venv with
# llama-cpp-python, and llama.cpp's sources under work/); metrale is built
# with the workspace's default (dev, optimized) profile unless --metrale is
# given. Results: work/quant-results.jsonl; table: report.py.
set -euo pipefail

HERE="$(cd "$(dirname "$0")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
THREADS=2 PROMPT=512 GEN=64 REPEAT=3 METRALE="" KERNEL="" OUT=""
VENV="$HERE/.venv"
SHAPES="granite-4.0-h-350m llama-370m"
QUANT="bf16 Q8_0 Q4_K_M"
while [ $# -gt 0 ]; do
  case "$1" in
    --threads) THREADS="$2"; shift 2 ;;
    --prompt-len) PROMPT="$2"; shift 2 ;;
    --gen-len) GEN="$2"; shift 2 ;;
    --shapes) SHAPES="$2"; shift 2 ;;
    --quant) QUANT="$2"; shift 2 ;;
    --repeat) REPEAT="$2"; shift 2 ;;
    --metrale) METRALE="$2"; shift 2 ;;
    --venv) VENV="$2"; shift 2 ;;
    --cpu-kernel) KERNEL="$2"; shift 2 ;;
    --out) OUT="$2"; shift 2 ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done

WORK="$HERE/work"
PY="$VENV/bin/python"
mkdir -p "$WORK/models"
"$PY" -c "import llama_cpp" 2>/dev/null || { echo "no llama-cpp-python in $VENV: run compare.sh once first" >&2; exit 1; }
LLAMA_SRC="$(ls -d "$WORK"/llama_cpp_python-*/vendor/llama.cpp 2>/dev/null | head -n 1 || true)"
[ -n "$LLAMA_SRC" ] || { echo "no llama.cpp sources under $WORK: run compare.sh once first" >&2; exit 1; }

if [ -z "$METRALE" ]; then
  (cd "$ROOT" && cargo build -p metrale)
  METRALE="${CARGO_TARGET_DIR:-$ROOT/target}/debug/metrale"
fi

# 1. The files: HF checkpoint -> bf16 GGUF (llama.cpp's converter) -> each type.
for shape in $SHAPES; do
  dir="$WORK/models/$shape-bf16"
  [ -f "$dir/model.safetensors" ] ||
    "$METRALE" export-random --config "$ROOT/benches/configs/$shape.json" --out "$dir" --weight-dtype bf16
  [ -f "$dir.gguf" ] || "$PY" "$HERE/convert.py" "$LLAMA_SRC" "$dir" "$dir.gguf" bf16 > "$WORK/convert-$shape.log" 2>&1 ||
    { echo "converting $shape failed; see $WORK/convert-$shape.log" >&2; exit 1; }
  for q in $QUANT; do
    [ "$q" = bf16 ] && continue
    out="$WORK/models/$shape-$q.gguf"
    [ -f "$out" ] || "$PY" "$HERE/quantize.py" "$dir.gguf" "$out" "$q" --threads "$THREADS" > "$WORK/quantize-$shape-$q.log" 2>&1 ||
      { echo "quantizing $shape to $q failed; see $WORK/quantize-$shape-$q.log" >&2; exit 1; }
  done
done

# 2. Rounds: every (shape, type) once per round, both engines back to back.
OUT="${OUT:-$WORK/quant-results.jsonl}"
: > "$OUT"
if [ -n "$KERNEL" ]; then export METRALE_CPU_KERNEL="$KERNEL"; else unset METRALE_CPU_KERNEL; fi
echo "load before the runs: $(cut -d' ' -f1-3 /proc/loadavg)" >&2
for round in $(seq 1 "$REPEAT"); do
  for shape in $SHAPES; do
    for q in $QUANT; do
      gguf="$WORK/models/$shape-$q.gguf"
      echo "== round $round of $REPEAT: $shape $q" >&2
      run_m() { "$METRALE" bench --model "$gguf" --threads "$THREADS" --prompt-len "$PROMPT" --gen-len "$GEN" --json 2> "$WORK/metrale-$shape-$q.log"; }
      run_l() { "$PY" "$HERE/llama_bench.py" "$gguf" --threads "$THREADS" --prompt-len "$PROMPT" --gen-len "$GEN" 2> "$WORK/llama-$shape-$q.log"; }
      if [ $((round % 2)) -eq 1 ]; then
        m="$(run_m)" || { echo "metrale failed on $shape $q; see $WORK/metrale-$shape-$q.log" >&2; continue; }
        l="$(run_l)" || { echo "llama.cpp failed on $shape $q; see $WORK/llama-$shape-$q.log" >&2; continue; }
      else
        l="$(run_l)" || { echo "llama.cpp failed on $shape $q; see $WORK/llama-$shape-$q.log" >&2; continue; }
        m="$(run_m)" || { echo "metrale failed on $shape $q; see $WORK/metrale-$shape-$q.log" >&2; continue; }
      fi
      printf '{"shape": "%s", "format": "%s", "round": %s, "metrale": %s, "llama": %s}\n' "$shape" "$q" "$round" "$m" "$l" >> "$OUT"
    done
  done
done
echo "load after the runs: $(cut -d' ' -f1-3 /proc/loadavg)" >&2
"$PY" "$HERE/report.py" "$OUT"
