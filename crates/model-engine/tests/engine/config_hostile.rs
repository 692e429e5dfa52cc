//! Hostile config.json files: a count that the parser turns into a list of
//! tensor names, a loop or a buffer (experts, layers, heads, groups, the
//! vocabulary) set huge in each family's fixture. Each must be refused by
//! the load, promptly and within a bounded address space (tests/limited),
//! with an error naming config.json and the key; 2^26 experts once made
//! the Nemotron-H parser build 2^26 names per MoE layer (an abort).

use crate::common;
use crate::limited;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use common::{fixture, small_options};
use limited::run_limited;
use metrale_gpu_runtime::cpu::CpuBackend;
use metrale_gpu_runtime::gpu::GpuBackend;
use metrale_model_engine::model::TransformerModel;
use metrale_model_weights::loader::WeightDType;
use serde_json::{Map, Value, json};

const DEADLINE: Duration = Duration::from_secs(60);

/// What every family reads as a count.
const COMMON: [&str; 2] = ["vocab_size", "hidden_size"];

/// Each fixture with the count keys its family reads (beyond [`COMMON`]).
/// Not `chunk_size`: the scans cap their chunks whatever it says, so it
/// never sizes anything.
const CASES: [(&str, &[&str]); 8] = [
    ("llama", ATTENTION),
    ("qwen3", ATTENTION),
    (
        "mamba2",
        &[
            "num_hidden_layers",
            "num_heads",
            "n_groups",
            "head_dim",
            "state_size",
            "conv_kernel",
        ],
    ),
    (
        "bamba",
        &[
            "num_hidden_layers",
            "intermediate_size",
            "num_attention_heads",
            "mamba_n_heads",
            "mamba_d_head",
            "mamba_n_groups",
            "mamba_d_state",
            "mamba_d_conv",
        ],
    ),
    (
        "nemotron_h",
        &[
            "intermediate_size",
            "mamba_num_heads",
            "mamba_head_dim",
            "n_groups",
            "ssm_state_size",
            "conv_kernel",
        ],
    ),
    (
        "nemotron_h_moe",
        &[
            "n_routed_experts",
            "moe_intermediate_size",
            "moe_shared_expert_intermediate_size",
            "num_attention_heads",
            "mamba_num_heads",
        ],
    ),
    (
        "granitemoehybrid",
        &[
            "num_hidden_layers",
            "num_local_experts",
            "intermediate_size",
            "shared_intermediate_size",
            "num_attention_heads",
            "mamba_n_heads",
        ],
    ),
    (
        "qwen3_next",
        &[
            "num_hidden_layers",
            "num_experts",
            "moe_intermediate_size",
            "shared_expert_intermediate_size",
            "num_attention_heads",
            "linear_num_key_heads",
            "linear_num_value_heads",
            "linear_key_head_dim",
            "linear_value_head_dim",
            "linear_conv_kernel_dim",
        ],
    ),
];

/// The llama family's counts.
const ATTENTION: &[&str] = &[
    "num_hidden_layers",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
];

/// A copy of the fixture directory `name` under `root`.
fn copy_fixture(name: &str, root: &Path) -> PathBuf {
    let dir = root.join(name);
    std::fs::create_dir_all(&dir).unwrap();
    for entry in std::fs::read_dir(fixture(name)).unwrap() {
        let entry = entry.unwrap();
        if entry.file_type().unwrap().is_file() && entry.file_name() != "golden.safetensors" {
            std::fs::copy(entry.path(), dir.join(entry.file_name())).unwrap();
        }
    }
    dir
}

/// One hostile config: a fixture, the keys set in its config.json, the
/// keys removed, and the key the error must name.
struct Case {
    fixture: &'static str,
    set: Vec<(&'static str, Value)>,
    remove: &'static [&'static str],
    named: &'static str,
}

/// Loads each case's fixture copy (made under `root`) with its config.json
/// edited; every load must fail naming config.json and the case's key.
/// All cases run; the failures are reported together.
fn all_refused(root: &Path, cases: &[Case]) {
    let _ = std::fs::remove_dir_all(root);
    let mut failed = Vec::new();
    for case in cases {
        let dir = root.join(case.fixture);
        if !dir.exists() {
            copy_fixture(case.fixture, root);
        }
        let text = std::fs::read_to_string(fixture(case.fixture).join("config.json")).unwrap();
        let mut map: Map<String, Value> = serde_json::from_str(&text).unwrap();
        for key in case.remove {
            map.remove(*key);
        }
        for (key, value) in &case.set {
            map.insert(key.to_string(), value.clone());
        }
        let text = serde_json::to_string_pretty(&Value::Object(map)).unwrap();
        std::fs::write(dir.join("config.json"), text).unwrap();
        let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::with_threads(1));
        let result = TransformerModel::load(
            &dir,
            gpu,
            small_options(),
            WeightDType::AsStored,
            &mut |_| {},
        );
        let set: Vec<String> = (case.set.iter())
            .map(|(k, v)| format!("{k} = {}", short(&v.to_string(), 30)))
            .collect();
        let what = format!("{} with {}", case.fixture, set.join(", "));
        let e = match result {
            Ok(_) => "loaded".to_string(),
            Err(e) => e.to_string(),
        };
        if !(e.contains("config.json") && e.contains(&format!("`{}`", case.named))) {
            let (key, e) = (case.named, short(&e, 300));
            eprintln!("{what}: the error does not name config.json and `{key}`: {e}");
            failed.push(what);
        }
    }
    let _ = std::fs::remove_dir_all(root);
    assert!(failed.is_empty(), "not refused by key: {failed:#?}");
}

/// The start of `s` (the values and errors of huge lists are long).
fn short(s: &str, chars: usize) -> String {
    s.chars().take(chars).collect()
}

fn scratch(tag: &str) -> PathBuf {
    std::env::temp_dir().join(format!("metrale-config-{tag}-{}", std::process::id()))
}

#[test]
fn huge_counts_in_config_json_are_refused_by_key() {
    let name = "huge_counts_in_config_json_are_refused_by_key";
    run_limited(name, DEADLINE, || {
        let mut cases = Vec::new();
        for (fixture, keys) in CASES {
            for key in COMMON.iter().chain(keys) {
                for n in [1u64 << 26, 1 << 30] {
                    cases.push(Case {
                        fixture,
                        set: vec![(key, json!(n))],
                        // A layer list beside the count would be refused
                        // for its length, not its size.
                        remove: if *key == "num_hidden_layers" {
                            &["layer_types", "layers_block_type"]
                        } else {
                            &[]
                        },
                        named: key,
                    });
                }
            }
        }
        all_refused(&scratch("counts"), &cases);
    });
}

/// A layer list longer than any model's, in each family that reads one.
#[test]
fn huge_layer_lists_are_refused_by_key() {
    let name = "huge_layer_lists_are_refused_by_key";
    run_limited(name, DEADLINE, || {
        let lists = [
            ("qwen3", "layer_types", "full_attention"),
            ("nemotron_h", "layers_block_type", "mlp"),
            ("granitemoehybrid", "layer_types", "full_attention"),
            ("qwen3_next", "layer_types", "linear_attention"),
        ];
        let mut cases: Vec<Case> = (lists.into_iter())
            .map(|(fixture, key, item)| Case {
                fixture,
                set: vec![(key, json!(vec![item; 100_000]))],
                remove: &[],
                named: key,
            })
            .collect();
        cases.push(Case {
            fixture: "nemotron_h_moe",
            set: vec![("hybrid_override_pattern", json!("E".repeat(100_000)))],
            remove: &["num_hidden_layers"],
            named: "hybrid_override_pattern",
        });
        all_refused(&scratch("lists"), &cases);
    });
}

/// Experts within the per-layer maximum, in more MoE layers than their
/// names can be built for: refused by the expert count's key.
#[test]
fn experts_over_all_layers_are_bounded() {
    let name = "experts_over_all_layers_are_bounded";
    run_limited(name, DEADLINE, || {
        let cases = [
            Case {
                fixture: "nemotron_h_moe",
                set: vec![
                    ("hybrid_override_pattern", json!("E".repeat(4096))),
                    ("n_routed_experts", json!(4096)),
                ],
                remove: &["num_hidden_layers"],
                named: "n_routed_experts",
            },
            Case {
                fixture: "qwen3_next",
                set: vec![
                    ("num_hidden_layers", json!(4096)),
                    ("num_experts", json!(4096)),
                ],
                remove: &["layer_types"],
                named: "num_experts",
            },
        ];
        all_refused(&scratch("experts"), &cases);
    });
}

/// config.json as a FIFO blocked the open until a writer came, and as a
/// link to `/dev/zero` read until memory ran out; a regular file is read
/// only up to a bound. Each is refused promptly, naming the file.
#[cfg(unix)]
#[test]
fn special_or_huge_json_files_are_refused_promptly() {
    use metrale_model_engine::config::json::{MAX_JSON_BYTES, read_json};
    use metrale_model_engine::config::load_config;
    let name = "special_or_huge_json_files_are_refused_promptly";
    run_limited(name, DEADLINE, || {
        let root = scratch("special");
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(&root).unwrap();
        let fifo = root.join("fifo");
        std::fs::create_dir_all(&fifo).unwrap();
        let made = std::process::Command::new("mkfifo")
            .arg(fifo.join("config.json"))
            .status();
        assert!(made.is_ok_and(|s| s.success()), "mkfifo");
        let zero = root.join("zero");
        std::fs::create_dir_all(&zero).unwrap();
        std::os::unix::fs::symlink("/dev/zero", zero.join("config.json")).unwrap();
        let huge = root.join("huge");
        std::fs::create_dir_all(&huge).unwrap();
        let file = std::fs::File::create(huge.join("config.json")).unwrap();
        file.set_len(MAX_JSON_BYTES + 1).unwrap();
        for (dir, words) in [
            (&fifo, "FIFO"),
            (&zero, "character device"),
            (&huge, "larger than"),
        ] {
            let path = dir.join("config.json");
            let e = load_config(dir).unwrap_err().to_string();
            assert!(e.starts_with(&format!("{}: ", path.display())), "{e}");
            assert!(e.contains(words), "{e}");
            let e = read_json(&path).unwrap_err().to_string();
            assert!(e.contains(words), "{e}");
        }
        let _ = std::fs::remove_dir_all(&root);
    });
}
