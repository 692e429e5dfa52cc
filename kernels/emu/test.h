// Helpers of the emulation tests.
#pragma once
inline std::mt19937 rng(42);
inline std::vector<float> rv(size_t n, float lo, float hi) {
    std::uniform_real_distribution<float> d(lo, hi);
    std::vector<float> v(n);
    for (auto& x : v) x = d(rng);
    return v;
}
inline unsigned short to_bf16(float x) {
    unsigned b = __float_as_uint(x);
    return (b + 0x7fff + ((b >> 16) & 1)) >> 16;
}
inline unsigned short to_f16(float x) { return emu_f32_to_f16(x); }
inline int fails = 0;
inline void check(const char* what, double got, double want, double tol) {
    if (!(std::fabs(got - want) <= tol * (1 + std::fabs(want)))) {
        if (fails++ < 10) printf("FAIL %s: got %.9g want %.9g\n", what, got, want);
    }
}
