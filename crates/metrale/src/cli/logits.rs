//! `metrale logits`: the parity interface. Runs a model over token ids and
//! writes F32 logits `[N, vocab]` as the tensor `logits` of a safetensors file.

use std::collections::HashMap;
use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use metrale::{LoadOptions, Model};
use safetensors::tensor::{Dtype, TensorView};

#[derive(clap::Args)]
pub struct Args {
    /// The model: a directory, a .safetensors file in one, or a Hugging
    /// Face hub id org/name in the local cache. Default: $METRALE_MODEL,
    /// else the bundled model.
    #[arg(short, long)]
    pub model: Option<PathBuf>,
    /// The model `--model` names, resolved.
    #[arg(skip)]
    pub model_dir: PathBuf,
    /// The revision of a hub id model: a branch, tag or commit hash
    /// (default: main).
    #[arg(long, value_name = "REV")]
    pub revision: Option<String>,
    /// Comma-separated token ids.
    #[arg(long, value_delimiter = ',', required = true)]
    pub ids: Vec<u32>,
    /// Prefill the first P ids in one pass, then feed the rest one at a time.
    #[arg(long, value_name = "P")]
    pub decode_from: Option<usize>,
    /// Where to write the logits.
    #[arg(long)]
    pub out: PathBuf,
    #[command(flatten)]
    pub device: super::DeviceArgs,
    #[command(flatten)]
    pub dtype: super::DTypeArgs,
    /// Worker threads (0: one per core; at most 4 per core).
    #[arg(short, long, default_value_t = 0)]
    pub threads: usize,
    /// The context: the most ids the model may be run over (default: the
    /// model's max_position_embeddings).
    #[arg(long, visible_alias = "max-model-len", value_name = "TOKENS")]
    pub ctx_size: Option<usize>,
    /// The most memory the model may take, e.g. 8GiB (default: what the
    /// host and its cgroup have available); checked before loading.
    #[arg(long, value_parser = super::parse_memory)]
    pub memory_limit: Option<usize>,
    /// The KV cache's element type (docs/ACCURACY.md measures each).
    #[arg(long, value_enum, default_value_t = super::KvDType::Auto)]
    pub kv_dtype: super::KvDType,
    #[command(flatten)]
    pub prefix: super::PrefixCacheArgs,
}

pub fn run(mut args: Args) -> Result<()> {
    args.model_dir = metrale::model_dir(args.model.as_deref(), args.revision.as_deref())?;
    if let Some(p) = args.decode_from
        && p > args.ids.len()
    {
        bail!(
            "--decode-from {p} is beyond the {} ids given",
            args.ids.len()
        );
    }
    if let Some(ctx) = args.ctx_size {
        super::generate::check_ctx_size(ctx, &args.model_dir)?;
        if args.ids.len() > ctx {
            bail!(
                "{} ids are more than the context of {ctx} positions (--ctx-size)",
                args.ids.len()
            );
        }
    }
    let mut options = LoadOptions {
        device: args.device.device,
        threads: args.threads,
        memory_limit: args.memory_limit,
        bf16_dot_products: args.dtype.bf16_dot_products(),
        bf16_ssm_state: args.dtype.bf16_ssm_state(),
        quant: args.dtype.quant,
        ..LoadOptions::default()
    };
    options.model.max_batch_tokens = args.ids.len().clamp(1, 4096);
    options.model.kv_blocks = args.ids.len().div_ceil(options.model.kv_block_size) + 1;
    options.model.max_seqs = 1;
    args.dtype.apply(args.kv_dtype, &mut options.model);
    options.model.cuda_graphs = !args.device.no_cuda_graphs;
    options.model.prefix_cache = args.prefix.options();
    tracing::debug!("loading {} with {options:?}", args.model_dir.display());
    let model = Model::load(&args.model_dir, &options, &mut super::load_progress())?;
    let vocab = model.engine().config().vocab_size;
    let logits = model.logits(&args.ids, args.decode_from);
    let shutdown = model.shutdown();
    let logits = logits?;
    shutdown?;
    let bytes: Vec<u8> = logits.iter().flat_map(|v| v.to_le_bytes()).collect();
    let view = TensorView::new(Dtype::F32, vec![args.ids.len(), vocab], &bytes)?;
    let tensors: HashMap<String, TensorView<'_>> = HashMap::from([("logits".to_string(), view)]);
    // Written as any file the user makes (the umask's permissions):
    // serialize_to_file goes through a 0600 temporary file.
    let file = safetensors::serialize(&tensors, None)?;
    std::fs::write(&args.out, file).with_context(|| format!("writing {}", args.out.display()))?;
    Ok(())
}
