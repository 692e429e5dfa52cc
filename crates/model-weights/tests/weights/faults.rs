//! A failure injected at every allocation, and at every copy, of a full
//! load: always an error, and nothing left on the ledger.

use crate::common;

use common::*;
use metrale_core::scope::ModelResource;
use metrale_gpu_runtime::GpuBackend;
use metrale_gpu_runtime::cpu::CpuBackend;
use metrale_gpu_runtime::fault::FaultPlan;
use metrale_model_weights::WeightsError;
use metrale_model_weights::loader::{WeightDType, load_safetensors};

#[test]
fn every_allocation_and_copy_can_fail() {
    for name in ["granitemoehybrid", "mamba2"] {
        let dir = fixture(name);
        let expected = expect_all(&dir);
        let gpu = CpuBackend::new();
        gpu.hooks().set_faults(FaultPlan::default());
        let mut store =
            load_safetensors(&dir, &expected, &gpu, WeightDType::F32, &mut |_| {}).unwrap();
        let allocations = gpu.hooks().alloc_count();
        assert_eq!(allocations, expected.len(), "one allocation per tensor");
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
                match load_safetensors(&dir, &expected, &gpu, WeightDType::F32, &mut |_| {}) {
                    Ok(_) => panic!("{name}: {plan:?} should fail the load"),
                    Err(WeightsError::Device { name: tensor, .. }) => assert!(!tensor.is_empty()),
                    Err(other) => panic!("{name}: {plan:?}: unexpected error {other}"),
                }
                assert_eq!(gpu.live_bytes(), 0, "{name}: {plan:?} leaked");
            }
        }
    }
}
