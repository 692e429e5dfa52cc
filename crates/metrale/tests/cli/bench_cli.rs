//! `metrale bench` runs on a tiny random-weight model and prints the keys the
//! comparisons read; `metrale export-random` writes a checkpoint that loads.
//! No timing is asserted: figures depend on the machine.

use std::path::PathBuf;
use std::process::Command;

fn tiny_config() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../benches/configs/tiny-hybrid.json")
}

fn bench(args: &[&str]) -> serde_json::Value {
    let mut all = vec!["--prompt-len", "12", "--gen-len", "3", "--threads", "1"];
    all.extend(["--json", "--no-probe"]);
    all.extend_from_slice(args);
    bench_json(&all)
}

/// `metrale bench` with exactly `args`; its JSON (it must succeed).
fn bench_json(args: &[&str]) -> serde_json::Value {
    let out = Command::new(env!("CARGO_BIN_EXE_metrale"))
        .arg("bench")
        .args(args)
        .output()
        .expect("running metrale");
    assert!(
        out.status.success(),
        "metrale bench failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("JSON on stdout")
}

fn check_keys(v: &serde_json::Value, dtype: &str) {
    for key in ["prefill_tok_s", "decode_tok_s", "ttft_ms"] {
        let x = v[key]
            .as_f64()
            .unwrap_or_else(|| panic!("{key} missing in {v}"));
        assert!(x.is_finite() && x > 0.0, "{key} = {x}");
    }
    assert!(
        v["peak_rss_bytes"].as_u64().is_some_and(|b| b > 0),
        "peak_rss_bytes in {v}"
    );
    assert_eq!(v["weight_dtype"], dtype);
    assert!(v["decode_bytes_per_step"].as_f64().is_some_and(|b| b > 0.0));
}

#[test]
fn bench_json_from_a_config_alone() {
    let config = tiny_config();
    let v = bench(&["--config", config.to_str().unwrap()]);
    check_keys(&v, "bf16");
    let v = bench(&[
        "--config",
        config.to_str().unwrap(),
        "--weight-dtype",
        "f32",
        "--batch",
        "2",
    ]);
    check_keys(&v, "f32");
    assert_eq!(v["batch"], 2);
}

#[test]
fn bench_with_bf16_dot_products() {
    // 40 prompt rows take the GEMM path: bf16 dot products where the CPU has them.
    let config = tiny_config();
    let v = bench_json(&[
        "--config",
        config.to_str().unwrap(),
        "--dtype",
        "bf16",
        "--prompt-len",
        "40",
        "--gen-len",
        "2",
        "--threads",
        "2",
        "--json",
        "--no-probe",
    ]);
    check_keys(&v, "bf16");
    assert!(v["bf16_dot_products"].is_boolean());
}

/// Every kernel this CPU runs, by `bench --cpu-kernel` and by
/// METRALE_CPU_KERNEL, is the one the report names; one it does not run,
/// or an unknown name, is refused with the kernels it does run.
#[test]
fn the_cpu_kernel_can_be_forced() {
    let config = tiny_config();
    let config = config.to_str().unwrap();
    let run = |env: Option<&str>, args: &[&str]| {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_metrale"));
        cmd.args(["bench", "--config", config, "--dtype", "bf16"])
            .args(["--prompt-len", "20", "--gen-len", "2", "--threads", "1"])
            .args(["--json", "--no-probe"])
            .args(args)
            .env_remove("METRALE_CPU_KERNEL");
        if let Some(name) = env {
            cmd.env("METRALE_CPU_KERNEL", name);
        }
        cmd.output().expect("running metrale")
    };
    let runs_here = metrale::Bf16Kernel::available_here();
    for name in ["amx", "dot", "fma"] {
        let kernel = metrale::parse_cpu_kernel(name).expect("a kernel");
        for out in [run(None, &["--cpu-kernel", name]), run(Some(name), &[])] {
            let err = String::from_utf8_lossy(&out.stderr).to_string();
            if runs_here.contains(&kernel) {
                assert!(out.status.success(), "{name}: {err}");
                let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
                assert_eq!(v["bf16_kernel"], kernel.describe(), "{name}");
            } else {
                assert!(!out.status.success(), "{name} ran on a CPU without it");
                assert!(err.contains("does not run on this CPU"), "{err}");
                assert!(!err.contains("panicked"), "{err}");
            }
        }
    }
    for out in [run(Some("avx9"), &[]), run(None, &["--cpu-kernel", "avx9"])] {
        let err = String::from_utf8_lossy(&out.stderr).to_string();
        assert!(!out.status.success());
        assert!(
            err.contains("avx9") && err.contains("amx, dot or fma"),
            "{err}"
        );
        assert!(!err.contains("panicked"), "{err}");
    }
}

#[test]
fn exported_random_checkpoint_loads_and_benches() {
    let dir = std::env::temp_dir().join(format!("metrale-export-{}", std::process::id()));
    let status = Command::new(env!("CARGO_BIN_EXE_metrale"))
        .args([
            "export-random",
            "--config",
            tiny_config().to_str().unwrap(),
            "--out",
            dir.to_str().unwrap(),
        ])
        .status()
        .expect("running metrale");
    assert!(status.success());
    assert!(dir.join("model.safetensors").is_file() && dir.join("config.json").is_file());
    let v = bench(&["--model", dir.to_str().unwrap()]);
    check_keys(&v, "bf16");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `--batch 1,3`: both batch sizes on the model loaded once, one JSON object
/// each (an array), and a table with a decode line per batch size against
/// the probed peaks.
#[test]
fn bench_a_list_of_batch_sizes() {
    let dir = std::env::temp_dir().join(format!("metrale-batches-{}", std::process::id()));
    let status = Command::new(env!("CARGO_BIN_EXE_metrale"))
        .args(["export-random", "--config", tiny_config().to_str().unwrap()])
        .args(["--out", dir.to_str().unwrap()])
        .status()
        .expect("running metrale");
    assert!(status.success());
    let model = dir.to_str().unwrap();
    let v = bench(&["--model", model, "--batch", "1,3"]);
    let runs = v.as_array().expect("an array of one object per batch size");
    assert_eq!(runs.len(), 2, "{v}");
    for (run, b) in runs.iter().zip([1, 3]) {
        check_keys(run, "bf16");
        assert_eq!(run["batch"], b);
        let agg = run["decode_tok_s"].as_f64().unwrap();
        let per_seq = run["decode_tok_s_per_seq"].as_f64().unwrap();
        assert!((agg / b as f64 - per_seq).abs() < 1e-9 * agg, "{run}");
        for key in ["decode_flop_s", "decode_weight_bytes_s"] {
            assert!(run[key].as_f64().is_some_and(|x| x > 0.0), "{key} in {run}");
        }
    }
    // A table, with the probes (a second or so).
    let out = Command::new(env!("CARGO_BIN_EXE_metrale"))
        .args([
            "bench",
            "--model",
            model,
            "--batch",
            "1,3",
            "--threads",
            "1",
        ])
        .args(["--prompt-len", "12", "--gen-len", "3"])
        .output()
        .expect("running metrale");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(text.matches("model        ").count(), 1, "{text}");
    for b in ["b1", "b3"] {
        let line = text
            .lines()
            .find(|l| l.starts_with(&format!("decode {b}: ")))
            .unwrap_or_else(|| panic!("no decode {b} line in {text}"));
        assert!(line.contains("tok/s per sequence"), "{line}");
        assert!(
            line.contains(" peak)") && line.contains("GB/s weights ("),
            "{line}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// `--shared-prefix`: misses and hits of the prefix cache on an exported
/// random hybrid (its recurrent state comes back from snapshots).
#[test]
fn bench_shared_prefix_times_misses_and_hits() {
    let dir = std::env::temp_dir().join(format!("metrale-prefix-{}", std::process::id()));
    let status = Command::new(env!("CARGO_BIN_EXE_metrale"))
        .args(["export-random", "--config"])
        .arg(tiny_config())
        .arg("--out")
        .arg(&dir)
        .status()
        .expect("running metrale");
    assert!(status.success());
    let run = |extra: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_metrale"))
            .args(["bench", "--threads", "1", "--model"])
            .arg(&dir)
            .args(["--shared-prefix", "24", "--suffix", "4", "--repeat", "2"])
            .args(extra)
            .output()
            .expect("running metrale");
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        stdout
    };
    let text = run(&[]);
    for line in ["miss ttft", "hit ttft", "x faster", "prefix hits"] {
        assert!(text.contains(line), "{line}: {text}");
    }
    let v: serde_json::Value = serde_json::from_str(&run(&["--json"])).expect("one JSON object");
    for key in ["miss_ttft_ms", "hit_ttft_ms", "speedup"] {
        assert!(v[key].as_f64().is_some_and(|x| x > 0.0), "{key} in {v}");
    }
    assert_eq!(v["hits"], 6);
    // Each hit reuses the 24-token prefix, less what lies after the
    // nearest snapshot (recomputed).
    let reused = v["prefix_hit_tokens"].as_u64().unwrap();
    let recomputed = v["prefix_recomputed_tokens"].as_u64().unwrap();
    assert!(reused > 0, "{v}");
    assert!(reused + recomputed <= 6 * 24, "{v}");
    let off: serde_json::Value =
        serde_json::from_str(&run(&["--json", "--no-prefix-cache"])).expect("one JSON object");
    assert_eq!(off["prefix_hit_tokens"], 0, "{off}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Without --model or --config, bench runs the bundled model, as
/// generate does; the default 512-token prompt shrinks to what its
/// 512-position context leaves beside --gen-len.
#[test]
fn bench_defaults_to_the_bundled_model() {
    let v = bench_json(&["--json", "--no-probe", "--threads", "1", "--gen-len", "8"]);
    assert_eq!(v["prompt_len"], 504, "{v}");
    assert!(
        v["model"]
            .as_str()
            .is_some_and(|m| m.contains("default-model")),
        "{v}"
    );
    // An explicit --prompt-len is taken as given (and refused when it does
    // not fit).
    let out = Command::new(env!("CARGO_BIN_EXE_metrale"))
        .args(["bench", "--json", "--prompt-len", "512", "--gen-len", "8"])
        .env_remove("METRALE_MODEL")
        .output()
        .expect("running metrale");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("--prompt-len 512 plus --gen-len 8"),
        "{stderr}"
    );
}

#[test]
fn bench_profile_times_each_op_of_both_phases() {
    let config = tiny_config();
    let v = bench(&["--config", config.to_str().unwrap(), "--profile"]);
    for (phase, steps) in [("prefill_ops", 1), ("decode_ops", 3)] {
        let ops = v[phase]
            .as_array()
            .unwrap_or_else(|| panic!("{phase} missing in {v}"));
        let calls = |name: &str| {
            ops.iter()
                .find(|o| o["op"] == name)
                .and_then(|o| o["calls"].as_u64())
                .unwrap_or_else(|| panic!("{name} missing in {phase}: {v}"))
        };
        // tiny-hybrid: three layers, Mamba ones among them; every step runs
        // the embedding once and at least one matmul per layer.
        assert_eq!(calls("embedding"), steps, "{phase}");
        assert!(calls("matmul") >= 3 * steps, "{phase}");
        assert!(calls("ssd_scan") >= steps, "{phase}");
        let shares: f64 = ops.iter().map(|o| o["share"].as_f64().unwrap()).sum();
        assert!(
            shares > 0.0 && shares <= 1.0 + 1e-9,
            "{phase}: shares sum to {shares}"
        );
    }
    let plain = bench(&["--config", config.to_str().unwrap()]);
    assert!(
        plain.get("prefill_ops").is_none(),
        "no profile unless asked: {plain}"
    );
}

/// A GGUF file benches with its quantized tensors as stored (Q4_K_M: the
/// decode bytes are the file's blocks, far below bf16's two bytes per
/// parameter), or widened when `--weight-dtype` says so.
#[test]
fn bench_runs_a_quantized_gguf_file_as_stored() {
    let gguf = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/gguf/llama/Q4_K_M.gguf");
    let gguf = gguf.to_str().unwrap();
    let v = bench(&["--model", gguf]);
    for key in ["prefill_tok_s", "decode_tok_s"] {
        assert!(v[key].as_f64().is_some_and(|x| x > 0.0), "{key} in {v}");
    }
    let dtype = v["weight_dtype"].as_str().unwrap().to_string();
    assert!(dtype.starts_with("q"), "a quantized type: {v}");
    let stored = v["decode_bytes_per_step"].as_f64().unwrap();
    let params = v["params"].as_f64().unwrap();
    assert!(stored < params, "{stored} bytes for {params} parameters");
    let widened = bench(&["--model", gguf, "--weight-dtype", "bf16"]);
    assert_eq!(widened["weight_dtype"], "bf16", "{widened}");
    let bf16 = widened["decode_bytes_per_step"].as_f64().unwrap();
    assert!(bf16 > 2.5 * stored, "bf16 {bf16} against stored {stored}");
}

/// With the probes on, each batch size's roofline divides by the bandwidth
/// probed next to its decode window, and the probes' 512 MiB buffers stay
/// out of the peak memory (a tiny model's process holds far less).
#[test]
fn bench_probes_stay_out_of_the_peak_memory() {
    let config = tiny_config();
    let v = bench_json(&[
        "--config",
        config.to_str().unwrap(),
        "--prompt-len",
        "12",
        "--gen-len",
        "3",
        "--threads",
        "1",
        "--batch",
        "1,2",
        "--json",
    ]);
    let rows = v.as_array().expect("one object per batch size");
    assert_eq!(rows.len(), 2, "{v}");
    for row in rows {
        let bw = row["bandwidth_bytes_s"].as_f64().unwrap_or(0.0);
        assert!(bw > 1e8, "bandwidth_bytes_s in {row}");
        let peak = row["peak_rss_bytes"].as_u64().unwrap_or(u64::MAX);
        assert!(
            peak < 256 << 20,
            "peak_rss_bytes {peak} counts a probe's buffer"
        );
    }
}
