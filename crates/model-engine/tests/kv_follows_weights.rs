//! `ModelOptions::kv_follows_weights` (the CLI's `--kv-dtype auto` under
//! bf16 arithmetic): the KV cache in bf16 for weights held narrower than
//! f32, the backend's default for f32 weights, a dtype asked for outright
//! untouched.

mod common;

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
        (DType::BF16, true, None, Some(DType::BF16)),
        (DType::F32, true, None, None),
        (DType::BF16, false, None, None),
        (DType::BF16, true, Some(DType::F32), Some(DType::F32)),
        (DType::F32, false, Some(DType::BF16), Some(DType::BF16)),
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
