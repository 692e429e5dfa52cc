// Helpers of the emulation tests (after the kernel source, whose common.cuh
// gives f32_to_bf16).
#pragma once
inline std::mt19937 rng(42);
inline std::vector<float> rv(size_t n, float lo, float hi) {
    std::uniform_real_distribution<float> d(lo, hi);
    std::vector<float> v(n);
    for (auto& x : v) x = d(rng);
    return v;
}
inline unsigned short to_bf16(float x) { return f32_to_bf16(x); }
inline unsigned short to_f16(float x) { return emu_f32_to_f16(x); }
inline int fails = 0;
inline void check(const char* what, double got, double want, double tol) {
    if (!(std::fabs(got - want) <= tol * (1 + std::fabs(want)))) {
        if (fails++ < 10) printf("FAIL %s: got %.9g want %.9g\n", what, got, want);
    }
}
