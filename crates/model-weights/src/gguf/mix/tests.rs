//! The type choice against llama.cpp's own quantizer: for every model and
//! file type of the GGUF fixtures' manifest (8 models x 8 file types, made
//! by llama-quantize from F32 files), the type of every tensor.

use std::path::PathBuf;

use serde_json::Value;

use super::*;

fn manifest() -> Value {
    let path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/gguf/manifest.json");
    let text = std::fs::read_to_string(&path).expect("the GGUF fixtures' manifest");
    serde_json::from_str(&text).expect("manifest JSON")
}

fn ggml(name: &str) -> GgmlType {
    GgmlType::from_name(name).unwrap_or_else(|| panic!("unknown type {name}"))
}

#[test]
fn the_types_are_llama_quantizes() {
    let manifest = manifest();
    let mut checked = 0;
    for (model, m) in manifest["models"].as_object().unwrap() {
        let hf = &m["hf_config"];
        let n_expert = ["num_local_experts", "num_experts", "n_routed_experts"]
            .iter()
            .find_map(|k| hf[k].as_u64())
            .unwrap_or(0) as usize;
        let params = MixParams {
            n_layer: hf["num_hidden_layers"].as_u64().unwrap() as usize,
            n_expert,
        };
        let f32_tensors = m["f32_tensors"].as_object().unwrap();
        let names: Vec<&String> = f32_tensors.keys().collect();
        let shapes: Vec<Vec<usize>> = names
            .iter()
            .map(|n| {
                (f32_tensors[n.as_str()]["shape"].as_array().unwrap())
                    .iter()
                    .map(|d| d.as_u64().unwrap() as usize)
                    .collect()
            })
            .collect();
        let tensors: Vec<MixTensor> = names
            .iter()
            .zip(&shapes)
            .map(|(n, ne)| MixTensor {
                name: n,
                ne,
                ty: ggml(f32_tensors[n.as_str()]["type"].as_str().unwrap()),
            })
            .collect();
        for (format, f) in m["formats"].as_object().unwrap() {
            let ftype = FileType::from_name(format).expect("a known file type");
            let chosen = choose_types(&tensors, &params, ftype);
            for (t, ty) in tensors.iter().zip(chosen) {
                let want = f["types"][t.name].as_str().unwrap();
                assert_eq!(ty, ggml(want), "{model} {format}: {}", t.name);
                checked += 1;
            }
        }
    }
    assert!(checked > 1000, "only {checked} tensors checked");
}

#[test]
fn names_ids_and_fallbacks() {
    for t in FileType::ALL {
        assert_eq!(FileType::from_name(&t.name().to_ascii_lowercase()), Some(t));
    }
    assert_eq!(FileType::from_name("q4_k_x"), None);
    assert_eq!(FileType::Q4_K_M.ftype_id(), 15);
    assert_eq!(fallback(544, GgmlType::Q4K), GgmlType::Q5_0);
    assert_eq!(fallback(544, GgmlType::Q6K), GgmlType::Q8_0);
    assert_eq!(fallback(544, GgmlType::Q5K), GgmlType::Q5_1);
    assert_eq!(fallback(100, GgmlType::Q4K), GgmlType::F16);
    assert_eq!(fallback(512, GgmlType::Q4K), GgmlType::Q4K);
    // Everything counts in llama.cpp's order: blocks by number, not text.
    let mut names = ["blk.10.a", "blk.2.b", "output.weight", "blk.2.a"];
    names.sort_by(|a, b| llama_order(a, b));
    assert_eq!(names, ["output.weight", "blk.2.a", "blk.2.b", "blk.10.a"]);
}

/// `attn_v` and `ffn_down` in "more bits" layers get Q6_K in a `_M` mix,
/// counted over a 16-layer model in llama.cpp's order.
#[test]
fn the_m_mixes_give_more_bits_to_some_layers() {
    let names: Vec<String> = (0..16)
        .flat_map(|i| {
            [
                format!("blk.{i}.attn_v.weight"),
                format!("blk.{i}.ffn_down.weight"),
            ]
        })
        .collect();
    let ne = [256usize, 256];
    let tensors: Vec<MixTensor> = names
        .iter()
        .map(|n| MixTensor {
            name: n,
            ne: &ne,
            ty: GgmlType::F32,
        })
        .collect();
    let params = MixParams {
        n_layer: 16,
        n_expert: 0,
    };
    let types = choose_types(&tensors, &params, FileType::Q4_K_M);
    let q6: Vec<usize> = (0..16).filter(|&i| types[2 * i] == GgmlType::Q6K).collect();
    // i < 2, i >= 14, and (i - 2) % 3 == 2.
    assert_eq!(q6, [0, 1, 4, 7, 10, 13, 14, 15]);
    for i in 0..16 {
        assert_eq!(types[2 * i], types[2 * i + 1], "layer {i}");
        if !q6.contains(&i) {
            assert_eq!(types[2 * i], GgmlType::Q4K);
        }
    }
    let eight = MixParams {
        n_expert: 8,
        ..params
    };
    assert!(
        choose_types(&tensors, &eight, FileType::Q4_K_M)
            .iter()
            .step_by(2)
            .all(|&t| t == GgmlType::Q8_0)
    );
}
