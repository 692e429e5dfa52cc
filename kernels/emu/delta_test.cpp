// delta.cu against an f64 reference of the CPU backend's recurrence
// (src/cpu/recurrent/delta.rs, the op's contract in src/ops/recurrent.rs),
// launched as src/cuda/delta.rs does.
#include KERNEL_CU
#include "test.h"
static double softplus64(double x) { return x > 20 ? x : std::log1p(std::exp(x)); }

struct Seq { unsigned r0, len, slot; };

static int lanes_per_column(int dk) {
    int l = 1;
    while (l < (dk + MAX_RPL - 1) / MAX_RPL) l <<= 1;
    return std::clamp(l, 1, 32);
}

// `grid_y` below the sequences makes the kernel walk them grid-stride.
// `tiled`: value head h reads key head h % nk (llama.cpp's Qwen3.5 order).
static void test_delta(int nk, int nv, int dk, int dv, const std::vector<Seq>& seqs, int rows, int n_slots,
                       int extra, int a_dtype, int b_dtype, unsigned grid_y, bool tiled = false) {
    const int kw = nk * dk, vw = nv * dv;
    std::vector<float> q = rv((size_t)rows * kw, -1, 1), k = rv((size_t)rows * kw, -1, 1),
                       v = rv((size_t)rows * vw, -1, 1), a = rv((size_t)rows * nv, -3, 3),
                       b = rv((size_t)rows * nv, -3, 3);
    std::vector<float> alog = rv(nv, -2, 1), bias = rv(nv, -1, 1);
    std::vector<unsigned short> alog16(nv), bias16(nv);
    for (int h = 0; h < nv; ++h) {
        if (a_dtype != DT_F32) alog16[h] = a_dtype == DT_BF16 ? to_bf16(alog[h]) : to_f16(alog[h]), alog[h] = load_f32(alog16.data(), h, a_dtype);
        if (b_dtype != DT_F32) bias16[h] = b_dtype == DT_BF16 ? to_bf16(bias[h]) : to_f16(bias[h]), bias[h] = load_f32(bias16.data(), h, b_dtype);
    }
    const int per = nv * dk * dv + extra;
    std::vector<float> st = rv((size_t)n_slots * per + 1, -0.5, 0.5), st0 = st;
    std::vector<float> out((size_t)rows * vw, 7.0f);
    std::vector<unsigned> words;
    for (auto s : seqs) words.insert(words.end(), {s.r0, s.len, s.slot});
    const int lpc = lanes_per_column(dk), cols = DELTA_WARPS * (32 / lpc), col_blocks = (dv + cols - 1) / cols;
    const int flags = a_dtype | (b_dtype << 2) | (__builtin_ctz(lpc) << 4) | ((int)tiled << 7) | ((nv / nk) << 8);
    launch(Dim3{(unsigned)(nv * col_blocks), grid_y, 1}, DELTA_WARPS * 32, 0, [&] {
        gated_delta_rule(q.data(), k.data(), v.data(), a.data(), b.data(),
                         a_dtype == DT_F32 ? (const void*)alog.data() : alog16.data(),
                         b_dtype == DT_F32 ? (const void*)bias.data() : bias16.data(), out.data(), st.data(),
                         words.data(), seqs.size(), nv, dk, dv, rows, n_slots, per, flags);
    });
    std::vector<char> written((size_t)rows, 0), slot_used(n_slots, 0);
    for (auto s : seqs) {
        if (s.len == 0 || s.r0 + s.len > (unsigned)rows || s.slot >= (unsigned)n_slots) continue;
        slot_used[s.slot] = 1;
        for (int h = 0; h < nv; ++h) {
            const int kh = tiled ? h % nk : h / (nv / nk);
            std::vector<double> S(st0.begin() + (size_t)s.slot * per + (size_t)h * dk * dv,
                                  st0.begin() + (size_t)s.slot * per + (size_t)(h + 1) * dk * dv);
            const double neg_a = -std::exp((double)alog[h]);
            for (unsigned t = 0; t < s.len; ++t) {
                const size_t row = s.r0 + t;
                written[row] = 1;
                std::vector<double> kk(dk), qq(dk);
                double sk = 0, sq = 0;
                for (int i = 0; i < dk; ++i) {
                    kk[i] = k[row * kw + kh * dk + i], qq[i] = q[row * kw + kh * dk + i];
                    sk += kk[i] * kk[i], sq += qq[i] * qq[i];
                }
                const double rk = 1 / std::sqrt(sk + 1e-6), rq = 1 / std::sqrt((double)dk) / std::sqrt(sq + 1e-6);
                for (int i = 0; i < dk; ++i) kk[i] *= rk, qq[i] *= rq;
                const double eg = std::exp(neg_a * softplus64((double)a[row * nv + h] + bias[h]));
                const double beta = 1 / (1 + std::exp(-(double)b[row * nv + h]));
                for (int j = 0; j < dv; ++j) {
                    double kv = 0;
                    for (int i = 0; i < dk; ++i) kv += (S[i * dv + j] *= eg) * kk[i];
                    const double d = (v[row * vw + h * dv + j] - kv) * beta;
                    double o = 0;
                    for (int i = 0; i < dk; ++i) o += (S[i * dv + j] += kk[i] * d) * qq[i];
                    check("delta out", out[row * vw + h * dv + j], o, 2e-5);
                }
            }
            for (int i = 0; i < dk * dv; ++i)
                check("delta state", st[(size_t)s.slot * per + (size_t)h * dk * dv + i], S[i], 2e-5);
        }
        for (int i = nv * dk * dv; i < per; ++i) check("delta slot tail", st[(size_t)s.slot * per + i], st0[(size_t)s.slot * per + i], 0);
    }
    for (int r = 0; r < rows; ++r)
        if (!written[r])
            for (int i = 0; i < vw; ++i) check("delta row of no sequence", out[(size_t)r * vw + i], 7, 0);
    for (int sl = 0; sl < n_slots; ++sl)
        if (!slot_used[sl])
            for (int i = 0; i < per; ++i) check("delta unused slot", st[(size_t)sl * per + i], st0[(size_t)sl * per + i], 0);
    check("delta past the pool", st[(size_t)n_slots * per], st0[(size_t)n_slots * per], 0);
    printf("delta nk %d nv %d dk %d dv %d lpc %d seqs %zu grid_y %u dtypes %d/%d: %d fails so far\n", nk, nv, dk, dv,
           lpc, seqs.size(), grid_y, a_dtype, b_dtype, fails);
}

int main() {
    // Prefill, decode, a zero-length sequence, one past the rows and one
    // past the pool (both skipped), a spare row.
    const std::vector<Seq> mixed = {{0, 9, 2}, {9, 1, 0}, {10, 0, 1}, {10, 4, 1}, {12, 5, 3}, {14, 1, 9}};
    test_delta(2, 4, 16, 24, mixed, 15, 4, 3, DT_F32, DT_BF16, 6);
    test_delta(2, 6, 16, 24, mixed, 15, 4, 3, DT_F32, DT_F32, 6, true);
    test_delta(1, 2, 128, 40, mixed, 15, 4, 0, DT_BF16, DT_F16, 2);
    test_delta(2, 2, 100, 9, mixed, 15, 4, 5, DT_F16, DT_F32, 1);
    test_delta(1, 1, 256, 33, {{0, 3, 0}, {3, 2, 1}}, 5, 2, 0, DT_F32, DT_F32, 2);
    test_delta(3, 3, 3, 130, {{1, 6, 1}, {7, 1, 0}}, 8, 2, 1, DT_BF16, DT_BF16, 1);
    test_delta(1, 4, 8, 7, {{0, 0, 0}}, 2, 1, 0, DT_F32, DT_F32, 1);
    // Qwen3-Next's head shape (two of its v heads), a 64-token prefill and a decode.
    test_delta(1, 2, 128, 128, {{0, 64, 1}, {64, 1, 0}}, 65, 2, 0, DT_F32, DT_BF16, 2);
    printf("%s (%d fails)\n", fails ? "FAILED" : "ALL OK", fails);
    return fails != 0;
}
