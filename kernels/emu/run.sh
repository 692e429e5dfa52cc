#!/bin/sh
# Runs the kernels on the host against f64 references: every emu/<stem>_test.cpp
# includes a copy of ../<stem>.cu (and of ../common.cuh) with the CUDA-only
# spellings rewritten (emu.h emulates the built-ins: each CUDA thread a
# fiber, shuffles and __syncthreads as barriers). A check of the kernels'
# indexing and semantics without a GPU, not of their speed.
# Needs g++ >= 11 (C++20, _Float16). Exits non-zero when any test fails.
# See ../README.md.
# `run.sh moe delta` runs only those stems' tests.
# EMU_CXXFLAGS adds compiler flags (e.g. "-fsanitize=address -g").
set -eu
here=$(cd "$(dirname "$0")" && pwd)
src=$(dirname "$here")
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# The CUDA-only spellings of a kernel source: dynamic shared memory becomes
# the emulated launch's, the inline PTX conversions their C++ equivalents.
rewrite() {
    sed -e 's/extern __shared__ \([a-z ]*[a-z]\) \([a-z_0-9]*\)\[\];/\1* \2 = (\1*)emu_dyn_smem;/' \
        -e 's/asm("{\{0,1\} *cvt\.rn\.f16\.f32 %0, %1; *}\{0,1\}" : "=h"(\([a-z_0-9]*\)) : "f"(\([a-z_0-9]*\)));/\1 = emu_f32_to_f16(\2);/' \
        -e 's/asm("{\{0,1\} *cvt\.f32\.f16 %0, %1; *}\{0,1\}" : "=f"(\([a-z_0-9]*\)) : "h"(\([a-z_0-9]*\)));/\1 = emu_f16_to_f32(\2);/' \
        -e 's/asm("mov\.b32 %0, %1;" : "=r"(\([a-z_0-9]*\)) : "f"(\([a-z_0-9]*\)));/\1 = __float_as_uint(\2);/' \
        "$1" > "$2"
    if grep -n 'asm\|extern __shared__' "$2"; then
        echo "emu/run.sh: $1 has CUDA-only code it does not rewrite" >&2
        exit 1
    fi
}
printf '#include "emu.h"\n' > "$tmp/common.cuh.head"
rewrite "$src/common.cuh" "$tmp/common.body"
cat "$tmp/common.cuh.head" "$tmp/common.body" > "$tmp/common.cuh"
if [ $# -gt 0 ]; then stems="$*"; else
    stems=$(cd "$here" && ls *_test.cpp | sed 's/_test\.cpp$//'); fi
# Compile two at a time, then run.
pids=""
for s in $stems; do
    rewrite "$src/$s.cu" "$tmp/$s.cu"
    ( g++ -std=c++20 -O2 -fno-strict-aliasing ${EMU_CXXFLAGS:-} -I"$here" -DKERNEL_CU="\"$tmp/$s.cu\"" \
        -o "$tmp/$s" "$here/${s}_test.cpp" > "$tmp/$s.log" 2>&1 || echo "compile failed" >> "$tmp/$s.log" ) &
    pids="$pids $!"
    if [ $(echo $pids | wc -w) -ge 2 ]; then wait $pids; pids=""; fi
done
wait $pids 2>/dev/null || true
status=0
for s in $stems; do
    if [ ! -x "$tmp/$s" ]; then cat "$tmp/$s.log"; echo "== $s: COMPILE FAILED"; status=1; continue; fi
    echo "== $s"
    if ! "$tmp/$s"; then echo "== $s: FAILED"; status=1; fi
done
[ $status -eq 0 ] && echo "emu: all tests passed" || echo "emu: FAILURES"
exit $status
