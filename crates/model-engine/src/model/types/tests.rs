//! Teardown tests: order, attempt-all, first error with label, leaked
//! sequences, the sweep warning, idempotence, failure injection while building.

use std::io::Write;
use std::sync::Arc;

use metrale_core::DType;
use metrale_gpu_runtime::cpu::CpuBackend;
use metrale_gpu_runtime::fault::FaultPlan;
use metrale_gpu_runtime::gpu::GpuBackend;
use metrale_model_weights::weights::WeightStore;
use parking_lot::Mutex;

use super::*;
use crate::cache::SnapshotKey;
use crate::config::*;

fn names() -> LayerNames {
    LayerNames {
        input_norm: "n".into(),
        ffn_norm: None,
        mixer: MixerNames::None,
        ffn: FfnNames::None,
    }
}

/// A tiny hybrid: one Mamba-2 layer and one attention layer.
fn hybrid_config() -> ModelConfig {
    ModelConfig {
        model_type: ModelType::Bamba,
        hidden_size: 16,
        vocab_size: 32,
        norm_eps: 1e-5,
        norm_weight_offset: 0.0,
        tie_word_embeddings: false,
        embedding_multiplier: 1.0,
        residual_multiplier: 1.0,
        logits_divisor: 1.0,
        max_position_embeddings: 64,
        declared_dtype: Some(DType::F32),
        bos_token_id: None,
        eos_token_ids: vec![2],
        attention: Some(AttentionConfig {
            n_heads: 2,
            n_kv_heads: 1,
            head_dim: 8,
            rope: None,
            scale: 8f32.powf(-0.5),
            qk_norm: false,
            output_gate: false,
            qkv_bias: false,
            o_bias: false,
        }),
        mamba: Some(MambaConfig {
            n_heads: 2,
            head_dim: 8,
            d_state: 4,
            n_groups: 1,
            conv_kernel: 4,
            chunk_size: 8,
            time_step_limit: (0.0, f32::INFINITY),
            conv_bias: true,
            proj_bias: false,
            norm_eps: 1e-5,
            norm_groups: 1,
        }),
        deltanet: None,
        short_conv: None,
        mlp: Some(MlpConfig {
            intermediate_size: 32,
            activation: Activation::SwiGlu,
        }),
        moe: None,
        names: ModelNames {
            embed: "e".into(),
            final_norm: "f".into(),
            lm_head: None,
        },
        layers: vec![
            LayerPlan {
                mixer: MixerKind::Mamba2,
                ffn: FfnKind::Mlp,
                names: names(),
                sliding_window: None,
            },
            LayerPlan {
                mixer: MixerKind::Attention,
                ffn: FfnKind::Mlp,
                names: names(),
                sliding_window: None,
            },
        ],
        aside: Vec::new(),
        warnings: Vec::new(),
    }
}

fn options() -> ModelOptions {
    ModelOptions {
        kv_block_size: 4,
        kv_blocks: 8,
        max_seqs: 3,
        max_batch_tokens: 16,
        kv_dtype: None,
        kv_follows_weights: false,
        ssm_state_dtype: None,
        ssm_state_follows_weights: false,
        cuda_graphs: true,
        prefix_cache: Default::default(),
    }
}

/// A CPU backend whose hooks carry a fault plan from its creation.
type Fi = CpuBackend;

fn fault_injecting(plan: FaultPlan) -> Arc<Fi> {
    let cpu = Arc::new(CpuBackend::with_threads(1));
    cpu.hooks().set_faults(plan);
    cpu
}

/// A model with every kind of resource populated: pools, a snapshot, a
/// derived weight and a weight store.
fn full_model(plan: FaultPlan) -> (Arc<Fi>, TransformerModel) {
    let fi = fault_injecting(FaultPlan::default());
    let gpu: Arc<dyn GpuBackend> = fi.clone();
    let mut model = TransformerModel::new(gpu.clone(), hybrid_config(), options()).unwrap();
    let mut store = WeightStore::new();
    let w = store
        .upload(gpu.as_ref(), "w", DType::F32, vec![2, 4], &[0u8; 32])
        .unwrap()
        .slice;
    model
        .derived
        .permute_rows(gpu.as_ref(), "w.permuted", w, 4, &[1, 0])
        .unwrap();
    {
        let slot = model.ssm_pool.acquire(gpu.as_ref()).unwrap();
        let pool = model.ssm_pool.clone();
        model
            .ssm_snapshots
            .capture(
                gpu.as_ref(),
                &pool,
                slot.slot(),
                SnapshotKey::of(&[1, 2, 3]),
            )
            .unwrap();
    }
    model.adopt_weight_store(store);
    fi.hooks().set_faults(plan);
    (fi, model)
}

/// The owner labels in teardown order, collapsing repeats.
fn owner_sequence(fi: &Fi) -> Vec<String> {
    let mut seq: Vec<String> = Vec::new();
    for o in fi.hooks().freed_owners() {
        let o = if o.starts_with("weights: ") {
            "weights".to_string()
        } else if o.starts_with("derived: ") {
            "derived".to_string()
        } else {
            o
        };
        if seq.last() != Some(&o) {
            seq.push(o);
        }
    }
    seq
}

#[test]
fn release_pools_frees_in_the_specified_order_and_empties_the_ledger() {
    let (fi, mut model) = full_model(FaultPlan::default());
    assert!(fi.live_bytes() > 0);
    model.release_pools().unwrap();
    assert_eq!(
        owner_sequence(&fi),
        [
            "derived",
            "ssm snapshots",
            "ssm state pool",
            "kv cache",
            "buffer arena",
            "weights"
        ]
    );
    assert_eq!(fi.live_bytes(), 0);
    assert!(fi.ledger().is_empty());
}

#[test]
fn a_failing_step_does_not_stop_later_steps_and_its_label_is_the_context() {
    // Find the index of the first KV-cache free in a clean teardown, then fail it.
    let (probe, mut clean) = full_model(FaultPlan::default());
    clean.release_pools().unwrap();
    let kv_index = probe
        .hooks()
        .freed_owners()
        .iter()
        .position(|o| o == "kv cache")
        .unwrap();
    let (fi, mut model) = full_model(FaultPlan {
        fail_free_at: Some(kv_index),
        ..FaultPlan::default()
    });
    let err = model.release_pools().unwrap_err();
    assert_eq!(
        err.to_string(),
        "kv cache",
        "outermost context is the step's label: {err:#}"
    );
    assert!(
        format!("{err:#}").contains(&format!("injected fault: free #{kv_index}")),
        "{err:#}"
    );
    let seq = owner_sequence(&fi);
    assert_eq!(
        seq,
        [
            "derived",
            "ssm snapshots",
            "ssm state pool",
            "kv cache",
            "buffer arena",
            "weights"
        ]
    );
    assert_eq!(
        fi.live_bytes(),
        0,
        "later steps still released their memory"
    );
}

#[test]
fn the_first_error_wins_when_several_steps_fail() {
    let (fi, mut model) = full_model(FaultPlan {
        fail_free_at: Some(0),
        fail_copy_at: None,
        fail_alloc_at: None,
        fail_op_at: None,
    });
    // Make a second step fail too: a leaked slot.
    let leaked = model.ssm_pool.acquire(fi.as_ref()).unwrap();
    let mut result = Ok(());
    let logs = capture_logs(|| result = model.release_pools());
    let err = result.unwrap_err();
    assert_eq!(err.to_string(), "derived weights");
    assert!(
        logs.contains("teardown: ssm state pool also failed"),
        "later failures are logged: {logs}"
    );
    drop(leaked);
}

#[test]
fn a_sequence_still_holding_a_slot_fails_the_pool_step_and_later_steps_run() {
    let (fi, mut model) = full_model(FaultPlan::default());
    let held = model.ssm_pool.acquire(fi.as_ref()).unwrap();
    let err = model.release_pools().unwrap_err();
    assert_eq!(err.to_string(), "ssm state pool");
    assert!(
        format!("{err:#}").contains("1 handle(s) still hold the SSM pool"),
        "{err:#}"
    );
    let seq = owner_sequence(&fi);
    assert!(
        seq.ends_with(&[
            "kv cache".to_string(),
            "buffer arena".to_string(),
            "weights".to_string()
        ]),
        "{seq:?}"
    );
    // The pool's memory was not freed by its owner; the sweep reclaimed it.
    assert_eq!(fi.live_bytes(), 0);
    drop(held);
}

/// Captures log output of the closure.
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

#[test]
fn unreleased_allocations_are_swept_counted_and_warned_about() {
    let (fi, mut model) = full_model(FaultPlan::default());
    let gpu: &dyn GpuBackend = fi.as_ref();
    let _orphan_a = gpu.alloc(100, "orphan").unwrap();
    let _orphan_b = gpu.alloc(50, "orphan").unwrap();
    let logs = capture_logs(|| model.release_pools().unwrap());
    assert!(logs.contains("WARN"), "{logs}");
    assert!(logs.contains("teardown swept 2 allocation(s)"), "{logs}");
    assert_eq!(fi.live_bytes(), 0);
}

#[test]
fn no_warning_when_every_owner_released_its_memory() {
    let (_fi, mut model) = full_model(FaultPlan::default());
    let logs = capture_logs(|| model.release_pools().unwrap());
    assert!(!logs.contains("swept"), "{logs}");
}

#[test]
fn release_pools_twice_is_harmless() {
    let (fi, mut model) = full_model(FaultPlan::default());
    model.release_pools().unwrap();
    let frees = fi.hooks().freed_owners().len();
    model.release_pools().unwrap();
    assert_eq!(
        fi.hooks().freed_owners().len(),
        frees,
        "nothing freed twice"
    );
    assert_eq!(fi.live_bytes(), 0);
    model.shutdown().unwrap();
}

#[test]
fn a_failure_at_every_allocation_while_building_leaves_the_ledger_empty() {
    // Count the allocations of a successful build first.
    let probe = fault_injecting(FaultPlan::default());
    let model = TransformerModel::new(probe.clone(), hybrid_config(), options()).unwrap();
    let total = probe.hooks().alloc_count();
    assert!(total >= 4, "pools, cache layers and arena: {total}");
    model.shutdown().unwrap();
    for index in 0..total {
        let fi = fault_injecting(FaultPlan {
            fail_alloc_at: Some(index),
            ..FaultPlan::default()
        });
        let result = TransformerModel::new(fi.clone(), hybrid_config(), options());
        let err = result
            .err()
            .unwrap_or_else(|| panic!("allocation {index} failed but the build succeeded"));
        assert!(err.to_string().contains("injected fault"), "{err}");
        assert_eq!(
            fi.live_bytes(),
            0,
            "allocation {index}: {}",
            fi.ledger_report()
        );
    }
}

#[test]
fn dropping_a_model_without_shutdown_still_releases_it() {
    let (fi, model) = full_model(FaultPlan::default());
    drop(model);
    assert_eq!(fi.live_bytes(), 0);
}

#[test]
fn slots_return_to_the_pool_and_exhaustion_is_an_error() {
    let (fi, model) = full_model(FaultPlan::default());
    let gpu: &dyn GpuBackend = fi.as_ref();
    let guards: Vec<_> = (0..3)
        .map(|_| model.ssm_pool.acquire(gpu).unwrap())
        .collect();
    assert_eq!(model.ssm_pool.in_use(), 3);
    let err = model.ssm_pool.acquire(gpu).unwrap_err();
    assert!(matches!(err, EngineError::Exhausted { .. }), "{err}");
    drop(guards);
    assert_eq!(model.ssm_pool.in_use(), 0);
    model.shutdown().unwrap();
}
