//! Random-weight models built from a config alone: benchmarks at the shapes
//! of real checkpoints without their weights.
//!
//! Every tensor of [`ModelConfig::expected_tensors`] is filled from a seeded
//! generator keyed by the seed and the tensor's name, so a tensor's values do
//! not depend on the order tensors are made in, and the same seed gives the
//! same model in memory ([`random_weight_store`]) and on disk
//! ([`write_random_checkpoint`], a Hugging Face directory another engine can
//! load).
//!
//! Values are chosen so that a forward pass stays finite: norm weights make
//! an effective weight of 1, `A_log = log(1..=n)`, `dt_bias` puts
//! `softplus(dt_bias)` in `[0.001, 0.1]` (log-uniform, as Mamba initialises
//! it), `D = 1`, biases 0, conv weights uniform in `±1/sqrt(kernel)`, and
//! every other matrix (embedding, projections, experts, router) uniform with
//! standard deviation 0.02.

use std::io::Write;
use std::path::Path;
use std::sync::Arc;

use metrale_core::DType;
use metrale_core::scope::ModelResource;
use metrale_gpu_runtime::gpu::GpuBackend;
use metrale_model_weights::weights::{DeviceTensor, WeightStore};

use crate::config::*;
use crate::error::{EngineError, Result};
use crate::model::{ModelOptions, TransformerModel};

/// Elements generated per upload chunk (bounds temporary host memory).
const CHUNK: usize = 1 << 20;
/// Standard deviation of the random matrices.
const STD: f32 = 0.02;

/// How a tensor's values are drawn.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Fill {
    Const(f32),
    /// Uniform in `[-bound, bound]`.
    Uniform(f32),
    /// `log(i + 1)` for element `i`.
    ALog,
    /// `softplus⁻¹(dt)` with `dt` log-uniform in `[0.001, 0.1]`.
    DtBias,
}

/// The fill of every tensor the config expects, by name.
fn fills(c: &ModelConfig) -> std::collections::HashMap<String, Fill> {
    let mut f = std::collections::HashMap::new();
    let norm = Fill::Const(1.0 - c.norm_weight_offset);
    f.insert(c.names.final_norm.clone(), norm);
    for l in &c.layers {
        f.insert(l.names.input_norm.clone(), norm);
        if let Some(n) = &l.names.ffn_norm {
            f.insert(n.clone(), norm);
        }
        match &l.names.mixer {
            MixerNames::Attention(a) => {
                for n in [&a.q_norm, &a.k_norm].into_iter().flatten() {
                    f.insert(n.clone(), norm);
                }
                for b in [&a.q_bias, &a.k_bias, &a.v_bias, &a.o_bias]
                    .into_iter()
                    .flatten()
                {
                    f.insert(b.clone(), Fill::Const(0.0));
                }
            }
            MixerNames::Mamba2(m) => {
                let kernel = c.mamba.as_ref().map_or(4, |m| m.conv_kernel) as f32;
                f.insert(m.conv_weight.clone(), Fill::Uniform(1.0 / kernel.sqrt()));
                f.insert(m.dt_bias.clone(), Fill::DtBias);
                f.insert(m.a_log.clone(), Fill::ALog);
                f.insert(m.d.clone(), Fill::Const(1.0));
                f.insert(m.norm.clone(), Fill::Const(1.0));
                for b in [&m.in_proj_bias, &m.conv_bias, &m.out_proj_bias]
                    .into_iter()
                    .flatten()
                {
                    f.insert(b.clone(), Fill::Const(0.0));
                }
            }
            MixerNames::GatedDeltaNet(d) => {
                let kernel = c.deltanet.as_ref().map_or(4, |d| d.conv_kernel) as f32;
                f.insert(d.conv_weight.clone(), Fill::Uniform(1.0 / kernel.sqrt()));
                f.insert(d.dt_bias.clone(), Fill::DtBias);
                f.insert(d.a_log.clone(), Fill::ALog);
                f.insert(d.norm.clone(), Fill::Const(1.0));
            }
            MixerNames::ShortConv(n) => {
                let kernel = c.short_conv.as_ref().map_or(3, |s| s.kernel) as f32;
                f.insert(n.conv_weight.clone(), Fill::Uniform(1.0 / kernel.sqrt()));
                if n.bias {
                    for w in [&n.in_proj, &n.conv_weight, &n.out_proj] {
                        f.insert(crate::config::bias_of(w), Fill::Const(0.0));
                    }
                }
            }
            MixerNames::None => {}
        }
    }
    f
}

/// splitmix64: small, fast and good enough for benchmark weights.
struct Rng(u64);

impl Rng {
    fn new(seed: u64, name: &str) -> Self {
        // FNV-1a of the name, mixed with the seed.
        let h = name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
            (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3)
        });
        Self(h ^ seed.wrapping_mul(0x9e37_79b9_7f4a_7c15))
    }

    #[inline]
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `[-1, 1)`.
    #[inline]
    fn symmetric(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 * (2.0 / (1u64 << 24) as f32) - 1.0
    }
}

/// Generates a tensor's values in chunks; `emit` receives each chunk's bytes
/// in `dtype` and the byte offset it starts at.
fn generate(
    fill: Fill,
    name: &str,
    seed: u64,
    elements: usize,
    dtype: DType,
    emit: &mut dyn FnMut(&[u8], usize) -> Result<()>,
) -> Result<()> {
    let mut rng = Rng::new(seed, name);
    let mut values = vec![0f32; CHUNK.min(elements.max(1))];
    let mut bytes = Vec::with_capacity(values.len() * dtype.size_of());
    let mut start = 0;
    while start < elements {
        let n = CHUNK.min(elements - start);
        for (i, v) in values[..n].iter_mut().enumerate() {
            *v = match fill {
                Fill::Const(c) => c,
                Fill::Uniform(bound) => bound * rng.symmetric(),
                Fill::ALog => ((start + i + 1) as f32).ln(),
                Fill::DtBias => {
                    let u = 0.5 * (rng.symmetric() + 1.0);
                    let dt = (0.001f32.ln() + u * (0.1f32.ln() - 0.001f32.ln())).exp();
                    // softplus⁻¹(dt) = dt + log(-expm1(-dt))
                    dt + (-(-dt).exp_m1()).ln()
                }
            };
        }
        bytes.clear();
        encode(&values[..n], dtype, &mut bytes)?;
        emit(&bytes, start * dtype.size_of())?;
        start += n;
    }
    Ok(())
}

fn encode(values: &[f32], dtype: DType, out: &mut Vec<u8>) -> Result<()> {
    match dtype {
        DType::F32 => values
            .iter()
            .for_each(|v| out.extend_from_slice(&v.to_le_bytes())),
        DType::BF16 => values
            .iter()
            .for_each(|v| out.extend_from_slice(&half::bf16::from_f32(*v).to_le_bytes())),
        DType::F16 => values
            .iter()
            .for_each(|v| out.extend_from_slice(&half::f16::from_f32(*v).to_le_bytes())),
        other => {
            return Err(EngineError::Request(format!(
                "random weights cannot be held as {other}"
            )));
        }
    }
    Ok(())
}

/// The fill of `spec`: its role's, or a 0.02-std matrix.
fn fill_of(fills: &std::collections::HashMap<String, Fill>, spec: &TensorSpec) -> Fill {
    fills
        .get(&spec.name)
        .copied()
        .unwrap_or(Fill::Uniform(STD * 3f32.sqrt()))
}

/// Every tensor `config` expects, filled with seeded random values and held
/// as `dtype` on `gpu`. On failure nothing stays allocated.
pub fn random_weight_store(
    config: &ModelConfig,
    seed: u64,
    dtype: DType,
    gpu: &dyn GpuBackend,
) -> Result<WeightStore> {
    let fills = fills(config);
    let mut store = WeightStore::new();
    let mut seen = std::collections::HashSet::new();
    for spec in config.expected_tensors() {
        if !seen.insert(spec.name.clone()) {
            continue;
        }
        let elements: usize = spec.shape.iter().product();
        let made = (|| {
            let slice = gpu
                .alloc_slice(dtype, elements, &format!("weights: {}", spec.name))
                .map_err(EngineError::device(format!("allocating {}", spec.name)))?;
            let filled = generate(
                fill_of(&fills, &spec),
                &spec.name,
                seed,
                elements,
                dtype,
                &mut |bytes, offset| {
                    gpu.copy_h2d(bytes, slice.ptr(), offset)
                        .map_err(EngineError::device(format!("uploading {}", spec.name)))
                },
            );
            match filled {
                Ok(()) => Ok(slice),
                Err(e) => {
                    let _ = gpu.free(slice.ptr());
                    Err(e)
                }
            }
        })();
        match made {
            Ok(slice) => {
                store.insert(
                    spec.name.clone(),
                    DeviceTensor {
                        slice,
                        shape: spec.shape.clone(),
                    },
                );
            }
            Err(e) => {
                let _ = store.release(gpu);
                return Err(e);
            }
        }
    }
    Ok(store)
}

impl TransformerModel {
    /// A model of `config`'s shape with seeded random weights held as
    /// `dtype` (f32, bf16 or f16): for benchmarks at real shapes.
    pub fn random(
        gpu: Arc<dyn GpuBackend>,
        config: ModelConfig,
        options: ModelOptions,
        seed: u64,
        dtype: DType,
    ) -> Result<Self> {
        crate::model::MemoryPlan::new(gpu.as_ref(), &config, &options, &|_| dtype)?
            .check(gpu.as_ref())?;
        let mut store = random_weight_store(&config, seed, dtype, gpu.as_ref())?;
        let options = options.for_weights(&store);
        let mut model = match TransformerModel::new(gpu.clone(), config, options) {
            Ok(m) => m,
            Err(e) => {
                let _ = store.release(gpu.as_ref());
                return Err(e);
            }
        };
        model.attach_weights(store)?;
        Ok(model)
    }
}

/// Writes a Hugging Face checkpoint directory for the random model: `config_json`
/// (the config.json text `config` was parsed from) as config.json and the same
/// weights [`random_weight_store`] makes as model.safetensors, in `dtype`.
pub fn write_random_checkpoint(
    dir: &Path,
    config_json: &str,
    config: &ModelConfig,
    seed: u64,
    dtype: DType,
) -> Result<()> {
    let io = |what: String| {
        move |e: std::io::Error| EngineError::Config {
            path: dir.join(&what),
            detail: e.to_string(),
        }
    };
    std::fs::create_dir_all(dir).map_err(io(String::new()))?;
    std::fs::write(dir.join("config.json"), config_json).map_err(io("config.json".into()))?;
    let st_dtype = match dtype {
        DType::F32 => "F32",
        DType::BF16 => "BF16",
        DType::F16 => "F16",
        other => {
            return Err(EngineError::Request(format!(
                "random weights cannot be held as {other}"
            )));
        }
    };
    let fills = fills(config);
    let mut specs = config.expected_tensors();
    let mut seen = std::collections::HashSet::new();
    specs.retain(|s| seen.insert(s.name.clone()));
    // Header: name -> dtype, shape, [start, end) in the data section.
    let mut header = serde_json::Map::new();
    let mut offset = 0usize;
    for s in &specs {
        let bytes = s.shape.iter().product::<usize>() * dtype.size_of();
        header.insert(s.name.clone(), serde_json::json!({ "dtype": st_dtype, "shape": s.shape, "data_offsets": [offset, offset + bytes] }));
        offset += bytes;
    }
    header.insert(
        "__metadata__".into(),
        serde_json::json!({ "format": "pt", "metrale_random_seed": seed.to_string() }),
    );
    let mut text = serde_json::Value::Object(header).to_string().into_bytes();
    while !text.len().is_multiple_of(8) {
        text.push(b' ');
    }
    let path = dir.join("model.safetensors");
    let file = std::fs::File::create(&path).map_err(io("model.safetensors".into()))?;
    let mut w = std::io::BufWriter::with_capacity(1 << 22, file);
    let werr = |e: std::io::Error| EngineError::Config {
        path: path.clone(),
        detail: e.to_string(),
    };
    w.write_all(&(text.len() as u64).to_le_bytes())
        .map_err(werr)?;
    w.write_all(&text).map_err(werr)?;
    for s in &specs {
        let elements = s.shape.iter().product();
        generate(
            fill_of(&fills, s),
            &s.name,
            seed,
            elements,
            dtype,
            &mut |bytes, _| w.write_all(bytes).map_err(werr),
        )?;
    }
    w.flush().map_err(werr)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_seed_same_values_and_fills_by_role() {
        let mut a = Vec::new();
        let mut b = Vec::new();
        generate(
            Fill::Uniform(1.0),
            "x",
            7,
            10,
            DType::F32,
            &mut |bytes, _| {
                a.extend_from_slice(bytes);
                Ok(())
            },
        )
        .unwrap();
        generate(
            Fill::Uniform(1.0),
            "x",
            7,
            10,
            DType::F32,
            &mut |bytes, _| {
                b.extend_from_slice(bytes);
                Ok(())
            },
        )
        .unwrap();
        assert_eq!(a, b);
        let mut c = Vec::new();
        generate(Fill::ALog, "a", 0, 3, DType::F32, &mut |bytes, _| {
            c.extend_from_slice(bytes);
            Ok(())
        })
        .unwrap();
        let v: Vec<f32> = c
            .chunks(4)
            .map(|x| f32::from_le_bytes([x[0], x[1], x[2], x[3]]))
            .collect();
        assert_eq!(v, vec![0.0, 2f32.ln(), 3f32.ln()]);
        let mut d = Vec::new();
        generate(Fill::DtBias, "dt", 1, 1000, DType::F32, &mut |bytes, _| {
            d.extend_from_slice(bytes);
            Ok(())
        })
        .unwrap();
        for x in d.chunks(4) {
            let bias = f32::from_le_bytes([x[0], x[1], x[2], x[3]]);
            let dt = (1.0 + bias.exp()).ln();
            assert!((0.00099..=0.1001).contains(&dt), "softplus(dt_bias) = {dt}");
        }
    }

    #[test]
    fn random_models_of_every_fixture_give_finite_logits() {
        use crate::model::{Logits, Step};
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures");
        for name in [
            "llama",
            "qwen3",
            "mamba2",
            "bamba",
            "nemotron_h",
            "granitemoehybrid",
            "qwen3_next",
        ] {
            let config = crate::config::load_config(&root.join(name)).unwrap();
            let gpu: Arc<dyn GpuBackend> =
                Arc::new(metrale_gpu_runtime::cpu::CpuBackend::with_threads(1));
            let options = ModelOptions {
                max_batch_tokens: 8,
                kv_blocks: 4,
                max_seqs: 1,
                ..ModelOptions::default()
            };
            let model =
                TransformerModel::random(gpu.clone(), config, options, 3, DType::BF16).unwrap();
            let mut seq = model.new_sequence().unwrap();
            let ids = [1u32, 5, 9, 2, 7];
            let out = model
                .forward(&mut [Step {
                    seq: &mut seq,
                    tokens: &ids,
                    logits: Logits::All,
                }])
                .unwrap();
            model.free_sequence(seq);
            assert!(
                out[0].iter().all(|v| v.is_finite()),
                "{name}: non-finite logits"
            );
            assert!(out[0].iter().any(|v| *v != 0.0), "{name}: all-zero logits");
            model.shutdown().unwrap();
            assert_eq!(gpu.live_bytes(), 0, "{name}: teardown left memory");
        }
    }
}
