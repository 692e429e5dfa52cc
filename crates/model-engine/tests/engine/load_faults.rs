//! A failure injected at each allocation (and each copy) of a full model
//! load, in turn: an error every time, and an empty ledger after.

use std::path::PathBuf;

use metrale_core::scope::ModelResource;
use metrale_gpu_runtime::GpuBackend;
use metrale_gpu_runtime::cpu::CpuBackend;
use metrale_gpu_runtime::fault::FaultPlan;
use metrale_model_engine::EngineError;
use metrale_model_engine::config::load_config;
use metrale_model_engine::loader::load_weights;
use metrale_model_weights::WeightsError;
use metrale_model_weights::loader::WeightDType;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures")).join(name)
}

#[test]
fn each_allocation_of_a_full_load_can_fail() {
    for name in ["qwen3_next", "nemotron_h", "bamba"] {
        let dir = fixture(name);
        let config = load_config(&dir).unwrap();
        let gpu = CpuBackend::new();
        gpu.hooks().set_faults(FaultPlan::default());
        let mut store =
            load_weights(&dir, &config, &gpu, WeightDType::AsStored, &mut |_| {}).unwrap();
        let allocations = gpu.hooks().alloc_count();
        assert_eq!(allocations, config.expected_tensors().len(), "{name}");
        store.release(&gpu).unwrap();
        assert_eq!(gpu.live_bytes(), 0);
        for i in 0..allocations {
            for plan in [
                FaultPlan {
                    fail_alloc_at: Some(i),
                    ..FaultPlan::default()
                },
                FaultPlan {
                    fail_copy_at: Some(i),
                    ..FaultPlan::default()
                },
            ] {
                gpu.hooks().set_faults(plan);
                match load_weights(&dir, &config, &gpu, WeightDType::F32, &mut |_| {}) {
                    Ok(_) => panic!("{name}: {plan:?} must fail"),
                    Err(EngineError::Weights(WeightsError::Device { .. })) => {}
                    Err(other) => panic!("{name}: {plan:?}: unexpected {other}"),
                }
                assert_eq!(gpu.live_bytes(), 0, "{name}: {plan:?}");
                assert_eq!(gpu.ledger().live_count(), 0, "{name}: {plan:?}");
            }
        }
    }
}
