#!/usr/bin/env bash
# Batched decode: metrale against llama.cpp at the same batch sizes, on the
# same bf16 GGUF file of each shape (random weights, llama.cpp's converter;
# made as compare_quant.sh makes them when missing). Each round runs both
# engines back to back, the order alternating between rounds, so that a
# round's ratio compares them under the same load: metrale's
# `bench --batch 1,4,16` (the model loaded once) and llama_batch_bench.py
# (llama.cpp's llama_batch API, one llama_decode per step for all B
# sequences). Run by hand.
#
#   benches/compare/compare_batch.sh [--threads T] [--prompt-len N] [--gen-len M]
#        [--batch 1,4,16,64] [--shapes "granite-4.0-h-350m llama-370m"]
#        [--quant "bf16 Q8_0 Q4_K_M"] [--repeat R] [--metrale PATH] [--venv DIR]
#        [--models DIR] [--cpu-kernel amx|dot|fma] [--out FILE]
#
# --venv and --models default to benches/compare/.venv and work/models
# (another checkout's, by absolute path, from a worktree without them).
# --quant names the files: bf16 (the converter's), or a type compare_quant.sh
# made (work/models/SHAPE-TYPE.gguf). --cpu-kernel sets METRALE_CPU_KERNEL
# for metrale's runs.
# Results: work/batch-results.jsonl; table: report_batch.py.
set -euo pipefail

HERE="$(cd "$(dirname "$0")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
THREADS=2 PROMPT=64 GEN=32 BATCH=1,4,16,64 REPEAT=3 METRALE="" QUANT=bf16 KERNEL="" OUT=""
SHAPES="granite-4.0-h-350m llama-370m"
VENV="$HERE/.venv" WORK="$HERE/work" MODELS=""
while [ $# -gt 0 ]; do
  case "$1" in
    --threads) THREADS="$2"; shift 2 ;;
    --prompt-len) PROMPT="$2"; shift 2 ;;
    --gen-len) GEN="$2"; shift 2 ;;
    --batch) BATCH="$2"; shift 2 ;;
    --shapes) SHAPES="$2"; shift 2 ;;
    --repeat) REPEAT="$2"; shift 2 ;;
    --metrale) METRALE="$2"; shift 2 ;;
    --venv) VENV="$2"; shift 2 ;;
    --models) MODELS="$2"; shift 2 ;;
    --quant) QUANT="$2"; shift 2 ;;
    --cpu-kernel) KERNEL="$2"; shift 2 ;;
    --out) OUT="$2"; shift 2 ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done
MODELS="${MODELS:-$WORK/models}"
PY="$VENV/bin/python"
mkdir -p "$WORK" "$MODELS"
"$PY" -c "import llama_cpp" 2>/dev/null || { echo "no llama-cpp-python in $VENV: run compare.sh once first" >&2; exit 1; }

if [ -z "$METRALE" ]; then
  (cd "$ROOT" && cargo build -p metrale)
  METRALE="${CARGO_TARGET_DIR:-$ROOT/target}/debug/metrale"
fi

# 1. The files, as compare_quant.sh makes them (needs llama.cpp's sources).
for shape in $SHAPES; do
  gguf="$MODELS/$shape-bf16.gguf"
  [ -f "$gguf" ] && continue
  LLAMA_SRC="$(ls -d "$WORK"/llama_cpp_python-*/vendor/llama.cpp 2>/dev/null | head -n 1 || true)"
  [ -n "$LLAMA_SRC" ] || { echo "no $gguf and no llama.cpp sources under $WORK: run compare.sh once first" >&2; exit 1; }
  dir="$MODELS/$shape-bf16"
  [ -f "$dir/model.safetensors" ] ||
    "$METRALE" export-random --config "$ROOT/benches/configs/$shape.json" --out "$dir" --weight-dtype bf16
  "$PY" "$HERE/convert.py" "$LLAMA_SRC" "$dir" "$gguf" bf16 > "$WORK/convert-$shape.log" 2>&1 ||
    { echo "converting $shape failed; see $WORK/convert-$shape.log" >&2; exit 1; }
done

# 2. Rounds: every shape once per round, both engines back to back.
OUT="${OUT:-$WORK/batch-results.jsonl}"
: > "$OUT"
if [ -n "$KERNEL" ]; then export METRALE_CPU_KERNEL="$KERNEL"; else unset METRALE_CPU_KERNEL; fi
echo "load before the runs: $(cut -d' ' -f1-3 /proc/loadavg)" >&2
for round in $(seq 1 "$REPEAT"); do
  for shape in $SHAPES; do
  for q in $QUANT; do
    gguf="$MODELS/$shape-$q.gguf"
    [ -f "$gguf" ] || { echo "no $gguf: run compare_quant.sh --quant $q once first" >&2; exit 1; }
    echo "== round $round of $REPEAT: $shape $q, batch $BATCH" >&2
    run_m() { "$METRALE" bench --model "$gguf" --threads "$THREADS" --prompt-len "$PROMPT" --gen-len "$GEN" --batch "$BATCH" --json 2> "$WORK/metrale-batch-$shape-$q.log"; }
    run_l() { "$PY" "$HERE/llama_batch_bench.py" "$gguf" --threads "$THREADS" --prompt-len "$PROMPT" --gen-len "$GEN" --batch "$BATCH" 2> "$WORK/llama-batch-$shape-$q.log"; }
    if [ $((round % 2)) -eq 1 ]; then
      m="$(run_m)" || { echo "metrale failed on $shape $q; see $WORK/metrale-batch-$shape-$q.log" >&2; continue; }
      l="$(run_l)" || { echo "llama.cpp failed on $shape $q; see $WORK/llama-batch-$shape-$q.log" >&2; continue; }
    else
      l="$(run_l)" || { echo "llama.cpp failed on $shape $q; see $WORK/llama-batch-$shape-$q.log" >&2; continue; }
      m="$(run_m)" || { echo "metrale failed on $shape $q; see $WORK/metrale-batch-$shape-$q.log" >&2; continue; }
    fi
    # A single batch size gives one object, not an array: wrap it.
    case "$m" in \[*) ;; *) m="[$m]" ;; esac
    printf '{"shape": "%s", "format": "%s", "round": %s, "metrale": %s, "llama": %s}\n' "$shape" "$q" "$round" "$m" "$l" >> "$OUT"
  done
  done
done
echo "load after the runs: $(cut -d' ' -f1-3 /proc/loadavg)" >&2
"$PY" "$HERE/report_batch.py" "$OUT"
