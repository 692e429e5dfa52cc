// The gated delta rule (Qwen3-Next linear attention), recurrent form for
// every row: prefill and decode alike (the op's contract: the chunked form
// differs only in rounding). The semantics are the CPU backend's
// (src/cpu/recurrent/delta.rs, and the op's documentation in
// src/ops/recurrent.rs).
//
// Per sequence and v head h (k head h / (n_v_heads / n_k_heads)), with the
// state S [k_head_dim, v_head_dim] row-major (slot layout [n_v_heads,
// k_head_dim, v_head_dim]), per token:
//   k = l2norm(k), q = l2norm(q) * k_head_dim^-0.5   (x * 1/sqrt(sum x^2 + 1e-6))
//   g = -exp(a_log) * softplus(a + dt_bias), beta = sigmoid(b)
//   S = exp(g) * S;  S += k (x) ((v - S^T k) * beta);  o = S^T q.
//
// Each column j of S evolves on its own (it needs only v_j and the head's
// k and q), so the columns are spread over blocks and lanes: a group of
// `lpc` lanes (a power of two, 1 to 32) holds one column, lane s of the
// group rows s, s + lpc, s + 2 lpc, ... (at most MAX_RPL of them) in
// registers. Per token the group reduces, in one pass of shuffles, the
// squared norms of k and q, k.q, S'^T k and S'^T q (S' = exp(g) S); then
//   o = S'^T q + d (k.q),  d = (v - S'^T k) beta,
// which equals (S' + k d)^T q, the CPU's order of operations up to rounding.
//
// Grid: x = n_v_heads * (column blocks of one head), y walks the sequences
// (grid-stride); block: DELTA_WARPS warps, 32 / lpc columns each.
#include "common.cuh"

#define DELTA_WARPS 4
// Rows of S a lane holds at most: k_head_dim <= MAX_RPL * 32.
#define MAX_RPL 8

// HF `l2norm` epsilon.
#define L2_EPS 1e-6f

// torch softplus (beta 1, threshold 20), as the CPU's `softplus`.
__device__ __forceinline__ float softplus_f(float x) {
    return x > 20.0f ? x : log1pf(expf(x));
}

// `flags`: bits 0-1 the dtype code of a_log, bits 2-3 that of dt_bias
// (DT_* of common.cuh), bits 4-6 log2(lpc), bit 7 value heads tiled over
// the key heads (kh = h % n_k_heads; else kh = h / group), bits 8-30 the v
// heads per k head (group = n_v_heads / n_k_heads).
// Sequences are [row_start, len, slot] words; one whose rows end past
// `rows_bound` (the rows every operand holds) or whose slot lies outside
// the pool (`n_slots` of `per_slot` floats) is skipped, as is len 0.
extern "C" __global__ void gated_delta_rule(const float* q, const float* k, const float* v,
                                            const float* a, const float* b, const void* a_log,
                                            const void* dt_bias, float* out, float* states,
                                            const unsigned* seqs, int n_seqs, int n_v_heads,
                                            int k_head_dim, int v_head_dim,
                                            long long rows_bound, long long n_slots,
                                            long long per_slot, int flags) {
    const int dk = k_head_dim, dv = v_head_dim;
    const int lpc = 1 << ((flags >> 4) & 7);
    const int cols_per_block = DELTA_WARPS * (32 / lpc);
    const int col_blocks = (dv + cols_per_block - 1) / cols_per_block;
    const int h = blockIdx.x / col_blocks;
    if (h >= n_v_heads) {
        return;
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int s = lane & (lpc - 1);  // this lane's place in its column's group
    const int j = (blockIdx.x % col_blocks) * cols_per_block + warp * (32 / lpc) + lane / lpc;
    // Lanes of a column past dv compute with zeros and write nothing; they
    // stay in the loops for the shuffles.
    const bool col_ok = j < dv;
    const int group = (flags >> 8) & 0x7fffff;
    // Bit 7: value heads tiled over the key heads (llama.cpp's Qwen3.5 GGUF
    // order), else grouped by key head (Hugging Face's).
    const int kh = (flags >> 7) & 1 ? h % (n_v_heads / group) : h / group;
    const int kw = (n_v_heads / group) * dk, vw = n_v_heads * dv;
    const float neg_a = -expf(load_f32(a_log, h, flags & 3));
    const float bias = load_f32(dt_bias, h, (flags >> 2) & 3);
    const float scale = 1.0f / sqrtf((float)dk);

    for (int si = blockIdx.y; si < n_seqs; si += gridDim.y) {
        const unsigned* d = seqs + 3 * (long long)si;
        const long long row0 = d[0], len = d[1], slot = d[2];
        if (len == 0 || row0 + len > rows_bound || slot >= n_slots) {
            continue;
        }
        float* st = states + slot * per_slot + (long long)h * dk * dv + j;
        float S[MAX_RPL];
#pragma unroll
        for (int r = 0; r < MAX_RPL; ++r) {
            const int i = s + r * lpc;
            S[r] = (col_ok && i < dk) ? st[(long long)i * dv] : 0.0f;
        }
        // This token's inputs, loaded one token ahead.
        float nk[MAX_RPL], nq[MAX_RPL], nv, na, nb;
        auto load = [&](long long row) {
            const float* kr = k + row * kw + (long long)kh * dk;
            const float* qr = q + row * kw + (long long)kh * dk;
#pragma unroll
            for (int r = 0; r < MAX_RPL; ++r) {
                const int i = s + r * lpc;
                nk[r] = i < dk ? kr[i] : 0.0f;
                nq[r] = i < dk ? qr[i] : 0.0f;
            }
            nv = col_ok ? v[row * vw + (long long)h * dv + j] : 0.0f;
            na = a[row * n_v_heads + h];
            nb = b[row * n_v_heads + h];
        };
        load(row0);
        for (long long t = 0; t < len; ++t) {
            const long long row = row0 + t;
            float kk[MAX_RPL], qq[MAX_RPL];
#pragma unroll
            for (int r = 0; r < MAX_RPL; ++r) {
                kk[r] = nk[r];
                qq[r] = nq[r];
            }
            const float vj = nv, at = na, bt = nb;
            if (t + 1 < len) {
                load(row + 1);
            }
            const float eg = expf(neg_a * softplus_f(at + bias));
            const float beta = 1.0f / (1.0f + expf(-bt));
            // Partial sums over this lane's rows.
            float ssk = 0.0f, ssq = 0.0f, kq = 0.0f, sk = 0.0f, sq = 0.0f;
#pragma unroll
            for (int r = 0; r < MAX_RPL; ++r) {
                S[r] *= eg;
                ssk += kk[r] * kk[r];
                ssq += qq[r] * qq[r];
                kq += kk[r] * qq[r];
                sk += S[r] * kk[r];
                sq += S[r] * qq[r];
            }
            for (int o = lpc >> 1; o > 0; o >>= 1) {
                ssk += __shfl_xor_sync(FULL_MASK, ssk, o);
                ssq += __shfl_xor_sync(FULL_MASK, ssq, o);
                kq += __shfl_xor_sync(FULL_MASK, kq, o);
                sk += __shfl_xor_sync(FULL_MASK, sk, o);
                sq += __shfl_xor_sync(FULL_MASK, sq, o);
            }
            // The raw sums, scaled by the norms: k = rk k_raw, q = rq q_raw.
            const float rk = 1.0f / sqrtf(ssk + L2_EPS);
            const float rq = scale / sqrtf(ssq + L2_EPS);
            const float kv = rk * sk;
            const float dlt = (vj - kv) * beta;
            const float o = rq * sq + dlt * (rk * rq * kq);
            const float dk_step = dlt * rk;  // S += k_raw * rk * delta
#pragma unroll
            for (int r = 0; r < MAX_RPL; ++r) {
                S[r] += kk[r] * dk_step;
            }
            if (col_ok && s == 0) {
                out[row * vw + (long long)h * dv + j] = o;
            }
        }
#pragma unroll
        for (int r = 0; r < MAX_RPL; ++r) {
            const int i = s + r * lpc;
            if (col_ok && i < dk) {
                st[(long long)i * dv] = S[r];
            }
        }
    }
}
