//! Hostile GGUF files found by fuzzing the loader, one test per kind: each
//! is refused with an error naming the file and the key or tensor at
//! fault, promptly, within a bounded address space (tests/limited), and
//! `metrale quantize` writes nothing from them.

use crate::hostile;
use crate::limited;

use std::path::Path;
use std::time::Duration;

use hostile::*;
use limited::run_limited;
use metrale_model_engine::gguf::ModelSource;
use metrale_model_engine::gguf::export::{QuantizeOptions, quantize};
use metrale_model_weights::gguf::mix::FileType;
use metrale_model_weights::gguf::{GgufArray, GgufValue};

const DEADLINE: Duration = Duration::from_secs(60);

fn scratch(tag: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("metrale-hostile-{}-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A per-layer key given as one value once became a `block_count`-long
/// list before the layer count was checked: 4 billion layers were a 34 GB
/// allocation (an abort) for the Granite and Nemotron-H families, and an
/// 18-minute loop over tensor names for Qwen3-Next.
#[test]
fn huge_block_counts_are_refused_by_key() {
    run_limited("huge_block_counts_are_refused_by_key", DEADLINE, || {
        for stem in FIXTURES {
            let file = fixture(stem);
            for n in [4097, 1 << 26, u32::MAX] {
                let mut edits = vec![set(".block_count", GgufValue::U32(n))];
                for key in [".attention.head_count_kv", ".feed_forward_length"] {
                    edits.push(set(key, GgufValue::U32(2)));
                }
                edits.push(remove(".attention.recurrent_layers"));
                let name = format!("{stem}-{n}.gguf");
                refused(&name, rewrite(&file, &edits), "block_count");
            }
        }
    });
}

/// Counts the config turns into per-layer lists of names (experts, key
/// groups) must fit the file's tensor data.
#[test]
fn expert_and_group_counts_the_tensors_cannot_hold_are_refused() {
    let name = "expert_and_group_counts_the_tensors_cannot_hold_are_refused";
    run_limited(name, DEADLINE, || {
        for stem in ["granitemoehybrid", "nemotron_h_moe", "qwen3_next"] {
            let file = fixture(stem);
            let edits = [
                set(".expert_count", GgufValue::U32(1 << 26)),
                set(".expert_group_count", GgufValue::U32(1)),
            ];
            refused(
                &format!("{stem}-experts.gguf"),
                rewrite(&file, &edits),
                "expert_count",
            );
        }
        // Qwen3-Next's key groups become four row runs each, per layer.
        let big = GgufValue::U32(1 << 26);
        let edits = [
            set(".ssm.group_count", big.clone()),
            set(".ssm.time_step_rank", big.clone()),
            set(".ssm.inner_size", big),
        ];
        let image = rewrite(&fixture("qwen3_next"), &edits);
        refused("qwen3_next-groups.gguf", image, "ssm.group_count");
    });
}

/// A tensor without dimensions where the config reads a size from one
/// was a panic (an index into an empty shape).
#[test]
fn size_tensors_without_dimensions_are_refused_by_name() {
    for shape in [&[][..], &[0, 64], &[512, 0], &[512]] {
        let image = rewrite(&fixture("llama"), &[reshape("token_embd.weight", shape)]);
        refused("embd.gguf", image, "token_embd.weight");
    }
    // Granite's shared expert width, read from the tensor when the key is
    // absent.
    let edits = [
        remove(".expert_shared_feed_forward_length"),
        reshape("blk.0.ffn_gate_shexp.weight", &[]),
    ];
    let image = rewrite(&fixture("granitemoehybrid"), &edits);
    refused("shexp.gguf", image, "blk.0.ffn_gate_shexp.weight");
}

/// `metrale quantize` once wrote a scalar or empty tensor out, and
/// reported a zero-length row as an internal error.
#[test]
fn quantize_refuses_tensors_without_elements_and_writes_nothing() {
    let dir = scratch("quantize");
    for (tag, shape) in [("scalar", &[][..]), ("rows", &[0, 32]), ("row", &[32, 0])] {
        let input = dir.join(format!("{tag}.gguf"));
        let add = Edit::Add("extra.weight".into(), shape.to_vec());
        std::fs::write(&input, rewrite(&fixture("llama"), &[add])).unwrap();
        for ftype in [FileType::Q8_0, FileType::F16] {
            let output = dir.join(format!("{tag}-out.gguf"));
            let opts = QuantizeOptions {
                ftype,
                pre_tokenizer: None,
            };
            let e = match quantize(&input, &output, &opts, &mut |_| {}) {
                Ok(_) => panic!("{tag}: {shape:?} was written"),
                Err(e) => e.to_string(),
            };
            assert!(
                e.contains("extra.weight") && e.contains(&format!("{tag}.gguf")),
                "{e}"
            );
            assert!(!e.contains("internal error"), "{e}");
            assert!(!output.exists(), "{tag}: {}", output.display());
            let leftovers = std::fs::read_dir(&dir).unwrap().count();
            assert_eq!(leftovers, 1, "{tag}: a temporary file was left");
        }
        std::fs::remove_file(&input).unwrap();
    }
}

/// A NaN or infinite float became JSON `null` in the rebuilt config: the
/// key's default, silently.
#[test]
fn non_finite_float_keys_are_refused_by_key() {
    let cases: [(&str, &str); 9] = [
        ("llama", ".attention.layer_norm_rms_epsilon"),
        ("llama", ".rope.freq_base"),
        ("llama", ".rope.scaling.factor"),
        ("nemotron_h", ".attention.layer_norm_epsilon"),
        ("granitemoehybrid", ".attention.scale"),
        ("granitemoehybrid", ".embedding_scale"),
        ("granitemoehybrid", ".residual_scale"),
        ("granitemoehybrid", ".logit_scale"),
        ("nemotron_h_moe", ".expert_weights_scale"),
    ];
    let values = [
        GgufValue::F32(f32::NAN),
        GgufValue::F32(f32::INFINITY),
        GgufValue::F32(f32::NEG_INFINITY),
        GgufValue::F64(f64::NAN),
        // Finite as f64, infinite as the f32 the config holds.
        GgufValue::F64(1e300),
    ];
    for (stem, key) in cases {
        let file = fixture(stem);
        for v in &values {
            let mut edits = vec![set(key, v.clone())];
            if key == ".rope.scaling.factor" {
                edits.push(set(
                    ".rope.scaling.type",
                    GgufValue::String("linear".into()),
                ));
            }
            let e = refused(&format!("{stem}.gguf"), rewrite(&file, &edits), &key[1..]);
            assert!(e.contains("not a finite number"), "{e}");
        }
    }
}

#[cfg(unix)]
/// Makes a FIFO at `path` (mkfifo(1): the test needs no libc call).
fn mkfifo(path: &Path) {
    let ok = std::process::Command::new("mkfifo").arg(path).status();
    assert!(ok.is_ok_and(|s| s.success()), "mkfifo {}", path.display());
}

/// A FIFO named `*.gguf` blocked opening forever; `/dev/zero` under that
/// name was read until memory ran out. Both, and a directory given to
/// `quantize`, are refused by kind; run in a limited child so that a
/// regression fails the test, not the machine.
#[cfg(unix)]
#[test]
fn special_files_named_gguf_are_refused_promptly() {
    run_limited(
        "special_files_named_gguf_are_refused_promptly",
        DEADLINE,
        || {
            let dir = scratch("special");
            let fifo = dir.join("fifo.gguf");
            mkfifo(&fifo);
            let zero = dir.join("zero.gguf");
            std::os::unix::fs::symlink("/dev/zero", &zero).unwrap();
            for (path, kind) in [(&fifo, "FIFO"), (&zero, "character device")] {
                let source = ModelSource::from_path(path);
                assert_eq!(source, ModelSource::Gguf(path.clone()));
                let errors = [
                    source.config().map(|_| ()).unwrap_err().to_string(),
                    source.tokenizer().map(|_| ()).unwrap_err().to_string(),
                    source.chat_template().map(|_| ()).unwrap_err().to_string(),
                ];
                for e in errors {
                    assert!(
                        e.contains(&path.display().to_string()) && e.contains(kind),
                        "{e}"
                    );
                }
                let out = dir.join("out.gguf");
                let opts = QuantizeOptions {
                    ftype: FileType::Q8_0,
                    pre_tokenizer: None,
                };
                let e = quantize(path, &out, &opts, &mut |_| {})
                    .unwrap_err()
                    .to_string();
                assert!(e.contains(kind), "{e}");
                assert!(!out.exists());
            }
        },
    );
}

/// A per-layer key given as an array longer than the layers (as long as
/// the file allows) is refused by key, whatever its length.
#[test]
fn huge_per_layer_arrays_are_refused_by_key() {
    run_limited("huge_per_layer_arrays_are_refused_by_key", DEADLINE, || {
        let long = GgufValue::Array(GgufArray::U32(vec![2; 1 << 20]));
        for stem in ["bamba", "nemotron_h"] {
            let edits = [set(".attention.head_count_kv", long.clone())];
            let image = rewrite(&fixture(stem), &edits);
            refused(&format!("{stem}.gguf"), image, "attention.head_count_kv");
        }
        let flags = GgufValue::Array(GgufArray::Bool(vec![true; 1 << 20]));
        let edits = [
            set(".attention.recurrent_layers", flags),
            set(".block_count", GgufValue::U32(1 << 20)),
        ];
        refused(
            "qwen3_next.gguf",
            rewrite(&fixture("qwen3_next"), &edits),
            "block_count",
        );
    });
}
