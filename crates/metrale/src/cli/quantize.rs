//! `metrale quantize IN OUT --type T`: a GGUF file llama.cpp loads, from a
//! Hugging Face checkpoint directory or a float GGUF file (see
//! `metrale_model_engine::gguf::export`).
//!
//! Test hook: `METRALE_TEST_QUANTIZE_PAUSE_MS=N` sleeps N milliseconds after
//! each tensor written, so that a test can interrupt a write in progress.

use std::io::IsTerminal;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use indicatif::{ProgressBar, ProgressStyle};
use metrale::engine::gguf::export::{QuantizeEvent, QuantizeOptions, quantize};
use metrale::weights::file_kind;
use metrale::weights::gguf::mix::FileType;

#[derive(clap::Args)]
pub struct Args {
    /// The input: a checkpoint directory (config.json, safetensors,
    /// tokenizer.json) or a GGUF file of F32/F16/BF16 tensors.
    pub input: PathBuf,
    /// The GGUF file to write: written to a temporary file beside it
    /// (removed if the write fails or is interrupted by SIGINT, SIGTERM,
    /// SIGHUP or SIGQUIT, then exit status 128 + the signal's number) and
    /// renamed to OUT once complete. OUT must be absent or a regular file
    /// (replaced): a symbolic link, even to a regular file, is refused
    /// rather than replaced by a file, as are FIFOs, devices and sockets.
    pub output: PathBuf,
    /// The file type: f32, f16, bf16 (llama.cpp's converter's --outtype),
    /// or q8_0, q4_0, q4_1, q5_0, q5_1, q4_k_s, q4_k_m, q5_k_s, q5_k_m,
    /// q6_k (llama-quantize's mixes, from the f32 values).
    #[arg(long = "type", short = 't', value_name = "T", value_parser = parse_type)]
    pub ftype: FileType,
    /// The tokenizer.ggml.pre to write when llama.cpp's table of
    /// pre-tokenizers does not know the checkpoint's (or to override it):
    /// a name llama.cpp implements, e.g. gpt-2, llama-bpe, qwen2.
    #[arg(long, value_name = "NAME")]
    pub pre_tokenizer: Option<String>,
}

/// The test hook's pause after each tensor (see the module docs).
fn test_pause() -> Option<std::time::Duration> {
    let ms = std::env::var("METRALE_TEST_QUANTIZE_PAUSE_MS").ok()?;
    ms.parse().ok().map(std::time::Duration::from_millis)
}

/// OUT must be absent or a regular file. Anything else is refused before
/// any work: the file is renamed into place, which would replace a FIFO or
/// a device node (as root, even /dev/full) with a regular file, and a
/// symlink with the file rather than write through it.
fn check_output(out: &Path) -> Result<()> {
    match std::fs::symlink_metadata(out) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e).with_context(|| format!("{}: cannot see what is there", out.display())),
        Ok(m) if m.is_file() => Ok(()),
        Ok(m) if m.is_symlink() => {
            let target = std::fs::read_link(out)
                .map(|t| format!(" to {}", t.display()))
                .unwrap_or_default();
            bail!(
                "{}: is a symbolic link{target}; quantize replaces OUT with a new file \
                 rather than write through a link, so give the file's own path",
                out.display()
            )
        }
        Ok(m) if m.is_dir() => bail!(
            "{}: is a directory; give the GGUF file to write",
            out.display()
        ),
        Ok(m) => bail!(
            "{}: is {}; quantize writes only a new file or over a regular file",
            out.display(),
            file_kind(m.file_type())
        ),
    }
}

fn parse_type(s: &str) -> Result<FileType, String> {
    FileType::from_name(s)
        .ok_or_else(|| format!("unknown type {s:?}; one of {}", FileType::names()))
}

pub fn run(args: Args) -> Result<()> {
    if !args.input.exists() {
        bail!("{}: no such file or directory", args.input.display());
    }
    check_output(&args.output)?;
    let tmp = metrale::engine::gguf::export::temp_path(&args.output);
    if let Ok(m) = std::fs::symlink_metadata(&tmp) {
        bail!(
            "{}: there is already {} there, in the way of the temporary file (left by an \
             interrupted run?); remove it",
            tmp.display(),
            file_kind(m.file_type())
        );
    }
    let opts = QuantizeOptions {
        ftype: args.ftype,
        pre_tokenizer: args.pre_tokenizer.clone(),
    };
    // Interrupted mid-write, the temporary file goes too (OUT is untouched).
    super::signals::remove_on_signal(&tmp)?;
    let pause = test_pause();
    let show = std::io::stderr().is_terminal() && !super::quiet();
    let mut bar: Option<ProgressBar> = None;
    let mut progress = |e: QuantizeEvent| match e {
        QuantizeEvent::Start { elements, .. } if show => {
            let b = ProgressBar::new(elements).with_finish(indicatif::ProgressFinish::AndClear);
            if let Ok(style) = ProgressStyle::with_template("quantizing {bar:40} {percent}% {msg}")
            {
                b.set_style(style);
            }
            bar = Some(b);
        }
        QuantizeEvent::Tensor {
            name, ty, elements, ..
        } => {
            tracing::debug!("{name}: {}", ty.name());
            if let Some(b) = &bar {
                b.inc(elements);
                b.set_message(name);
            }
            if let Some(pause) = pause {
                std::thread::sleep(pause);
            }
        }
        _ => {}
    };
    let summary = quantize(&args.input, &args.output, &opts, &mut progress)
        .with_context(|| format!("writing {}", args.output.display()))?;
    if let Some(b) = bar.take() {
        b.finish_and_clear();
    }
    for note in &summary.notes {
        eprintln!("note: {note}");
    }
    if !super::quiet() {
        let types: Vec<String> = (summary.types.iter())
            .map(|(t, n)| format!("{n} {}", t.name()))
            .collect();
        eprintln!(
            "wrote {} ({}, {} tensors: {}, {:.1} MiB)",
            args.output.display(),
            args.ftype.name(),
            summary.tensors,
            types.join(", "),
            summary.bytes as f64 / (1024.0 * 1024.0)
        );
    }
    Ok(())
}
