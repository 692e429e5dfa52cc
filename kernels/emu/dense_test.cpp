// dense.cu against references following the CPU backend (src/cpu/dense.rs):
// f64 where the kernel rounds, exact where it moves or adds in a fixed order.
#include KERNEL_CU
#include "test.h"
static double sig64(double x) { return 1 / (1 + std::exp(-x)); }

static void test_embedding(int dtype) {
    const int vocab = 50, hidden = 37, n = 9;
    std::vector<float> tf = rv(vocab * hidden, -1, 1);
    std::vector<unsigned short> t16(vocab * hidden);
    for (int i = 0; i < vocab * hidden; ++i)
        if (dtype != DT_F32) t16[i] = dtype == DT_BF16 ? to_bf16(tf[i]) : to_f16(tf[i]), tf[i] = load_f32(t16.data(), i, dtype);
    std::vector<unsigned> ids = {0, 49, 3, 50, 7, 0xffffffffu, 3, 20, 1};
    std::vector<float> out(n * hidden + 1, 7.0f);
    launch(Dim3{2, 1, 1}, 64, 0, [&] {
        embedding(dtype == DT_F32 ? (const void*)tf.data() : t16.data(), ids.data(), out.data(), n, hidden, vocab, dtype);
    });
    for (int i = 0; i < n; ++i)
        for (int c = 0; c < hidden; ++c)
            check("embedding", out[i * hidden + c], ids[i] < (unsigned)vocab ? tf[ids[i] * hidden + c] : 0.0f, 0);
    check("embedding past the end", out[n * hidden], 7, 0);
}

static void test_rms_norm(int rows, int dim, unsigned threads, float offset, int dtype) {
    std::vector<float> x = rv(rows * dim, -3, 3), wf = rv(dim, -1, 1), out(rows * dim + 1, 7.0f);
    std::vector<unsigned short> w16(dim);
    for (int i = 0; i < dim; ++i)
        if (dtype != DT_F32) w16[i] = dtype == DT_BF16 ? to_bf16(wf[i]) : to_f16(wf[i]), wf[i] = load_f32(w16.data(), i, dtype);
    launch(Dim3{(unsigned)rows + 1, 1, 1}, threads, 0, [&] {
        rms_norm(x.data(), dtype == DT_F32 ? (const void*)wf.data() : w16.data(), out.data(), rows, dim, 1e-6f, offset, dtype);
    });
    for (int r = 0; r < rows; ++r) {
        double ss = 0;
        for (int c = 0; c < dim; ++c) ss += (double)x[r * dim + c] * x[r * dim + c];
        const double rs = 1 / std::sqrt(ss / dim + 1e-6);
        for (int c = 0; c < dim; ++c) check("rms_norm", out[r * dim + c], x[r * dim + c] * rs * ((double)offset + wf[c]), 2e-6);
    }
    check("rms_norm past the rows", out[rows * dim], 7, 0);
}

static void test_rope(int rows, int heads, int hd, int rot, float scaling) {
    std::vector<float> x = rv(rows * heads * hd, -1, 1), x0 = x, inv(rot / 2);
    for (int i = 0; i < rot / 2; ++i) inv[i] = std::pow(10000.0f, -2.0f * i / rot);
    std::vector<unsigned> pos(rows);
    for (int r = 0; r < rows; ++r) pos[r] = r * 37 % 5000;
    launch(Dim3{3, 1, 1}, 128, 0, [&] { rope(x.data(), pos.data(), inv.data(), rows, heads, hd, rot, scaling); });
    for (int r = 0; r < rows; ++r)
        for (int h = 0; h < heads; ++h) {
            const float* a = &x0[(r * heads + h) * hd];
            const float* g = &x[(r * heads + h) * hd];
            for (int i = 0; i < hd; ++i) {
                if (i >= rot) { check("rope untouched", g[i], a[i], 0); continue; }
                const int half = rot / 2, p = i % half;
                const double ang = (float)pos[r] * inv[p];  // the angle in f32, as the CPU
                const double c = std::cos(ang) * scaling, s = std::sin(ang) * scaling;
                const double want = i < half ? a[i] * c - a[i + half] * s : a[i] * c + a[i - half] * s;
                check("rope", g[i], want, 2e-5);
            }
        }
}

// The f16 cache's rounding: nearest even, held within +-65504, NaN kept.
static unsigned short to_f16_sat(float x) {
    return to_f16(x > 65504.0f ? 65504.0f : (x < -65504.0f ? -65504.0f : x));
}

static void test_kv_store(int dtype) {
    const int n = 7, kvw = 12, bs = 4, cap = 20;
    std::vector<float> k = rv(n * kvw, -2, 2), v = rv(n * kvw, -2, 2);
    // Values past f16's range (held at its largest) and a NaN (kept).
    k[3] = 1e6f, v[5] = -7e4f, k[kvw + 1] = INFINITY, v[kvw + 2] = NAN;
    std::vector<unsigned> slots = {0, 5, 19, 20, 3, 100, 8};
    const size_t cells = (size_t)(cap / bs) * kvw * bs + 1;
    std::vector<float> kc(cells, 7.0f), vc(cells, 7.0f);
    std::vector<unsigned short> kc16(cells, 0xabcd), vc16(cells, 0xabcd);
    const bool narrow = dtype != DT_F32;
    void* kp = narrow ? (void*)kc16.data() : kc.data();
    void* vp = narrow ? (void*)vc16.data() : vc.data();
    launch(Dim3{1, 1, 1}, 32, 0, [&] { kv_store(k.data(), v.data(), kp, vp, slots.data(), n, kvw, bs, cap, dtype); });
    auto held = [&](float x) -> double {
        return dtype == DT_BF16 ? to_bf16(x) : dtype == DT_F16 ? to_f16_sat(x) : x;
    };
    std::vector<double> wk(cells, narrow ? 0xabcd : 7.0), wv = wk;
    for (int i = 0; i < n; ++i) {
        if (slots[i] >= (unsigned)cap) continue;
        const int blk = slots[i] / bs, off = slots[i] % bs;
        for (int c = 0; c < kvw; ++c) {
            const size_t ki = ((size_t)blk * kvw + c) * bs + off, vi = (size_t)slots[i] * kvw + c;
            wk[ki] = held(k[i * kvw + c]);
            wv[vi] = held(v[i * kvw + c]);
        }
    }
    for (size_t i = 0; i < cells; ++i) {
        // Compared as bits where narrow (a NaN's bits equal themselves).
        if (narrow) {
            check("kv_store k", kc16[i], wk[i], 0);
            check("kv_store v", vc16[i], wv[i], 0);
        } else {
            // Exactly as given, infinities and NaNs included.
            auto same = [](double got, double want) { return got == want || (std::isnan(got) && std::isnan(want)); };
            check("kv_store k", same(kc[i], wk[i]), 1, 0);
            check("kv_store v", same(vc[i], wv[i]), 1, 0);
        }
    }
    if (dtype == DT_F16) {
        check("kv_store f16 saturates", kc16[(0 * kvw + 3) * bs + 0], 0x7bff, 0);
        check("kv_store f16 saturates", vc16[0 * kvw + 5], 0xfbff, 0);
    }
}

static void test_elementwise() {
    const long long n = 1000;
    std::vector<float> g = rv(n, -6, 6), u = rv(n, -2, 2), out(n + 1, 7.0f);
    launch(Dim3{2, 1, 1}, 128, 0, [&] { silu_mul(g.data(), u.data(), out.data(), n); });
    for (int i = 0; i < n; ++i) check("silu_mul", out[i], g[i] * sig64(g[i]) * u[i], 2e-6);
    std::vector<float> gi = g;
    launch(Dim3{1, 1, 1}, 64, 0, [&] { silu_mul(gi.data(), u.data(), gi.data(), n); });
    for (int i = 0; i < n; ++i) check("silu_mul in place", gi[i], out[i], 0);
    launch(Dim3{3, 1, 1}, 32, 0, [&] { relu2(g.data(), out.data(), n); });
    for (int i = 0; i < n; ++i) check("relu2", out[i], g[i] > 0 ? (double)g[i] * g[i] : 0.0, 1e-7);
    launch(Dim3{3, 1, 1}, 32, 0, [&] { sigmoid_mul(u.data(), g.data(), out.data(), n); });
    for (int i = 0; i < n; ++i) check("sigmoid_mul", out[i], u[i] * sig64(g[i]), 2e-6);
    check("elementwise past n", out[n], 7, 0);
    std::vector<float> acc = rv(n, -1, 1), acc0 = acc;
    launch(Dim3{2, 1, 1}, 64, 0, [&] { add_scaled(acc.data(), u.data(), 1.0f, n); });
    for (int i = 0; i < n; ++i) check("add_scaled 1", acc[i], acc0[i] + u[i], 0);
    acc = acc0;
    launch(Dim3{2, 1, 1}, 64, 0, [&] { add_scaled(acc.data(), u.data(), -0.37f, n); });
    for (int i = 0; i < n; ++i) check("add_scaled", acc[i], acc0[i] + -0.37 * u[i], 1e-6);
    acc = acc0;
    launch(Dim3{1, 1, 1}, 96, 0, [&] { scale(acc.data(), 3.5f, n); });
    for (int i = 0; i < n; ++i) check("scale", acc[i], acc0[i] * 3.5, 1e-7);
}

static void test_bias_cols_rows() {
    const int m = 5, n = 23;
    for (int dtype = 0; dtype < 3; ++dtype) {
        std::vector<float> out = rv(m * n, -1, 1), out0 = out, bf = rv(n, -1, 1);
        std::vector<unsigned short> b16(n);
        for (int i = 0; i < n; ++i)
            if (dtype != DT_F32) b16[i] = dtype == DT_BF16 ? to_bf16(bf[i]) : to_f16(bf[i]), bf[i] = load_f32(b16.data(), i, dtype);
        launch(Dim3{1, 1, 1}, 32, 0, [&] { bias_add(out.data(), dtype == DT_F32 ? (const void*)bf.data() : b16.data(), m, n, dtype); });
        for (int i = 0; i < m * n; ++i) check("bias_add", out[i], out0[i] + bf[i % n], 1e-7);
    }
    const int rows = 4, sw = 30, c0 = 7, cols = 11;
    std::vector<float> src = rv(rows * sw, -1, 1), dst(rows * cols + 1, 7.0f);
    launch(Dim3{2, 1, 1}, 32, 0, [&] { copy_cols(src.data(), dst.data(), rows, sw, c0, cols); });
    for (int r = 0; r < rows; ++r)
        for (int c = 0; c < cols; ++c) check("copy_cols", dst[r * cols + c], src[r * sw + c0 + c], 0);
    check("copy_cols past the end", dst[rows * cols], 7, 0);
    std::vector<float> wide(rows * sw, 7.0f);
    launch(Dim3{2, 1, 1}, 32, 0, [&] { scatter_cols(dst.data(), wide.data(), rows, cols, sw, c0); });
    for (int r = 0; r < rows; ++r)
        for (int c = 0; c < sw; ++c)
            check("scatter_cols", wide[r * sw + c], c >= c0 && c < c0 + cols ? src[r * sw + c] : 7.0f, 0);
    // gather_rows of 1-, 2- and 4-byte units; a row past the source is skipped.
    for (int unit : {1, 2, 4}) {
        const long long ru = 9, src_rows = 6;
        std::vector<unsigned char> s(src_rows * ru * unit);
        for (auto& b : s) b = rng();
        std::vector<unsigned> idx = {5, 0, 6, 2, 2, 99};
        std::vector<unsigned char> o(idx.size() * ru * unit + 4, 0xee);
        launch(Dim3{1, 1, 1}, 32, 0, [&] { gather_rows(s.data(), idx.data(), o.data(), idx.size(), ru, src_rows, unit); });
        for (size_t i = 0; i < idx.size(); ++i)
            for (long long b = 0; b < ru * unit; ++b)
                check("gather_rows", o[i * ru * unit + b], idx[i] < src_rows ? s[idx[i] * ru * unit + b] : 0xee, 0);
        check("gather_rows past the end", o[idx.size() * ru * unit], 0xee, 0);
    }
    // scatter_add_rows: repeated rows add in entry order (exact), a row past dst skipped.
    const int ne = 8, w = 70, dr = 4;
    std::vector<float> sa = rv(ne * w, -1, 1), wt = rv(ne, 0, 1), d = rv(dr * w, -1, 1);
    std::vector<unsigned> rr = {1, 3, 1, 0, 4, 1, 3, 2};
    std::vector<float> want = d;
    for (int i = 0; i < ne; ++i)
        if (rr[i] < (unsigned)dr)
            for (int c = 0; c < w; ++c) want[rr[i] * w + c] += wt[i] * sa[i * w + c];
    launch(Dim3{1, 1, 1}, 32, 0, [&] { scatter_add_rows(sa.data(), rr.data(), wt.data(), d.data(), ne, w, dr); });
    for (int i = 0; i < dr * w; ++i) check("scatter_add_rows", d[i], want[i], 0);
}

int main() {
    for (int dt = 0; dt < 3; ++dt) test_embedding(dt);
    printf("embedding: %d fails so far\n", fails);
    test_rms_norm(3, 96, 32, 0.0f, DT_F32);
    test_rms_norm(2, 1000, 256, 1.0f, DT_BF16);
    test_rms_norm(2, 7, 64, 0.5f, DT_F16);
    printf("rms_norm: %d fails so far\n", fails);
    test_rope(5, 3, 16, 16, 1.0f);
    test_rope(4, 2, 24, 8, 1.25f);
    printf("rope: %d fails so far\n", fails);
    test_kv_store(DT_F32);
    test_kv_store(DT_BF16);
    test_kv_store(DT_F16);
    printf("kv_store: %d fails so far\n", fails);
    test_elementwise();
    printf("elementwise: %d fails so far\n", fails);
    test_bias_cols_rows();
    printf("bias, columns, rows: %d fails so far\n", fails);
    printf("%s (%d fails)\n", fails ? "FAILED" : "ALL OK", fails);
    return fails != 0;
}
