//! The memory plan is what the model allocates, byte for byte, and a model
//! that does not fit is refused before anything is allocated.

use crate::common;

use std::sync::Arc;

use common::{FIXTURES, fixture};

use metrale_core::DType;
use metrale_gpu_runtime::cpu::CpuBackend;
use metrale_gpu_runtime::gpu::GpuBackend;
use metrale_model_engine::EngineError;
use metrale_model_engine::config::load_config;
use metrale_model_engine::model::{MemoryPlan, ModelOptions, TransformerModel};
use metrale_model_weights::loader::{WeightDType, scan_safetensors};

fn options() -> ModelOptions {
    ModelOptions {
        kv_block_size: 16,
        kv_blocks: 7,
        max_seqs: 3,
        max_batch_tokens: 40,
        kv_dtype: None,
        kv_follows_weights: false,
        ssm_state_dtype: None,
        ssm_state_follows_weights: false,
        cuda_graphs: true,
        prefix_cache: Default::default(),
    }
}

#[test]
fn the_plan_is_what_a_model_allocates() {
    for name in FIXTURES {
        // The third: SSM states held in bf16 (a narrower pool).
        let cases = [
            (WeightDType::AsStored, false),
            (WeightDType::F32, false),
            (WeightDType::AsStored, true),
        ];
        for (policy, bf16_states) in cases {
            let cpu = Arc::new(CpuBackend::with_threads(1).with_bf16_ssm_state(bf16_states));
            let gpu: Arc<dyn GpuBackend> = cpu.clone();
            let model = TransformerModel::load(&fixture(name), gpu, options(), policy, &mut |_| {})
                .expect("fixture loads");
            let stored = scan_safetensors(&fixture(name)).unwrap();
            let held = |spec: &metrale_model_engine::config::TensorSpec| {
                let t = stored.iter().find(|t| t.name == spec.name).unwrap();
                policy.target(if t.dtype == "BF16" {
                    DType::BF16
                } else {
                    DType::F32
                })
            };
            let plan =
                MemoryPlan::new(cpu.as_ref(), model.config(), model.options(), &held).unwrap();
            assert_eq!(
                plan.at_load(),
                cpu.live_bytes(),
                "{name} {policy:?} (bf16 states: {bf16_states}): planned {}, allocated {}",
                plan.breakdown(),
                cpu.live_bytes()
            );
            model.shutdown().unwrap();
        }
    }
}

#[test]
fn a_model_that_does_not_fit_is_refused_before_allocating() {
    for name in FIXTURES {
        let config = load_config(&fixture(name)).unwrap();
        let plan =
            MemoryPlan::new(&CpuBackend::new(), &config, &options(), &|_| DType::BF16).unwrap();
        // One byte short, for a loaded and for a random-weight model.
        let cpu = Arc::new(CpuBackend::with_threads(1).with_memory_limit(plan.total() - 1));
        let gpu: Arc<dyn GpuBackend> = cpu.clone();
        let err = TransformerModel::random(gpu.clone(), config, options(), 1, DType::BF16)
            .err()
            .expect("does not fit");
        assert!(
            matches!(
                &err,
                EngineError::Exhausted {
                    resource: "memory",
                    ..
                }
            ),
            "{name}: {err}"
        );
        assert!(err.to_string().contains("the model needs"), "{err}");
        assert_eq!(cpu.live_bytes(), 0, "{name}: nothing allocated");
        let err = TransformerModel::load(
            &fixture(name),
            gpu,
            options(),
            WeightDType::BF16,
            &mut |_| {},
        )
        .err()
        .expect("does not fit");
        assert!(err.to_string().contains("available"), "{name}: {err}");
        assert_eq!(cpu.live_bytes(), 0, "{name}: nothing allocated");
    }
}
