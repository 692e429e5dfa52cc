// Helpers shared by the kernels of metrale's CUDA backend. No toolkit
// header is included (NVRTC compiles these alone): bf16 and f16 are held as
// their 16-bit patterns and converted here.
#pragma once

// Dtype codes the host passes for weights, tables and caches.
#define DT_F32 0
#define DT_BF16 1
#define DT_F16 2

#define FULL_MASK 0xffffffffu

// bf16 bits to f32: the high half of the f32 pattern.
__device__ __forceinline__ float bf16_to_f32(unsigned short b) {
    return __uint_as_float(((unsigned)b) << 16);
}

// f32 to bf16 bits, rounded to nearest, ties to even; a NaN stays a quiet NaN
// (the same bits as the CPU backend's `to_bf16`).
__device__ __forceinline__ unsigned short f32_to_bf16(float x) {
    unsigned b = __float_as_uint(x);
    if ((b & 0x7fffffffu) > 0x7f800000u) {
        return (unsigned short)((b >> 16) | 0x0040u);
    }
    return (unsigned short)((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
}

// f16 bits to f32 (exact).
__device__ __forceinline__ float f16_to_f32(unsigned short h) {
    float f;
    asm("{ cvt.f32.f16 %0, %1; }" : "=f"(f) : "h"(h));
    return f;
}

// f32 to f16 bits, rounded to nearest, ties to even; finite values beyond
// f16's range held at +-65504 rather than made infinite (a KV cache's
// rounding: one infinite key would turn its block's scores into NaN); a NaN
// stays a NaN (the same bits as the CPU backend's `to_f16_saturating`).
__device__ __forceinline__ unsigned short f32_to_f16_sat(float x) {
    const float y = x > 65504.0f ? 65504.0f : (x < -65504.0f ? -65504.0f : x);
    unsigned short h;
    asm("{ cvt.rn.f16.f32 %0, %1; }" : "=h"(h) : "f"(y));
    return h;
}

// Element `i` of an f32, bf16 or f16 array, widened to f32.
__device__ __forceinline__ float load_f32(const void* p, long long i, int dtype) {
    if (dtype == DT_BF16) {
        return bf16_to_f32(((const unsigned short*)p)[i]);
    } else if (dtype == DT_F16) {
        return f16_to_f32(((const unsigned short*)p)[i]);
    }
    return ((const float*)p)[i];
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        v += __shfl_xor_sync(FULL_MASK, v, o);
    }
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, o));
    }
    return v;
}

// The sum of `v` over the block (blockDim.x a multiple of 32, at most 1024),
// returned to every thread; `scratch` is 32 floats of shared memory. The
// order of additions is fixed by the block shape alone.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int warps = (blockDim.x + 31) >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) {
        scratch[warp] = v;
    }
    __syncthreads();
    float t = lane < warps ? scratch[lane] : 0.0f;
    return warp_sum(t);
}

// A grid-stride loop over `n` elements.
#define GRID_STRIDE(i, n)                                                        \
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < (n); \
         i += (long long)gridDim.x * blockDim.x)
