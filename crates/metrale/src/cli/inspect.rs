//! `metrale inspect`.

use std::path::PathBuf;

use anyhow::Result;

#[derive(clap::Args)]
pub struct Args {
    /// The model directory (config.json, *.safetensors).
    pub model_dir: PathBuf,
    /// A memory budget, e.g. 8GiB, to report what fits.
    #[arg(long)]
    pub memory: Option<String>,
}

pub fn run(args: Args) -> Result<()> {
    anyhow::bail!("inspect {}: not built yet", args.model_dir.display())
}
