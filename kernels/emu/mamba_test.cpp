// mamba.cu against f64 references: the SSD scan, the causal conv1d with its
// state, and the gated RMSNorm.
#include KERNEL_CU
#include "test.h"
static double softplus64(double x) { return x > 20 ? x : std::log1p(std::exp(x)); }
static double silu64(double x) { return x / (1 + std::exp(-x)); }
static void test_ssd(int nh, int hd, int ds, int ng, bool strided) {
    const int w = nh * hd, bc = ng * ds;
    struct S { int r0, len, slot; };
    std::vector<S> seqs = {{0, 37, 1}, {37, 1, 0}, {38, 0, 2}, {38, 33, 3}};
    const int rows = 72;  // one spare
    const long long xs = strided ? w + 2 * bc : w, bs = strided ? w + 2 * bc : bc;
    std::vector<float> all = rv(rows * (w + 2 * bc), -1, 1);
    std::vector<float> xv(rows * w), bv(rows * bc), cv(rows * bc);
    for (int r = 0; r < rows; ++r) {
        for (int i = 0; i < w; ++i) xv[r * w + i] = all[r * (w + 2 * bc) + i];
        for (int i = 0; i < bc; ++i) bv[r * bc + i] = all[r * (w + 2 * bc) + w + i], cv[r * bc + i] = all[r * (w + 2 * bc) + w + bc + i];
    }
    std::vector<float> dtr = rv(rows * nh, -4, 2), alog = rv(nh, -1, 2), dvals = rv(nh, -1, 1), bias = rv(nh, -1, 1);
    std::vector<unsigned short> d16(nh), b16(nh);
    for (int i = 0; i < nh; ++i) { d16[i] = to_bf16(dvals[i]); dvals[i] = bf16_to_f32(d16[i]); b16[i] = to_f16(bias[i]); bias[i] = f16_to_f32(b16[i]); }
    const int per = w * ds + 5;  // slots a little larger than needed
    std::vector<float> st = rv(4 * per, -1, 1), st0 = st;
    std::vector<float> y(rows * w, 7.0f);
    std::vector<unsigned> words; for (auto s : seqs) { words.push_back(s.r0); words.push_back(s.len); words.push_back(s.slot); }
    const float dtmin = 0.01f, dtmax = 2.0f;
    const float* xp = strided ? all.data() : xv.data();
    const float* bp = strided ? all.data() + w : bv.data();
    const float* cp = strided ? all.data() + w + bc : cv.data();
    const int pblocks = (hd + SSD_WARPS * SSD_ROWS - 1) / (SSD_WARPS * SSD_ROWS);
    launch(Dim3{(unsigned)seqs.size(), (unsigned)(nh * pblocks), 1}, SSD_WARPS * 32, 0, [&] {
        ssd_scan(xp, dtr.data(), bp, cp, alog.data(), d16.data(), b16.data(), y.data(), st.data(), words.data(),
                 seqs.size(), nh, hd, ds, ng, dtmin, dtmax, xs, bs, per, 4, rows, 0, 1, 2);
    });
    for (auto s : seqs) {
        std::vector<double> S(st0.begin() + s.slot * per, st0.begin() + s.slot * per + w * ds);
        for (int row = s.r0; row < s.r0 + s.len; ++row)
            for (int h = 0; h < nh; ++h) {
                int g = h / (nh / ng);
                double dt = std::clamp(softplus64((double)dtr[row * nh + h] + bias[h]), (double)dtmin, (double)dtmax);
                double da = std::exp(-std::exp((double)alog[h]) * dt);
                for (int p = 0; p < hd; ++p) {
                    double xvv = xv[row * w + h * hd + p], acc = 0;
                    for (int k = 0; k < ds; ++k) {
                        double& sv = S[(h * hd + p) * ds + k];
                        sv = sv * da + dt * xvv * bv[row * bc + g * ds + k];
                        acc += sv * cv[row * bc + g * ds + k];
                    }
                    check("ssd y", y[row * w + h * hd + p], acc + dvals[h] * xvv, 2e-5);
                }
            }
        for (int i = 0; i < w * ds; ++i) check("ssd state", st[s.slot * per + i], S[i], 2e-5);
        for (int i = w * ds; i < per; ++i) check("ssd slot tail", st[s.slot * per + i], st0[s.slot * per + i], 0);
    }
    for (int i = 71 * w; i < 72 * w; ++i) check("ssd spare row", y[i], 7.0, 0);
    printf("ssd nh %d hd %d ds %d ng %d strided %d: %d fails so far\n", nh, hd, ds, ng, strided, fails);
}

// `gated`: LFM2's gates, out = post * conv(pre * x), the state keeping pre * x.
static void test_conv(int ch, int k, bool with_bias, bool silu, bool gated = false) {
    struct S { int r0, len, slot; };
    std::vector<S> seqs = {{0, 5, 1}, {5, 1, 0}, {6, 0, 3}, {6, 2, 2}};
    const int rows = 9, km1 = k - 1;
    std::vector<float> x = rv(rows * ch, -2, 2), wf = rv(ch * k, -1, 1), bf = rv(ch, -0.5, 0.5);
    std::vector<float> pre = rv(rows * ch, -1.5, 1.5), post = rv(rows * ch, -1.5, 1.5);
    const float* prep = gated ? pre.data() : nullptr;
    const float* postp = gated ? post.data() : nullptr;
    std::vector<unsigned short> w16(ch * k), b16(ch);
    for (int i = 0; i < ch * k; ++i) { w16[i] = to_bf16(wf[i]); wf[i] = bf16_to_f32(w16[i]); }
    for (int i = 0; i < ch; ++i) { b16[i] = to_f16(bf[i]); bf[i] = f16_to_f32(b16[i]); }
    const int per = ch * km1;
    std::vector<float> st = rv(4 * per, -1, 1), st0 = st, out(rows * ch, 7.0f);
    std::vector<unsigned> words; for (auto s : seqs) { words.push_back(s.r0); words.push_back(s.len); words.push_back(s.slot); }
    unsigned nslots = per == 0 ? 0xffffffffu : 4;
    unsigned gx = std::min<long long>((rows * ch + 255) / 256, std::max<long long>((ch + 255) / 256, (4096 + seqs.size() - 1) / seqs.size()));
    launch(Dim3{gx, (unsigned)seqs.size(), 1}, 256, 0, [&] {
        causal_conv1d(x.data(), w16.data(), with_bias ? b16.data() : nullptr, out.data(), st.data(), words.data(), seqs.size(), ch, k, per, nslots, rows, 1, 2, silu, prep, postp);
    });
    if (km1 > 0)
        launch(Dim3{(unsigned)((ch + 255) / 256), (unsigned)seqs.size(), 1}, 256, 0, [&] {
            conv_state_update(x.data(), st.data(), words.data(), seqs.size(), ch, k, per, nslots, rows, prep);
        });
    for (auto s : seqs)
        for (int c = 0; c < ch; ++c) {
            std::vector<double> hist;
            for (int j = 0; j < km1; ++j) hist.push_back(st0[s.slot * per + j * ch + c]);
            for (int t = 0; t < s.len; ++t) {
                const int at = (s.r0 + t) * ch + c;
                // The state holds f32 products, as the kernel computes them.
                hist.push_back(gated ? (double)(pre[at] * x[at]) : x[at]);
            }
            for (int t = 0; t < s.len; ++t) {
                double acc = with_bias ? bf[c] : 0;
                for (int j = 0; j < k; ++j) acc += wf[c * k + j] * hist[t + j];
                const int at = (s.r0 + t) * ch + c;
                check("conv out", out[at], gated ? post[at] * acc : silu ? silu64(acc) : acc, 1e-5);
            }
            for (int j = 0; j < km1; ++j) check("conv state", st[s.slot * per + j * ch + c], hist[s.len + j], 0);
        }
    for (int i = 8 * ch; i < 9 * ch; ++i) check("conv spare", out[i], 7, 0);
    printf("conv ch %d k %d bias %d silu %d gated %d: %d fails so far\n", ch, k, with_bias, silu, gated, fails);
}

static void test_norm(int rows, int dim, int gs, int order) {
    std::vector<float> x = rv(rows * dim, -3, 3), g = rv(rows * dim, -3, 3), wf = rv(dim, 0.5, 1.5), out(rows * dim, NAN);
    std::vector<unsigned short> w16(dim);
    for (int i = 0; i < dim; ++i) { w16[i] = to_f16(wf[i]); wf[i] = f16_to_f32(w16[i]); }
    const int groups = dim / gs;
    unsigned threads = std::clamp(((gs + 3) / 4 + 31) / 32 * 32, 32, 1024);
    launch(Dim3{(unsigned)(rows * groups), 1, 1}, threads, 0, [&] {
        gated_rms_norm(x.data(), g.data(), w16.data(), out.data(), rows * groups, dim, gs, 1e-5f, order, 2);
    });
    for (int r = 0; r < rows; ++r)
        for (int q = 0; q < groups; ++q) {
            double ss = 0;
            std::vector<double> h(gs);
            for (int i = 0; i < gs; ++i) { int id = r * dim + q * gs + i; h[i] = order == 0 ? x[id] * silu64(g[id]) : x[id]; ss += h[i] * h[i]; }
            double rs = 1 / std::sqrt(ss / gs + 1e-5);
            for (int i = 0; i < gs; ++i) {
                int id = r * dim + q * gs + i;
                double v = h[i] * rs * wf[q * gs + i];
                if (order == 1) v *= silu64(g[id]);
                check("norm", out[id], v, 1e-5);
            }
        }
    printf("norm rows %d dim %d gs %d order %d: %d fails so far\n", rows, dim, gs, order, fails);
}

int main() {
    test_ssd(4, 40, 72, 2, true);
    test_ssd(3, 8, 16, 1, false);
    test_ssd(2, 16, 200, 2, true);
    test_ssd(2, 20, 40, 1, false);
    test_ssd(3, 6, 24, 3, true);
    test_conv(70, 4, true, true);
    test_conv(300, 3, false, false);
    test_conv(33, 2, true, false);
    test_conv(40, 1, true, true);
    test_conv(90, 3, false, false, true);
    test_conv(33, 2, true, false, true);
    test_norm(3, 96, 32, 0);
    test_norm(2, 96, 96, 1);
    test_norm(2, 4100, 4100, 0);
    printf("%s (%d fails)\n", fails ? "FAILED" : "ALL OK", fails);
    return fails != 0;
}
