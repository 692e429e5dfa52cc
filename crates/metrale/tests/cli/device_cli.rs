//! `--device` on every subcommand that runs a model: `cpu` and `auto` run
//! (generate, inspect, logits, bench), unknown names (and `cuda` in a build
//! without the `cuda` feature) are refused by the argument parser with the
//! flag and the accepted values, and `-v` logs the device chosen. With the
//! `cuda` feature and no GPU, `--device cuda` fails with the reason and no
//! panic, and `auto` falls back to the CPU saying so on stderr.

use std::path::PathBuf;
use std::process::{Command, Output, Stdio};

use metrale::Device;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures")).join(name)
}

fn tiny_config() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../benches/configs/tiny-hybrid.json")
}

fn metrale(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_metrale"))
        .args(args)
        .env_remove("METRALE_MODEL")
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .output()
        .expect("the metrale binary runs")
}

/// Whether this build can open a GPU here (then `auto` is not the CPU).
fn gpu_present() -> bool {
    #[cfg(feature = "cuda")]
    {
        metrale::gpu_runtime::cuda::CudaBackend::try_new(0).is_ok()
    }
    #[cfg(not(feature = "cuda"))]
    {
        false
    }
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

fn generate(device: &str) -> Output {
    metrale(&[
        "generate",
        "--device",
        device,
        "--max-tokens",
        "6",
        "--temperature",
        "0",
        "The capital of France is",
    ])
}

#[test]
fn generate_runs_on_cpu_and_auto_alike() {
    let cpu = generate("cpu");
    assert!(cpu.status.success(), "{}", text(&cpu.stderr));
    assert!(!text(&cpu.stdout).trim().is_empty());
    assert!(text(&cpu.stderr).contains("generated: 6 tokens"));
    if gpu_present() {
        return;
    }
    let auto = generate("auto");
    assert!(auto.status.success(), "{}", text(&auto.stderr));
    // auto is the CPU in this build: greedy gives the same text.
    assert_eq!(text(&auto.stdout), text(&cpu.stdout));
    let default = metrale(&[
        "generate",
        "--max-tokens",
        "6",
        "--temperature",
        "0",
        "The capital of France is",
    ]);
    assert!(default.status.success(), "{}", text(&default.stderr));
    assert_eq!(text(&default.stdout), text(&cpu.stdout));
}

#[test]
fn inspect_loads_on_cpu_and_auto() {
    let dir = fixture("bamba");
    let dir = dir.to_str().unwrap();
    let plain = metrale(&["inspect", dir, "--device", "cpu"]);
    assert!(plain.status.success(), "{}", text(&plain.stderr));
    let devices: &[&str] = if gpu_present() {
        &["cpu"]
    } else {
        &["cpu", "auto"]
    };
    for &device in devices {
        let out = metrale(&["inspect", dir, "--device", device]);
        assert!(out.status.success(), "{device}: {}", text(&out.stderr));
        assert_eq!(text(&out.stdout), text(&plain.stdout), "{device}");
        let out = metrale(&["inspect", dir, "--no-load", "--device", device]);
        assert!(out.status.success(), "{device}: {}", text(&out.stderr));
    }
}

#[test]
fn logits_and_bench_take_the_flag() {
    let out_file = std::env::temp_dir().join(format!("metrale-device-{}.st", std::process::id()));
    let out = metrale(&[
        "logits",
        "--model",
        fixture("llama").to_str().unwrap(),
        "--ids",
        "1,2,3",
        "--device",
        "cpu",
        "--out",
        out_file.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(out_file.is_file());
    let _ = std::fs::remove_file(&out_file);

    let config = tiny_config();
    let args = |device: &'static str| {
        vec![
            "bench",
            "--config",
            config.to_str().unwrap(),
            "--device",
            device,
            "--prompt-len",
            "12",
            "--gen-len",
            "2",
            "--threads",
            "1",
            "--no-probe",
        ]
    };
    let mut json = args(if gpu_present() { "cpu" } else { "auto" });
    json.push("--json");
    let out = metrale(&json);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
    assert_eq!(v["device"], "cpu", "{v}");
    assert!(v.get("device_name").is_none(), "{v}");
    let out = metrale(&args("cpu"));
    assert!(out.status.success(), "{}", text(&out.stderr));
    let table = text(&out.stdout);
    assert!(table.contains("run          cpu, 1 thread(s)"), "{table}");
}

/// Every way to reach a model with a device this build cannot run on.
fn with_device(device: &str) -> Vec<Vec<String>> {
    let model = fixture("llama").to_str().unwrap().to_string();
    let config = tiny_config().to_str().unwrap().to_string();
    let own = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    vec![
        own(&["generate", "--device", device, "hi"]),
        own(&["chat", "--device", device]),
        own(&["inspect", &model, "--device", device]),
        own(&["inspect", &model, "--no-load", "--device", device]),
        own(&[
            "logits",
            "--model",
            &model,
            "--ids",
            "1",
            "--out",
            "/dev/null",
            "--device",
            device,
        ]),
        own(&["bench", "--config", &config, "--device", device]),
    ]
}

fn assert_refused(args: &[String], needle: &str) {
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = metrale(&args);
    let stderr = text(&out.stderr);
    assert!(!out.status.success(), "{args:?} succeeded");
    assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
    assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
    assert!(out.stdout.is_empty(), "{args:?}");
    for want in ["--device", &Device::ACCEPTED.join(", "), needle] {
        assert!(
            stderr.contains(want),
            "{args:?}: {want:?} missing in {stderr}"
        );
    }
}

#[cfg(not(feature = "cuda"))]
#[test]
fn cuda_is_refused_naming_the_flag_and_the_cuda_feature() {
    for device in ["cuda", "cuda:1"] {
        for args in with_device(device) {
            assert_refused(
                &args,
                "metrale was built without CUDA support; the CUDA backend arrives with the `cuda` feature",
            );
        }
    }
}

#[test]
fn unknown_devices_are_refused_with_the_accepted_values() {
    for args in with_device("tpu") {
        assert_refused(&args, "unknown device \"tpu\"");
    }
}

/// Without a GPU (CI), every subcommand given `--device cuda[:N]` exits
/// non-zero with the reason (the driver library is missing, or there is no
/// such device) and no panic, and prints nothing on stdout.
#[cfg(feature = "cuda")]
#[test]
fn cuda_without_a_gpu_fails_clearly() {
    if gpu_present() {
        return;
    }
    for device in ["cuda", "cuda:1"] {
        for args in with_device(device) {
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            let out = metrale(&args);
            let stderr = text(&out.stderr);
            assert!(!out.status.success(), "{args:?} succeeded");
            assert_eq!(out.status.code(), Some(1), "{args:?}: {stderr}");
            assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
            assert!(out.stdout.is_empty(), "{args:?}");
            let ordinal = if device == "cuda" { 0 } else { 1 };
            assert!(
                stderr.contains(&format!("cannot open CUDA device {ordinal}")),
                "{args:?}: {stderr}"
            );
            assert!(
                stderr.contains("driver") || stderr.contains("no CUDA device"),
                "{args:?}: the reason is missing: {stderr}"
            );
        }
    }
    // A malformed ordinal is the parser's error.
    assert_refused(
        &[
            "generate".into(),
            "--device".into(),
            "cuda:x".into(),
            "hi".into(),
        ],
        "bad CUDA device \"cuda:x\"",
    );
}

/// `auto` without a GPU runs on the CPU, the normal case on most
/// machines: nothing about CUDA at the default log level, the reason at
/// `-v`.
#[cfg(feature = "cuda")]
#[test]
fn auto_falls_back_to_the_cpu_saying_why_at_v() {
    if gpu_present() {
        return;
    }
    let out = generate("auto");
    let stderr = text(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(!stderr.contains("CUDA"), "{stderr}");
    let verbose = metrale(&[
        "-v",
        "generate",
        "--device",
        "auto",
        "--max-tokens",
        "2",
        "hi",
    ]);
    let stderr = text(&verbose.stderr);
    assert!(
        stderr.contains("--device auto: running on the CPU (cannot open CUDA device 0"),
        "{stderr}"
    );
    // An explicit cpu says nothing of CUDA.
    assert!(!text(&generate("cpu").stderr).contains("CUDA"));
}

#[test]
fn help_documents_the_flag_and_verbose_logs_the_device() {
    for sub in ["generate", "chat", "inspect", "logits", "bench"] {
        let out = metrale(&[sub, "--help"]);
        let help = text(&out.stdout);
        assert!(
            help.contains(if cfg!(feature = "cuda") {
                "--device <cpu|auto|cuda[:N]>"
            } else {
                "--device <cpu|auto>"
            }) && help.contains("[default: auto]"),
            "{sub}: {help}"
        );
    }
    let out = metrale(&[
        "-v",
        "generate",
        "--device",
        "auto",
        "--max-tokens",
        "2",
        "hi",
    ]);
    let stderr = text(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let chosen = if gpu_present() {
        "device cuda:0 (--device auto)"
    } else {
        "device cpu (--device auto)"
    };
    assert!(stderr.contains(chosen), "{stderr}");
    // Without -v (RUST_LOG=warn) the line is not there.
    let quiet = generate("cpu");
    assert!(!text(&quiet.stderr).contains("device cpu"));
}

#[test]
fn every_kv_dtype_runs_and_unknown_kv_dtypes_are_refused() {
    let fixture = fixture("llama");
    let fixture = fixture.to_str().unwrap();
    for kv in ["auto", "f32", "bf16", "f16"] {
        let out = metrale(&[
            "generate",
            "--model",
            fixture,
            "--kv-dtype",
            kv,
            "--max-tokens",
            "4",
            "--temperature",
            "0",
            "hello",
        ]);
        assert!(
            out.status.success(),
            "--kv-dtype {kv}: {}",
            text(&out.stderr)
        );
        assert!(text(&out.stderr).contains("generated: 4 tokens"));
    }
    let bad = metrale(&["generate", "--kv-dtype", "i8", "hello"]);
    assert_eq!(bad.status.code(), Some(2));
    let err = text(&bad.stderr);
    assert!(
        err.contains("--kv-dtype") && err.contains("bf16") && err.contains("f16"),
        "{err}"
    );
    assert!(!err.contains("panicked"));
}
