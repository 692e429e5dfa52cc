//! Rotary position embedding settings, in every spelling real configs use.
//!
//! transformers 5 writes `rope_parameters: {rope_type, rope_theta,
//! partial_rotary_factor, factor, ...}`; older configs put `rope_theta` and
//! `partial_rotary_factor` at the top level and the scaling in
//! `rope_scaling: {type | rope_type, factor, ...}`. Both are accepted; where
//! both are present, `rope_parameters` wins.

use super::json::Obj;
use super::{RopeConfig, RopeScaling};
use crate::error::Result;

/// Family defaults for what a config may leave out.
#[derive(Clone, Copy, Debug)]
pub struct RopeDefaults {
    pub theta: f32,
    /// Fraction of each head's channels that are rotated (Bamba 0.5, Qwen3-Next 0.25).
    pub partial_rotary_factor: f32,
    /// Whether a top-level `partial_rotary_factor` counts. transformers'
    /// Bamba overwrites it with 0.5 (only one inside `rope_parameters`
    /// survives).
    pub top_level_partial: bool,
}

impl Default for RopeDefaults {
    fn default() -> Self {
        Self {
            theta: 10_000.0,
            partial_rotary_factor: 1.0,
            top_level_partial: true,
        }
    }
}

/// The rotary settings of `o` for heads of `head_dim` channels.
pub fn parse_rope(o: &Obj<'_>, head_dim: usize, defaults: RopeDefaults) -> Result<RopeConfig> {
    let params = o.opt_obj("rope_parameters")?;
    let legacy = o.opt_obj("rope_scaling")?;

    let theta = match &params {
        Some(p) if p.get(&["rope_theta"]).is_some() => {
            p.pos_f32_or(&["rope_theta"], defaults.theta)?
        }
        _ => o.pos_f32_or(&["rope_theta"], defaults.theta)?,
    };
    let partial = match &params {
        Some(p) if p.get(&["partial_rotary_factor"]).is_some() => {
            p.f32_or(&["partial_rotary_factor"], 1.0)?
        }
        _ if defaults.top_level_partial => {
            o.f32_or(&["partial_rotary_factor"], defaults.partial_rotary_factor)?
        }
        _ => defaults.partial_rotary_factor,
    };
    if !(partial > 0.0 && partial <= 1.0) {
        return Err(o.err(format!(
            "partial_rotary_factor must be in (0, 1], found {partial}"
        )));
    }
    let rotary_dim = (head_dim as f64 * f64::from(partial)) as usize;
    if rotary_dim == 0 || !rotary_dim.is_multiple_of(2) {
        return Err(o.err(format!("partial_rotary_factor {partial} of head_dim {head_dim} gives {rotary_dim} rotary channels; it must be even and positive")));
    }

    // The scaling comes from whichever object names a type other than "default".
    let typed = |p: &Obj<'_>| -> Result<Option<String>> {
        Ok(p.opt_str(&["rope_type", "type"])?
            .map(str::to_ascii_lowercase))
    };
    let mut source = None;
    for candidate in [params, legacy].into_iter().flatten() {
        if let Some(t) = typed(&candidate)?
            && t != "default"
        {
            source = Some((candidate, t));
            break;
        }
    }
    let scaling = match source {
        None => RopeScaling::Default,
        Some((s, kind)) => scaling(o, &s, &kind)?,
    };
    Ok(RopeConfig {
        theta,
        rotary_dim,
        scaling,
    })
}

fn scaling(o: &Obj<'_>, s: &Obj<'_>, kind: &str) -> Result<RopeScaling> {
    let factor = || -> Result<f32> {
        let f = s.f32_or(&["factor"], 0.0)?;
        if f <= 0.0 {
            return Err(s.err(format!("rope scaling `{kind}` needs a positive `factor`")));
        }
        Ok(f)
    };
    let original = |default: usize| s.size_or(&["original_max_position_embeddings"], default);
    Ok(match kind {
        "linear" => RopeScaling::Linear { factor: factor()? },
        "llama3" => RopeScaling::Llama3 {
            factor: factor()?,
            low_freq_factor: s.pos_f32_or(&["low_freq_factor"], 1.0)?,
            high_freq_factor: s.pos_f32_or(&["high_freq_factor"], 4.0)?,
            original_max_position: original(8192)?,
        },
        "yarn" => {
            let max_pos = o.size_or(&["max_position_embeddings"], 4096)?;
            let opt =
                |k: &'static str| -> Result<Option<f32>> { Ok(s.opt_f64(&[k])?.map(|x| x as f32)) };
            RopeScaling::Yarn {
                factor: factor()?,
                original_max_position: original(max_pos)?,
                beta_fast: s.f32_or(&["beta_fast"], 32.0)?,
                beta_slow: s.f32_or(&["beta_slow"], 1.0)?,
                attention_factor: opt("attention_factor")?,
                mscale: opt("mscale")?,
                mscale_all_dim: opt("mscale_all_dim")?,
            }
        }
        other => {
            return Err(s.err(format!("rope scaling type {other:?} is not supported (supported: default, linear, llama3, yarn)")));
        }
    })
}
