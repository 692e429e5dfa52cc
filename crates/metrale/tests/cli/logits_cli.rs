//! `metrale logits`, the parity interface: its output matches the golden
//! logits in one prefill and with `--decode-from` at the prompt length, and
//! bad arguments fail cleanly.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result};
use safetensors::SafeTensors;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name)
}

fn tensor_f32(st: &SafeTensors<'_>, name: &str) -> Result<(Vec<usize>, Vec<f32>)> {
    let t = st.tensor(name)?;
    Ok((
        t.shape().to_vec(),
        t.data()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
    ))
}

fn tensor_ids(st: &SafeTensors<'_>, name: &str) -> Result<Vec<i64>> {
    Ok(st
        .tensor(name)?
        .data()
        .chunks_exact(8)
        .map(|c| i64::from_le_bytes(c.try_into().unwrap_or([0; 8])))
        .collect())
}

fn run_logits(
    model: &str,
    ids: &[i64],
    decode_from: Option<usize>,
    out: &Path,
) -> Result<std::process::Output> {
    let ids: Vec<String> = ids.iter().map(|i| i.to_string()).collect();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_metrale"));
    // The exact arithmetic: the default (`auto`) multiplies bf16 weights
    // with bf16 dot products, out of the golden files' 1e-4.
    cmd.args(["logits", "--threads", "2", "--dtype", "f32", "--model"])
        .arg(fixture(model))
        .args(["--ids", &ids.join(","), "--out"])
        .arg(out);
    if let Some(p) = decode_from {
        cmd.args(["--decode-from", &p.to_string()]);
    }
    cmd.output().context("running metrale logits")
}

#[test]
fn logits_match_golden_in_prefill_and_decode() -> Result<()> {
    let dir = std::env::temp_dir().join(format!("metrale-logits-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    for model in ["llama", "granitemoehybrid", "qwen3_next"] {
        let golden = std::fs::read(fixture(model).join("golden.safetensors"))?;
        let golden = SafeTensors::deserialize(&golden)?;
        let tokens = tensor_ids(&golden, "tokens_0")?;
        let prompt_len = tensor_ids(&golden, "prompt_0")?.len();
        let (_, expected) = tensor_f32(&golden, "logits_0")?;
        for decode_from in [None, Some(prompt_len)] {
            let out = dir.join(format!("{model}-{decode_from:?}.safetensors"));
            let result = run_logits(model, &tokens, decode_from, &out)?;
            assert!(
                result.status.success(),
                "{}",
                String::from_utf8_lossy(&result.stderr)
            );
            // As any file the user makes: the umask's permissions, not a
            // temporary file's 0600.
            #[cfg(unix)]
            {
                use std::os::unix::fs::PermissionsExt;
                let mode = std::fs::metadata(&out)?.permissions().mode() & 0o777;
                assert_ne!(mode, 0o600, "{}", out.display());
                assert!(mode & 0o044 != 0, "{mode:o}");
            }
            let bytes = std::fs::read(&out)?;
            let st = SafeTensors::deserialize(&bytes)?;
            let (shape, got) = tensor_f32(&st, "logits")?;
            assert_eq!(shape, vec![tokens.len(), 512]);
            let d = got
                .iter()
                .zip(&expected)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0, f32::max);
            assert!(d <= 1e-4, "{model} decode_from {decode_from:?}: {d}");
        }
    }
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}

#[test]
fn bad_arguments_fail_with_a_message() -> Result<()> {
    let out = std::env::temp_dir().join(format!(
        "metrale-logits-bad-{}.safetensors",
        std::process::id()
    ));
    let r = run_logits("llama", &[1, 2, 3], Some(9), &out)?;
    assert!(!r.status.success());
    assert!(
        String::from_utf8_lossy(&r.stderr).contains("--decode-from 9"),
        "{}",
        String::from_utf8_lossy(&r.stderr)
    );
    let r = run_logits("llama", &[1, 99999], None, &out)?;
    assert!(!r.status.success());
    assert!(
        String::from_utf8_lossy(&r.stderr).contains("token id 99999"),
        "{}",
        String::from_utf8_lossy(&r.stderr)
    );
    let r = run_logits("no-such-model", &[1], None, &out)?;
    assert!(!r.status.success());
    assert!(
        String::from_utf8_lossy(&r.stderr).contains("no-such-model"),
        "{}",
        String::from_utf8_lossy(&r.stderr)
    );
    Ok(())
}
