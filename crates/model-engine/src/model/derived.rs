//! Derived weights: copies of checkpoint tensors made at load in the layout
//! the kernels want (rows permuted so that fused projections split into
//! contiguous column ranges). Owned separately from the weight store.

use std::collections::BTreeMap;

use metrale_core::scope::ModelResource;
use metrale_gpu_runtime::gpu::{DeviceSlice, GpuBackend};

use crate::error::{EngineError, Result};

/// Named device tensors derived from the checkpoint at load.
#[derive(Default)]
pub struct DerivedWeights {
    tensors: BTreeMap<String, DeviceSlice>,
}

impl DerivedWeights {
    pub fn new() -> Self {
        Self::default()
    }

    /// A copy of `src` (`[rows, width]`) with its rows reordered: output row
    /// `i` is source row `order[i]`. Rows are copied device to device.
    #[track_caller]
    pub fn permute_rows(
        &mut self,
        gpu: &dyn GpuBackend,
        name: &str,
        src: DeviceSlice,
        width: usize,
        order: &[usize],
    ) -> Result<DeviceSlice> {
        if order.len() * width != src.len() || order.iter().any(|&r| r * width >= src.len().max(1))
        {
            return Err(EngineError::Request(format!(
                "{name}: permutation of {} rows does not fit a tensor of {} elements",
                order.len(),
                src.len()
            )));
        }
        let dst = gpu
            .alloc_slice(src.dtype(), src.len(), &format!("derived: {name}"))
            .map_err(EngineError::device(format!("deriving {name}")))?;
        let row_bytes = width * src.dtype().size_of();
        for (i, &r) in order.iter().enumerate() {
            if let Err(e) = gpu.copy_d2d(
                src.ptr(),
                r * row_bytes,
                dst.ptr(),
                i * row_bytes,
                row_bytes,
            ) {
                let _ = gpu.free(dst.ptr());
                return Err(EngineError::device(format!("deriving {name}"))(e));
            }
        }
        if let Some(old) = self.tensors.insert(name.to_string(), dst) {
            let _ = gpu.free(old.ptr());
        }
        Ok(dst)
    }

    pub fn get(&self, name: &str) -> Option<DeviceSlice> {
        self.tensors.get(name).copied()
    }

    pub fn len(&self) -> usize {
        self.tensors.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tensors.is_empty()
    }

    pub fn bytes(&self) -> usize {
        self.tensors.values().map(|t| t.bytes()).sum()
    }
}

impl<'g> ModelResource<dyn GpuBackend + 'g> for DerivedWeights {
    fn label(&self) -> &str {
        "derived weights"
    }

    fn release(&mut self, gpu: &(dyn GpuBackend + 'g)) -> anyhow::Result<()> {
        let mut first: Option<anyhow::Error> = None;
        for (name, t) in std::mem::take(&mut self.tensors) {
            if let Err(e) = gpu.free(t.ptr())
                && first.is_none()
            {
                first =
                    Some(anyhow::Error::new(e).context(format!("freeing derived weight {name}")));
            }
        }
        first.map_or(Ok(()), Err)
    }
}
