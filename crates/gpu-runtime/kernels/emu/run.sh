#!/bin/sh
# Runs kernels/mamba.cu on the host, each CUDA thread of a block a
# std::thread (shuffles and __syncthreads as barriers; common.cuh here is a
# host shim of ../common.cuh), against f64 references of the SSD scan, the
# causal conv1d with its state, and the gated RMSNorm. A check of the
# kernels' indexing and semantics without a GPU, not of their speed.
# Needs g++ >= 11 (C++20 std::barrier, _Float16). About a minute.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# Static shared memory becomes the emulated block's.
sed 's/__shared__ float scratch\[32\];/float* scratch = emu->shared;/' \
    "$here/../mamba.cu" > "$tmp/mamba_emu.cu"
g++ -std=c++20 -O1 -pthread -I"$here" -DMAMBA_CU="\"$tmp/mamba_emu.cu\"" \
    -o "$tmp/mamba_test" "$here/mamba_test.cpp"
"$tmp/mamba_test"
