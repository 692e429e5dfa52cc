//! A device memory bandwidth probe, for `metrale bench`'s roofline.

use cudarc::driver::{result, sys};

use super::CudaBackend;
use crate::error::{GpuError, Result};
use crate::gpu::GpuBackend;

/// The largest copy the probe makes (1 GiB each way).
const PROBE_BYTES: usize = 1 << 30;
/// Timed copies; the median is reported.
const RUNS: usize = 5;

/// A timing event, destroyed when dropped.
struct TimingEvent(sys::CUevent);

impl TimingEvent {
    fn new(backend: &CudaBackend) -> Result<Self> {
        result::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT)
            .map(Self)
            .map_err(|e| backend.device_error("bandwidth_probe", e))
    }
}

impl Drop for TimingEvent {
    fn drop(&mut self) {
        // SAFETY: created once by `new`, destroyed once; no work queued
        // after the probe references it.
        unsafe {
            let _ = result::event::destroy(self.0);
        }
    }
}

impl CudaBackend {
    /// Device memory bandwidth in bytes per second: the median of a few
    /// timed device-to-device copies of up to 1 GiB (less when free memory
    /// is short), counting the bytes read and the bytes written. The two
    /// buffers are on the ledger (owner "bandwidth probe") while it runs
    /// and freed before it returns.
    pub fn bandwidth_probe(&self) -> Result<f64> {
        // What may be allocated: the device's free memory, within the
        // backend's memory limit.
        let free = self.available_memory().unwrap_or(0);
        let mut bytes = PROBE_BYTES;
        // Two buffers, leaving a quarter of the free memory alone.
        while bytes > (16 << 20) && 2 * bytes > free / 4 * 3 {
            bytes /= 2;
        }
        if 2 * bytes > free {
            return Err(GpuError::OutOfMemory {
                bytes: 2 * bytes,
                owner: "bandwidth probe".into(),
                live: self.live_bytes(),
            });
        }
        let gpu: &dyn GpuBackend = self;
        let src = gpu.alloc(bytes, "bandwidth probe")?;
        let dst = match gpu.alloc(bytes, "bandwidth probe") {
            Ok(dst) => dst,
            Err(e) => {
                let _ = gpu.free(src);
                return Err(e);
            }
        };
        let timed = self.time_copies(src.raw(), dst.raw(), bytes);
        let freed = gpu.free(src).and(gpu.free(dst));
        let mut seconds = timed?;
        freed?;
        self.stream_sync("bandwidth_probe")?;
        seconds.sort_by(f64::total_cmp);
        let median = seconds[seconds.len() / 2];
        if median <= 0.0 {
            return Err(GpuError::Unavailable(
                "bandwidth probe: the copies took no measurable time".into(),
            ));
        }
        Ok(2.0 * bytes as f64 / median)
    }

    /// Seconds of each of `RUNS` copies of `bytes` from `src` to `dst`,
    /// after one untimed copy.
    fn time_copies(&self, src: u64, dst: u64, bytes: usize) -> Result<Vec<f64>> {
        self.ctx.bind()?;
        let stream = self.ctx.stream;
        let err = |e| self.device_error("bandwidth_probe", e);
        let start = TimingEvent::new(self)?;
        let stop = TimingEvent::new(self)?;
        let mut seconds = Vec::with_capacity(RUNS);
        // SAFETY: both ranges are live allocations of `bytes` (just made);
        // the events are live and recorded on the backend's stream.
        unsafe {
            result::memcpy_dtod_async(dst, src, bytes, stream).map_err(err)?;
            for _ in 0..RUNS {
                result::event::record(start.0, stream).map_err(err)?;
                result::memcpy_dtod_async(dst, src, bytes, stream).map_err(err)?;
                result::event::record(stop.0, stream).map_err(err)?;
                result::event::synchronize(stop.0).map_err(err)?;
                let ms = result::event::elapsed(start.0, stop.0).map_err(err)?;
                seconds.push(f64::from(ms) / 1e3);
            }
        }
        Ok(seconds)
    }
}
