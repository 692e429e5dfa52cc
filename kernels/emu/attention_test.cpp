// attention.cu (paged_attention, then attn_reduce) against an f64 reference
// of causal grouped-query attention over the paged cache (src/cpu/
// attention.rs; the layouts of src/ops/dense.rs KvLayer, the descriptors of
// src/ops/step.rs AttnBatch), launched as src/cuda/attention.rs does.
#include KERNEL_CU
#include "test.h"

struct Desc { unsigned q_start, q_len, kv_len, table_start; };

// `target` small: few or no splits; large: many. `rows_bound` the rows q holds.
static void test_attn(int n_heads, int n_kv, int hd, int bs, int hpb, bool separate, int dtype, bool vec, int window,
                      const std::vector<Desc>& seqs, const std::vector<unsigned>& tables, int rows_bound, int target,
                      unsigned grid_x) {
    const int num_blocks = 12, kvw = n_kv * hd, group = n_heads / n_kv;
    const size_t cells = (size_t)num_blocks * bs * kvw;
    std::vector<float> kf = rv(cells, -1, 1), vf = rv(cells, -1, 1);
    std::vector<unsigned short> k16(cells), v16(cells);
    for (size_t i = 0; i < cells; ++i)
        if (dtype != DT_F32) {
            const bool b = dtype == DT_BF16;
            k16[i] = b ? to_bf16(kf[i]) : to_f16(kf[i]), kf[i] = load_f32(k16.data(), i, dtype);
            v16[i] = b ? to_bf16(vf[i]) : to_f16(vf[i]), vf[i] = load_f32(v16.data(), i, dtype);
        }
    std::vector<float> q = rv((size_t)rows_bound * n_heads * hd, -1, 1), out((size_t)rows_bound * n_heads * hd, 7.0f);
    // The partials as the host sizes them (split_bounds of
    // src/cuda/attention.rs: the worst case over every row count), then a
    // guard that must stay as it is.
    size_t pfloats = 0;
    const long long head_blocks = n_heads / hpb;
    for (long long r = 1; r <= std::min<long long>(rows_bound, target); ++r) {
        if (r * head_blocks >= target) continue;
        long long sp = (target + r * head_blocks - 1) / (r * head_blocks);
        sp = std::min<long long>({sp, MAX_SPLITS, (4 * PARTIAL_FLOATS) / (r * n_heads * (hd + 2) * 4)});
        if (sp > 1) pfloats = std::max<size_t>(pfloats, r * n_heads * sp * (hd + 2));
    }
    std::vector<float> partials(pfloats + 64, NAN);
    for (size_t i = pfloats; i < partials.size(); ++i) partials[i] = -1.5f;
    std::vector<unsigned> words;
    for (auto d : seqs) words.insert(words.end(), {d.q_start, d.q_len, d.kv_len, d.table_start});
    const float scale = 1.0f / std::sqrt((float)hd);
    const int flags = (dtype == DT_BF16 ? FLAG_BF16 : dtype == DT_F16 ? FLAG_F16 : 0) | (separate ? FLAG_SEPARATE_KV : 0) | (vec ? FLAG_VEC : 0);
    const size_t shared = 4 * ((size_t)hpb * hd + (separate ? 2 : 1) * TILE * hd);
    const void* kp = dtype != DT_F32 ? (const void*)k16.data() : kf.data();
    const void* vp = dtype != DT_F32 ? (const void*)v16.data() : vf.data();
    launch(Dim3{grid_x, (unsigned)(n_heads / hpb), 1}, hpb * 32, shared, [&] {
        paged_attention(q.data(), kp, vp, words.data(), tables.data(), out.data(), partials.data(), seqs.size(), n_kv,
                        hd, bs, scale, window, num_blocks, tables.size(), flags, rows_bound, target);
    });
    launch(Dim3{3, 1, 1}, std::min((hd + 31) / 32 * 32, 256), 0, [&] {
        attn_reduce(partials.data(), words.data(), out.data(), seqs.size(), n_heads, n_heads / hpb, hd, rows_bound,
                    target);
    });
    for (size_t i = pfloats; i < partials.size(); ++i) check("attention partials guard", partials[i], -1.5, 0);
    std::vector<char> done(rows_bound);
    for (auto d : seqs) {
        if (d.q_len == 0 || d.q_len > d.kv_len) continue;
        for (unsigned i = 0; i < d.q_len && d.q_start + i < (unsigned)rows_bound; ++i) {
            const int row = d.q_start + i;
            if (done[row]) continue;  // the first sequence holding a row wins
            done[row] = 1;
            const long long pos = d.kv_len - d.q_len + i;
            const long long first = window > 0 && pos + 1 > window ? pos + 1 - window : 0;
            for (int h = 0; h < n_heads; ++h) {
                const int kvh = h / group;
                std::vector<double> sc;
                double mx = -INFINITY;
                for (long long t = first; t <= pos; ++t) {
                    const unsigned blk = tables[d.table_start + t / bs];
                    const long long off = t % bs;
                    double dot = 0;
                    for (int c = 0; c < hd; ++c)
                        dot += (double)q[((size_t)row * n_heads + h) * hd + c] *
                               kf[(((size_t)blk * n_kv + kvh) * hd + c) * bs + off];
                    sc.push_back(dot * scale);
                    mx = std::max(mx, sc.back());
                }
                double sum = 0;
                for (auto& s : sc) sum += s = std::exp(s - mx);
                for (int c = 0; c < hd; ++c) {
                    double o = 0;
                    for (long long t = first; t <= pos; ++t) {
                        const unsigned blk = tables[d.table_start + t / bs];
                        const long long off = t % bs;
                        o += sc[t - first] * vf[(((size_t)blk * bs + off) * n_kv + kvh) * hd + c];
                    }
                    check("attention", out[((size_t)row * n_heads + h) * hd + c], o / sum, 2e-5);
                }
            }
        }
    }
    for (int r = 0; r < rows_bound; ++r)
        if (!done[r])
            for (int i = 0; i < n_heads * hd; ++i) check("attention row of no sequence", out[(size_t)r * n_heads * hd + i], 7, 0);
    printf("attention heads %d/%d hd %d bs %d hpb %d sep %d dtype %d vec %d window %d seqs %zu rows %d target %d: %d fails so far\n",
           n_heads, n_kv, hd, bs, hpb, separate, dtype, vec, window, seqs.size(), rows_bound, target, fails);
}

int main() {
    // Prefill of 5 rows over 40 positions, a decode row over 70, an empty
    // sequence, one with more queries than keys (skipped), a spare row.
    const std::vector<Desc> mixed = {{0, 5, 40, 0}, {5, 1, 70, 5}, {6, 0, 3, 0}, {6, 4, 2, 0}};
    const std::vector<unsigned> tab = {3, 0, 7, 1, 5, 2, 9, 4, 11, 6, 8, 10, 3, 1, 0, 2, 4, 6, 8, 10};
    for (int target : {1, 40, 4000}) {
        test_attn(4, 2, 64, 8, 2, true, DT_F32, true, 0, mixed, tab, 7, target, 5);
        test_attn(4, 1, 40, 8, 4, false, DT_BF16, true, 0, mixed, tab, 7, target, 2);
    }
    test_attn(2, 2, 24, 6, 1, true, DT_BF16, false, 0, mixed, tab, 7, 40, 3);
    test_attn(6, 2, 36, 16, 3, false, DT_F32, false, 0, mixed, tab, 7, 4000, 4);
    test_attn(4, 2, 64, 8, 1, true, DT_F32, true, 17, mixed, tab, 7, 40, 5);
    test_attn(2, 1, 256, 16, 2, false, DT_BF16, true, 33, mixed, tab, 7, 4000, 3);
    // An f16 cache: 16-byte units and element by element.
    test_attn(4, 1, 40, 8, 4, false, DT_F16, true, 0, mixed, tab, 7, 40, 2);
    test_attn(2, 2, 24, 6, 1, true, DT_F16, false, 0, mixed, tab, 7, 4000, 3);
    // Decode, many sequences, one long enough for several MIN_SPLIT_CHUNKs.
    const std::vector<Desc> decode = {{0, 1, 300, 0}, {1, 1, 1, 10}, {2, 1, 33, 11}};
    std::vector<unsigned> tab2;
    for (int i = 0; i < 19; ++i) tab2.push_back((i * 5) % 12);
    test_attn(2, 1, 32, 16, 2, true, DT_F32, true, 0, decode, tab2, 3, 4000, 7);
    test_attn(2, 1, 32, 16, 1, false, DT_BF16, true, 100, decode, tab2, 4, 60, 2);
    // A sequence whose rows run past the rows q holds: those rows are not
    // computed.
    test_attn(2, 1, 32, 8, 2, true, DT_F32, true, 0, {{0, 2, 9, 0}, {2, 4, 30, 2}}, tab, 4, 4000, 3);
    printf("%s (%d fails)\n", fails ? "FAILED" : "ALL OK", fails);
    return fails != 0;
}
