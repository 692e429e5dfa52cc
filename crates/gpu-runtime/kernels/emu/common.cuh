// Host emulation shim of ../common.cuh for emu/run.sh: every CUDA thread of a block is a
// std::thread; shuffles and __syncthreads are barriers.
#pragma once
#include <barrier>
#include <cmath>
#include <cstring>
#include <cstdint>
#include <algorithm>
#define DT_F32 0
#define DT_BF16 1
#define DT_F16 2
#define FULL_MASK 0xffffffffu
#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(x)
struct Dim3 { unsigned x = 1, y = 1, z = 1; };
extern thread_local Dim3 threadIdx, blockIdx;
extern Dim3 blockDim, gridDim;
struct Emu {
    std::barrier<>* block_bar;
    std::barrier<>* warp_bar[32];
    float slots[1024];
    float shared[32];
};
extern Emu* emu;
inline float __uint_as_float(unsigned u) { float f; memcpy(&f, &u, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned u; memcpy(&u, &f, 4); return u; }
inline float bf16_to_f32(unsigned short b) { return __uint_as_float(((unsigned)b) << 16); }
inline float f16_to_f32(unsigned short h) { return (float)(*(_Float16*)&h); }
inline float load_f32(const void* p, long long i, int dtype) {
    if (dtype == DT_BF16) return bf16_to_f32(((const unsigned short*)p)[i]);
    if (dtype == DT_F16) return f16_to_f32(((const unsigned short*)p)[i]);
    return ((const float*)p)[i];
}
inline float __shfl_sync(unsigned, float v, int src) {
    int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
    emu->slots[threadIdx.x] = v;
    emu->warp_bar[w]->arrive_and_wait();
    float r = emu->slots[w * 32 + (src & 31)];
    emu->warp_bar[w]->arrive_and_wait();
    (void)lane;
    return r;
}
inline float __shfl_xor_sync(unsigned m, float v, int o) {
    return __shfl_sync(m, v, (threadIdx.x & 31) ^ o);
}
inline void __syncthreads() { emu->block_bar->arrive_and_wait(); }
inline float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}
inline float block_sum(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int warps = (blockDim.x + 31) >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float t = lane < warps ? scratch[lane] : 0.0f;
    return warp_sum(t);
}
using std::min;
