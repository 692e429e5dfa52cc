//! A scripted two-turn chat through the model's chat template (its
//! tokenizer_config.json's `chat_template`): each reply is appended to the
//! conversation before the next user turn.
//!
//! ```text
//! cargo run -p metrale --example chat -- [MODEL]
//! ```

use anyhow::Result;
use metrale::{ChatMessage, Generator};

fn main() -> Result<()> {
    let model = match std::env::args().nth(1) {
        Some(spec) => spec.into(),
        None => metrale::bundled_model_dir()?,
    };
    let mut generator = Generator::from_dir(model)?;
    let template = generator.chat_template()?;
    let mut params = generator.default_params();
    params.max_tokens = Some(24);
    params.seed = Some(5);

    let mut conversation = vec![ChatMessage::new("system", "You are a helpful assistant.")];
    for question in ["Hello! Who are you?", "What is the capital of France?"] {
        conversation.push(ChatMessage::new("user", question));
        let prompt = generator.chat_prompt(&template, &conversation)?;
        let reply = generator.generate_ids(prompt, &params)?;
        println!("user: {question}\nassistant: {}\n", reply.text);
        conversation.push(ChatMessage::new("assistant", &reply.text));
    }
    generator.shutdown()
}
