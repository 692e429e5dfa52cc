//! Every golden fixture's config parses into the right plan and settings,
//! names exactly the tensors its checkpoint stores, and loads.

use std::collections::BTreeMap;
use std::path::PathBuf;

use metrale_core::scope::ModelResource;
use metrale_gpu_runtime::GpuBackend;
use metrale_gpu_runtime::cpu::CpuBackend;
use metrale_model_engine::config::{
    Activation, FfnKind, MixerKind, ModelType, RopeScaling, load_config,
};
use metrale_model_engine::loader::load_weights;
use metrale_model_weights::loader::{LoadProgress, WeightDType, scan_safetensors};

const FIXTURES: [(&str, ModelType, &str); 12] = [
    ("llama", ModelType::Llama, "* *"),
    ("qwen3", ModelType::Qwen3, "* *"),
    ("mamba2", ModelType::Mamba2, "M M"),
    ("bamba", ModelType::Bamba, "M * M"),
    ("nemotron_h", ModelType::NemotronH, "M * M -"),
    ("granitemoehybrid", ModelType::GraniteMoeHybrid, "M * M"),
    ("qwen3_next", ModelType::Qwen3Next, "G G G *"),
    ("qwen3_5", ModelType::Qwen35, "G G G *"),
    ("qwen3_5_moe", ModelType::Qwen35Moe, "G * G *"),
    ("lfm2", ModelType::Lfm2, "C C * C"),
    ("lfm2_moe", ModelType::Lfm2Moe, "C * C C"),
    ("lfm2_vl", ModelType::Lfm2, "C * C C"),
];

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures")).join(name)
}

#[test]
fn every_fixture_has_its_plan() {
    for (name, model_type, plan) in FIXTURES {
        let config = load_config(&fixture(name)).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(config.model_type, model_type, "{name}");
        assert_eq!(config.plan_line(), plan, "{name}");
        assert_eq!(config.eos_token_ids, vec![2], "{name}");
        assert_eq!(config.vocab_size, 512, "{name}");
        assert_eq!(config.hidden_size, 64, "{name}");
    }
}

#[test]
fn expected_tensors_match_each_checkpoint_exactly() {
    for (name, _, _) in FIXTURES {
        let config = load_config(&fixture(name)).unwrap();
        let expected: BTreeMap<String, Vec<usize>> = config
            .expected_tensors()
            .into_iter()
            .map(|t| (t.name, t.shape))
            .collect();
        let mut stored: BTreeMap<String, Vec<usize>> = scan_safetensors(&fixture(name))
            .unwrap()
            .into_iter()
            .map(|t| (t.name, t.shape))
            .collect();
        // The parts set aside (a vision tower, MTP layers) hold the rest,
        // and what the config says of them is there.
        for part in &config.aside {
            for t in &part.expected {
                assert_eq!(stored.get(&t.name), Some(&t.shape), "{name}: {}", t.name);
            }
            stored.retain(|n, _| !part.prefixes.iter().any(|p| n.starts_with(p.as_str())));
        }
        assert_eq!(expected, stored, "{name}");
        assert_eq!(
            config.parameter_count(),
            stored
                .values()
                .map(|s| s.iter().product::<usize>())
                .sum::<usize>(),
            "{name}"
        );
    }
}

#[test]
fn every_fixture_loads_and_releases() {
    let gpu = CpuBackend::new();
    for (name, _, _) in FIXTURES {
        let config = load_config(&fixture(name)).unwrap();
        let mut events = Vec::new();
        let mut store = load_weights(
            &fixture(name),
            &config,
            &gpu,
            WeightDType::AsStored,
            &mut |p| events.push(p),
        )
        .unwrap();
        let warnings: Vec<&String> = events
            .iter()
            .filter_map(|e| match e {
                LoadProgress::Warning(w) => Some(w),
                _ => None,
            })
            .collect();
        let notices = events
            .iter()
            .filter(|e| matches!(e, LoadProgress::Notice(_)))
            .count();
        if name == "qwen3_5" {
            // The vision tower in one warning, the MTP layers in one notice.
            assert_eq!(warnings.len(), 1, "{name}: {warnings:?}");
            assert!(
                warnings[0].contains("vision tower (21 tensors"),
                "{}",
                warnings[0]
            );
            assert!(warnings[0].contains("text-only"), "{}", warnings[0]);
            assert_eq!(notices, 1, "{name}: {events:?}");
        } else if name == "lfm2_vl" {
            // The vision tower and projector in one warning.
            assert_eq!(warnings.len(), 1, "{name}: {warnings:?}");
            assert!(warnings[0].contains("text-only"), "{}", warnings[0]);
            assert_eq!(notices, 0, "{name}: {events:?}");
        } else {
            assert!(warnings.is_empty() && notices == 0, "{name}: {events:?}");
        }
        assert!(
            matches!(events.last(), Some(LoadProgress::Done { .. })),
            "{name}"
        );
        assert_eq!(store.len(), config.expected_tensors().len(), "{name}");
        assert_eq!(gpu.live_bytes(), store.bytes(), "{name}");
        store.release(&gpu).unwrap();
        assert_eq!(gpu.live_bytes(), 0, "{name}");
    }
}

#[test]
fn loads_bf16_checkpoints_as_f32() {
    let gpu = CpuBackend::new();
    let config = load_config(&fixture("qwen3")).unwrap();
    let mut store = load_weights(
        &fixture("qwen3"),
        &config,
        &gpu,
        WeightDType::F32,
        &mut |_| {},
    )
    .unwrap();
    let embed = store.get("model.embed_tokens.weight").unwrap();
    assert_eq!(embed.dtype(), metrale_core::DType::F32);
    assert_eq!(embed.bytes(), 512 * 64 * 4);
    store.release(&gpu).unwrap();
    assert_eq!(gpu.live_bytes(), 0);
}

#[test]
fn dense_families() {
    let llama = load_config(&fixture("llama")).unwrap();
    let a = llama.attention.as_ref().unwrap();
    assert_eq!((a.n_heads, a.n_kv_heads, a.head_dim), (4, 2, 16));
    let rope = a.rope.as_ref().unwrap();
    assert_eq!(
        (rope.theta, rope.rotary_dim, &rope.scaling),
        (10000.0, 16, &RopeScaling::Default)
    );
    assert!(!a.qk_norm && !a.qkv_bias && !a.output_gate);
    assert_eq!(a.scale, 0.25);
    assert!(llama.names.lm_head.is_some());
    assert_eq!(llama.norm_eps, 1e-6);
    assert_eq!(llama.declared_dtype, Some(metrale_core::DType::F32));

    let qwen3 = load_config(&fixture("qwen3")).unwrap();
    let a = qwen3.attention.as_ref().unwrap();
    assert!(a.qk_norm);
    assert_eq!(a.head_dim, 32);
    assert!(qwen3.tie_word_embeddings && qwen3.names.lm_head.is_none());
    assert_eq!(qwen3.declared_dtype, Some(metrale_core::DType::BF16));
}

#[test]
fn mamba_families() {
    let m2 = load_config(&fixture("mamba2")).unwrap();
    let m = m2.mamba.as_ref().unwrap();
    assert_eq!(
        (m.n_heads, m.head_dim, m.d_state, m.n_groups, m.norm_groups),
        (8, 16, 16, 2, 2)
    );
    assert_eq!((m.conv_dim(), m.in_proj_dim(), m.chunk_size), (192, 328, 8));
    assert_eq!(m.time_step_limit, (0.0, f32::INFINITY));
    assert_eq!(m.norm_eps, 1e-5);
    assert!(m.conv_bias && !m.proj_bias);
    assert_eq!(
        m2.recurrent_bytes_per_sequence(),
        2 * 4 * (192 * 3 + 8 * 16 * 16)
    );
    assert_eq!(m2.kv_bytes_per_token(), 0);

    let bamba = load_config(&fixture("bamba")).unwrap();
    let rope = bamba.attention.as_ref().unwrap().rope.as_ref().unwrap();
    assert_eq!(rope.rotary_dim, 8);
    assert_eq!(bamba.mamba.as_ref().unwrap().norm_groups, 1);
    assert_eq!(bamba.layers[1].mixer, MixerKind::Attention);
    assert!(bamba.layers.iter().all(|l| l.ffn == FfnKind::Mlp));

    let nem = load_config(&fixture("nemotron_h")).unwrap();
    assert!(nem.attention.as_ref().unwrap().rope.is_none());
    assert_eq!(nem.mlp.as_ref().unwrap().activation, Activation::Relu2);
    assert_eq!(
        (nem.layers[3].mixer, nem.layers[3].ffn),
        (MixerKind::None, FfnKind::Mlp)
    );
    assert_eq!(nem.mamba.as_ref().unwrap().norm_groups, 2);
    assert!(nem.layers.iter().all(|l| l.names.ffn_norm.is_none()));

    let granite = load_config(&fixture("granitemoehybrid")).unwrap();
    assert_eq!(
        (
            granite.embedding_multiplier,
            granite.residual_multiplier,
            granite.logits_divisor
        ),
        (2.0, 0.5, 1.5)
    );
    let a = granite.attention.as_ref().unwrap();
    assert_eq!(a.scale, 0.2);
    assert!(a.rope.is_some());
    let moe = granite.moe.as_ref().unwrap();
    assert_eq!(
        (
            moe.n_experts,
            moe.top_k,
            moe.expert_intermediate,
            moe.shared_intermediate
        ),
        (4, 2, 64, Some(96))
    );
    assert!(moe.norm_topk_prob && !moe.shared_expert_gate);
    assert!(granite.layers.iter().all(|l| l.ffn == FfnKind::Moe));
    assert_eq!(granite.mamba.as_ref().unwrap().norm_eps, 1e-6);
}

#[test]
fn qwen3_next_settings() {
    let q = load_config(&fixture("qwen3_next")).unwrap();
    assert_eq!(q.norm_weight_offset, 1.0);
    let a = q.attention.as_ref().unwrap();
    assert!(a.output_gate && a.qk_norm);
    assert_eq!(a.rope.as_ref().unwrap().rotary_dim, 4);
    let d = q.deltanet.as_ref().unwrap();
    assert_eq!(
        (
            d.n_k_heads,
            d.n_v_heads,
            d.k_head_dim,
            d.v_head_dim,
            d.conv_dim()
        ),
        (2, 4, 16, 16, 128)
    );
    let moe = q.moe.as_ref().unwrap();
    assert_eq!(
        (
            moe.n_experts,
            moe.top_k,
            moe.expert_intermediate,
            moe.shared_intermediate
        ),
        (4, 2, 32, Some(48))
    );
    assert!(moe.shared_expert_gate && moe.norm_topk_prob);
    assert!(q.mlp.is_none());
    assert_eq!(q.kv_bytes_per_token(), 2 * 2 * 16 * 4);
}
