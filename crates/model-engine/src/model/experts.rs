//! A MoE layer's experts as the grouped ops want them: per projection, one
//! device table of every expert's weight address ([`ExpertTable`]), built
//! once at load, so that a step runs all experts with a few grouped
//! matmuls reading device-side routes.

use metrale_gpu_runtime::gpu::GpuBackend;
use metrale_gpu_runtime::ops::ExpertTable;

use super::derived::DerivedWeights;
use super::weights::{Linear, MlpWeights};
use crate::config::{ExpertNames, MlpNames};
use crate::error::{EngineError, Result};

/// Every expert's projections of one MoE layer.
#[derive(Clone, Copy, Debug)]
pub(crate) enum ExpertTables {
    /// `down(silu(gate x) * up x)`.
    SwiGlu {
        gate: ExpertTable,
        up: ExpertTable,
        down: ExpertTable,
    },
    /// `down(relu(up x)²)` (Nemotron-H).
    Plain { up: ExpertTable, down: ExpertTable },
}

impl ExpertTables {
    /// The experts' intermediate width.
    pub fn intermediate(&self) -> usize {
        match self {
            ExpertTables::SwiGlu { up, .. } | ExpertTables::Plain { up, .. } => up.n,
        }
    }
}

/// Tables a layer with these expert names needs (what the memory plan counts).
pub(crate) fn tables_per_layer(names: &ExpertNames) -> usize {
    match names {
        ExpertNames::Separate(list) if matches!(list.first(), Some(MlpNames::Plain { .. })) => 2,
        _ => 3,
    }
}

/// Builds the tables of `experts` (all of one kind, dtype and shape, without
/// biases) as derived tensors named after `layer`.
pub(crate) fn tables(
    experts: &[MlpWeights],
    derived: &mut DerivedWeights,
    gpu: &dyn GpuBackend,
    layer: usize,
) -> Result<ExpertTables> {
    let mut projections: [Vec<Linear>; 3] = Default::default();
    let mut plain = None;
    for (e, mlp) in experts.iter().enumerate() {
        let (is_plain, parts) = match mlp {
            MlpWeights::Split { gate, up, down } => (false, vec![*gate, *up, *down]),
            MlpWeights::Fused { gate_up, down } => {
                let inter = gate_up.n / 2;
                (
                    false,
                    vec![gate_up.rows(0, inter)?, gate_up.rows(inter, inter)?, *down],
                )
            }
            MlpWeights::Plain { up, down } => (true, vec![*up, *down]),
        };
        if *plain.get_or_insert(is_plain) != is_plain {
            return Err(unsupported(layer, format!("expert {e} is of another kind")));
        }
        if parts.iter().any(|l| l.b.is_some()) {
            return Err(unsupported(layer, format!("expert {e} has biases")));
        }
        for (list, l) in projections.iter_mut().zip(parts) {
            list.push(l);
        }
    }
    let mut table = |what: &str, list: &[Linear]| -> Result<ExpertTable> {
        let first = list
            .first()
            .ok_or_else(|| unsupported(layer, "no experts".into()))?;
        if let Some(l) = list
            .iter()
            .find(|l| (l.n, l.k, l.w.dtype()) != (first.n, first.k, first.w.dtype()))
        {
            return Err(unsupported(
                layer,
                format!(
                    "{what} weights differ: [{}, {}] {} and [{}, {}] {}",
                    first.n,
                    first.k,
                    first.w.dtype(),
                    l.n,
                    l.k,
                    l.w.dtype()
                ),
            ));
        }
        let ptrs: Vec<u64> = list.iter().map(|l| l.w.ptr().raw()).collect();
        let name = format!("layer{layer}.experts.{what}");
        Ok(ExpertTable {
            ptrs: derived.upload_u64(gpu, &name, &ptrs)?,
            dtype: first.w.dtype(),
            n: first.n,
            k: first.k,
        })
    };
    let [a, b, c] = &projections;
    Ok(if plain == Some(true) {
        ExpertTables::Plain {
            up: table("up", a)?,
            down: table("down", b)?,
        }
    } else {
        ExpertTables::SwiGlu {
            gate: table("gate", a)?,
            up: table("up", b)?,
            down: table("down", c)?,
        }
    })
}

fn unsupported(layer: usize, detail: String) -> EngineError {
    EngineError::Request(format!(
        "layer {layer}: the experts cannot run as grouped matmuls: {detail}"
    ))
}
