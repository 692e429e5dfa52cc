//! The hooks through the provided methods of a real backend (the CPU): fault
//! injection at every allocation, free and copy, the transfer counters, and a
//! sticky op fault with debug sync on and off.

use metrale_core::DType;

use super::*;
use crate::cpu::CpuBackend;
use crate::gpu::{DevicePtr, DeviceSlice, GpuBackend};

/// A backend with debug sync set explicitly, whatever the environment says.
fn cpu(debug_sync: bool) -> CpuBackend {
    let cpu = CpuBackend::with_threads(1);
    cpu.hooks().set_debug_sync(debug_sync);
    cpu
}

/// Allocates and fills `n` buffers of 4 floats; on failure frees what it
/// made, as every owner in the engine does.
fn build(gpu: &dyn GpuBackend, n: usize) -> Result<Vec<DeviceSlice>> {
    let mut made: Vec<DeviceSlice> = Vec::new();
    let mut step = || -> Result<()> {
        let s = gpu.alloc_slice(DType::F32, 4, &format!("buffer {}", made.len()))?;
        made.push(s);
        gpu.upload_f32(&[1.0, 2.0, 3.0, 4.0], s)
    };
    for _ in 0..n {
        if let Err(e) = step() {
            let _ = gpu.free_all(made.iter().map(|s| s.ptr()));
            return Err(e);
        }
    }
    Ok(made)
}

fn free_slices(gpu: &dyn GpuBackend, slices: &[DeviceSlice]) -> Result<()> {
    gpu.free_all(slices.iter().map(|s| s.ptr()))
}

#[test]
fn a_fault_at_every_allocation_and_copy_leaves_an_empty_ledger() {
    let cpu = cpu(false);
    let gpu: &dyn GpuBackend = &cpu;
    gpu.hooks().set_faults(FaultPlan::default());
    let made = build(gpu, 5).unwrap();
    assert_eq!(gpu.hooks().alloc_count(), 5);
    free_slices(gpu, &made).unwrap();
    for i in 0..5 {
        gpu.hooks().set_faults(FaultPlan {
            fail_alloc_at: Some(i),
            ..FaultPlan::default()
        });
        match build(gpu, 5) {
            Err(GpuError::InjectedFault { op, index }) => {
                assert_eq!((op, index), ("allocation", i));
            }
            other => panic!("allocation {i}: {other:?}"),
        }
        assert_eq!(gpu.live_bytes(), 0, "allocation {i}");
        gpu.hooks().set_faults(FaultPlan {
            fail_copy_at: Some(i),
            ..FaultPlan::default()
        });
        match build(gpu, 5) {
            Err(GpuError::InjectedFault { op: "copy", index }) => assert_eq!(index, i),
            other => panic!("copy {i}: {other:?}"),
        }
        assert!(gpu.ledger().is_empty(), "copy {i}");
    }
}

#[test]
fn an_injected_free_fault_still_returns_the_memory_and_owners_are_recorded_in_order() {
    let cpu = cpu(false);
    let gpu: &dyn GpuBackend = &cpu;
    assert!(
        gpu.hooks().freed_owners().is_empty(),
        "nothing recorded without a plan"
    );
    gpu.hooks().set_faults(FaultPlan::default());
    let made = build(gpu, 3).unwrap();
    gpu.hooks().set_faults(FaultPlan {
        fail_free_at: Some(1),
        ..FaultPlan::default()
    });
    let err = free_slices(gpu, &made).unwrap_err();
    assert!(
        matches!(
            err,
            GpuError::InjectedFault {
                op: "free",
                index: 1
            }
        ),
        "{err}"
    );
    assert_eq!(gpu.live_bytes(), 0);
    assert_eq!(
        gpu.hooks().freed_owners(),
        ["buffer 0", "buffer 1", "buffer 2"]
    );
    gpu.hooks().clear_faults();
    assert!(gpu.hooks().freed_owners().is_empty());
    assert_eq!(gpu.hooks().fault_plan(), None);
}

#[test]
fn transfers_are_counted_by_kind_and_bytes() {
    let cpu = cpu(false);
    let gpu: &dyn GpuBackend = &cpu;
    let a = gpu.alloc_slice(DType::F32, 8, "a").unwrap();
    let b = gpu.alloc_slice(DType::F32, 8, "b").unwrap();
    gpu.hooks().reset_transfers();
    gpu.upload_f32(&[1.0; 8], a).unwrap();
    gpu.upload_f32(&[2.0; 4], b.slice(0, 4).unwrap()).unwrap();
    gpu.copy_slice(a.slice(0, 2).unwrap(), b.slice(4, 2).unwrap())
        .unwrap();
    gpu.zero(a).unwrap();
    gpu.scale(b, 2.0, 8).unwrap();
    gpu.add_scaled(a, b, 1.0, 8).unwrap();
    assert_eq!(
        gpu.download_f32(a).unwrap(),
        [4., 4., 4., 4., 2., 2., 0., 0.]
    );
    gpu.synchronize().unwrap();
    assert_eq!(
        gpu.hooks().transfers(),
        Transfers {
            h2d_copies: 2,
            h2d_bytes: 48,
            d2h_copies: 1,
            d2h_bytes: 32,
            d2d_copies: 1,
            memsets: 1,
            op_launches: 2,
        }
    );
    gpu.hooks().reset_transfers();
    assert_eq!(gpu.hooks().transfers(), Transfers::default());
    free_slices(gpu, &[a, b]).unwrap();
}

#[test]
fn a_failed_copy_is_not_counted() {
    let cpu = cpu(false);
    let gpu: &dyn GpuBackend = &cpu;
    let a = gpu.alloc_slice(DType::F32, 4, "a").unwrap();
    gpu.hooks().set_faults(FaultPlan {
        fail_copy_at: Some(0),
        ..FaultPlan::default()
    });
    assert!(gpu.upload_f32(&[1.0; 4], a).is_err());
    assert_eq!(gpu.hooks().transfers().h2d_copies, 0);
    gpu.free(a.ptr()).unwrap();
}

/// Two buffers of 4 floats and an op that faults at launch `at`.
fn armed(debug_sync: bool, at: usize) -> (CpuBackend, DeviceSlice, DeviceSlice) {
    let cpu = cpu(debug_sync);
    let gpu: &dyn GpuBackend = &cpu;
    let made = build(gpu, 2).unwrap();
    gpu.hooks().set_faults(FaultPlan {
        fail_op_at: Some(at),
        ..FaultPlan::default()
    });
    (cpu, made[0], made[1])
}

/// Everything after a sticky fault fails with it, naming the call; frees
/// report it too but still return the memory.
fn assert_unusable(gpu: &dyn GpuBackend, a: DeviceSlice, b: DeviceSlice) {
    assert!(gpu.hooks().is_faulted());
    let driver_at = |r: Result<()>, want: &str| match r {
        Err(GpuError::Driver { op, code: 700, .. }) if op == want => {}
        other => panic!("{want}: expected the sticky error, got {other:?}"),
    };
    driver_at(gpu.relu2(a, b, 4), "relu2");
    driver_at(gpu.upload_f32(&[0.0; 4], a), "copy_h2d");
    driver_at(gpu.download_f32(a).map(drop), "copy_d2h");
    driver_at(gpu.copy_slice(a, b), "copy_d2d");
    driver_at(gpu.zero(a), "memset_zero");
    driver_at(gpu.synchronize(), "synchronize");
    driver_at(gpu.record_fence().map(drop), "record_fence");
    driver_at(gpu.alloc(16, "late").map(drop), "alloc");
    let errors: Vec<GpuError> = [a, b]
        .into_iter()
        .filter_map(|s| gpu.free(s.ptr()).err())
        .collect();
    assert_eq!(errors.len(), 2, "every free reports the fault");
    assert!(
        errors
            .iter()
            .all(|e| matches!(e, GpuError::Driver { op: "free", .. }))
    );
    assert_eq!(gpu.live_bytes(), 0, "the memory was still returned");
}

#[test]
fn with_debug_sync_the_faulting_op_reports_its_own_fault() {
    let (cpu, a, b) = armed(true, 1);
    let gpu: &dyn GpuBackend = &cpu;
    gpu.scale(a, 2.0, 4).expect("launch 0 is fine");
    let err = gpu.add_scaled(a, b, 1.0, 4).unwrap_err();
    match &err {
        GpuError::Driver { op, code, message } => {
            assert_eq!((*op, *code), ("add_scaled", 700));
            assert_eq!(
                message,
                "an illegal memory access was encountered (injected)"
            );
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(
        err.to_string(),
        "add_scaled: device error 700: an illegal memory access was encountered (injected)"
    );
    let later = gpu.synchronize().unwrap_err().to_string();
    assert!(later.contains("faulted earlier, at add_scaled"), "{later}");
    assert_unusable(gpu, a, b);
}

#[test]
fn without_debug_sync_the_fault_surfaces_at_the_next_synchronising_call() {
    for sync_with in ["copy_d2h", "synchronize", "wait_fence"] {
        let (cpu, a, b) = armed(false, 0);
        let gpu: &dyn GpuBackend = &cpu;
        let fence = gpu.record_fence().unwrap();
        gpu.scale(a, 2.0, 4)
            .expect("an asynchronous fault is not the launch's error");
        let err = match sync_with {
            "copy_d2h" => gpu.download_f32(a).map(drop),
            "synchronize" => gpu.synchronize(),
            _ => gpu.wait_fence(fence),
        }
        .unwrap_err();
        let GpuError::Driver { op, code, message } = &err else {
            panic!("{err:?}");
        };
        assert_eq!((*op, *code), (sync_with, 700));
        assert!(
            message.contains("an earlier asynchronous op failed"),
            "{message}"
        );
        assert!(message.contains("METRALE_DEBUG_SYNC=1"), "{message}");
        assert!(
            !message.contains("scale"),
            "the origin is unknown: {message}"
        );
        assert_unusable(gpu, a, b);
    }
}

#[test]
fn without_debug_sync_the_next_op_reports_the_fault_too() {
    let (cpu, a, b) = armed(false, 0);
    let gpu: &dyn GpuBackend = &cpu;
    gpu.scale(a, 2.0, 4).unwrap();
    let err = gpu.relu2(a, b, 4).unwrap_err();
    assert!(
        matches!(
            err,
            GpuError::Driver {
                op: "relu2",
                code: 700,
                ..
            }
        ),
        "{err}"
    );
    assert_eq!(
        gpu.hooks().transfers().op_launches,
        2,
        "both launches counted"
    );
    assert_unusable(gpu, a, b);
}

#[test]
fn the_sweep_after_a_fault_still_empties_the_ledger() {
    let (cpu, a, _b) = armed(true, 0);
    let gpu: &dyn GpuBackend = &cpu;
    assert!(gpu.scale(a, 1.0, 4).is_err());
    assert_eq!(gpu.sweep_unreleased(), 2);
    assert_eq!(gpu.live_bytes(), 0);
    // Dropping the backend sweeps an empty ledger: nothing to free twice.
}

#[test]
fn clearing_the_plan_does_not_clear_a_sticky_fault() {
    let (cpu, a, b) = armed(true, 0);
    let gpu: &dyn GpuBackend = &cpu;
    assert!(gpu.scale(a, 1.0, 4).is_err());
    gpu.hooks().clear_faults();
    assert!(gpu.synchronize().is_err(), "only a new backend clears it");
    let _ = free_slices(gpu, &[a, b]);
}

#[test]
fn fences_on_the_cpu_are_complete_and_distinct() {
    let cpu = cpu(false);
    let gpu: &dyn GpuBackend = &cpu;
    let first = gpu.record_fence().unwrap();
    let second = gpu.record_fence().unwrap();
    assert_ne!(first, second);
    gpu.wait_fence(first).unwrap();
    gpu.wait_fence(second).unwrap();
}

#[test]
fn debug_sync_flag_values() {
    for on in ["1", "true", "ON", " yes "] {
        assert!(flag_is_on(on), "{on:?}");
    }
    for off in ["", "0", "false", "no", "2"] {
        assert!(!flag_is_on(off), "{off:?}");
    }
    let cpu = cpu(false);
    assert!(!cpu.hooks().debug_sync());
    cpu.hooks().set_debug_sync(true);
    assert!(cpu.hooks().debug_sync());
}

#[test]
fn an_unknown_pointer_is_not_freed() {
    let cpu = cpu(false);
    let gpu: &dyn GpuBackend = &cpu;
    let bogus = DevicePtr::from_raw(64).unwrap();
    assert!(matches!(
        gpu.free(bogus),
        Err(GpuError::UnknownPointer { ptr: 64 })
    ));
}
