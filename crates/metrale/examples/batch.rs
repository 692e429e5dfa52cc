//! Batching: several prompts run concurrently through the engine's
//! continuous batching; results come back in the prompts' order.
//!
//! ```text
//! cargo run -p metrale --example batch -- [MODEL]
//! ```

use anyhow::Result;
use metrale::{Generator, SamplingParams};

fn main() -> Result<()> {
    let model = match std::env::args().nth(1) {
        Some(spec) => spec.into(),
        None => metrale::bundled_model_dir()?,
    };
    let prompts = [
        "The capital of France is",
        "Once upon a time",
        "The meaning of life is",
        "def fibonacci(n):",
    ];

    let mut generator = Generator::builder(model).max_seqs(prompts.len()).build()?;
    let params = SamplingParams {
        max_tokens: Some(16),
        seed: Some(3),
        ..generator.default_params()
    };
    let outs = generator.generate_batch(&prompts, &params)?;
    for (prompt, out) in prompts.iter().zip(&outs) {
        println!("{prompt:?} -> {:?} ({:?})", out.text, out.finish_reason);
    }
    generator.shutdown()
}
