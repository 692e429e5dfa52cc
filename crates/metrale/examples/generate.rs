//! The smallest program: load a model, generate once, tear it down.
//!
//! ```text
//! cargo run -p metrale --example generate -- [MODEL] [PROMPT]
//! ```
//!
//! MODEL is a directory, a `.safetensors` file or a hub id in the local
//! cache (default: the model bundled into this build, a tiny hybrid trained
//! on Debian's fortune quotations). Sampling follows the checkpoint's own defaults
//! (`generation_config.json`) with a fixed seed.

use anyhow::Result;
use metrale::Generator;

fn main() -> Result<()> {
    let mut args = std::env::args().skip(1);
    let model = match args.next() {
        Some(spec) => spec.into(),
        None => metrale::bundled_model_dir()?,
    };
    let prompt = args
        .next()
        .unwrap_or_else(|| "The capital of France is".into());

    let mut generator = Generator::from_dir(model)?;
    let mut params = generator.default_params();
    params.max_tokens = Some(32);
    params.seed = Some(1);
    let out = generator.generate(&prompt, &params)?;
    println!("{prompt}{}", out.text);
    eprintln!(
        "{} prompt + {} generated tokens, finish: {:?}",
        out.usage.prompt_tokens, out.usage.completion_tokens, out.finish_reason
    );
    generator.shutdown()
}
