//! Derived weights: copies of checkpoint tensors made at load in the layout
//! the kernels want (rows permuted so that fused projections split into
//! contiguous column ranges), and small tables made from the config or the
//! weights (RoPE frequencies, expert weight addresses). Owned separately
//! from the weight store.

use std::collections::BTreeMap;

use metrale_core::DType;
use metrale_core::scope::ModelResource;
use metrale_gpu_runtime::gpu::{DeviceSlice, GpuBackend};
use metrale_gpu_runtime::ops::step::u32_bytes;

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
    /// `i` is source row `order[i]`. One gather op on the device (the order
    /// is uploaded once, into memory freed before returning).
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
        let words: Vec<u32> = order.iter().map(|&r| r as u32).collect();
        let dst = self.alloc(gpu, name, src.dtype(), src.len())?;
        let gathered = stage_u32(gpu, &words).and_then(|idx| {
            let run = gpu.gather_rows(src, idx, width, dst);
            let freed = gpu.free(idx.ptr());
            run.and(freed)
        });
        self.adopt(gpu, name, dst, gathered)
    }

    /// Packs derived matrix `name` (`[n, k]`) for the matmuls, as
    /// [`WeightStore::pack_matmul`](metrale_model_weights::weights::WeightStore::pack_matmul)
    /// does for checkpoint tensors; returns its slice as it now is.
    pub fn pack_matmul(
        &mut self,
        gpu: &dyn GpuBackend,
        name: &str,
        n: usize,
        k: usize,
    ) -> Result<DeviceSlice> {
        let slice = self
            .tensors
            .get_mut(name)
            .ok_or_else(|| EngineError::Internal(format!("no derived tensor {name}")))?;
        if let Some(packed) = gpu
            .pack_matmul_weight(*slice, n, k)
            .map_err(EngineError::device(format!("packing {name}")))?
        {
            *slice = packed;
        }
        Ok(*slice)
    }

    /// `values` in device memory, f32 (RoPE's inverse frequencies).
    #[track_caller]
    pub fn upload_f32(
        &mut self,
        gpu: &dyn GpuBackend,
        name: &str,
        values: &[f32],
    ) -> Result<DeviceSlice> {
        let dst = self.alloc(gpu, name, DType::F32, values.len())?;
        let copied = gpu.upload_f32(values, dst);
        self.adopt(gpu, name, dst, copied)
    }

    /// `values` in device memory, u64 (tables of device addresses).
    #[track_caller]
    pub fn upload_u64(
        &mut self,
        gpu: &dyn GpuBackend,
        name: &str,
        values: &[u64],
    ) -> Result<DeviceSlice> {
        let dst = self.alloc(gpu, name, DType::U64, values.len())?;
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        let copied = gpu.copy_h2d(&bytes, dst.ptr(), 0);
        self.adopt(gpu, name, dst, copied)
    }

    #[track_caller]
    fn alloc(
        &self,
        gpu: &dyn GpuBackend,
        name: &str,
        dtype: DType,
        len: usize,
    ) -> Result<DeviceSlice> {
        gpu.alloc_slice(dtype, len, &format!("derived: {name}"))
            .map_err(EngineError::device(format!("deriving {name}")))
    }

    /// Keeps `dst` under `name` when filling it succeeded; frees it otherwise.
    fn adopt(
        &mut self,
        gpu: &dyn GpuBackend,
        name: &str,
        dst: DeviceSlice,
        filled: std::result::Result<(), metrale_gpu_runtime::GpuError>,
    ) -> Result<DeviceSlice> {
        if let Err(e) = filled {
            let _ = gpu.free(dst.ptr());
            return Err(EngineError::device(format!("deriving {name}"))(e));
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

/// `words` in a fresh device allocation (freed by the caller).
#[track_caller]
fn stage_u32(
    gpu: &dyn GpuBackend,
    words: &[u32],
) -> std::result::Result<DeviceSlice, metrale_gpu_runtime::GpuError> {
    let s = gpu.alloc_slice(DType::U32, words.len(), "derived: row order")?;
    if let Err(e) = gpu.copy_h2d(u32_bytes(words), s.ptr(), 0) {
        let _ = gpu.free(s.ptr());
        return Err(e);
    }
    Ok(s)
}
