//! `metrale quantize` against llama.cpp's own files.
//!
//! - bf16 export: each safetensors fixture, laid out as llama.cpp's
//!   converter saw it (tests/fixtures/gguf-bf16/README.md), exported with
//!   `--type bf16`, has the metadata (every key and value but the
//!   descriptive `general.name` / `general.size_label`, in the same order)
//!   and the tensors (names, order, types, shapes, bytes) of
//!   `convert_hf_to_gguf.py --outtype bf16`'s file.
//! - f32 / f16 export: the same against the converter's `--outtype f32` /
//!   `f16` files, recorded (tensor hashes, metadata changes) in
//!   quantized.json.
//! - quantized export: from each bf16 GGUF fixture and from each fixture
//!   directory, every tensor's name, type, shape and sha256 are those
//!   llama-quantize wrote (tests/fixtures/gguf-bf16/quantized.json, made
//!   by gen_quantized.py there), in llama-quantize's order, with the
//!   metadata keys it changed.

use std::path::{Path, PathBuf};

use metrale_model_engine::gguf::export::{QuantizeOptions, quantize};
use metrale_model_weights::gguf::mix::FileType;
use metrale_model_weights::gguf::{GgufFile, GgufValue};

pub const MODELS: [&str; 8] = [
    "llama",
    "qwen3",
    "mamba2",
    "bamba",
    "nemotron_h",
    "granitemoehybrid",
    "qwen3_next",
    "nemotron_h_moe",
];

fn fixtures() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures"))
}

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("metrale-export-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A scratch copy of fixture `model` as llama.cpp's converter reads it:
/// its weights and generation/tokenizer configs, the shared byte-level BPE
/// tokenizer.json the converter accepts, and `config` as its config.json.
pub(crate) fn fixture_for_export(model: &str, dir: &Path, config: &Path) {
    let f = fixtures();
    for n in [
        "model.safetensors",
        "generation_config.json",
        "tokenizer_config.json",
    ] {
        std::fs::copy(f.join(model).join(n), dir.join(n)).unwrap();
    }
    std::fs::copy(
        f.join("gguf-bf16/tokenizer.json"),
        dir.join("tokenizer.json"),
    )
    .unwrap();
    std::fs::copy(config, dir.join("config.json")).unwrap();
}

/// The directory llama.cpp's converter read for `model`.
fn converter_input(model: &str, test: &str) -> PathBuf {
    let f = fixtures();
    let dir = scratch(&format!("src-{model}-{test}"));
    if model == "default" {
        // models/default, its layer_types spelled as the converter reads
        // them (gen_quantized.py's KQUANT_CONFIG_FIX).
        let src = f.join("../../models/default");
        for n in [
            "model.safetensors",
            "generation_config.json",
            "tokenizer_config.json",
            "tokenizer.json",
        ] {
            std::fs::copy(src.join(n), dir.join(n)).unwrap();
        }
        let text = std::fs::read_to_string(src.join("config.json")).unwrap();
        let text = text
            .replace("\"linear_attention\"", "\"mamba\"")
            .replace("\"full_attention\"", "\"attention\"");
        std::fs::write(dir.join("config.json"), text).unwrap();
        return dir;
    }
    let special = f.join(format!("gguf-bf16/configs/{model}.json"));
    let config = if special.exists() {
        special
    } else {
        f.join(model).join("config.json")
    };
    fixture_for_export(model, &dir, &config);
    dir
}

fn options(ftype: FileType) -> QuantizeOptions {
    QuantizeOptions {
        ftype,
        // The fixtures' tokenizer is not in llama.cpp's table; the
        // converter was run with its check relaxed to `gpt-2`.
        pre_tokenizer: Some("gpt-2".into()),
    }
}

const DESCRIPTIVE: [&str; 2] = ["general.name", "general.size_label"];

fn metadata(f: &GgufFile) -> Vec<(String, GgufValue)> {
    (f.metadata().iter())
        .filter(|(k, _)| !DESCRIPTIVE.contains(&k.as_str()))
        .cloned()
        .collect()
}

#[test]
fn bf16_export_is_llama_cpps_conversion() {
    for model in MODELS {
        let src = converter_input(model, "bf16");
        let out = src.join("out.gguf");
        quantize(&src, &out, &options(FileType::BF16), &mut |_| {})
            .unwrap_or_else(|e| panic!("{model}: {e}"));
        let ours = GgufFile::open(&out).unwrap();
        let theirs = GgufFile::open(&fixtures().join(format!("gguf-bf16/{model}.gguf"))).unwrap();
        let (a, b) = (metadata(&ours), metadata(&theirs));
        for ((ka, va), (kb, vb)) in a.iter().zip(&b) {
            assert_eq!(ka, kb, "{model}: metadata order");
            assert_eq!(va, vb, "{model}: {ka}");
        }
        assert_eq!(
            a.iter().map(|e| &e.0).collect::<Vec<_>>(),
            b.iter().map(|e| &e.0).collect::<Vec<_>>(),
            "{model}: metadata keys"
        );
        let names = |f: &GgufFile| {
            f.tensors()
                .map(|t| t.name().to_string())
                .collect::<Vec<_>>()
        };
        assert_eq!(names(&ours), names(&theirs), "{model}: tensor order");
        for (x, y) in ours.tensors().zip(theirs.tensors()) {
            assert_eq!(x.ggml_type(), y.ggml_type(), "{model}: {}", x.name());
            assert_eq!(x.info.dims, y.info.dims, "{model}: {}", x.name());
            assert!(x.data == y.data, "{model}: {} bytes differ", x.name());
        }
        let _ = std::fs::remove_dir_all(&src);
    }
}

/// One output file of tests/fixtures/gguf-bf16/quantized.json.
struct Expected {
    source: String,
    model: String,
    format: String,
    changed: serde_json::Map<String, serde_json::Value>,
    removed: Vec<String>,
    /// (name, GGUF type, ne, sha256), in file order.
    tensors: Vec<(String, String, Vec<u64>, String)>,
}

fn expected_files() -> Vec<Expected> {
    let text = std::fs::read_to_string(fixtures().join("gguf-bf16/quantized.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let s = |v: &serde_json::Value| v.as_str().unwrap().to_string();
    (v["files"].as_array().unwrap().iter())
        .map(|f| Expected {
            source: s(&f["source"]),
            model: s(&f["model"]),
            format: s(&f["format"]),
            changed: f["metadata_changed"].as_object().unwrap().clone(),
            removed: (f["metadata_removed"].as_array().unwrap().iter())
                .map(s)
                .collect(),
            tensors: (f["tensors"].as_array().unwrap().iter())
                .map(|t| {
                    let ne = (t[2].as_array().unwrap().iter())
                        .map(|d| d.as_u64().unwrap())
                        .collect();
                    (s(&t[0]), s(&t[1]), ne, s(&t[3]))
                })
                .collect(),
        })
        .collect()
}

/// `base`'s metadata with llama-quantize's recorded changes applied.
fn after_quantize(base: &GgufFile, e: &Expected) -> Vec<(String, GgufValue)> {
    let mut m = metadata(base);
    m.retain(|(k, _)| !e.removed.contains(k));
    for (k, v) in &e.changed {
        // llama-quantize changes only integer keys of these files.
        let v = GgufValue::U32(v.as_u64().unwrap_or_else(|| panic!("{k}: {v}")) as u32);
        match m.iter_mut().find(|(key, _)| key == k) {
            Some(entry) => entry.1 = v,
            None => m.push((k.clone(), v)),
        }
    }
    m.sort_by(|a, b| a.0.cmp(&b.0));
    m
}

fn check_quantized(ours: &GgufFile, e: &Expected, base: &GgufFile) {
    let what = format!("{} {} {}", e.source, e.model, e.format);
    let got: Vec<(String, String, Vec<u64>, String)> = ours
        .tensors()
        .map(|t| {
            (
                t.name().to_string(),
                t.ggml_type().name().to_lowercase(),
                t.info.dims.clone(),
                metrale_model_engine::gguf::export::sha256_hex(t.data),
            )
        })
        .collect();
    let want: Vec<_> = (e.tensors.iter())
        .map(|(n, ty, ne, h)| (n.clone(), ty.to_lowercase(), ne.clone(), h.clone()))
        .collect();
    assert_eq!(got.len(), want.len(), "{what}: tensor count");
    for (g, w) in got.iter().zip(&want) {
        assert_eq!(g, w, "{what}");
    }
    let mut m = metadata(ours);
    m.sort_by(|a, b| a.0.cmp(&b.0));
    assert_eq!(m, after_quantize(base, e), "{what}: metadata");
}

#[test]
fn requantizing_the_bf16_files_is_llama_quantize() {
    let all = expected_files();
    // 8 fixtures x 10 formats x 2 sources, the converter's f32 and f16
    // files of the 8 fixtures, and models/default's 6 K-quant formats.
    assert_eq!(all.len(), 2 * 8 * 10 + 8 * 2 + 6);
    let dir = scratch("requant");
    for e in all.iter().filter(|e| e.source == "gguf-bf16") {
        let input = fixtures().join(format!("gguf-bf16/{}.gguf", e.model));
        let out = dir.join(format!("{}-{}.gguf", e.model, e.format));
        let ftype = FileType::from_name(&e.format).unwrap();
        quantize(&input, &out, &options(ftype), &mut |_| {})
            .unwrap_or_else(|err| panic!("{} {}: {err}", e.model, e.format));
        let ours = GgufFile::open(&out).unwrap();
        check_quantized(&ours, e, &GgufFile::open(&input).unwrap());
        std::fs::remove_file(&out).unwrap();
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn k_quants_of_a_checkpoint_are_llama_quantizes() {
    // models/default's rows (256, 512) take Q4_K / Q5_K / Q6_K themselves.
    let src = converter_input("default", "kquant");
    let all = expected_files();
    let expected: Vec<_> = all.iter().filter(|e| e.model == "default").collect();
    assert_eq!(expected.len(), 6);
    let mut k_types = std::collections::BTreeSet::new();
    for e in expected {
        let out = src.join(format!("{}.gguf", e.format));
        let ftype = FileType::from_name(&e.format).unwrap();
        quantize(&src, &out, &options(ftype), &mut |_| {})
            .unwrap_or_else(|err| panic!("default {}: {err}", e.format));
        let ours = GgufFile::open(&out).unwrap();
        let got: Vec<_> = ours
            .tensors()
            .map(|t| {
                k_types.insert(t.ggml_type().name().to_lowercase());
                (
                    t.name().to_string(),
                    t.ggml_type().name().to_lowercase(),
                    t.info.dims.clone(),
                    metrale_model_engine::gguf::export::sha256_hex(t.data),
                )
            })
            .collect();
        let want: Vec<_> = (e.tensors.iter())
            .map(|(n, ty, ne, h)| (n.clone(), ty.to_lowercase(), ne.clone(), h.clone()))
            .collect();
        assert_eq!(got, want, "default {}", e.format);
        let ft = e.changed["general.file_type"].as_u64().unwrap() as u32;
        assert_eq!(ours.get_u32("general.file_type").unwrap(), ft);
    }
    for t in ["q4_k", "q5_k", "q6_k"] {
        assert!(k_types.contains(t), "{t} not exercised: {k_types:?}");
    }
    let _ = std::fs::remove_dir_all(&src);
}

#[test]
fn quantizing_a_checkpoint_is_convert_f32_then_llama_quantize() {
    for model in MODELS {
        let src = converter_input(model, "quant");
        let bf16 = GgufFile::open(&fixtures().join(format!("gguf-bf16/{model}.gguf"))).unwrap();
        for e in expected_files()
            .iter()
            .filter(|e| (e.source == "hf-f32" || e.source == "hf-convert") && e.model == model)
        {
            let out = src.join(format!("{}.gguf", e.format));
            let ftype = FileType::from_name(&e.format).unwrap();
            quantize(&src, &out, &options(ftype), &mut |_| {})
                .unwrap_or_else(|err| panic!("{model} {}: {err}", e.format));
            let ours = GgufFile::open(&out).unwrap();
            // The f32 conversion's metadata is the bf16 file's but for
            // general.file_type, which llama-quantize sets (and the
            // converter's f32 / f16 files differ from it only there).
            check_quantized(&ours, e, &bf16);
        }
        let _ = std::fs::remove_dir_all(&src);
    }
}

#[test]
fn refusals_name_the_problem_and_leave_no_file() {
    let dir = scratch("refusals");
    let listing = |d: &PathBuf| {
        let mut v: Vec<String> = std::fs::read_dir(d)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    };
    // An already quantized file: kept as it is when the target is its own
    // type, refused (naming the tensor) when another.
    let q8 = fixtures().join("gguf/llama/Q8_0.gguf");
    let out = dir.join("same.gguf");
    quantize(&q8, &out, &options(FileType::Q8_0), &mut |_| {}).unwrap();
    let (a, b) = (GgufFile::open(&out).unwrap(), GgufFile::open(&q8).unwrap());
    for t in a.tensors() {
        assert!(t.data == b.tensor(t.name()).unwrap().data, "{}", t.name());
    }
    let out = dir.join("q4.gguf");
    let e = quantize(&q8, &out, &options(FileType::Q4_0), &mut |_| {})
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("Q8_0.gguf") && e.contains("is already quantized (q8_0)"),
        "{e}"
    );
    assert!(!out.exists());
    assert_eq!(listing(&dir), ["same.gguf"]);

    // A tokenizer whose pre-tokenizer llama.cpp's table lacks and which is
    // not GPT-2's pipeline (a prefix space), without an override: refused,
    // saying how to override.
    let src = converter_input("llama", "refusals");
    let tj_path = src.join("tokenizer.json");
    let mut tj: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&tj_path).unwrap()).unwrap();
    tj["pre_tokenizer"]["add_prefix_space"] = true.into();
    std::fs::write(&tj_path, tj.to_string()).unwrap();
    let before = listing(&src);
    let opts = QuantizeOptions {
        ftype: FileType::BF16,
        pre_tokenizer: None,
    };
    let e = quantize(&src, &src.join("x.gguf"), &opts, &mut |_| {})
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("tokenizer.json")
            && e.contains("not one llama.cpp knows")
            && e.contains("--pre-tokenizer"),
        "{e}"
    );
    assert_eq!(listing(&src), before);

    // A dense Nemotron-H config with transformers' MoE defaults: the
    // converter takes it for nemotron_h_moe, where its MLP layer would be
    // lost; refused, saying what to drop.
    let e = quantize(
        &fixtures().join("nemotron_h"),
        &dir.join("n.gguf"),
        &options(FileType::BF16),
        &mut |_| {},
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("config.json") && e.contains("dense feed-forward layers [3]"),
        "{e}"
    );
    assert_eq!(listing(&dir), ["same.gguf"]);

    // A failure while writing (a late tensor of a dtype that is not
    // exported, I32 where the header said F32): the error names the file
    // and the tensor, the temporary file is removed, OUT never appears.
    let st = src.join("model.safetensors");
    let mut bytes = std::fs::read(&st).unwrap();
    let header_len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header = String::from_utf8(bytes[8..8 + header_len].to_vec()).unwrap();
    let at = header.find("model.norm.weight").unwrap();
    let f32_at = 8 + at + header[at..].find("F32").unwrap();
    bytes[f32_at] = b'I';
    std::fs::write(&st, &bytes).unwrap();
    let e = quantize(
        &src,
        &src.join("x.gguf"),
        &options(FileType::Q8_0),
        &mut |_| {},
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("model.safetensors") && e.contains("\"model.norm.weight\" is I32"),
        "{e}"
    );
    assert_eq!(listing(&src), before);
    let _ = std::fs::remove_dir_all(&src);
    let _ = std::fs::remove_dir_all(&dir);
}

/// The temporary file `.OUT.tmp-<pid>` has a guessable name: a link
/// planted there (in a shared directory, by someone else) once made
/// quantize truncate and overwrite the file it pointed to. It is refused,
/// naming the path, and the link's target is untouched.
#[cfg(unix)]
#[test]
fn a_link_at_the_temporary_path_is_not_followed() {
    use metrale_model_engine::gguf::export::temp_path;
    let dir = scratch("planted-link");
    let victim = dir.join("victim.txt");
    std::fs::write(&victim, b"someone else's file").unwrap();
    let out = dir.join("out.gguf");
    let tmp = temp_path(&out);
    std::os::unix::fs::symlink(&victim, &tmp).unwrap();
    let q8 = fixtures().join("gguf/llama/Q8_0.gguf");
    let e = quantize(&q8, &out, &options(FileType::Q8_0), &mut |_| {})
        .unwrap_err()
        .to_string();
    assert!(
        e.starts_with(&format!("{}: ", tmp.display())) && e.contains("already exists"),
        "{e}"
    );
    assert_eq!(std::fs::read(&victim).unwrap(), b"someone else's file");
    assert!(!out.exists());
    let _ = std::fs::remove_dir_all(&dir);
}
