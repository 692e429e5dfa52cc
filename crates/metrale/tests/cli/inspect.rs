//! `metrale inspect` on every fixture: the right type, layer plan and
//! sizes; a memory budget; and clear failures.

use std::path::PathBuf;
use std::process::Command;

use metrale_model_weights::loader::scan_safetensors;

const FIXTURES: [(&str, &str, &str); 7] = [
    ("llama", "llama", "* *"),
    ("qwen3", "qwen3", "* *"),
    ("mamba2", "mamba2", "M M"),
    ("bamba", "bamba", "M * M"),
    ("nemotron_h", "nemotron_h", "M * M -"),
    ("granitemoehybrid", "granitemoehybrid", "M * M"),
    ("qwen3_next", "qwen3_next", "G G G *"),
];

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures")).join(name)
}

fn inspect(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_metrale"))
        .arg("inspect")
        .args(args)
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The value of the line starting with `key`.
fn field<'a>(stdout: &'a str, key: &str) -> &'a str {
    stdout
        .lines()
        .find_map(|l| {
            l.strip_prefix(key)
                .filter(|rest| rest.starts_with("  "))
                .map(str::trim)
        })
        .unwrap_or_else(|| panic!("no {key:?} line in\n{stdout}"))
}

#[test]
fn every_fixture() {
    for (name, model_type, plan) in FIXTURES {
        let dir = fixture(name);
        let (ok, stdout, stderr) = inspect(&[dir.to_str().unwrap()]);
        assert!(ok, "{name}: {stderr}");
        assert_eq!(field(&stdout, "model type"), model_type, "{stdout}");
        assert_eq!(field(&stdout, "layer plan"), plan, "{stdout}");
        let stored = scan_safetensors(&dir).unwrap();
        let params: usize = stored
            .iter()
            .map(|t| t.shape.iter().product::<usize>())
            .sum();
        let bytes: usize = stored.iter().map(|t| t.bytes).sum();
        assert!(
            field(&stdout, "parameters").starts_with(&format!("{params} ")),
            "{name}: {stdout}"
        );
        assert!(
            field(&stdout, "weights").starts_with(&format!("{bytes} bytes")),
            "{name}: {stdout}"
        );
        assert!(!stderr.contains("warn"), "{name}: {stderr}");

        // Headers only gives the same numbers.
        let (ok, quick, stderr) = inspect(&[dir.to_str().unwrap(), "--no-load"]);
        assert!(ok, "{name}: {stderr}");
        assert_eq!(field(&quick, "parameters"), field(&stdout, "parameters"));
        assert_eq!(field(&quick, "weights"), field(&stdout, "weights"));
    }
}

#[test]
fn cache_sizes_and_budget() {
    let weights: u64 = scan_safetensors(&fixture("bamba"))
        .unwrap()
        .iter()
        .map(|t| t.bytes as u64)
        .sum();
    let free = (1u64 << 20) - weights;
    // One attention layer, 2 KV heads of 16: 2 * 2 * 16 values per token.
    // Two Mamba layers: conv state 160 x 3 (f32) plus SSM state 8 x 16 x 16.
    // The defaults (`--dtype auto`, bf16 weights) hold the cache and the
    // SSM states in bf16 as `run` does; `--dtype f32` in f32.
    for (extra, kv, ssm) in [(None, 2, 2), (Some("f32"), 4, 4)] {
        let mut args = vec![
            fixture("bamba").to_str().unwrap().to_string(),
            "--memory".into(),
            "1MiB".into(),
            "--context".into(),
            "100".into(),
        ];
        if let Some(dtype) = extra {
            args.extend(["--dtype".into(), dtype.to_string()]);
        }
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let (ok, stdout, stderr) = inspect(&args);
        assert!(ok, "{stderr}");
        let per_token = 2 * 2 * 16 * kv;
        assert!(
            field(&stdout, "kv cache").starts_with(&format!("{per_token} bytes per token")),
            "{stdout}"
        );
        let rec = 2 * (4 * 160 * 3 + ssm * 8 * 16 * 16);
        assert!(
            field(&stdout, "recurrent state").starts_with(&format!("{rec} bytes")),
            "{stdout}"
        );
        assert!(
            field(&stdout, "kv tokens").starts_with(&format!("{} ", free / per_token as u64)),
            "{stdout}"
        );
        let seqs = free / (rec as u64 + 100 * per_token as u64);
        assert!(
            field(&stdout, "sequences").starts_with(&format!("{seqs} of 100 tokens")),
            "{stdout}"
        );
    }

    // f32 weights keep the f32 cache and f32 SSM states under the defaults
    // (as `run` holds them: `ModelOptions::for_weights`), with and without
    // loading them. llama: 2 attention layers, 2 KV heads of 16.
    let f32_caches = [
        ("llama", "kv cache", "512 bytes per token (f32"),
        ("mamba2", "recurrent state", "(f32 conv + f32 SSM state"),
    ];
    for (name, key, want) in f32_caches {
        for extra in [None, Some("--no-load")] {
            let dir = fixture(name);
            let mut args = vec![dir.to_str().unwrap()];
            args.extend(extra);
            let (ok, stdout, stderr) = inspect(&args);
            assert!(ok, "{stderr}");
            assert!(field(&stdout, key).contains(want), "{name}: {stdout}");
        }
    }

    let (ok, stdout, _) = inspect(&[fixture("mamba2").to_str().unwrap(), "--memory", "2 MB"]);
    assert!(ok);
    assert!(
        field(&stdout, "kv tokens").starts_with("unlimited"),
        "{stdout}"
    );

    let (ok, stdout, _) = inspect(&[fixture("llama").to_str().unwrap(), "--memory", "1000"]);
    assert!(ok);
    assert!(stdout.contains("does not fit"), "{stdout}");
}

/// `--memory` without a size (or `--memory free`) plans against the free
/// memory of the device `--device` opens (here the CPU: the host's).
#[test]
fn budget_from_the_devices_free_memory() {
    let dir = fixture("llama");
    let dir = dir.to_str().unwrap();
    for args in [
        &[dir, "--device", "cpu", "--memory"][..],
        &[dir, "--memory", "free", "--device", "cpu"][..],
        &[dir, "--no-load", "--device", "cpu", "--memory", "FREE"][..],
    ] {
        let (ok, stdout, stderr) = inspect(args);
        assert!(ok, "{args:?}: {stderr}");
        let budget = field(&stdout, "memory budget");
        assert!(
            budget.contains("the free memory of cpu"),
            "{args:?}: {stdout}"
        );
        let bytes: u64 = budget.split(' ').next().unwrap().parse().unwrap();
        assert!(bytes > 0, "{stdout}");
        assert!(stdout.contains("after weights"), "{stdout}");
    }
}

#[test]
fn clear_failures() {
    let (ok, _, stderr) = inspect(&["/nonexistent/model"]);
    assert!(!ok);
    assert!(
        stderr.contains("/nonexistent/model/config.json"),
        "{stderr}"
    );
    let (ok, _, stderr) = inspect(&[fixture("llama").to_str().unwrap(), "--memory", "lots"]);
    assert!(!ok);
    assert!(stderr.contains("lots"), "{stderr}");
}

#[test]
fn a_config_alone() {
    // config.json without weights: --no-load reports from the config, a
    // full inspect says what is missing and points at --no-load.
    let dir = std::env::temp_dir().join(format!("metrale-config-only-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(
        fixture("bamba").join("config.json"),
        dir.join("config.json"),
    )
    .unwrap();
    let (ok, full, stderr) = inspect(&[fixture("bamba").to_str().unwrap()]);
    assert!(ok, "{stderr}");
    let (ok, stdout, stderr) = inspect(&[dir.to_str().unwrap(), "--no-load"]);
    assert!(ok, "{stderr}");
    assert_eq!(field(&stdout, "parameters"), field(&full, "parameters"));
    assert_eq!(field(&stdout, "layer plan"), "M * M");
    assert!(
        field(&stdout, "weights").contains("no weight files read"),
        "{stdout}"
    );
    let (ok, _, stderr) = inspect(&[dir.to_str().unwrap()]);
    assert!(!ok);
    assert!(
        stderr.contains("no weights found") && stderr.contains("--no-load"),
        "{stderr}"
    );
    std::fs::remove_dir_all(&dir).ok();
}
