// moe.cu against references following the CPU backend (src/cpu/moe.rs,
// src/cpu/routing.rs): the routers in f64 (the choice must match up to
// near-ties; exact ties go to the lower index), the grouping exactly, the
// grouped matmuls and the shared expert's gate in f64.
#include KERNEL_CU
#include "test.h"
#include <numeric>
static double sig64(double x) { return 1 / (1 + std::exp(-x)); }

// Logits: uniform, or quantized to a few values so that exact ties occur.
static std::vector<float> logits(size_t n, bool ties) {
    std::vector<float> l = rv(n, -4, 4);
    if (ties)
        for (auto& x : l) x = std::round(x);
    return l;
}

// Checks a row's routes against `order` (the reference ranking) and `score`
// (what ranks); a different expert is accepted only at a near-tie.
static void check_route(const char* what, const unsigned* got_e, const float* got_w, const std::vector<int>& order,
                        const std::vector<double>& score, const std::vector<double>& weight, int k) {
    std::vector<char> seen(score.size());
    for (int j = 0; j < k; ++j) {
        const unsigned e = got_e[j];
        if (e >= score.size() || seen[e]) {
            check(what, e, order[j], 0);
            continue;
        }
        seen[e] = 1;
        // An exact tie goes to the lower index; a near-tie either way.
        const double gap = std::fabs(score[e] - score[order[j]]);
        if ((int)e != order[j] && !(gap > 0 && gap < 1e-6)) check(what, e, order[j], 0);
        check(what, got_w[j], weight[e], 1e-5);
    }
}

static void test_softmax(int rows, int n, int k, bool renorm, bool ties) {
    std::vector<float> l = logits((size_t)rows * n, ties);
    std::vector<unsigned> ex(rows * k + 1, 0xdeadu);
    std::vector<float> w(rows * k + 1, 7.0f);
    launch(Dim3{(unsigned)rows, 1, 1}, ROUTER_THREADS, n * 5, [&] {
        softmax_topk(l.data(), ex.data(), w.data(), rows, n, k, renorm);
    });
    for (int r = 0; r < rows; ++r) {
        std::vector<double> p(n);
        double mx = -INFINITY, sum = 0;
        for (int i = 0; i < n; ++i) mx = std::max(mx, (double)l[r * n + i]);
        for (int i = 0; i < n; ++i) sum += p[i] = std::exp(l[r * n + i] - mx);
        for (auto& x : p) x /= sum;
        std::vector<int> order(n);
        std::iota(order.begin(), order.end(), 0);
        std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return p[a] > p[b]; });
        double denom = 1;
        if (renorm) {
            denom = 0;
            for (int j = 0; j < k; ++j) denom += p[order[j]];
        }
        std::vector<double> wt(n);
        for (int i = 0; i < n; ++i) wt[i] = p[i] / denom;
        check_route("softmax_topk", &ex[r * k], &w[r * k], order, p, wt, k);
    }
    check("softmax_topk past the rows", ex[rows * k], 0xdeadu, 0);
    check("softmax_topk past the rows", w[rows * k], 7, 0);
    printf("softmax_topk rows %d n %d k %d renorm %d ties %d: %d fails so far\n", rows, n, k, renorm, ties, fails);
}

static void test_sigmoid(int rows, int n, int k, int n_group, int topk_group, int bias_dtype, bool renorm,
                         float scale, bool ties, float eps = 1e-20f) {
    std::vector<float> l = logits((size_t)rows * n, ties);
    std::vector<float> bias = rv(n, -0.5, 0.5);
    if (ties)
        for (auto& x : bias) x = std::round(x * 4) / 4;
    std::vector<unsigned short> b16(n);
    for (int i = 0; i < n; ++i) {
        if (bias_dtype == DT_BF16) b16[i] = to_bf16(bias[i]), bias[i] = bf16_to_f32(b16[i]);
        if (bias_dtype == DT_F16) b16[i] = to_f16(bias[i]), bias[i] = emu_f16_to_f32(b16[i]);
    }
    const void* bp = bias_dtype < 0 ? nullptr : bias_dtype == DT_F32 ? (const void*)bias.data() : b16.data();
    std::vector<unsigned> ex(rows * k + 1, 0xdeadu);
    std::vector<float> w(rows * k + 1, 7.0f);
    const int shared = 8 * n + 4 * n_group + n + n_group;
    launch(Dim3{(unsigned)rows, 1, 1}, ROUTER_THREADS, shared, [&] {
        sigmoid_topk(l.data(), bp, std::max(bias_dtype, 0), ex.data(), w.data(), rows, n, k, n_group, topk_group,
                     renorm, scale, eps);
    });
    const int per = n / n_group;
    for (int r = 0; r < rows; ++r) {
        std::vector<double> s(n), c(n);
        for (int i = 0; i < n; ++i) {
            s[i] = sig64(l[r * n + i]);
            c[i] = s[i] + (bp ? bias[i] : 0.0);
        }
        std::vector<double> gs(n_group);
        for (int g = 0; g < n_group; ++g) {
            double first = -INFINITY, second = -INFINITY;
            for (int i = g * per; i < (g + 1) * per; ++i) {
                if (c[i] > first) second = first, first = c[i];
                else if (c[i] > second) second = c[i];
            }
            gs[g] = per == 1 ? first : first + second;
        }
        std::vector<int> gorder(n_group);
        std::iota(gorder.begin(), gorder.end(), 0);
        std::stable_sort(gorder.begin(), gorder.end(), [&](int a, int b) { return gs[a] > gs[b]; });
        std::vector<char> kept(n_group);
        for (int j = 0; j < topk_group; ++j) kept[gorder[j]] = 1;
        std::vector<int> order;
        for (int i = 0; i < n; ++i)
            if (kept[i / per]) order.push_back(i);
        std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return c[a] > c[b]; });
        double denom = 1;
        if (renorm) {
            denom = eps;
            for (int j = 0; j < k; ++j) denom += s[order[j]];
        }
        std::vector<double> wt(n);
        for (int i = 0; i < n; ++i) wt[i] = s[i] / denom * scale;
        check_route("sigmoid_topk", &ex[r * k], &w[r * k], order, c, wt, k);
    }
    check("sigmoid_topk past the rows", ex[rows * k], 0xdeadu, 0);
    printf("sigmoid_topk rows %d n %d k %d groups %d keep %d bias %d renorm %d ties %d: %d fails so far\n", rows, n,
           k, n_group, topk_group, bias_dtype, renorm, ties, fails);
}

// `bad`: this many entries name an expert >= n_experts (skipped).
static void test_group(int rows, int k, int n_experts, int bad, bool skewed) {
    const int entries = rows * k;
    std::vector<unsigned> ex(entries + 1);
    std::uniform_int_distribution<int> d(0, n_experts - 1);
    for (int i = 0; i < entries; ++i) {
        int e = d(rng);
        if (skewed) e = e % 3 == 0 ? e : (e & 1) * (n_experts - 1);  // many on two experts
        ex[i] = e;
    }
    for (int j = 0; j < bad && entries > 0; ++j) ex[(j * 7919) % entries] = n_experts + (j % 3 == 2 ? 1000000 : j);
    std::vector<float> w = rv(entries + 1, 0, 1);
    std::vector<unsigned> off(n_experts + 2, 0xdeadu), rows_out(entries + 1, 0xdeadu);
    std::vector<float> wout(entries + 1, 7.0f);
    launch(Dim3{1, 1, 1}, GROUP_THREADS, 4 * n_experts, [&] {
        moe_group(ex.data(), w.data(), off.data(), rows_out.data(), wout.data(), entries, std::max(k, 1), n_experts);
    });
    std::vector<unsigned> want_off(n_experts + 1, 0);
    for (int i = 0; i < entries; ++i)
        if (ex[i] < (unsigned)n_experts) want_off[ex[i] + 1]++;
    for (int e = 0; e < n_experts; ++e) want_off[e + 1] += want_off[e];
    std::vector<unsigned> next(want_off.begin(), want_off.end() - 1), want_rows(entries, 0xdeadu);
    std::vector<float> want_w(entries, 7.0f);
    for (int i = 0; i < entries; ++i)
        if (ex[i] < (unsigned)n_experts) {
            want_rows[next[ex[i]]] = i / k;
            want_w[next[ex[i]]++] = w[i];
        }
    for (int e = 0; e <= n_experts; ++e) check("moe_group offsets", off[e], want_off[e], 0);
    check("moe_group offsets tail", off[n_experts + 1], 0xdeadu, 0);
    for (int i = 0; i <= entries; ++i) {
        check("moe_group rows", rows_out[i], i < entries ? want_rows[i] : 0xdeadu, 0);
        check("moe_group weights", wout[i], i < entries ? want_w[i] : 7.0f, 0);
    }
    printf("moe_group rows %d k %d experts %d bad %d skewed %d: %d fails so far\n", rows, k, n_experts, bad, skewed,
           fails);
}

// Expert e gets counts[e] rows (offsets their prefix sums, ending at
// `entries`, or past it with `overrun`).
static void test_gemm(const std::vector<int>& counts, int n, int k, int dtype, bool swiglu, bool overrun = false) {
    const int ne = counts.size();
    std::vector<unsigned> off(ne + 1, 0);
    for (int e = 0; e < ne; ++e) off[e + 1] = off[e] + counts[e];
    const int entries = off[ne] - (overrun ? 5 : 0);
    std::vector<float> x = rv((size_t)entries * k, -1, 1);
    x.resize(x.size() + 64, NAN);  // a read past the operand poisons a result
    std::vector<std::vector<float>> wf(ne), uf(ne);
    std::vector<std::vector<unsigned short>> w16(ne), u16(ne);
    std::vector<unsigned long long> tg(ne), tu(ne);
    for (int e = 0; e < ne; ++e) {
        if (counts[e] == 0 && e % 2 == 0) continue;  // an expert with no rows may have no weight
        wf[e] = rv((size_t)n * k, -1, 1);
        uf[e] = rv((size_t)n * k, -1, 1);
        wf[e].resize(n * k + 64, NAN);
        uf[e].resize(n * k + 64, NAN);
        if (dtype != DT_F32) {
            w16[e].resize(n * k + 64, 0x7fc0);
            u16[e].resize(n * k + 64, 0x7fc0);
            for (int i = 0; i < n * k; ++i) {
                w16[e][i] = dtype == DT_BF16 ? to_bf16(wf[e][i]) : to_f16(wf[e][i]);
                u16[e][i] = dtype == DT_BF16 ? to_bf16(uf[e][i]) : to_f16(uf[e][i]);
                wf[e][i] = load_f32(w16[e].data(), i, dtype);
                uf[e][i] = load_f32(u16[e].data(), i, dtype);
            }
            tg[e] = (unsigned long long)w16[e].data();
            tu[e] = (unsigned long long)u16[e].data();
        } else {
            tg[e] = (unsigned long long)wf[e].data();
            tu[e] = (unsigned long long)uf[e].data();
        }
    }
    std::vector<float> out((size_t)(entries + 1) * n, 7.0f), up((size_t)(entries + 1) * n, 7.0f);
    const unsigned row_tiles = (entries + TM - 1) / TM + std::min(ne, entries);
    const unsigned col_tiles = (n + TN - 1) / TN;
    launch(Dim3{row_tiles, col_tiles, 1}, GM_THREADS, 0, [&] {
        if (swiglu)
            grouped_matmul_swiglu(x.data(), tg.data(), tu.data(), dtype, off.data(), out.data(), up.data(), entries, n,
                                  k, ne);
        else
            grouped_matmul(x.data(), tg.data(), dtype, off.data(), out.data(), entries, n, k, ne);
    });
    std::vector<char> covered(entries + 1);
    for (int e = 0; e < ne; ++e)
        for (int r = std::min<int>(off[e], entries); r < std::min<int>(off[e + 1], entries); ++r) {
            covered[r] = 1;
            for (int c = 0; c < n; ++c) {
                double g = 0, u = 0, mag = 0;
                for (int i = 0; i < k; ++i) {
                    const float xi = x[(size_t)r * k + i];
                    const double xr = dtype == DT_BF16 ? bf16_to_f32(to_bf16(xi))
                                      : dtype == DT_F16 ? emu_f16_to_f32(to_f16(xi))
                                                        : xi;
                    g += xr * wf[e][(size_t)c * k + i];
                    u += xr * uf[e][(size_t)c * k + i];
                    mag += std::fabs(xr);
                }
                const double tol = 1e-6 * (1 + mag);
                if (swiglu) {
                    check("grouped_matmul_swiglu out", out[(size_t)r * n + c], g * sig64(g) * u, tol * (1 + std::fabs(u)));
                    check("grouped_matmul_swiglu up", up[(size_t)r * n + c], u, tol);
                } else {
                    check("grouped_matmul out", out[(size_t)r * n + c], g, tol);
                }
            }
        }
    for (int r = 0; r <= entries; ++r)
        if (!covered[r])
            for (int c = 0; c < n; ++c) check("grouped_matmul row of no expert", out[(size_t)r * n + c], 7, 0);
    printf("grouped_matmul%s experts %d entries %d n %d k %d dtype %d overrun %d: %d fails so far\n",
           swiglu ? "_swiglu" : "", ne, entries, n, k, dtype, overrun, fails);
}

static void test_gate_add(int rows, int width, unsigned blocks) {
    const long long n = (long long)rows * width;
    std::vector<float> acc = rv(n + 1, -1, 1), acc0 = acc, x = rv(n, -2, 2), g = rv(rows, -5, 5);
    launch(Dim3{blocks, 1, 1}, 256, 0, [&] { sigmoid_gate_add(acc.data(), x.data(), g.data(), width, n); });
    for (long long i = 0; i < n; ++i) check("sigmoid_gate_add", acc[i], acc0[i] + sig64(g[i / width]) * x[i], 1e-6);
    check("sigmoid_gate_add past the end", acc[n], acc0[n], 0);
    printf("sigmoid_gate_add rows %d width %d blocks %u: %d fails so far\n", rows, width, blocks, fails);
}

int main() {
    test_softmax(3, 8, 2, true, false);
    test_softmax(2, 128, 8, true, false);
    test_softmax(2, 300, 6, false, false);
    test_softmax(2, 60, 60, true, false);
    test_softmax(4, 64, 4, true, true);
    test_softmax(1, 5, 1, false, true);
    test_softmax(2, 512, 10, true, false);  // Qwen3-Next's router
    test_sigmoid(3, 256, 8, 8, 4, DT_BF16, true, 2.5f, false);
    test_sigmoid(2, 128, 6, 1, 1, -1, true, 1.0f, false);
    test_sigmoid(2, 64, 4, 64, 4, DT_F32, false, 1.5f, false);
    test_sigmoid(2, 72, 5, 6, 3, DT_F16, true, 1.0f, false);
    test_sigmoid(4, 64, 8, 8, 2, DT_F32, true, 1.0f, true);
    test_sigmoid(2, 200, 16, 4, 2, DT_BF16, true, 1.0f, true);
    // LFM2-MoE: one group, the expert bias, renormalised with 1e-6.
    test_sigmoid(3, 32, 4, 1, 1, DT_F32, true, 1.5f, false, 1e-6f);
    test_group(3, 2, 4, 0, false);
    test_group(300, 8, 64, 5, false);
    test_group(200, 6, 1500, 0, false);
    test_group(500, 4, 16, 3, true);
    test_group(0, 8, 10, 0, false);
    test_group(1, 1, 1, 0, false);
    for (int sw = 0; sw < 2; ++sw) {
        test_gemm({3, 0, 70, 1, 0, 64, 130}, 72, 40, DT_F32, sw);
        test_gemm({0, 65, 2, 0}, 64, 64, DT_BF16, sw);
        test_gemm({5, 17, 0, 129}, 130, 33, DT_F16, sw);
        test_gemm({1}, 3, 7, DT_BF16, sw);
        test_gemm({40, 0, 30, 9}, 20, 96, DT_F32, sw, true);
    }
    // Tiles found past the first 32 experts (find_tile's later chunks).
    std::vector<int> many(70);
    for (int e = 0; e < 70; ++e) many[e] = e % 3 == 0 ? 0 : (e * 37) % 90;
    test_gemm(many, 65, 20, DT_BF16, false);
    test_gemm(many, 8, 40, DT_F32, true);
    test_gate_add(3, 100, 1);
    test_gate_add(5, 300, 4);
    test_gate_add(1, 1, 1);
    printf("%s (%d fails)\n", fails ? "FAILED" : "ALL OK", fails);
    return fails != 0;
}
