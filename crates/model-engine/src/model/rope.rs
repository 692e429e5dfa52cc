//! RoPE inverse frequencies for each scaling type, computed once at load as
//! Hugging Face's `ROPE_INIT_FUNCTIONS` do.

use std::f64::consts::PI;

use crate::config::{RopeConfig, RopeScaling};

/// Inverse frequencies (`rotary_dim / 2` of them) and the attention factor
/// that multiplies cos and sin.
pub fn inv_freq(rope: &RopeConfig) -> (Vec<f32>, f32) {
    let dim = rope.rotary_dim;
    let base = rope.theta as f64;
    let plain: Vec<f64> = (0..dim / 2)
        .map(|i| 1.0 / base.powf((2 * i) as f64 / dim as f64))
        .collect();
    match &rope.scaling {
        RopeScaling::Default => (to_f32(&plain), 1.0),
        RopeScaling::Linear { factor } => (
            plain.iter().map(|f| (f / *factor as f64) as f32).collect(),
            1.0,
        ),
        RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position,
        } => {
            let (factor, low, high, old) = (
                *factor as f64,
                *low_freq_factor as f64,
                *high_freq_factor as f64,
                *original_max_position as f64,
            );
            let (low_wavelen, high_wavelen) = (old / low, old / high);
            let freqs = plain
                .iter()
                .map(|&f| {
                    let wavelen = 2.0 * PI / f;
                    if wavelen < high_wavelen {
                        f
                    } else if wavelen > low_wavelen {
                        f / factor
                    } else {
                        let smooth = (old / wavelen - low) / (high - low);
                        (1.0 - smooth) * f / factor + smooth * f
                    }
                })
                .collect::<Vec<_>>();
            (to_f32(&freqs), 1.0)
        }
        RopeScaling::Yarn {
            factor,
            original_max_position,
            beta_fast,
            beta_slow,
            attention_factor,
            mscale,
            mscale_all_dim,
        } => {
            let factor = *factor as f64;
            let get_mscale = |scale: f64, m: f64| {
                if scale <= 1.0 {
                    1.0
                } else {
                    0.1 * m * scale.ln() + 1.0
                }
            };
            let attention = match (attention_factor, mscale, mscale_all_dim) {
                (Some(a), _, _) => *a as f64,
                (None, Some(m), Some(all)) if *m != 0.0 && *all != 0.0 => {
                    get_mscale(factor, *m as f64) / get_mscale(factor, *all as f64)
                }
                _ => get_mscale(factor, 1.0),
            };
            let max_pos = *original_max_position as f64;
            let correction_dim = |rotations: f64| {
                (dim as f64 * (max_pos / (rotations * 2.0 * PI)).ln()) / (2.0 * base.ln())
            };
            let low = correction_dim(*beta_fast as f64).floor().max(0.0);
            let high = correction_dim(*beta_slow as f64)
                .ceil()
                .min(dim as f64 - 1.0);
            let high = if low == high { high + 0.001 } else { high };
            let freqs = plain
                .iter()
                .enumerate()
                .map(|(i, &extrapolation)| {
                    let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
                    let extrapolation_factor = 1.0 - ramp;
                    let interpolation = extrapolation / factor;
                    interpolation * (1.0 - extrapolation_factor)
                        + extrapolation * extrapolation_factor
                })
                .collect::<Vec<_>>();
            (to_f32(&freqs), attention as f32)
        }
    }
}

fn to_f32(v: &[f64]) -> Vec<f32> {
    v.iter().map(|&x| x as f32).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(scaling: RopeScaling) -> RopeConfig {
        RopeConfig {
            theta: 500000.0,
            rotary_dim: 128,
            scaling,
        }
    }

    #[test]
    fn default_frequencies_follow_theta() {
        let (f, a) = inv_freq(&RopeConfig {
            theta: 10000.0,
            rotary_dim: 8,
            scaling: RopeScaling::Default,
        });
        assert_eq!(a, 1.0);
        let expected = [1.0, 0.1, 0.01, 0.001];
        for (x, e) in f.iter().zip(expected) {
            assert!((x - e).abs() < 1e-7, "{f:?}");
        }
    }

    #[test]
    fn llama3_keeps_high_frequencies_and_divides_low_ones() {
        let (plain, _) = inv_freq(&cfg(RopeScaling::Default));
        let (scaled, _) = inv_freq(&cfg(RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position: 8192,
        }));
        assert_eq!(plain[0], scaled[0]);
        let last = plain.len() - 1;
        assert!((scaled[last] - plain[last] / 8.0).abs() < 1e-12);
    }

    #[test]
    fn yarn_attention_factor_defaults_to_mscale() {
        let (_, a) = inv_freq(&cfg(RopeScaling::Yarn {
            factor: 4.0,
            original_max_position: 4096,
            beta_fast: 32.0,
            beta_slow: 1.0,
            attention_factor: None,
            mscale: None,
            mscale_all_dim: None,
        }));
        assert!((a - (0.1 * 4f32.ln() + 1.0)).abs() < 1e-6);
    }
}
