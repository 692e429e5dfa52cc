//! A checkpoint directory: one `model.safetensors`, or the shards listed by
//! `model.safetensors.index.json`, with every tensor name resolved to the
//! file that stores it.

use std::collections::{BTreeMap, HashMap};
use std::path::{Component, Path, PathBuf};

use serde_json::Value;

use super::header::{SafetensorsFile, TensorEntry};
use crate::error::WeightsError;

pub const SINGLE_FILE: &str = "model.safetensors";
pub const INDEX_FILE: &str = "model.safetensors.index.json";

/// The opened weight files of a model directory.
pub struct Checkpoint {
    /// What errors about the checkpoint as a whole name: the single file, or the index.
    pub source: PathBuf,
    pub files: Vec<SafetensorsFile>,
    /// Tensor name to (file index, entry index).
    by_name: HashMap<String, (usize, usize)>,
}

impl Checkpoint {
    /// Opens and checks every weight file of `dir`.
    pub fn open(dir: &Path) -> Result<Self, WeightsError> {
        let index = dir.join(INDEX_FILE);
        let single = dir.join(SINGLE_FILE);
        // `exists`, not `is_file`: a FIFO or a directory in their place is
        // refused by name when opened, not taken for a missing file.
        if index.exists() {
            let shards = read_index(&index)?;
            let mut files = Vec::new();
            let mut file_of: BTreeMap<&str, usize> = BTreeMap::new();
            for shard in shards.values() {
                if file_of.contains_key(shard.as_str()) {
                    continue;
                }
                let path = dir.join(shard);
                if !path.exists() {
                    return Err(WeightsError::MissingShard {
                        index: index.clone(),
                        shard: shard.clone(),
                    });
                }
                file_of.insert(shard, files.len());
                files.push(SafetensorsFile::open(&path)?);
            }
            let checkpoint = Self::from_files(index.clone(), files)?;
            for (tensor, shard) in &shards {
                let stored_in = checkpoint.by_name.get(tensor).map(|&(f, _)| f);
                if stored_in != file_of.get(shard.as_str()).copied() {
                    return Err(WeightsError::InvalidIndex {
                        path: index,
                        detail: format!(
                            "tensor {tensor:?} is mapped to {shard:?}, which does not store it"
                        ),
                    });
                }
            }
            Ok(checkpoint)
        } else if single.exists() {
            let file = SafetensorsFile::open(&single)?;
            Self::from_files(single, vec![file])
        } else {
            Err(WeightsError::NoWeights {
                dir: dir.to_path_buf(),
            })
        }
    }

    fn from_files(source: PathBuf, files: Vec<SafetensorsFile>) -> Result<Self, WeightsError> {
        let mut by_name = HashMap::new();
        for (f, file) in files.iter().enumerate() {
            for (e, entry) in file.tensors.iter().enumerate() {
                if let Some((g, _)) = by_name.insert(entry.name.clone(), (f, e)) {
                    return Err(WeightsError::DuplicateTensor {
                        tensor: entry.name.clone(),
                        first: files[g].path.clone(),
                        second: file.path.clone(),
                    });
                }
            }
        }
        let checkpoint = Self {
            source,
            files,
            by_name,
        };
        if let Some((method, tensor)) =
            quantized(checkpoint.entries().map(|(_, t)| t.name.as_str()))
        {
            return Err(WeightsError::Quantized {
                path: checkpoint.source.clone(),
                method: method.to_string(),
                tensor: tensor.to_string(),
            });
        }
        Ok(checkpoint)
    }

    /// The file holding `name` and its entry.
    pub fn find(&self, name: &str) -> Option<(&SafetensorsFile, &TensorEntry)> {
        let &(f, e) = self.by_name.get(name)?;
        let file = self.files.get(f)?;
        Some((file, file.tensors.get(e)?))
    }

    /// Every stored tensor, file by file.
    pub fn entries(&self) -> impl Iterator<Item = (&SafetensorsFile, &TensorEntry)> {
        self.files
            .iter()
            .flat_map(|f| f.tensors.iter().map(move |t| (f, t)))
    }
}

/// The quantization method whose tensors `names` holds, with the first such
/// tensor (by name): GPTQ (`g_idx`, or `qweight` / `qzeros` beside one),
/// AWQ (`qweight` / `qzeros` without `g_idx`), bitsandbytes (`absmax`,
/// `quant_map`, `quant_state`, `SCB`), FP8 (`weight_scale`,
/// `weight_scale_inv`).
pub fn quantized<'a>(names: impl Iterator<Item = &'a str>) -> Option<(&'static str, &'a str)> {
    let mut names: Vec<&str> = names.collect();
    names.sort_unstable();
    let last = |n: &str| n.rsplit('.').next().unwrap_or(n).to_string();
    let has = |suffix: &str| names.iter().copied().find(|n| last(n) == suffix);
    if let Some(t) = has("g_idx") {
        return Some(("GPTQ", t));
    }
    if let Some(t) = has("qweight").or_else(|| has("qzeros")) {
        return Some(("AWQ", t));
    }
    let bnb = names.iter().copied().find(|n| {
        let tail = last(n);
        tail == "absmax"
            || tail == "quant_map"
            || tail == "SCB"
            || n.contains(".quant_state.")
            || tail.starts_with("quant_state")
    });
    if let Some(t) = bnb {
        return Some(("bitsandbytes", t));
    }
    if let Some(t) = has("weight_scale").or_else(|| has("weight_scale_inv")) {
        return Some(("FP8", t));
    }
    None
}

/// The `weight_map` of an index file: tensor name to shard file name.
fn read_index(path: &Path) -> Result<BTreeMap<String, String>, WeightsError> {
    let invalid = |detail: String| WeightsError::InvalidIndex {
        path: path.to_path_buf(),
        detail,
    };
    let text = crate::read_regular_to_string(path)?;
    // Through the tolerant reading every checkpoint JSON file gets.
    let json: Value = serde_json::from_str(&metrale_core::json::wrap_nonfinite(&text))
        .map_err(|e| invalid(format!("not valid JSON: {e}")))?;
    let Some(map) = json.get("weight_map") else {
        return Err(invalid("key `weight_map` is missing".to_string()));
    };
    let Value::Object(map) = map else {
        return Err(invalid("key `weight_map` is not an object".to_string()));
    };
    let mut out = BTreeMap::new();
    for (tensor, shard) in map {
        let Value::String(shard) = shard else {
            return Err(invalid(format!(
                "weight_map[{tensor:?}] is not a file name"
            )));
        };
        let plain = Path::new(shard)
            .components()
            .all(|c| matches!(c, Component::Normal(_)));
        if shard.is_empty() || !plain {
            return Err(invalid(format!(
                "weight_map[{tensor:?}] = {shard:?} is not a file inside the model directory"
            )));
        }
        out.insert(tensor.clone(), shard.clone());
    }
    Ok(out)
}
