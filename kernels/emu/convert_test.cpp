// convert.cu (f32 to bf16 and f16 bits) against references: bf16 by
// choosing the nearer of the two neighbouring bf16 values in f64 (ties to
// even), f16 by the host's _Float16 conversion (IEEE, round to nearest even).
#include "emu.h"
#include KERNEL_CU
#include "test.h"

static unsigned short bf16_ref(float x) {
    unsigned u = __float_as_uint(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40);
    if (std::isinf(x)) return u >> 16;
    const unsigned lo = u & 0xffff0000u, hi = lo + 0x10000u;
    const double dl = std::fabs((double)x - (double)__uint_as_float(lo));
    // hi may be an infinity (overflow) or, from the largest finite
    // pattern's neighbour, the next binade: both are right as IEEE rounding.
    const double fhi = (lo & 0x7fffffffu) == 0x7f7f0000u ? std::ldexp(1.0, 128) * (x < 0 ? -1 : 1)
                                                          : (double)__uint_as_float(hi);
    const double dh = std::fabs(fhi - (double)x);
    if (dl < dh || (dl == dh && ((lo >> 16) & 1) == 0)) return lo >> 16;
    return hi >> 16;
}

int main() {
    std::vector<float> x = rv(5000, -3, 3);
    for (int i = 0; i < 1000; ++i) x[i] = __uint_as_float((unsigned)rng());  // any bits: NaNs, subnormals, huge
    const unsigned specials[] = {0x7f800000u, 0xff800000u, 0x7fc00000u, 0xffa12345u, 0x7f800001u, 0x7f7fffffu,
                                 0xff7fffffu, 0x7f7f8000u, 0x3f808000u, 0x3f818000u, 0x3f808001u, 0x80000000u,
                                 0x00000001u, 0x807fffffu, 0x477fe000u, 0x477ff000u, 0x33800000u, 0x33000000u};
    for (unsigned s : specials) x.push_back(__uint_as_float(s));
    const long long n = x.size();
    std::vector<unsigned short> yb(n + 1, 0xabcd), yh(n + 1, 0xabcd);
    launch(Dim3{3, 1, 1}, 256, 0, [&] { cast_f32_bf16(x.data(), yb.data(), n); });
    launch(Dim3{2, 1, 1}, 128, 0, [&] { cast_f32_f16(x.data(), yh.data(), n); });
    int nan_ok = 0;
    for (long long i = 0; i < n; ++i) {
        check("cast_f32_bf16", yb[i], bf16_ref(x[i]), 0);
        const unsigned short h = to_f16(x[i]);
        if (std::isnan(x[i])) {
            nan_ok += (yh[i] & 0x7c00) == 0x7c00 && (yh[i] & 0x3ff) != 0;
            check("cast_f32_f16 NaN", (yh[i] & 0x7c00) == 0x7c00 && (yh[i] & 0x3ff) != 0, 1, 0);
        } else {
            check("cast_f32_f16", yh[i], h, 0);
        }
    }
    check("cast past n", yb[n], 0xabcd, 0);
    check("cast past n", yh[n], 0xabcd, 0);
    printf("casts of %lld values (%d NaNs): %d fails\n", n, nan_ok, fails);
    printf("%s (%d fails)\n", fails ? "FAILED" : "ALL OK", fails);
    return fails != 0;
}
