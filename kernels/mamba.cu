// Mamba-2 kernels: the depthwise causal conv1d with its state, the gated
// RMSNorm and the SSD scan. The semantics are the CPU backend's
// (src/cpu/recurrent.rs, cpu/recurrent/ssd.rs, cpu/elementwise.rs).
//
// Sequences come from device memory: `seqs` holds `[row_start, len, slot]`
// u32 words per sequence (RecurrentBatch). The host knows only buffer
// sizes, so a sequence whose rows pass `rows_bound` or whose slot passes
// `n_slots` is skipped instead of faulting; `len == 0` leaves its state as
// it is.
#include "common.cuh"

#define SEQ_WORDS 3

// A sequence's descriptor; false when it has nothing to do or lies outside
// the buffers.
__device__ __forceinline__ bool read_seq(const unsigned* seqs, int i, long long rows_bound,
                                         unsigned n_slots, long long* row0, int* len,
                                         unsigned* slot) {
    const unsigned* d = seqs + (long long)i * SEQ_WORDS;
    *row0 = d[0];
    *len = (int)d[1];
    *slot = d[2];
    return d[1] > 0 && (long long)d[0] + (long long)d[1] <= rows_bound && d[2] < n_slots;
}

// SiLU as the CPU computes it: x / (1 + exp(-x)).
__device__ __forceinline__ float silu_f(float x) { return x / (1.0f + expf(-x)); }

// torch softplus (beta 1, threshold 20).
__device__ __forceinline__ float softplus_f(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

// ---------------------------------------------------------------------------
// causal_conv1d. Grid (blocks over a sequence's len * channels, n_seqs).
// out[t, c] = bias[c] + sum_j w[c, j] * in(t - (kernel-1) + j, c), inputs
// before the sequence's first row taken from the state ([kernel-1, channels],
// oldest first, at states + slot * per_slot); then SiLU when `silu`. Added
// in the CPU's order: bias, then the taps oldest first. The state is read
// only here; `conv_state_update` (queued after) writes the new one.
// LFM2's gates (`pre`, `post`, both null or both `[rows, channels]`): the
// inputs of this call are `pre * x` (the state already holds such), the
// output is `post * acc` (no SiLU).
extern "C" __global__ void causal_conv1d(const float* __restrict__ x, const void* __restrict__ w,
                                         const void* __restrict__ bias, float* __restrict__ out,
                                         const float* __restrict__ states,
                                         const unsigned* __restrict__ seqs, int n_seqs,
                                         int channels, int kernel, long long per_slot,
                                         unsigned n_slots, long long rows_bound, int w_dtype,
                                         int b_dtype, int silu, const float* __restrict__ pre,
                                         const float* __restrict__ post) {
    const int s = blockIdx.y;
    if (s >= n_seqs) {
        return;
    }
    long long row0;
    int len;
    unsigned slot;
    if (!read_seq(seqs, s, rows_bound, n_slots, &row0, &len, &slot)) {
        return;
    }
    const int km1 = kernel - 1;
    const float* st = states + (long long)slot * per_slot;
    const long long n = (long long)len * channels;
    for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < n;
         e += (long long)gridDim.x * blockDim.x) {
        const int t = (int)(e / channels), c = (int)(e % channels);
        float acc = bias ? load_f32(bias, c, b_dtype) : 0.0f;
        for (int j = 0; j < kernel; ++j) {
            // Input t + j - km1 of the sequence; negative: from the state.
            const int i = t + j - km1;
            const long long at = (row0 + i) * channels + c;
            const float v = i >= 0 ? (pre ? pre[at] * x[at] : x[at])
                                   : st[(long long)(t + j) * channels + c];
            acc += load_f32(w, (long long)c * kernel + j, w_dtype) * v;
        }
        const long long o = (row0 + t) * channels + c;
        out[o] = post ? post[o] * acc : silu ? silu_f(acc) : acc;
    }
}

// The conv's new state: the last kernel-1 inputs of each channel, from the
// old state where the sequence is shorter. Grid (channel blocks, n_seqs);
// each thread walks its channel's taps oldest first, so the in-place shift
// (tap i from old tap i + len) reads every old tap before it is overwritten.
// With LFM2's `pre` gate (else null) the inputs are `pre * x`.
extern "C" __global__ void conv_state_update(const float* __restrict__ x, float* states,
                                             const unsigned* __restrict__ seqs, int n_seqs,
                                             int channels, int kernel, long long per_slot,
                                             unsigned n_slots, long long rows_bound,
                                             const float* __restrict__ pre) {
    const int s = blockIdx.y;
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (s >= n_seqs || c >= channels) {
        return;
    }
    long long row0;
    int len;
    unsigned slot;
    if (!read_seq(seqs, s, rows_bound, n_slots, &row0, &len, &slot)) {
        return;
    }
    const int km1 = kernel - 1;
    float* st = states + (long long)slot * per_slot;
    for (int i = 0; i < km1; ++i) {
        // Tap i of the new state is input len + i - km1 of the sequence.
        const int src = len + i - km1;
        const long long at = (row0 + src) * channels + c;
        st[(long long)i * channels + c] = src >= 0 ? (pre ? pre[at] * x[at] : x[at])
                                                   : st[(long long)(i + len) * channels + c];
    }
}

// ---------------------------------------------------------------------------
// gated_rms_norm. One block per (row, group of `group_size` channels):
// BeforeNorm (order 0): h = x * silu(g); out = h * rsqrt(mean(h^2) + eps) * w.
// AfterNorm (order 1): out = x * rsqrt(mean(x^2) + eps) * w * silu(g).
extern "C" __global__ void gated_rms_norm(const float* __restrict__ x,
                                          const float* __restrict__ gate,
                                          const void* __restrict__ w, float* __restrict__ out,
                                          long long n_groups_total, int dim, int group_size,
                                          float eps, int order, int w_dtype) {
    __shared__ float scratch[32];
    const long long blk = blockIdx.x;
    if (blk >= n_groups_total) {
        return;
    }
    const int groups = dim / group_size;
    const long long row = blk / groups;
    const int c0 = (int)(blk % groups) * group_size;
    const long long base = row * dim + c0;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < group_size; i += blockDim.x) {
        float h = x[base + i];
        if (order == 0) {
            h *= silu_f(gate[base + i]);
        }
        ss += h * h;
    }
    ss = block_sum(ss, scratch);
    const float r = 1.0f / sqrtf(ss / (float)group_size + eps);
    for (int i = threadIdx.x; i < group_size; i += blockDim.x) {
        const float g = gate[base + i];
        const float wc = load_f32(w, c0 + i, w_dtype);
        const float xv = x[base + i];
        out[base + i] = order == 0 ? (xv * silu_f(g)) * (r * wc) : xv * r * wc * silu_f(g);
    }
}

// ---------------------------------------------------------------------------
// ssd_scan: the Mamba-2 SSD scan by its exact per-token recurrence (the
// function the chunked form computes; only the rounding differs), per
// sequence from and into its state [n_heads, head_dim, d_state] (f32, at
// states + slot * per_slot).
//
// Grid (n_seqs, n_heads * p_blocks). A block of SSD_WARPS warps takes
// SSD_WARPS * SSD_ROWS consecutive rows p of one head's state; each warp
// SSD_ROWS of them, its lanes splitting d_state (k = lane + 32 j, j <
// KPL: 1, 2, 4 or SSD_KPL, the fewest that cover d_state). The state stays
// in registers over the sequence's tokens:
//   dt = clamp(softplus(dt_raw + dt_bias), dt_min, dt_max); da = exp(dt A)
//   s[p, k] = s[p, k] * da + (x[p] dt) * B[k];  y[p] = sum_k s[p, k] C[k] + D x[p]
// with A = -exp(a_log). Head h reads B and C of group h / (n_heads / n_groups).
// Each token's operands are loaded one token ahead; dt and exp(dt A) are
// computed for 32 tokens at once, a token per lane.
#define SSD_WARPS 4
#define SSD_ROWS 4  // the butterfly below reduces exactly four rows
#define SSD_KPL 8  // d_state <= 32 * SSD_KPL

// The scan with KPL d_state values per lane (d_state <= 32 * KPL).
template <int KPL>
__device__ __forceinline__ void ssd_scan_kpl(
    const float* __restrict__ x, const float* __restrict__ dt_raw, const float* __restrict__ b,
    const float* __restrict__ c, const void* __restrict__ a_log, const void* __restrict__ d_skip,
    const void* __restrict__ dt_bias, float* __restrict__ y, float* __restrict__ states,
    const unsigned* __restrict__ seqs, int n_seqs, int n_heads, int head_dim, int d_state,
    int n_groups, float dt_min, float dt_max, long long x_stride, long long bc_stride,
    long long per_slot, unsigned n_slots, long long rows_bound, int a_dtype, int d_dtype,
    int bias_dtype) {
    const int s = blockIdx.x;
    const int p_blocks = (head_dim + SSD_WARPS * SSD_ROWS - 1) / (SSD_WARPS * SSD_ROWS);
    const int h = blockIdx.y / p_blocks;
    if (s >= n_seqs || h >= n_heads) {
        return;
    }
    long long row0;
    int len;
    unsigned slot;
    if (!read_seq(seqs, s, rows_bound, n_slots, &row0, &len, &slot)) {
        return;
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int p0 = (blockIdx.y % p_blocks) * (SSD_WARPS * SSD_ROWS) + warp * SSD_ROWS;
    const int g = h / (n_heads / n_groups);
    const float neg_a = -expf(load_f32(a_log, h, a_dtype));
    const float dh = load_f32(d_skip, h, d_dtype);
    const float bias = load_f32(dt_bias, h, bias_dtype);
    const int width = n_heads * head_dim;
    float* st = states + (long long)slot * per_slot + (long long)h * head_dim * d_state;

    bool row_ok[SSD_ROWS];
    bool k_ok[KPL];
#pragma unroll
    for (int r = 0; r < SSD_ROWS; ++r) {
        row_ok[r] = p0 + r < head_dim;
    }
#pragma unroll
    for (int j = 0; j < KPL; ++j) {
        k_ok[j] = lane + 32 * j < d_state;
    }

    float sv[SSD_ROWS][KPL];
#pragma unroll
    for (int r = 0; r < SSD_ROWS; ++r) {
#pragma unroll
        for (int j = 0; j < KPL; ++j) {
            sv[r][j] = row_ok[r] && k_ok[j]
                           ? st[(long long)(p0 + r) * d_state + lane + 32 * j]
                           : 0.0f;
        }
    }

    // dt and exp(dt A) of 32 tokens at a time, lane i holding token
    // t0 + i's (handed out by shuffles); the next 32 raw values loaded ahead.
    auto raw_dt = [&](int tt) { return tt < len ? dt_raw[(row0 + tt) * n_heads + h] : 0.0f; };
    float raw_next = raw_dt(lane), dtv = 0.0f, dav = 0.0f;
    // Operands of token t: x of the warp's rows, the lane's B and C.
    float nx[SSD_ROWS], nb[KPL], nc[KPL];
    auto load = [&](long long row) {
        const float* xr = x + row * x_stride + (long long)h * head_dim + p0;
#pragma unroll
        for (int r = 0; r < SSD_ROWS; ++r) {
            nx[r] = row_ok[r] ? xr[r] : 0.0f;
        }
        const float* br = b + row * bc_stride + (long long)g * d_state + lane;
        const float* cr = c + row * bc_stride + (long long)g * d_state + lane;
#pragma unroll
        for (int j = 0; j < KPL; ++j) {
            nb[j] = k_ok[j] ? br[32 * j] : 0.0f;
            nc[j] = k_ok[j] ? cr[32 * j] : 0.0f;
        }
    };
    load(row0);
    for (int t = 0; t < len; ++t) {
        const long long row = row0 + t;
        if ((t & 31) == 0) {
            // dt = clamp(softplus(dt_raw + dt_bias), dt_min, dt_max), as
            // Rust's f32::clamp (a NaN stays NaN).
            float v = softplus_f(raw_next + bias);
            v = v < dt_min ? dt_min : v;
            v = v > dt_max ? dt_max : v;
            dtv = v;
            dav = expf(v * neg_a);
            raw_next = raw_dt(t + 32 + lane);
        }
        const float dt = __shfl_sync(FULL_MASK, dtv, t & 31);
        const float da = __shfl_sync(FULL_MASK, dav, t & 31);
        float cx[SSD_ROWS], cb[KPL], cc[KPL];
#pragma unroll
        for (int r = 0; r < SSD_ROWS; ++r) {
            cx[r] = nx[r];
        }
#pragma unroll
        for (int j = 0; j < KPL; ++j) {
            cb[j] = nb[j];
            cc[j] = nc[j];
        }
        // The next token's operands (the last token's again at the end:
        // no branch, so the loop body stays one block for the scheduler).
        load(row0 + min(t + 1, len - 1));
        float part[SSD_ROWS];
#pragma unroll
        for (int r = 0; r < SSD_ROWS; ++r) {
            const float xdt = cx[r] * dt;
            float acc = 0.0f;
#pragma unroll
            for (int j = 0; j < KPL; ++j) {
                const float v = sv[r][j] * da + xdt * cb[j];
                sv[r][j] = v;
                acc += v * cc[j];
            }
            part[r] = acc;
        }
        // The four rows' sums over the warp in one butterfly: lanes with
        // bit 4 clear keep rows 0 and 1 (set: 2 and 3), then bit 3 picks
        // one of the two; row 2 * bit4 + bit3 ends whole in lane 8 * row.
        const bool hi16 = (lane & 16) != 0, hi8 = (lane & 8) != 0;
        float k0 = hi16 ? part[2] : part[0], k1 = hi16 ? part[3] : part[1];
        k0 += __shfl_xor_sync(FULL_MASK, hi16 ? part[0] : part[2], 16);
        k1 += __shfl_xor_sync(FULL_MASK, hi16 ? part[1] : part[3], 16);
        float sum = hi8 ? k1 : k0;
        sum += __shfl_xor_sync(FULL_MASK, hi8 ? k0 : k1, 8);
        sum += __shfl_xor_sync(FULL_MASK, sum, 4);
        sum += __shfl_xor_sync(FULL_MASK, sum, 2);
        sum += __shfl_xor_sync(FULL_MASK, sum, 1);
        const int mine = (hi16 ? 2 : 0) + (hi8 ? 1 : 0);
        if ((lane & 7) == 0 && p0 + mine < head_dim) {
            const float xm = mine == 0 ? cx[0] : mine == 1 ? cx[1] : mine == 2 ? cx[2] : cx[3];
            y[row * width + (long long)h * head_dim + p0 + mine] = sum + dh * xm;
        }
    }

#pragma unroll
    for (int r = 0; r < SSD_ROWS; ++r) {
#pragma unroll
        for (int j = 0; j < KPL; ++j) {
            if (row_ok[r] && k_ok[j]) {
                st[(long long)(p0 + r) * d_state + lane + 32 * j] = sv[r][j];
            }
        }
    }
}

// Lanes hold as few d_state values as d_state needs (no idle multiply-adds).
#define SSD_SCAN_KPL(kpl)                                                                      \
    ssd_scan_kpl<kpl>(x, dt_raw, b, c, a_log, d_skip, dt_bias, y, states, seqs, n_seqs,        \
                      n_heads, head_dim, d_state, n_groups, dt_min, dt_max, x_stride, bc_stride, \
                      per_slot, n_slots, rows_bound, a_dtype, d_dtype, bias_dtype)
extern "C" __global__ void __launch_bounds__(SSD_WARPS * 32)
    ssd_scan(const float* __restrict__ x, const float* __restrict__ dt_raw,
             const float* __restrict__ b, const float* __restrict__ c,
             const void* __restrict__ a_log, const void* __restrict__ d_skip,
             const void* __restrict__ dt_bias, float* __restrict__ y, float* __restrict__ states,
             const unsigned* __restrict__ seqs, int n_seqs, int n_heads, int head_dim,
             int d_state, int n_groups, float dt_min, float dt_max, long long x_stride,
             long long bc_stride, long long per_slot, unsigned n_slots, long long rows_bound,
             int a_dtype, int d_dtype, int bias_dtype) {
    if (d_state <= 32) {
        SSD_SCAN_KPL(1);
    } else if (d_state <= 64) {
        SSD_SCAN_KPL(2);
    } else if (d_state <= 128) {
        SSD_SCAN_KPL(4);
    } else {
        SSD_SCAN_KPL(SSD_KPL);
    }
}
