//! A sticky device fault injected at an op launch of a forward step: the
//! step fails naming the op (the op that caused it with debug sync, the call
//! where it surfaced without), and teardown reports the failures and still
//! leaves the ledger empty. Also what a decode step copies.

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;

use metrale_gpu_runtime::cpu::CpuBackend;
use metrale_gpu_runtime::fault::FaultPlan;
use metrale_gpu_runtime::{GpuBackend, GpuError};
use metrale_model_engine::EngineError;
use metrale_model_engine::model::{Logits, ModelOptions, Step, TransformerModel};
use metrale_model_weights::loader::WeightDType;
use parking_lot::Mutex;

/// A hybrid: attention, Mamba-2 and MLP layers, so a step runs most op kinds.
const FIXTURE: &str = "bamba";
const PROMPT: [u32; 3] = [1, 2, 3];

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures")).join(name)
}

fn load(debug_sync: bool) -> (Arc<CpuBackend>, TransformerModel) {
    let cpu = Arc::new(CpuBackend::with_threads(1));
    cpu.hooks().set_debug_sync(debug_sync);
    let options = ModelOptions {
        kv_block_size: 16,
        kv_blocks: 4,
        max_seqs: 2,
        max_batch_tokens: 16,
        kv_dtype: None,
        kv_follows_weights: false,
        ssm_state_dtype: None,
        ssm_state_follows_weights: false,
        cuda_graphs: true,
        prefix_cache: Default::default(),
    };
    let gpu: Arc<dyn GpuBackend> = cpu.clone();
    let model = TransformerModel::load(
        &fixture(FIXTURE),
        gpu,
        options,
        WeightDType::F32,
        &mut |_| {},
    )
    .expect("fixture loads");
    (cpu, model)
}

/// One step of `tokens` for a new sequence, which is then ended.
fn step(model: &TransformerModel, tokens: &[u32]) -> Result<Vec<Vec<f32>>, EngineError> {
    let mut seq = model.new_sequence()?;
    let result = model.forward(&mut [Step {
        seq: &mut seq,
        tokens,
        logits: Logits::Last,
    }]);
    model.free_sequence(seq);
    result
}

/// Op launches of one clean prefill step of the prompt.
fn launches_per_step() -> u64 {
    let (cpu, model) = load(false);
    cpu.hooks().reset_transfers();
    step(&model, &PROMPT).unwrap();
    let launches = cpu.hooks().transfers().op_launches;
    model.shutdown().unwrap();
    launches
}

/// The device error under a forward step's error.
fn driver(err: &EngineError) -> (&'static str, i32, &str) {
    match err {
        EngineError::Device {
            source: GpuError::Driver { op, code, message },
            ..
        } => (*op, *code, message.as_str()),
        other => panic!("expected a device fault, got {other}"),
    }
}

fn capture_logs(f: impl FnOnce()) -> String {
    #[derive(Clone, Default)]
    struct Sink(Arc<Mutex<Vec<u8>>>);
    impl Write for Sink {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let sink = Sink::default();
    let writer = sink.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(move || writer.clone())
        .with_ansi(false)
        .finish();
    tracing::subscriber::with_default(subscriber, f);
    String::from_utf8_lossy(&sink.0.lock()).into_owned()
}

/// Teardown after the fault: an error naming the device fault, each later
/// failing step logged, and nothing left on the ledger.
fn teardown_reports_and_empties(cpu: &CpuBackend, model: TransformerModel) {
    let mut result = Ok(());
    let logs = capture_logs(|| result = model.shutdown());
    let err = result.expect_err("teardown after a device fault fails");
    let chain = format!("{err:#}");
    assert!(chain.contains("free: device error 700"), "{chain}");
    assert!(
        logs.contains("also failed"),
        "later failures are reported: {logs}"
    );
    assert!(logs.contains("device error 700"), "{logs}");
    assert_eq!(cpu.live_bytes(), 0, "{}", cpu.ledger_report());
    assert!(cpu.ledger().is_empty());
}

#[test]
fn with_debug_sync_a_faulting_op_of_a_step_names_itself_and_teardown_still_empties_the_ledger() {
    let launches = launches_per_step() as usize;
    assert!(launches > 10, "{launches}");
    for at in [0, launches / 2, launches - 1] {
        let (cpu, model) = load(true);
        cpu.hooks().set_faults(FaultPlan {
            fail_op_at: Some(at),
            ..FaultPlan::default()
        });
        let err = step(&model, &PROMPT).expect_err("the step faults");
        let (op, code, message) = driver(&err);
        assert_eq!(code, 700, "{err}");
        assert_eq!(
            message, "an illegal memory access was encountered (injected)",
            "reported where it happened: {err}"
        );
        if at == 0 {
            assert_eq!(op, "embedding", "a step starts with the embedding");
        }
        assert!(
            err.to_string().contains(&format!("{op}: device error 700")),
            "{err}"
        );
        // The device stays faulted: the next step fails before any op runs.
        let again = step(&model, &PROMPT).expect_err("sticky");
        assert!(
            again
                .to_string()
                .contains(&format!("faulted earlier, at {op}")),
            "{again}"
        );
        teardown_reports_and_empties(&cpu, model);
    }
}

#[test]
fn without_debug_sync_a_fault_surfaces_later_and_teardown_still_empties_the_ledger() {
    let launches = launches_per_step() as usize;
    // The last op's fault surfaces at the logits download; an earlier op's
    // at the next op.
    for (at, surfaces_at) in [(launches - 1, Some("copy_d2h")), (1, None)] {
        let (cpu, model) = load(false);
        cpu.hooks().set_faults(FaultPlan {
            fail_op_at: Some(at),
            ..FaultPlan::default()
        });
        let err = step(&model, &PROMPT).expect_err("the step fails");
        let (op, code, message) = driver(&err);
        assert_eq!(code, 700);
        assert!(
            message.contains("an earlier asynchronous op failed"),
            "{err}"
        );
        assert!(message.contains("METRALE_DEBUG_SYNC=1"), "{err}");
        if let Some(want) = surfaces_at {
            assert_eq!(op, want, "{err}");
        }
        teardown_reports_and_empties(&cpu, model);
    }
}
