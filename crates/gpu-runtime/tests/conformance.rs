//! The conformance suite on the CPU backend, at the built-in small shapes:
//! every op passes on one thread and on two; and on a backend with broken
//! ops, the suite finds each.

#[path = "conformance/doctored.rs"]
mod doctored;

use std::collections::HashMap;
use std::time::Instant;

use doctored::{Doctored, Fault};

use metrale_gpu_runtime::conformance::{self, ArchShapes, Op, Status};
use metrale_gpu_runtime::cpu::CpuBackend;
use metrale_gpu_runtime::gpu::GpuBackend;

fn suite(threads: usize) {
    let cpu = CpuBackend::with_threads(threads);
    let started = Instant::now();
    let mut passed = Vec::new();
    for shapes in ArchShapes::small_set() {
        let report = conformance::run(&cpu, &shapes);
        println!("{report}");
        report.assert_all_passed();
        assert!(
            report.unsupported().is_empty(),
            "the CPU backend has every op"
        );
        passed.extend(report.with_status(|s| *s == Status::Passed));
    }
    // Between them the shapes run every op.
    for op in Op::ALL {
        assert!(passed.contains(&op), "{op} was run at no shape");
    }
    assert_eq!(cpu.live_bytes(), 0);
    println!(
        "{threads} thread(s): {:.2} s",
        started.elapsed().as_secs_f64()
    );
}

#[test]
fn every_op_conforms_on_two_threads() {
    suite(2);
}

#[test]
fn every_op_conforms_on_one_thread() {
    suite(1);
}

/// Each kind of broken op is found: wrong values, an op said to be missing
/// that runs anyway, memory left allocated, a panic; a missing op that
/// errs is `Unsupported`, and an op that needs it fails saying so.
#[test]
fn the_suite_finds_broken_ops() {
    let faults = HashMap::from([
        (Op::Scale, Fault::Off),
        (Op::SsdScan, Fault::Missing),
        (Op::Relu2, Fault::Lying),
        (Op::SigmoidGateAdd, Fault::Leaks),
        (Op::MoeGroup, Fault::Panics),
        (Op::KvStore, Fault::Missing),
    ]);
    let gpu = Doctored {
        inner: CpuBackend::with_threads(2),
        faults: faults.clone(),
    };
    let shapes = ArchShapes::small_set()
        .into_iter()
        .find(|s| s.name == "hybrid-mamba-moe")
        .unwrap();
    let report = conformance::run(&gpu, &shapes);
    println!("{report}");
    let failed = |op: Op, words: &str| match report.status(op) {
        Some(Status::Failed(why)) => assert!(why.contains(words), "{op}: {why}"),
        other => panic!("{op}: {other:?}, not failed"),
    };
    failed(Op::Scale, "got");
    failed(Op::Relu2, "does not support");
    failed(Op::SigmoidGateAdd, "left allocated");
    failed(Op::MoeGroup, "panicked");
    failed(Op::PagedAttention, "kv_store");
    assert_eq!(report.unsupported(), vec![Op::KvStore, Op::SsdScan]);
    for op in Op::ALL {
        if !faults.contains_key(&op) && op != Op::PagedAttention {
            assert!(
                matches!(report.status(op), Some(Status::Passed | Status::NotUsed)),
                "{op}: {:?}",
                report.status(op)
            );
        }
    }
    assert!(report.leaked_bytes > 0);
    let text = report.to_string();
    assert!(
        text.contains("FAILED") && text.contains("unsupported"),
        "{text}"
    );
    assert!(std::panic::catch_unwind(|| report.assert_all_passed()).is_err());
}
