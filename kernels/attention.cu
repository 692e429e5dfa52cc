// Causal grouped-query attention over the paged KV cache (see
// src/ops/dense.rs: KvLayer, and src/ops/step.rs: AttnBatch), f32, bf16 or
// f16 cache, f32 queries and outputs, online softmax in f32.
//
// The host knows an upper bound of the step's query rows (q's length) but
// not the sequences, so the kernels first find the step's real rows (the
// end of the last sequence's queries, `attn_geometry`) and from them the
// splits of each row's key range: enough (row, split) work items to fill
// the GPU when there are few rows (decode), one split when there are many
// (prefill); both kernels compute the same.
//
// Grid: y = group of `hpb` query heads of one kv head (hpb = blockDim.x /
// 32, one warp per query head); x walks the work items (row, split), grid-
// stride. For an item the block finds the row's sequence in the
// descriptors, then walks its positions TILE at a time: the tile's keys
// ([head_dim][TILE], so that lane j scores key j with no horizontal sum)
// and values ([TILE][head_dim], lane owns dims lane + 32 i) are staged in
// shared memory once for all the block's warps. With one split the block
// writes its output rows; with several each writes (max, sum, unnormalised
// accumulator) partials that `attn_reduce` combines.
#include "common.cuh"

#define TILE 32
// head_dim up to 32 * MAX_DIMS.
#define MAX_DIMS 8
// A split covers at least this many positions (whole tiles), so that a
// short context is not cut into slivers; the later splits are then empty.
#define MIN_SPLIT_CHUNK 128
// Splits per row at most.
#define MAX_SPLITS 64
// Partials (rows x heads x splits x (head_dim + 2) floats) stay within this
// (64 MiB): the splits are bounded by it.
#define PARTIAL_FLOATS (16ll << 20)
// Bits of `flags`.
#define FLAG_BF16 1
#define FLAG_SEPARATE_KV 2
// Blocks of a multiple of 8 tokens, head_dim a multiple of 8, both caches
// 16-byte aligned: tiles are loaded 16 bytes at a time.
#define FLAG_VEC 4
#define FLAG_F16 8
// Loads each thread has in flight at once when staging a tile.
#define LOADS_IN_FLIGHT 4
#define NO_BLOCK 0xffffffffu
#define NEG_INF (-__int_as_float(0x7f800000))

// A 16-bit cache element's bits (bf16 or f16) widened to f32.
__device__ __forceinline__ float narrow_to_f32(unsigned short b, int dtype) {
    return dtype == DT_BF16 ? bf16_to_f32(b) : f16_to_f32(b);
}

// Stages the tile of positions t0..t0 + TILE: keys as ks[d * TILE + tt]
// (with `do_k`), values as vs[tt * head_dim + d] (with `do_v`). Positions
// whose block is NO_BLOCK read as 0, and so do the values of positions
// outside [s0, s1), so that their zero weights never meet a NaN. With
// `vec`, 16 bytes at a time (a unit of 8 bf16 or f16, or 4 f32 values: 8 divides
// the block size, so a unit of keys never crosses a block), LOADS_IN_FLIGHT
// loads issued before any is used.
__device__ __forceinline__ void load_tile(float* ks, float* vs, bool do_k, bool do_v,
                                          const void* k_cache, const void* v_cache,
                                          const unsigned* s_blk, long long t0, long long s0,
                                          long long s1, int block_size, int n_kv_heads, int kvh,
                                          int hd, int kv_dtype, bool vec) {
    const int nthreads = blockDim.x;
    if (!vec) {
        if (do_k) {
            for (int e = threadIdx.x; e < hd * TILE; e += nthreads) {
                const int d = e / TILE, tt = e % TILE;
                const unsigned blk = s_blk[tt];
                float val = 0.0f;
                if (blk != NO_BLOCK) {
                    const long long off = (t0 + tt) % block_size;
                    const long long i =
                        (((long long)blk * n_kv_heads + kvh) * hd + d) * block_size + off;
                    val = load_f32(k_cache, i, kv_dtype);
                }
                ks[e] = val;
            }
        }
        if (do_v) {
            for (int e = threadIdx.x; e < hd * TILE; e += nthreads) {
                const int tt = e / hd, d = e % hd;
                const unsigned blk = s_blk[tt];
                const long long t = t0 + tt;
                float val = 0.0f;
                if (blk != NO_BLOCK && t >= s0 && t < s1) {
                    const long long off = t % block_size;
                    const long long i =
                        (((long long)blk * block_size + off) * n_kv_heads + kvh) * hd + d;
                    val = load_f32(v_cache, i, kv_dtype);
                }
                vs[e] = val;
            }
        }
        return;
    }
    const bool narrow = kv_dtype != DT_F32;
    const int unit = narrow ? 8 : 4;
    const int esize = narrow ? 2 : 4;
    const int k_per_row = TILE / unit;  // units of one key row (one d)
    const int v_per_row = hd / unit;    // units of one value row (one position)
    const int k_units = do_k ? hd * k_per_row : 0;
    const int total = k_units + (do_v ? TILE * v_per_row : 0);
    for (int base = threadIdx.x; base < total; base += LOADS_IN_FLIGHT * nthreads) {
        uint4 raw[LOADS_IN_FLIGHT];
#pragma unroll
        for (int j = 0; j < LOADS_IN_FLIGHT; ++j) {
            const int e = base + j * nthreads;
            raw[j] = make_uint4(0u, 0u, 0u, 0u);
            if (e < k_units) {
                const int d = e / k_per_row, tt = (e % k_per_row) * unit;
                const unsigned blk = s_blk[tt];
                if (blk != NO_BLOCK) {
                    const long long off = (t0 + tt) % block_size;
                    const long long i =
                        (((long long)blk * n_kv_heads + kvh) * hd + d) * block_size + off;
                    raw[j] = *(const uint4*)((const char*)k_cache + i * esize);
                }
            } else if (e < total) {
                const int ev = e - k_units;
                const int tt = ev / v_per_row, d = (ev % v_per_row) * unit;
                const unsigned blk = s_blk[tt];
                const long long t = t0 + tt;
                if (blk != NO_BLOCK && t >= s0 && t < s1) {
                    const long long off = t % block_size;
                    const long long i =
                        (((long long)blk * block_size + off) * n_kv_heads + kvh) * hd + d;
                    raw[j] = *(const uint4*)((const char*)v_cache + i * esize);
                }
            }
        }
#pragma unroll
        for (int j = 0; j < LOADS_IN_FLIGHT; ++j) {
            const int e = base + j * nthreads;
            if (e >= total) {
                continue;
            }
            float* dst;
            if (e < k_units) {
                dst = ks + (e / k_per_row) * TILE + (e % k_per_row) * unit;
            } else {
                const int ev = e - k_units;
                dst = vs + (ev / v_per_row) * hd + (ev % v_per_row) * unit;
            }
            const unsigned w[4] = {raw[j].x, raw[j].y, raw[j].z, raw[j].w};
            if (narrow) {
#pragma unroll
                for (int k = 0; k < 4; ++k) {
                    dst[2 * k] = narrow_to_f32((unsigned short)(w[k] & 0xffffu), kv_dtype);
                    dst[2 * k + 1] = narrow_to_f32((unsigned short)(w[k] >> 16), kv_dtype);
                }
            } else {
#pragma unroll
                for (int k = 0; k < 4; ++k) {
                    dst[k] = __uint_as_float(w[k]);
                }
            }
        }
    }
}

// The step's query rows (the end of the furthest valid sequence's rows,
// at most rows_bound) and splits per row, for a block of `hpb` heads.
// Run by one whole warp; every lane gets the answer.
__device__ void attn_geometry(const unsigned* seqs, int n_seqs, long long rows_bound,
                              int n_heads, int head_blocks, int head_dim, int target_blocks,
                              long long* rows_out, int* splits_out) {
    const int lane = threadIdx.x & 31;
    long long end = 0;
    for (int s = lane; s < n_seqs; s += 32) {
        const unsigned* d = seqs + 4ll * s;
        const long long q_start = d[0], q_len = d[1], kv_len = d[2];
        if (q_len <= kv_len && q_len > 0) {
            end = max(end, q_start + q_len);
        }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        end = max(end, (long long)__shfl_xor_sync(FULL_MASK, end, o));
    }
    const long long rows = min(end, rows_bound);
    long long splits = 1;
    const long long blocks = rows * head_blocks;
    if (rows > 0 && blocks < target_blocks) {
        splits = (target_blocks + blocks - 1) / blocks;
        splits = min(splits, (long long)MAX_SPLITS);
        splits = min(splits, PARTIAL_FLOATS / (rows * n_heads * (head_dim + 2)));
        splits = max(splits, 1ll);
    }
    *rows_out = rows;
    *splits_out = (int)splits;
}

// Dynamic shared memory: q [hpb][head_dim], keys [head_dim][TILE], and
// values [TILE][head_dim] after the keys with FLAG_SEPARATE_KV, else in the
// keys' place (loaded once the scores are taken).
//
// `partials` (several splits only): first (max, sum) pairs, then
// accumulators of head_dim, for each (row, head, split) in that order.
extern "C" __global__ void paged_attention(const float* q, const void* k_cache,
                                           const void* v_cache, const unsigned* seqs,
                                           const unsigned* tables, float* out, float* partials,
                                           int n_seqs, int n_kv_heads, int head_dim,
                                           int block_size, float scale, int window,
                                           unsigned num_blocks, unsigned table_len, int flags,
                                           long long rows_bound, int target_blocks) {
    extern __shared__ float smem[];
    __shared__ int s_seq;
    __shared__ long long s_rows;
    __shared__ int s_splits;
    __shared__ unsigned s_blk[TILE];

    const int hpb = blockDim.x >> 5;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int n_heads = gridDim.y * hpb;
    const int h = blockIdx.y * hpb + warp;
    const int group = n_heads / n_kv_heads;
    const int kvh = (blockIdx.y * hpb) / group;
    const int hd = head_dim;
    const int kv_dtype = (flags & FLAG_BF16) ? DT_BF16 : (flags & FLAG_F16) ? DT_F16 : DT_F32;
    const bool separate_kv = (flags & FLAG_SEPARATE_KV) != 0;
    const bool vec = (flags & FLAG_VEC) != 0;

    float* qs = smem;
    float* ks = smem + hpb * hd;
    float* vs = separate_kv ? ks + TILE * hd : ks;

    if (warp == 0) {
        long long r;
        int sp;
        attn_geometry(seqs, n_seqs, rows_bound, n_heads, gridDim.y, hd, target_blocks, &r, &sp);
        if (lane == 0) {
            s_rows = r;
            s_splits = sp;
        }
    }
    __syncthreads();
    const long long rows = s_rows;
    const int splits = s_splits;
    const long long items = rows * splits;
    float* acc_part = partials + rows * n_heads * splits * 2;

    for (long long item = blockIdx.x; item < items; item += gridDim.x) {
        const long long row = item / splits;
        const int z = (int)(item % splits);
        __syncthreads();  // every warp has read the previous item's s_seq

        // The row's sequence: the first whose query rows hold it.
        if (warp == 0) {
            int found = 0x7fffffff;
            for (int s = lane; s < n_seqs; s += 32) {
                const unsigned* d = seqs + 4ll * s;
                const long long q_start = d[0], q_len = d[1], kv_len = d[2];
                if (row >= q_start && row < q_start + q_len && q_len <= kv_len) {
                    found = min(found, s);
                }
            }
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) {
                found = min(found, __shfl_xor_sync(FULL_MASK, found, o));
            }
            if (lane == 0) {
                s_seq = found == 0x7fffffff ? -1 : found;
            }
        }
        __syncthreads();
        const int si = s_seq;

        // This split's positions [s0, s1) (block-uniform).
        long long s0 = 0, s1 = 0;
        long long table_start = 0;
        if (si >= 0) {
            const unsigned* d = seqs + 4ll * si;
            const long long q_start = d[0], q_len = d[1], kv_len = d[2];
            table_start = d[3];
            const long long pos = kv_len - q_len + (row - q_start);
            long long first = 0;
            if (window > 0 && pos + 1 > window) {
                first = pos + 1 - window;
            }
            const long long span = pos + 1 - first;
            long long chunk = (span + splits - 1) / splits;
            chunk = (chunk + TILE - 1) / TILE * TILE;
            if (splits > 1 && chunk < MIN_SPLIT_CHUNK) {
                chunk = MIN_SPLIT_CHUNK;
            }
            s0 = first + z * chunk;
            s1 = min(s0 + chunk, pos + 1);
            if (s0 > s1) {
                s0 = s1;
            }
        }
        const long long part = (row * n_heads + h) * splits + z;
        if (s0 >= s1) {
            // Nothing to see: an empty partial (a row outside every
            // sequence leaves its output as it was).
            if (splits > 1 && lane == 0) {
                partials[2 * part] = NEG_INF;
                partials[2 * part + 1] = 0.0f;
            }
            continue;
        }

        for (int d = lane; d < hd; d += 32) {
            qs[warp * hd + d] = q[(row * n_heads + h) * hd + d];
        }

        float m = NEG_INF, l = 0.0f;
        float acc[MAX_DIMS];
#pragma unroll
        for (int i = 0; i < MAX_DIMS; ++i) {
            acc[i] = 0.0f;
        }

        // Tiles start at multiples of TILE (16-byte units stay aligned).
        for (long long t0 = s0 / TILE * TILE; t0 < s1; t0 += TILE) {
            __syncthreads();  // the previous tile's readers are done
            if (threadIdx.x < TILE) {
                const long long t = t0 + threadIdx.x;
                unsigned blk = NO_BLOCK;
                if (t < s1) {
                    const long long ti = table_start + t / block_size;
                    if (ti < (long long)table_len) {
                        blk = tables[ti];
                        if (blk >= num_blocks) {
                            blk = NO_BLOCK;
                        }
                    }
                }
                s_blk[threadIdx.x] = blk;
            }
            __syncthreads();
            load_tile(ks, vs, true, separate_kv, k_cache, v_cache, s_blk, t0, s0, s1, block_size,
                      n_kv_heads, kvh, hd, kv_dtype, vec);
            __syncthreads();

            // Lane j scores position t0 + j.
            float s = NEG_INF;
            if (t0 + lane >= s0 && t0 + lane < s1 && s_blk[lane] != NO_BLOCK) {
                const float* qw = qs + warp * hd;
                float dot = 0.0f;
                for (int d = 0; d < hd; ++d) {
                    dot += qw[d] * ks[d * TILE + lane];
                }
                s = dot * scale;
            }

            if (!separate_kv) {
                __syncthreads();  // every warp has scored the keys
                load_tile(ks, vs, false, true, k_cache, v_cache, s_blk, t0, s0, s1, block_size,
                          n_kv_heads, kvh, hd, kv_dtype, vec);
                __syncthreads();
            }

            const float m_new = fmaxf(m, warp_max(s));
            if (m_new != NEG_INF) {  // warp-uniform
                const float alpha = expf(m - m_new);  // 0 while m is -inf
                const float p = s == NEG_INF ? 0.0f : expf(s - m_new);
                l = l * alpha + warp_sum(p);
#pragma unroll
                for (int i = 0; i < MAX_DIMS; ++i) {
                    acc[i] *= alpha;
                }
                const int count = (int)min((long long)TILE, s1 - t0);
                for (int tt = 0; tt < count; ++tt) {
                    const float pt = __shfl_sync(FULL_MASK, p, tt);
#pragma unroll
                    for (int i = 0; i < MAX_DIMS; ++i) {
                        const int d = lane + 32 * i;
                        if (d < hd) {
                            acc[i] += pt * vs[tt * hd + d];
                        }
                    }
                }
                m = m_new;
            }
        }

        if (splits == 1) {
            float* o = out + (row * n_heads + h) * hd;
#pragma unroll
            for (int i = 0; i < MAX_DIMS; ++i) {
                const int d = lane + 32 * i;
                if (d < hd) {
                    o[d] = l > 0.0f ? acc[i] / l : 0.0f;
                }
            }
        } else {
            if (lane == 0) {
                partials[2 * part] = m;
                partials[2 * part + 1] = l;
            }
            float* a = acc_part + part * hd;
#pragma unroll
            for (int i = 0; i < MAX_DIMS; ++i) {
                const int d = lane + 32 * i;
                if (d < hd) {
                    a[d] = acc[i];
                }
            }
        }
    }
}

// Combines the partials of `paged_attention`'s splits, for the same
// geometry (the same arguments): one (row, head) per block at a time,
// grid-stride. Splits with no keys (sum 0) are left out (their
// accumulators are never read); a row none of whose splits saw a key is
// left as it was. Does nothing when the rows took one split.
extern "C" __global__ void attn_reduce(const float* partials, const unsigned* seqs, float* out,
                                       int n_seqs, int n_heads, int head_blocks, int head_dim,
                                       long long rows_bound, int target_blocks) {
    __shared__ float s_w[MAX_SPLITS];
    __shared__ float s_total;
    __shared__ long long s_rows;
    __shared__ int s_splits;
    if (threadIdx.x < 32) {
        long long r;
        int sp;
        attn_geometry(seqs, n_seqs, rows_bound, n_heads, head_blocks, head_dim, target_blocks,
                      &r, &sp);
        if (threadIdx.x == 0) {
            s_rows = r;
            s_splits = sp;
        }
    }
    __syncthreads();
    const long long rows = s_rows;
    const int splits = s_splits;
    if (splits <= 1) {
        return;
    }
    const float* acc = partials + rows * n_heads * splits * 2;
    for (long long item = blockIdx.x; item < rows * n_heads; item += gridDim.x) {
        const long long base = item * splits;  // (row * n_heads + h) * splits
        __syncthreads();  // the previous item's weights are read
        if (threadIdx.x < 32) {
            const int lane = threadIdx.x;
            float mx = NEG_INF;
            for (int s = lane; s < splits; s += 32) {
                if (partials[2 * (base + s) + 1] > 0.0f) {
                    mx = fmaxf(mx, partials[2 * (base + s)]);
                }
            }
            mx = warp_max(mx);
            float total = 0.0f;
            for (int s = lane; s < splits; s += 32) {
                const float ls = partials[2 * (base + s) + 1];
                const float w = ls > 0.0f ? expf(partials[2 * (base + s)] - mx) : 0.0f;
                s_w[s] = w;
                total += w * ls;
            }
            total = warp_sum(total);
            if (lane == 0) {
                s_total = total;
            }
        }
        __syncthreads();
        const float total = s_total;
        if (!(total > 0.0f)) {
            continue;
        }
        for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
            float sum = 0.0f;
            for (int s = 0; s < splits; ++s) {
                const float w = s_w[s];
                if (w > 0.0f) {
                    sum += w * acc[(base + s) * head_dim + d];
                }
            }
            out[item * head_dim + d] = sum / total;
        }
    }
}
