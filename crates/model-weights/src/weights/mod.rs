//! The weight store: tensor name to device tensor, and the memory behind them.

use std::collections::BTreeMap;

use metrale_core::DType;
use metrale_core::scope::ModelResource;
use metrale_gpu_runtime::gpu::{DeviceSlice, GpuBackend};

use crate::error::WeightsError;

/// A tensor in device memory.
#[derive(Clone, Debug, PartialEq)]
pub struct DeviceTensor {
    pub slice: DeviceSlice,
    pub shape: Vec<usize>,
}

impl DeviceTensor {
    pub fn dtype(&self) -> DType {
        self.slice.dtype()
    }

    pub fn elements(&self) -> usize {
        self.shape.iter().product()
    }

    pub fn bytes(&self) -> usize {
        self.slice.bytes()
    }
}

/// The ledger of a model's weights. Owns one device allocation per tensor;
/// `release` frees them all and is idempotent.
#[derive(Default)]
pub struct WeightStore {
    tensors: BTreeMap<String, DeviceTensor>,
}

impl WeightStore {
    pub fn new() -> Self {
        Self::default()
    }

    /// Takes ownership of a tensor already allocated on `gpu`'s ledger.
    pub fn insert(
        &mut self,
        name: impl Into<String>,
        tensor: DeviceTensor,
    ) -> Option<DeviceTensor> {
        self.tensors.insert(name.into(), tensor)
    }

    /// Allocates a tensor for `name` and uploads `bytes` (already in `dtype`).
    #[track_caller]
    pub fn upload(
        &mut self,
        gpu: &dyn GpuBackend,
        name: &str,
        dtype: DType,
        shape: Vec<usize>,
        bytes: &[u8],
    ) -> Result<&DeviceTensor, WeightsError> {
        let elements: usize = shape.iter().product();
        let device = |source| WeightsError::Device {
            name: name.to_string(),
            source,
        };
        let slice = gpu
            .alloc_slice(dtype, elements, &format!("weights: {name}"))
            .map_err(device)?;
        if let Err(e) = gpu.copy_h2d(bytes, slice.ptr(), 0) {
            let _ = gpu.free(slice.ptr());
            return Err(device(e));
        }
        if let Some(old) = self
            .tensors
            .insert(name.to_string(), DeviceTensor { slice, shape })
        {
            let _ = gpu.free(old.slice.ptr());
        }
        Ok(&self.tensors[name])
    }

    /// Rewrites tensor `name`, a matrix `[n, k]` (or experts `[e, n', k]`
    /// taken as `[e·n', k]`), in place into the layout `gpu`'s matmuls read
    /// fastest ([`DenseOps::pack_matmul_weight`]) and relabels it; left as
    /// it is where the backend keeps it (or packed it already). Afterwards
    /// only matmuls and embedding lookups may read it. Returns its slice as
    /// it now is.
    ///
    /// [`DenseOps::pack_matmul_weight`]: metrale_gpu_runtime::ops::DenseOps::pack_matmul_weight
    pub fn pack_matmul(
        &mut self,
        gpu: &dyn GpuBackend,
        name: &str,
        n: usize,
        k: usize,
    ) -> Result<DeviceSlice, WeightsError> {
        let t = self
            .tensors
            .get_mut(name)
            .ok_or_else(|| WeightsError::NotLoaded {
                name: name.to_string(),
            })?;
        let packed =
            gpu.pack_matmul_weight(t.slice, n, k)
                .map_err(|source| WeightsError::Device {
                    name: name.to_string(),
                    source,
                })?;
        if let Some(slice) = packed {
            t.slice = slice;
        }
        Ok(t.slice)
    }

    pub fn get(&self, name: &str) -> Result<&DeviceTensor, WeightsError> {
        self.tensors
            .get(name)
            .ok_or_else(|| WeightsError::NotLoaded {
                name: name.to_string(),
            })
    }

    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    pub fn len(&self) -> usize {
        self.tensors.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tensors.is_empty()
    }

    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(String::as_str)
    }

    /// Bytes of device memory the weights occupy.
    pub fn bytes(&self) -> usize {
        self.tensors.values().map(DeviceTensor::bytes).sum()
    }

    /// Elements over all tensors (the parameter count).
    pub fn parameters(&self) -> usize {
        self.tensors.values().map(DeviceTensor::elements).sum()
    }
}

impl<'g> ModelResource<dyn GpuBackend + 'g> for WeightStore {
    fn label(&self) -> &str {
        "weight store"
    }

    /// Frees every tensor, attempting all; returns the first failure.
    fn release(&mut self, gpu: &(dyn GpuBackend + 'g)) -> anyhow::Result<()> {
        let mut first: Option<anyhow::Error> = None;
        for (name, t) in std::mem::take(&mut self.tensors) {
            if let Err(e) = gpu.free(t.slice.ptr())
                && first.is_none()
            {
                first = Some(anyhow::Error::new(e).context(format!("freeing weight {name}")));
            }
        }
        first.map_or(Ok(()), Err)
    }
}
