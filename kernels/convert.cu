// Casts of f32 activations to a GEMM's low-precision input type (bf16 or
// f16), written without toolkit headers: bits in, bits out.
//
// Each kernel is a grid-stride loop over `n` elements, so any grid covers
// any `n`.

// The bits of an f32.
static __device__ __forceinline__ unsigned int f32_bits(float x) {
    unsigned int u;
    asm("mov.b32 %0, %1;" : "=r"(u) : "f"(x));
    return u;
}

// f32 -> bf16, round to nearest even. A NaN stays a NaN with its sign and
// the top of its payload (the quiet bit is set so that truncating the
// payload cannot turn it into an infinity); infinities stay infinities and
// values beyond the largest bf16 round to infinity, as IEEE rounding does.
static __device__ __forceinline__ unsigned short bf16_bits(float x) {
    unsigned int u = f32_bits(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        return (unsigned short)((u >> 16) | 0x0040u);
    }
    unsigned int lsb = (u >> 16) & 1u;
    return (unsigned short)((u + 0x7fffu + lsb) >> 16);
}

// f32 -> f16, round to nearest even, by the hardware conversion (NaN in,
// NaN out; overflow to infinity; subnormals kept).
static __device__ __forceinline__ unsigned short f16_bits(float x) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
    return h;
}

extern "C" __global__ void cast_f32_bf16(const float* x, unsigned short* y, long long n) {
    long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        y[i] = bf16_bits(x[i]);
    }
}

extern "C" __global__ void cast_f32_f16(const float* x, unsigned short* y, long long n) {
    long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        y[i] = f16_bits(x[i]);
    }
}
