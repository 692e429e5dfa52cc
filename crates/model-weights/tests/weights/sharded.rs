//! A checkpoint split into two shards with an index loads exactly like the
//! single file it came from.

use crate::common;

use common::*;
use metrale_core::scope::ModelResource;
use metrale_gpu_runtime::GpuBackend;
use metrale_gpu_runtime::cpu::CpuBackend;
use metrale_model_weights::loader::{SafetensorsFile, WeightDType, load_safetensors};
use metrale_model_weights::weights::WeightStore;

fn bytes_of(gpu: &dyn GpuBackend, store: &WeightStore, name: &str) -> Vec<u8> {
    let t = store.get(name).unwrap();
    let mut out = vec![0u8; t.bytes()];
    gpu.copy_d2h(t.slice.ptr(), 0, &mut out).unwrap();
    out
}

/// Splits `fixture/model.safetensors` into two shards plus an index in a new directory.
fn split(fixture_name: &str) -> std::path::PathBuf {
    let file = SafetensorsFile::open(&fixture(fixture_name).join("model.safetensors")).unwrap();
    let mut entries: Vec<_> = file.tensors.iter().collect();
    entries.sort_by(|a, b| a.name.cmp(&b.name));
    let half = entries.len() / 2;
    let dir = scratch(&format!("sharded-{fixture_name}"));
    let mut weight_map = serde_json::Map::new();
    for (k, part) in [&entries[..half], &entries[half..]].into_iter().enumerate() {
        let shard = format!("model-{:05}-of-00002.safetensors", k + 1);
        let specs: Vec<Spec<'_>> = part
            .iter()
            .map(|t| Spec {
                name: &t.name,
                dtype: t.dtype.name(),
                shape: t.shape.clone(),
                data: {
                    let mut data = vec![0u8; t.end - t.start];
                    file.read(t, 0, &mut data).unwrap();
                    data
                },
            })
            .collect();
        std::fs::write(dir.join(&shard), image(&specs)).unwrap();
        for t in part.iter() {
            weight_map.insert(t.name.clone(), serde_json::Value::String(shard.clone()));
        }
    }
    let index = serde_json::json!({"metadata": {"total_size": 0}, "weight_map": weight_map});
    std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();
    dir
}

#[test]
fn two_shards_load_like_one_file() {
    for name in ["llama", "granitemoehybrid"] {
        let sharded = split(name);
        let expected = expect_all(&fixture(name));
        let gpu = CpuBackend::new();
        let mut one = load_safetensors(
            &fixture(name),
            &expected,
            &gpu,
            WeightDType::AsStored,
            &mut |_| {},
        )
        .unwrap();
        let mut two = load_safetensors(
            &sharded,
            &expected,
            &gpu,
            WeightDType::AsStored,
            &mut |_| {},
        )
        .unwrap();
        assert_eq!(one.len(), two.len());
        assert_eq!(one.len(), expected.len());
        for e in &expected {
            assert_eq!(
                one.get(&e.name).unwrap().shape,
                two.get(&e.name).unwrap().shape,
                "{name}: {}",
                e.name
            );
            assert_eq!(
                bytes_of(&gpu, &one, &e.name),
                bytes_of(&gpu, &two, &e.name),
                "{name}: {}",
                e.name
            );
        }
        one.release(&gpu).unwrap();
        two.release(&gpu).unwrap();
        assert_eq!(gpu.live_bytes(), 0);
        let _ = std::fs::remove_dir_all(&sharded);
    }
}

#[test]
fn the_index_wins_over_a_stray_single_file() {
    // With both present, the index decides; a missing shard is an error even
    // though model.safetensors exists.
    let dir = split("llama");
    std::fs::copy(
        fixture("llama").join("model.safetensors"),
        dir.join("model.safetensors"),
    )
    .unwrap();
    std::fs::remove_file(dir.join("model-00002-of-00002.safetensors")).unwrap();
    let gpu = CpuBackend::new();
    let err = match load_safetensors(
        &dir,
        &expect_all(&fixture("llama")),
        &gpu,
        WeightDType::AsStored,
        &mut |_| {},
    ) {
        Ok(_) => panic!("a missing shard must fail"),
        Err(e) => e,
    };
    assert!(
        err.to_string().contains("model-00002-of-00002.safetensors"),
        "{err}"
    );
    assert_eq!(gpu.live_bytes(), 0);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn converts_to_the_requested_dtype() {
    let gpu = CpuBackend::new();
    let expected = expect_all(&fixture("qwen3"));
    let mut bf16 = load_safetensors(
        &fixture("qwen3"),
        &expected,
        &gpu,
        WeightDType::AsStored,
        &mut |_| {},
    )
    .unwrap();
    let mut f32s = load_safetensors(
        &fixture("qwen3"),
        &expected,
        &gpu,
        WeightDType::F32,
        &mut |_| {},
    )
    .unwrap();
    assert_eq!(f32s.bytes(), 2 * bf16.bytes());
    let name = "model.layers.0.mlp.up_proj.weight";
    let g: &dyn GpuBackend = &gpu;
    let wide = g.download_f32(f32s.get(name).unwrap().slice).unwrap();
    let narrow: Vec<f32> = bytes_of(&gpu, &bf16, name)
        .chunks_exact(2)
        .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
        .collect();
    assert_eq!(wide, narrow);
    bf16.release(&gpu).unwrap();
    f32s.release(&gpu).unwrap();
    assert_eq!(gpu.live_bytes(), 0);
}
