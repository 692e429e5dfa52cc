//! Activation scratch: one allocation sized for the largest batch the engine
//! will run, handed out as named regions and released as one resource.

use metrale_core::DType;
use metrale_core::scope::ModelResource;

use crate::error::{GpuError, Result};
use crate::gpu::{DeviceSlice, GpuBackend};

/// Scratch memory for activations. Regions are carved at fixed offsets once
/// (`plan`), so a forward step allocates nothing.
#[derive(Default)]
pub struct BufferArena {
    base: Option<DeviceSlice>,
    regions: Vec<(String, usize, usize)>,
}

/// Builder: lists the regions (in f32 elements) before the one allocation.
#[derive(Default)]
pub struct ArenaPlan {
    regions: Vec<(String, usize)>,
}

impl ArenaPlan {
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a region of `len` f32 elements (rounded up to 16 for alignment).
    pub fn region(mut self, name: &str, len: usize) -> Self {
        self.regions
            .push((name.to_string(), len.div_ceil(16).saturating_mul(16)));
        self
    }

    /// Elements of all regions (saturating: a plan this large cannot be
    /// allocated, and the allocation says so).
    pub fn total_elements(&self) -> usize {
        self.regions
            .iter()
            .fold(0usize, |a, (_, l)| a.saturating_add(*l))
    }
}

impl BufferArena {
    /// Allocates one buffer holding every region of `plan`.
    #[track_caller]
    pub fn allocate(gpu: &dyn GpuBackend, plan: ArenaPlan) -> Result<Self> {
        let total = plan.total_elements().max(16);
        let base = gpu.alloc_slice(DType::F32, total, "buffer arena")?;
        let mut offset = 0;
        let regions = plan
            .regions
            .into_iter()
            .map(|(name, len)| {
                let r = (name, offset, len);
                offset += len;
                r
            })
            .collect();
        Ok(Self {
            base: Some(base),
            regions,
        })
    }

    /// The region called `name`.
    pub fn get(&self, name: &str) -> Result<DeviceSlice> {
        let base = self.base.ok_or_else(|| GpuError::Shape {
            op: "arena",
            detail: "arena was released".into(),
        })?;
        let (_, offset, len) =
            self.regions
                .iter()
                .find(|(n, _, _)| n == name)
                .ok_or_else(|| GpuError::Shape {
                    op: "arena",
                    detail: format!("no region {name:?}"),
                })?;
        base.slice(*offset, *len)
    }

    pub fn bytes(&self) -> usize {
        self.base.map_or(0, |b| b.bytes())
    }

    pub fn is_allocated(&self) -> bool {
        self.base.is_some()
    }
}

impl<'g> ModelResource<dyn GpuBackend + 'g> for BufferArena {
    fn label(&self) -> &str {
        "buffer arena"
    }

    fn release(&mut self, gpu: &(dyn GpuBackend + 'g)) -> anyhow::Result<()> {
        self.regions.clear();
        match self.base.take() {
            Some(b) => Ok(gpu.free(b.ptr())?),
            None => Ok(()),
        }
    }
}
