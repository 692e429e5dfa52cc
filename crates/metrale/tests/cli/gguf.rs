//! A `.gguf` file as the model of the facade and the CLI: `resolve_model`
//! takes it, `Model::load` gives the logits of the safetensors checkpoint it
//! was converted from, `Generator::load` generates with its tokenizer, chat
//! template and the plain sampling defaults, and `metrale generate`,
//! `inspect` and `logits` run on it.

use std::path::{Path, PathBuf};
use std::process::Command;

use metrale::SamplingParams;
use metrale::WeightDType;
use metrale::{EngineConfig, Generator, LoadOptions, Model};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

fn gguf(name: &str) -> PathBuf {
    fixtures().join(format!("gguf-bf16/{name}.gguf"))
}

fn options() -> LoadOptions {
    LoadOptions {
        device: metrale::Device::Cpu,
        threads: 1,
        // The converter stored the f32 fixture's weights as bf16; held as
        // bf16 both give the same device weights.
        dtype: WeightDType::BF16,
        ..LoadOptions::default()
    }
}

#[test]
fn resolve_model_takes_a_gguf_file() {
    let path = gguf("qwen3");
    assert_eq!(metrale::resolve_model(&path, None).unwrap(), path);
}

#[test]
fn model_logits_from_gguf_equal_the_checkpoint() {
    for name in ["qwen3", "bamba"] {
        let ids = [5u32, 9, 77, 300, 2, 41];
        let st = Model::load(&fixtures().join(name), &options(), &mut |_| {}).unwrap();
        let gg = Model::load(&gguf(name), &options(), &mut |_| {}).unwrap();
        for decode_from in [None, Some(3)] {
            assert_eq!(
                st.logits(&ids, decode_from).unwrap(),
                gg.logits(&ids, decode_from).unwrap(),
                "{name} {decode_from:?}"
            );
        }
        st.shutdown().unwrap();
        gg.shutdown().unwrap();
    }
}

#[test]
fn generator_runs_on_a_gguf_file() {
    let mut g = Generator::load(
        &gguf("llama"),
        &options(),
        EngineConfig::default(),
        &mut |_| {},
    )
    .unwrap();
    // GGUF has no generation_config: the plain defaults.
    assert_eq!(g.defaults().source, None);
    assert_eq!(g.tokenizer().eos_ids(), &[2]);
    let params = SamplingParams {
        max_tokens: Some(6),
        ..SamplingParams::greedy()
    };
    let out = g.generate("Hello there", &params).unwrap();
    assert!(!out.tokens.is_empty());
    let again = g.generate("Hello there", &params).unwrap();
    assert_eq!(out.tokens, again.tokens);
    let template = g.chat_template().unwrap();
    let ids = g
        .chat_prompt(&template, &[metrale::ChatMessage::new("user", "hi")])
        .unwrap();
    assert!(!ids.is_empty());
    g.shutdown().unwrap();
}

fn metrale(args: &[&str]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_metrale"))
        .args(args)
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.status.success(), text)
}

#[test]
fn cli_runs_on_a_gguf_file() {
    let model = gguf("mamba2");
    let model = model.to_str().unwrap();
    let (ok, text) = metrale(&[
        "generate",
        "-m",
        model,
        "-p",
        "Hi",
        "-n",
        "4",
        "--device",
        "cpu",
        "--temperature",
        "0",
    ]);
    assert!(ok, "{text}");
    let (ok, text) = metrale(&["inspect", model, "--device", "cpu"]);
    assert!(ok && text.contains("mamba2"), "{text}");
    let (ok, text) = metrale(&["inspect", model, "--no-load"]);
    assert!(ok && text.contains("parameters"), "{text}");
    let out = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("gguf-logits.safetensors");
    let (ok, text) = metrale(&[
        "logits",
        "-m",
        model,
        "--ids",
        "1,2,3",
        "--out",
        out.to_str().unwrap(),
        "--device",
        "cpu",
    ]);
    assert!(ok && out.is_file(), "{text}");
    let (ok, text) = metrale(&["generate", "-m", "/nonexistent/x.gguf", "-p", "Hi"]);
    assert!(!ok && text.contains("x.gguf"), "{text}");
}

/// `--quant` on the commands that load a model: generate and bench quantize
/// a checkpoint as it loads; an unknown type is refused with the list.
#[test]
fn cli_quantizes_on_load() {
    let dir = fixtures().join("bamba");
    let dir = dir.to_str().unwrap();
    let greedy = |extra: &[&str]| {
        let mut args = vec![
            "generate",
            "-m",
            dir,
            "-p",
            "Hi",
            "-n",
            "4",
            "--temperature",
            "0",
            "--ignore-eos",
        ];
        args.extend_from_slice(extra);
        let (ok, text) = metrale(&args);
        assert!(ok, "{text}");
        text
    };
    greedy(&["--quant", "q8_0"]);
    greedy(&["--quant", "Q4_K_M"]);
    let (ok, text) = metrale(&[
        "bench",
        "-m",
        dir,
        "--quant",
        "q6_k",
        "--prompt-len",
        "8",
        "--gen-len",
        "2",
        "--no-probe",
        "--json",
    ]);
    assert!(ok && text.contains("\"decode_tok_s\""), "{text}");
    let (ok, text) = metrale(&["generate", "-m", dir, "-p", "Hi", "--quant", "q3_x"]);
    assert!(
        !ok && text.contains("q4_k_m") && text.contains("q3_x"),
        "{text}"
    );
}
