//! `ModelOptions::kv_follows_weights` (the CLI's `--kv-dtype auto` under
//! bf16 arithmetic): the KV cache in f16 for weights held narrower than
//! f32, the backend's default for f32 weights, a dtype asked for outright
//! untouched. `ModelOptions::ssm_state_follows_weights` (`--ssm-state-dtype
//! auto`): f32 SSM states for f32 weights, whatever the backend holds by
//! default.

use crate::common;

use std::sync::Arc;

use metrale_core::DType;
use metrale_gpu_runtime::cpu::CpuBackend;
use metrale_gpu_runtime::gpu::GpuBackend;
use metrale_model_engine::config::load_config;
use metrale_model_engine::model::{ModelOptions, TransformerModel};

#[test]
fn the_kv_cache_follows_the_weights_when_asked() {
    let config = load_config(&common::fixture("llama")).expect("config");
    // (weights held in, follows the weights, asked for) -> the cache's dtype.
    let cases = [
        (DType::BF16, true, None, Some(DType::F16)),
        (DType::F32, true, None, None),
        (DType::BF16, false, None, None),
        (DType::BF16, true, Some(DType::F32), Some(DType::F32)),
        (DType::F32, false, Some(DType::BF16), Some(DType::BF16)),
        (DType::F32, true, Some(DType::F16), Some(DType::F16)),
    ];
    for (weights, follows, asked, want) in cases {
        let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::with_threads(1));
        let options = ModelOptions {
            kv_dtype: asked,
            kv_follows_weights: follows,
            ..common::small_options()
        };
        let model = TransformerModel::random(gpu.clone(), config.clone(), options, 7, weights)
            .expect("model");
        let what = format!("{weights} weights, follows {follows}, asked {asked:?}");
        assert_eq!(model.options().kv_dtype, want, "{what}");
        // The cache was allocated so: its bytes per token of every
        // attention layer's K and V.
        let kv = gpu
            .ledger()
            .report()
            .owner("kv cache")
            .expect("kv cache")
            .bytes;
        let heads = config.attention.as_ref().expect("attention").kv_width();
        let tokens = options_tokens();
        let layers = config.attention_layers().count();
        let size = want.unwrap_or(DType::F32).size_of();
        assert_eq!(kv, tokens * layers * 2 * heads * size, "{what}");
        model.shutdown().expect("shutdown");
        assert_eq!(gpu.ledger().live_bytes(), 0, "{what}");
    }
}

/// Tokens the small options' cache holds.
fn options_tokens() -> usize {
    let o = common::small_options();
    o.kv_blocks * o.kv_block_size
}

#[test]
fn the_ssm_states_follow_the_weights_when_asked() {
    let config = load_config(&common::fixture("mamba2")).expect("config");
    let shapes = metrale_model_engine::model::types::recurrent_state_shapes(&config);
    // (weights held in, follows the weights, asked for) -> the states'
    // dtype, on a backend that holds them in bf16 by default.
    let cases = [
        (DType::F32, true, None, DType::F32),
        (DType::BF16, true, None, DType::BF16),
        (DType::F32, false, None, DType::BF16),
        (DType::BF16, true, Some(DType::F32), DType::F32),
        (DType::F32, true, Some(DType::BF16), DType::BF16),
    ];
    for (weights, follows, asked, want) in cases {
        let cpu = CpuBackend::with_threads(1).with_bf16_ssm_state(true);
        let gpu: Arc<dyn GpuBackend> = Arc::new(cpu);
        let options = ModelOptions {
            ssm_state_dtype: asked,
            ssm_state_follows_weights: follows,
            ..common::small_options()
        };
        let model = TransformerModel::random(gpu.clone(), config.clone(), options, 7, weights)
            .expect("model");
        let what = format!("{weights} weights, follows {follows}, asked {asked:?}");
        // The pool was allocated so: f32 conv windows and the SSM states.
        let pool = gpu
            .ledger()
            .report()
            .owner("ssm state pool")
            .expect("ssm state pool")
            .bytes;
        let per_slot: usize = shapes
            .iter()
            .map(|s| 4 * s.conv + want.size_of() * s.ssm)
            .sum();
        assert_eq!(pool, per_slot * options.max_seqs, "{what}");
        model.shutdown().expect("shutdown");
        assert_eq!(gpu.ledger().live_bytes(), 0, "{what}");
    }
}
