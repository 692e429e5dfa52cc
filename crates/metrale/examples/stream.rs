//! Streaming: print each token's text as the engine produces it, and the
//! timings at the end.
//!
//! ```text
//! cargo run -p metrale --example stream -- [MODEL] [PROMPT]
//! ```

use std::io::Write;

use anyhow::Result;
use metrale::{Generator, SamplingParams, StreamEvent};

fn main() -> Result<()> {
    let mut args = std::env::args().skip(1);
    let model = match args.next() {
        Some(spec) => spec.into(),
        None => metrale::bundled_model_dir()?,
    };
    let prompt = args.next().unwrap_or_else(|| "Once upon a time".into());

    let mut generator = Generator::builder(model).threads(2).build()?;
    let params = SamplingParams {
        max_tokens: Some(32),
        ..SamplingParams::greedy()
    };
    print!("{prompt}");
    {
        // Dropping the stream early would cancel the request.
        let stream = generator.stream(&prompt, &params)?;
        for event in stream {
            match event? {
                StreamEvent::Token { text, .. } => {
                    print!("{text}");
                    std::io::stdout().flush()?;
                }
                StreamEvent::Finished {
                    reason, timings, ..
                } => {
                    println!();
                    eprintln!("[{reason:?}] {}", timings.summary());
                }
                StreamEvent::PromptLogprobs { .. } => {}
            }
        }
    }
    generator.shutdown()
}
