//! The SSM state pool: one slot per running sequence, holding every recurrent
//! layer's conv state and SSM state. A sequence holds a [`SlotGuard`] (with
//! the pool's `Arc`) that returns the slot when dropped.

use std::sync::Arc;

use metrale_core::scope::ModelResource;
use metrale_core::{DType, SlotId};
use metrale_gpu_runtime::gpu::{DeviceSlice, GpuBackend};
use metrale_gpu_runtime::ops::{StateLayout, StateSlots};
use parking_lot::Mutex;

use crate::error::{EngineError, Result};

/// State sizes of one recurrent layer, in elements per slot (of the
/// backend's `state_layout` dtype).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StateShape {
    /// The causal conv's rolling window: `[conv_channels, kernel - 1]`.
    pub conv: usize,
    /// The recurrent state: `[heads, ..]`.
    pub ssm: usize,
}

impl StateShape {
    /// Bytes of one sequence's slot of this layer, conv window and SSM
    /// state, in `gpu`'s layouts but the SSM state in `ssm_dtype` where
    /// given (as the pool allocates them: never empty).
    pub fn slot_bytes(&self, gpu: &dyn GpuBackend, ssm_dtype: Option<DType>) -> usize {
        let conv = gpu.state_layout(self.conv.max(1)).slot_bytes();
        let ssm = StateLayout {
            dtype: self.ssm_dtype(gpu, ssm_dtype),
            elements: self.ssm.max(1),
        };
        conv.saturating_add(ssm.slot_bytes())
    }

    /// The SSM state's element type: `over` where given (the model's
    /// `ModelOptions::ssm_state_dtype`), else `gpu`'s `ssm_state_layout`.
    pub fn ssm_dtype(&self, gpu: &dyn GpuBackend, over: Option<DType>) -> DType {
        over.unwrap_or_else(|| gpu.ssm_state_layout(self.ssm.max(1)).dtype)
    }
}

struct LayerState {
    shape: StateShape,
    conv: DeviceSlice,
    ssm: DeviceSlice,
}

/// Recurrent state for up to `n_slots` concurrent sequences.
pub struct SsmStatePool {
    n_slots: usize,
    layers: Vec<LayerState>,
    free: Mutex<Vec<SlotId>>,
}

impl SsmStatePool {
    /// A pool with no layers (a model without recurrent layers).
    pub fn empty() -> Self {
        Self {
            n_slots: 0,
            layers: Vec::new(),
            free: Mutex::new(Vec::new()),
        }
    }

    /// Allocates `n_slots` slots for the given recurrent layers, their SSM
    /// states in `ssm_dtype` where given (else the backend's layout). On
    /// failure nothing stays allocated.
    #[track_caller]
    pub fn allocate(
        gpu: &dyn GpuBackend,
        shapes: &[StateShape],
        n_slots: usize,
        ssm_dtype: Option<DType>,
    ) -> Result<Self> {
        let mut pool = Self {
            n_slots,
            layers: Vec::with_capacity(shapes.len()),
            free: Mutex::new((0..n_slots as u32).rev().map(SlotId).collect()),
        };
        if shapes.is_empty() {
            pool.n_slots = 0;
            pool.free.lock().clear();
            return Ok(pool);
        }
        for (i, &shape) in shapes.iter().enumerate() {
            // The backend's layout of each state (f32 on the CPU).
            let (conv_dtype, ssm_dtype) = (
                gpu.state_layout(shape.conv).dtype,
                shape.ssm_dtype(gpu, ssm_dtype),
            );
            let pair = gpu
                .alloc_slice(conv_dtype, shape.conv.max(1) * n_slots, "ssm state pool")
                .and_then(|conv| {
                    gpu.alloc_slice(ssm_dtype, shape.ssm.max(1) * n_slots, "ssm state pool")
                        .map(|ssm| (conv, ssm))
                        .inspect_err(|_| {
                            let _ = gpu.free(conv.ptr());
                        })
                });
            match pair {
                Ok((conv, ssm)) => pool.layers.push(LayerState { shape, conv, ssm }),
                Err(source) => {
                    let _ = pool.release(gpu);
                    return Err(EngineError::Device {
                        context: format!("allocating SSM state for recurrent layer {i}"),
                        source,
                    });
                }
            }
        }
        Ok(pool)
    }

    /// Takes a free slot and zeroes its state. Exhaustion is an error the
    /// scheduler can wait on (`EngineError::Exhausted`), not a panic.
    pub fn acquire(self: &Arc<Self>, gpu: &dyn GpuBackend) -> Result<SlotGuard> {
        let slot = self
            .free
            .lock()
            .pop()
            .ok_or_else(|| EngineError::Exhausted {
                resource: "SSM state slots",
                detail: format!("all {} slots are in use", self.n_slots),
            })?;
        let guard = SlotGuard {
            pool: Arc::clone(self),
            slot,
        };
        for layer in 0..self.layers.len() {
            let (conv, ssm) = (self.conv_state(layer, slot)?, self.ssm_state(layer, slot)?);
            gpu.zero(conv)
                .and_then(|_| gpu.zero(ssm))
                .map_err(EngineError::device(format!("clearing {slot}")))?;
        }
        Ok(guard)
    }

    /// Slots in use.
    pub fn in_use(&self) -> usize {
        self.n_slots - self.free.lock().len()
    }

    pub fn capacity(&self) -> usize {
        self.n_slots
    }

    /// Recurrent layers the pool holds state for.
    pub fn layers(&self) -> usize {
        self.layers.len()
    }

    pub fn shape(&self, layer: usize) -> Option<StateShape> {
        self.layers.get(layer).map(|l| l.shape)
    }

    fn layer(&self, layer: usize, slot: SlotId) -> Result<&LayerState> {
        if slot.index() >= self.n_slots {
            return Err(EngineError::Internal(format!(
                "{slot} is outside the pool of {}",
                self.n_slots
            )));
        }
        self.layers.get(layer).ok_or_else(|| {
            EngineError::Internal(format!("no SSM state for recurrent layer {layer}"))
        })
    }

    /// The conv state of recurrent layer `layer` (counting recurrent layers only) in `slot`.
    pub fn conv_state(&self, layer: usize, slot: SlotId) -> Result<DeviceSlice> {
        let l = self.layer(layer, slot)?;
        l.conv
            .slice(slot.index() * l.shape.conv, l.shape.conv)
            .map_err(EngineError::device("conv state"))
    }

    /// The SSM state of recurrent layer `layer` in `slot`.
    pub fn ssm_state(&self, layer: usize, slot: SlotId) -> Result<DeviceSlice> {
        let l = self.layer(layer, slot)?;
        l.ssm
            .slice(slot.index() * l.shape.ssm, l.shape.ssm)
            .map_err(EngineError::device("ssm state"))
    }

    /// Recurrent layer `layer`'s conv state of every slot (`[slots, conv]`).
    pub fn conv_slots(&self, layer: usize) -> Result<StateSlots> {
        let l = self.layer_at(layer)?;
        Ok(StateSlots {
            states: l.conv,
            per_slot: l.shape.conv,
        })
    }

    /// Recurrent layer `layer`'s SSM state of every slot (`[slots, ssm]`).
    pub fn ssm_slots(&self, layer: usize) -> Result<StateSlots> {
        let l = self.layer_at(layer)?;
        Ok(StateSlots {
            states: l.ssm,
            per_slot: l.shape.ssm,
        })
    }

    fn layer_at(&self, layer: usize) -> Result<&LayerState> {
        self.layers.get(layer).ok_or_else(|| {
            EngineError::Internal(format!("no SSM state for recurrent layer {layer}"))
        })
    }

    fn give_back(&self, slot: SlotId) {
        self.free.lock().push(slot);
    }
}

impl<'g> ModelResource<dyn GpuBackend + 'g> for SsmStatePool {
    fn label(&self) -> &str {
        "ssm state pool"
    }

    fn release(&mut self, gpu: &(dyn GpuBackend + 'g)) -> anyhow::Result<()> {
        let freed = gpu.free_all(
            self.layers
                .drain(..)
                .flat_map(|l| [l.conv.ptr(), l.ssm.ptr()]),
        );
        self.free.lock().clear();
        self.n_slots = 0;
        Ok(freed?)
    }
}

/// A sequence's hold on one slot; returns it to the pool when dropped.
pub struct SlotGuard {
    pool: Arc<SsmStatePool>,
    slot: SlotId,
}

impl SlotGuard {
    pub fn slot(&self) -> SlotId {
        self.slot
    }

    pub fn pool(&self) -> &SsmStatePool {
        &self.pool
    }
}

impl std::fmt::Debug for SlotGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SlotGuard({})", self.slot)
    }
}

impl Drop for SlotGuard {
    fn drop(&mut self) {
        self.pool.give_back(self.slot);
    }
}
