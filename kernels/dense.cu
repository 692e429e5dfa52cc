// Dense-transformer kernels other than attention: embedding, RMSNorm, RoPE,
// the KV cache's writes, activations, bias, column and row moves. The
// semantics are the CPU backend's (src/cpu/dense.rs, attention.rs).
#include "common.cuh"

// out[i, :] = table[ids[i], :] widened to f32; an id outside the vocabulary
// (which the host cannot see) gives a row of zeros instead of a fault.
extern "C" __global__ void embedding(const void* table, const unsigned* ids, float* out,
                                     int n_ids, int hidden, long long vocab, int dtype) {
    const long long n = (long long)n_ids * hidden;
    GRID_STRIDE(e, n) {
        const long long i = e / hidden, c = e % hidden;
        const unsigned id = ids[i];
        out[e] = (long long)id < vocab ? load_f32(table, (long long)id * hidden + c, dtype) : 0.0f;
    }
}

// One block per row: out = x / sqrt(mean(x^2) + eps) * (offset + w).
extern "C" __global__ void rms_norm(const float* x, const void* w, float* out, int rows, int dim,
                                    float eps, float offset, int w_dtype) {
    __shared__ float scratch[32];
    const long long row = blockIdx.x;
    if (row >= rows) {
        return;
    }
    const float* xr = x + row * dim;
    float* orow = out + row * dim;
    float ss = 0.0f;
    for (int c = threadIdx.x; c < dim; c += blockDim.x) {
        const float v = xr[c];
        ss += v * v;
    }
    ss = block_sum(ss, scratch);
    const float r = 1.0f / sqrtf(ss / (float)dim + eps);
    for (int c = threadIdx.x; c < dim; c += blockDim.x) {
        const float wc = offset + load_f32(w, c, w_dtype);
        orow[c] = xr[c] * r * wc;
    }
}

// RoPE in place, Hugging Face rotate_half: within the first rotary_dim
// channels of each head, channel i pairs with i + rotary_dim / 2. One thread
// per (row, head, pair).
extern "C" __global__ void rope(float* x, const unsigned* positions, const float* inv_freq,
                                int rows, int n_heads, int head_dim, int rotary_dim,
                                float scaling) {
    const int half = rotary_dim / 2;
    const long long n = (long long)rows * n_heads * half;
    GRID_STRIDE(e, n) {
        const int i = (int)(e % half);
        const long long rh = e / half;  // row * n_heads + head
        const long long row = rh / n_heads;
        const float a = (float)positions[row] * inv_freq[i];
        float s, c;
        sincosf(a, &s, &c);
        c *= scaling;
        s *= scaling;
        float* head = x + rh * head_dim;
        const float x1 = head[i], x2 = head[i + half];
        head[i] = x1 * c - x2 * s;
        head[i + half] = x2 * c + x1 * s;
    }
}

// Row i of k and v (kv_width = n_kv_heads * head_dim) into cache slot
// slots[i] = block * block_size + offset: keys transposed within the block
// ([blocks, kv_width, block_size]), values token-major ([slots, kv_width]);
// f32, bf16 or f16 (rounded to nearest even; f16 held within its range).
// Slots beyond `capacity` are skipped.
extern "C" __global__ void kv_store(const float* k, const float* v, void* k_cache, void* v_cache,
                                    const unsigned* slots, int n, int kv_width, int block_size,
                                    long long capacity, int cache_dtype) {
    const long long total = (long long)n * kv_width;
    GRID_STRIDE(e, total) {
        const long long i = e / kv_width, c = e % kv_width;
        const long long slot = slots[i];
        if (slot >= capacity) {
            continue;
        }
        const long long block = slot / block_size, off = slot % block_size;
        const long long ki = (block * kv_width + c) * block_size + off;
        const long long vi = slot * kv_width + c;
        if (cache_dtype == DT_BF16) {
            ((unsigned short*)k_cache)[ki] = f32_to_bf16(k[e]);
            ((unsigned short*)v_cache)[vi] = f32_to_bf16(v[e]);
        } else if (cache_dtype == DT_F16) {
            ((unsigned short*)k_cache)[ki] = f32_to_f16_sat(k[e]);
            ((unsigned short*)v_cache)[vi] = f32_to_f16_sat(v[e]);
        } else {
            ((float*)k_cache)[ki] = k[e];
            ((float*)v_cache)[vi] = v[e];
        }
    }
}

// out = silu(gate) * up (out may be gate: elementwise).
extern "C" __global__ void silu_mul(const float* gate, const float* up, float* out, long long n) {
    GRID_STRIDE(i, n) {
        const float g = gate[i];
        out[i] = g / (1.0f + expf(-g)) * up[i];
    }
}

// out = max(x, 0)^2.
extern "C" __global__ void relu2(const float* x, float* out, long long n) {
    GRID_STRIDE(i, n) {
        const float r = fmaxf(x[i], 0.0f);
        out[i] = r * r;
    }
}

// out = x * sigmoid(gate).
extern "C" __global__ void sigmoid_mul(const float* x, const float* gate, float* out,
                                       long long n) {
    GRID_STRIDE(i, n) {
        out[i] = x[i] * (1.0f / (1.0f + expf(-gate[i])));
    }
}

// acc += factor * x (acc += x exactly when factor is 1).
extern "C" __global__ void add_scaled(float* acc, const float* x, float factor, long long n) {
    if (factor == 1.0f) {
        GRID_STRIDE(i, n) { acc[i] += x[i]; }
    } else {
        GRID_STRIDE(i, n) { acc[i] += factor * x[i]; }
    }
}

// x *= factor.
extern "C" __global__ void scale(float* x, float factor, long long n) {
    GRID_STRIDE(i, n) { x[i] *= factor; }
}

// out[m, n] += bias[n] (bias f32, bf16 or f16).
extern "C" __global__ void bias_add(float* out, const void* bias, int m, int n, int dtype) {
    const long long total = (long long)m * n;
    GRID_STRIDE(e, total) { out[e] += load_f32(bias, e % n, dtype); }
}

// dst[r, :] = src[r, col_start..col_start + cols].
extern "C" __global__ void copy_cols(const float* src, float* dst, int rows, int src_width,
                                     int col_start, int cols) {
    const long long total = (long long)rows * cols;
    GRID_STRIDE(e, total) {
        const long long r = e / cols, c = e % cols;
        dst[e] = src[r * src_width + col_start + c];
    }
}

// dst[r, col_start..col_start + cols] = src[r, :].
extern "C" __global__ void scatter_cols(const float* src, float* dst, int rows, int cols,
                                        int dst_width, int col_start) {
    const long long total = (long long)rows * cols;
    GRID_STRIDE(e, total) {
        const long long r = e / cols, c = e % cols;
        dst[r * dst_width + col_start + c] = src[e];
    }
}

// out[i, :] = src[rows[i], :], rows of `row_units` units of `unit` bytes
// (1, 2 or 4: bit for bit, any dtype). Rows beyond `src_rows` are skipped.
extern "C" __global__ void gather_rows(const void* src, const unsigned* rows, void* out, int n,
                                       long long row_units, long long src_rows, int unit) {
    const long long total = (long long)n * row_units;
    GRID_STRIDE(e, total) {
        const long long i = e / row_units, c = e % row_units;
        const long long r = rows[i];
        if (r >= src_rows) {
            continue;
        }
        const long long from = r * row_units + c;
        if (unit == 4) {
            ((unsigned*)out)[e] = ((const unsigned*)src)[from];
        } else if (unit == 2) {
            ((unsigned short*)out)[e] = ((const unsigned short*)src)[from];
        } else {
            ((unsigned char*)out)[e] = ((const unsigned char*)src)[from];
        }
    }
}

// dst[rows[i], :] += weights[i] * src[i, :] in order of i: one thread per
// column walks the entries in order, so repeated rows add deterministically,
// as on the CPU. Rows beyond `dst_rows` are skipped.
extern "C" __global__ void scatter_add_rows(const float* src, const unsigned* rows,
                                            const float* weights, float* dst, int n, int width,
                                            long long dst_rows) {
    GRID_STRIDE(c, (long long)width) {
        for (int i = 0; i < n; ++i) {
            const long long r = rows[i];
            if (r < dst_rows) {
                dst[r * width + c] += weights[i] * src[(long long)i * width + c];
            }
        }
    }
}
