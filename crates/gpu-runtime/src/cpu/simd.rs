//! Vector helpers the CPU kernels share: [`simd_fn`], which compiles a loop
//! for AVX2+FMA as well as the baseline and picks one at run time; a
//! vectorisable `exp` and the activations built on it; a branch-free bf16
//! rounding; and the f32 `dot` and `axpy` loops. (The AVX-512 loops of
//! attention are in `vec.rs`, the decode GEMV's in `gemv.rs`.)

/// Defines a function whose body is compiled twice: for the build's baseline
/// target and with AVX2+FMA, which it runs when the CPU has them (the crate
/// is built for baseline x86-64, where loops vectorise to 4-lane SSE2 only).
/// Functions return `()`; arguments are plain identifiers.
macro_rules! simd_fn {
    ($(#[$m:meta])* $vis:vis fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $body:block) => {
        $(#[$m])*
        $vis fn $name($($arg: $ty),*) {
            $(#[$m])*
            #[inline(always)]
            fn imp($($arg: $ty),*) $body
            #[cfg(target_arch = "x86_64")]
            {
                $(#[$m])*
                #[target_feature(enable = "avx2,fma")]
                unsafe fn avx2($($arg: $ty),*) {
                    imp($($arg),*)
                }
                if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
                    // SAFETY: the running CPU has the features `avx2` is compiled for.
                    unsafe { avx2($($arg),*) };
                    return;
                }
            }
            imp($($arg),*)
        }
    };
}
pub(crate) use simd_fn;

/// `1 / (1 + exp(-x))`, with the vectorisable `exp_fast`.
#[inline]
pub(crate) fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + exp_fast(-x))
}

/// `x · sigmoid(x)`, with the vectorisable `exp_fast`.
#[inline]
pub(crate) fn silu(x: f32) -> f32 {
    x / (1.0 + exp_fast(-x))
}

/// `exp(x)` to about 1 ulp (Cephes `expf` polynomial), branch-free so that
/// loops over slices vectorise. Inputs below -87 give 0, above 88 are clamped.
#[inline(always)]
pub(crate) fn exp_fast(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // 1.5 * 2^23: adding it rounds to an integer held in the low mantissa bits.
    const MAGIC: f32 = 12_582_912.0;
    let xc = x.clamp(-87.0, 88.0);
    let t = xc * LOG2E + MAGIC;
    let n = t - MAGIC;
    let r = xc - n * LN2_HI - n * LN2_LO;
    let mut p = 1.987_569_1e-4_f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 0.5;
    let e = p * r * r + r + 1.0;
    // Wrapping integer ops: the clamp keeps them far from overflow, and the
    // overflow checks of the dev profile (the default build) would put a
    // panicking branch in every element and keep the loops scalar.
    let ni = (t.to_bits() as i32).wrapping_sub(MAGIC.to_bits() as i32);
    let scale = f32::from_bits((ni.wrapping_add(127) << 23) as u32);
    if x < -87.0 { 0.0 } else { e * scale }
}

/// `x` rounded to bf16 (to nearest, ties to even; NaN stays a quiet NaN),
/// branch-free so that loops over slices vectorise (`half`'s conversion
/// does not).
#[inline(always)]
pub(crate) fn to_bf16(x: f32) -> half::bf16 {
    let b = x.to_bits();
    // Wrapping: a negative NaN's bits overflow (its result is not used),
    // and a checked add would keep the loops scalar (see `exp_fast`).
    let rounded = (b.wrapping_add(0x7FFF).wrapping_add((b >> 16) & 1) >> 16) as u16;
    let nan = (b & 0x7FFF_FFFF) > 0x7F80_0000;
    half::bf16::from_bits(if nan {
        ((b >> 16) as u16) | 0x0040
    } else {
        rounded
    })
}

/// `x` widened to f32 (exact): its bits above sixteen zeros, a shift that
/// vectorises.
#[inline(always)]
pub(crate) fn from_bf16(x: half::bf16) -> f32 {
    f32::from_bits((x.to_bits() as u32) << 16)
}

/// A recurrent state's rounding to bf16: [`to_bf16`], but f32 subnormals
/// (|x| < 2^-126, where a decaying state ends) become zero of their sign,
/// as AVX512-BF16's `vcvtneps2bf16` rounds them; so the state kernels may
/// use that instruction and still give the bits of this function.
#[inline(always)]
pub(crate) fn to_bf16_state(x: f32) -> half::bf16 {
    let b = x.to_bits();
    if b & 0x7F80_0000 == 0 {
        half::bf16::from_bits((b >> 16) as u16 & 0x8000)
    } else {
        to_bf16(x)
    }
}

/// `y += a * x`.
#[inline(always)]
pub(crate) fn axpy(y: &mut [f32], a: f32, x: &[f32]) {
    y.iter_mut().zip(x).for_each(|(y, x)| *y += a * x);
}

/// f32 dot product with independent accumulators (vectorises).
#[inline(always)]
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    const LANES: usize = 16;
    let mut acc = [0f32; LANES];
    let (ac, bc) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    let tail: f32 = ac
        .remainder()
        .iter()
        .zip(bc.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ac.zip(bc) {
        for l in 0..LANES {
            acc[l] += x[l] * y[l];
        }
    }
    acc.iter().sum::<f32>() + tail
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `to_bf16_state` is what `vcvtneps2bf16` gives, on the values where
    /// roundings differ: subnormals, ties, NaNs, infinities, the extremes.
    #[test]
    #[cfg(target_arch = "x86_64")]
    fn to_bf16_state_is_the_instructions_rounding() {
        use std::arch::x86_64::*;
        if !(std::is_x86_feature_detected!("avx512f")
            && std::is_x86_feature_detected!("avx512bf16"))
        {
            eprintln!("no AVX512-BF16 here: nothing to compare");
            return;
        }
        let mut bits: Vec<u32> = vec![
            0x0000_0001,
            0x8000_0001,
            0x007F_FFFF,
            0x807F_FFFF,
            0x0040_0000,
            0x0000_8000,
            0x0080_0000,
            0x8080_0000,
            0x0080_8000,
            0x0081_8000,
            0x0080_7FFF,
            0x3F80_8000,
            0x3F81_8000,
            0x3F80_7FFF,
            0x7F7F_FFFF,
            0xFF7F_FFFF,
            0x7F80_0000,
            0xFF80_0000,
            0x7FC0_0000,
            0xFFC0_0001,
            0x7F80_0001,
            0xFF81_2345,
            0,
            0x8000_0000,
        ];
        let mut s = 0x9E37_79B9u32;
        bits.extend((0..4096).map(|_| {
            s ^= s << 13;
            s ^= s >> 17;
            s ^= s << 5;
            s
        }));
        for chunk in bits.chunks(16) {
            let mut v = [0f32; 16];
            for (d, &b) in v.iter_mut().zip(chunk) {
                *d = f32::from_bits(b);
            }
            // SAFETY: the CPU has AVX-512F and AVX512-BF16 (checked above).
            let got: [u16; 16] = unsafe {
                let x = _mm512_loadu_ps(v.as_ptr());
                std::mem::transmute(_mm512_cvtneps_pbh(x))
            };
            for (i, &b) in chunk.iter().enumerate() {
                let want = to_bf16_state(f32::from_bits(b)).to_bits();
                assert_eq!(got[i], want, "{b:#010x}: {:#06x} vs {want:#06x}", got[i]);
            }
        }
    }

    #[test]
    fn exp_fast_matches_std() {
        let mut x = -90.0f32;
        while x < 20.0 {
            let (got, want) = (exp_fast(x), x.exp());
            assert!(
                (got - want).abs() <= 4.0 * f32::EPSILON * want.abs() + 1e-37,
                "exp({x}) = {got}, want {want}"
            );
            x += 0.013;
        }
        assert_eq!(exp_fast(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp_fast(0.0), 1.0);
    }

    #[test]
    fn to_bf16_matches_half() {
        let specials = [
            0.0,
            -0.0,
            1.0,
            -1.5,
            f32::MAX,
            f32::MIN_POSITIVE,
            1e-40,
            f32::INFINITY,
            f32::NEG_INFINITY,
        ];
        let ties = [
            f32::from_bits(0x3F80_8000),
            f32::from_bits(0x3F81_8000),
            f32::from_bits(0x3F80_7FFF),
        ];
        let mut x = -70.0f32;
        let mut all: Vec<f32> = specials.iter().chain(&ties).copied().collect();
        while x < 70.0 {
            all.push(x.exp() * x.signum());
            x += 0.0137;
        }
        for v in all {
            assert_eq!(
                to_bf16(v).to_bits(),
                half::bf16::from_f32(v).to_bits(),
                "{v:e}"
            );
        }
        assert!(to_bf16(f32::NAN).is_nan() && to_bf16(f32::from_bits(0x7F80_0001)).is_nan());
    }

    #[test]
    fn dot_and_axpy_match_naive() {
        // 37 elements: two full 16-lane chunks and a tail.
        let a: Vec<f32> = (0..37).map(|i| i as f32 * 0.25 - 4.0).collect();
        let b: Vec<f32> = (0..37).map(|i| (i as f32).cos()).collect();
        let want: f32 = a.iter().zip(&b).map(|(x, y)| x * y).sum();
        assert!(
            (dot(&a, &b) - want).abs() < 1e-4,
            "{} vs {want}",
            dot(&a, &b)
        );
        let mut y = b.clone();
        axpy(&mut y, 2.0, &a);
        for ((y, a), b) in y.iter().zip(&a).zip(&b) {
            assert_eq!(*y, b + 2.0 * a);
        }
    }
}

/// Prefetches `data[from..to]` (clipped to `data`) into L1, one touch per
/// 64-byte line: the kernels' software prefetch of what they read next.
pub(super) fn prefetch<T>(data: &[T], from: usize, to: usize) {
    let step = (64 / std::mem::size_of::<T>().max(1)).max(1);
    #[cfg(target_arch = "x86_64")]
    for at in (from..to.min(data.len())).step_by(step) {
        // SAFETY: a prefetch never faults, and `at < data.len()` besides.
        unsafe {
            use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
            _mm_prefetch::<_MM_HINT_T0>(data.as_ptr().add(at).cast())
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (data, from, to, step);
}
