//! Tests of the backend's core (opening, scratch, casts, GEMM, bandwidth
//! probe). Without a GPU (CI) the device tests print why and pass; opening
//! must then fail with [`GpuError::Unavailable`] saying why, never panic.

use half::{bf16, f16};
use metrale_core::DType;

use super::CudaBackend;
use super::kernels;
use super::launch::{LaunchCfg, Ptr};
use super::workspace::Scratch;
use crate::error::GpuError;
use crate::gpu::{DeviceSlice, GpuBackend};
use crate::ops::MatmulDims;

/// Device 0, or None (with the reason printed) where there is none.
fn device() -> Option<CudaBackend> {
    match CudaBackend::try_new(0) {
        Ok(b) => Some(b),
        Err(GpuError::Unavailable(why)) => {
            eprintln!("no CUDA device, skipping: {why}");
            None
        }
        Err(e) => panic!("try_new(0) failed with something other than Unavailable: {e}"),
    }
}

#[test]
fn opening_without_a_device_says_why() {
    match CudaBackend::try_new(0) {
        Ok(b) => {
            // A GPU machine: it describes itself.
            assert!(!b.device_name().is_empty());
            assert!(
                b.compute_capability().0 >= 7,
                "{:?}",
                b.compute_capability()
            );
            let (free, total) = b.memory_info().unwrap();
            assert!(free > 0 && free <= total);
            assert_eq!(b.scratch_bytes(), 0);
        }
        Err(GpuError::Unavailable(why)) => {
            assert!(
                why.contains("driver") || why.contains("device"),
                "the reason names neither the driver nor the device: {why}"
            );
        }
        Err(e) => panic!("expected Unavailable, got {e}"),
    }
    // No such device, whether or not there is a driver.
    match CudaBackend::try_new(10_000) {
        Err(GpuError::Unavailable(why)) => {
            assert!(
                why.contains("driver") || why.contains("no CUDA device 10000"),
                "{why}"
            );
        }
        Err(e) => panic!("expected Unavailable, got {e}"),
        Ok(_) => panic!("device 10000 opened"),
    }
}

fn upload(gpu: &dyn GpuBackend, dtype: DType, bytes: &[u8]) -> DeviceSlice {
    let s = gpu
        .alloc_slice(dtype, bytes.len() / dtype.size_of(), "test")
        .unwrap();
    gpu.copy_h2d(bytes, s.ptr(), 0).unwrap();
    s
}

fn download(gpu: &dyn GpuBackend, s: DeviceSlice) -> Vec<u8> {
    let mut out = vec![0u8; s.bytes()];
    gpu.copy_d2h(s.ptr(), 0, &mut out).unwrap();
    out
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

fn u16s(b: &[u8]) -> Vec<u16> {
    b.chunks_exact(2)
        .map(|c| u16::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

#[test]
fn casts_round_to_nearest_even_and_keep_nans() {
    let Some(b) = device() else { return };
    let gpu: &dyn GpuBackend = &b;
    let mut values = vec![
        0.0f32,
        -0.0,
        1.0,
        -1.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        -f32::NAN,
        f32::from_bits(0x7f80_0001), // signalling NaN, payload only in the low bits
        f32::MAX,
        f32::MIN,
        f32::MIN_POSITIVE,
        1e-40, // subnormal
        65504.0,
        65520.0, // rounds to f16 infinity
        6e-8,    // f16 subnormal
        1.0 + f32::EPSILON,
        f32::from_bits(0x3f80_8000), // bf16 tie, even below
        f32::from_bits(0x3f81_8000), // bf16 tie, even above
        f32::from_bits(0x3f80_8001),
        f32::from_bits(0x3f80_7fff),
        f32::from_bits(0x7f7f_8000), // tie at the top: to infinity
    ];
    let mut seed = 0x2545_f491_4f6c_dd1du64;
    for _ in 0..10_000 {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        values.push(f32::from_bits(seed as u32));
    }
    let n = values.len();
    let x = upload(gpu, DType::F32, &f32_bytes(&values));
    for (kernel, dtype) in [
        (&kernels::CAST_F32_BF16, DType::BF16),
        (&kernels::CAST_F32_F16, DType::F16),
    ] {
        let y = gpu.alloc_slice(dtype, n, "test").unwrap();
        b.launch(
            kernel,
            LaunchCfg::linear(3, 128), // fewer threads than elements: the stride loop
            (Ptr::of(x), Ptr::of(y), n as i64),
        )
        .unwrap();
        let got = u16s(&download(gpu, y));
        for (i, (&v, &g)) in values.iter().zip(&got).enumerate() {
            let (want, is_nan) = match dtype {
                DType::BF16 => (bf16::from_f32(v).to_bits(), bf16::from_bits(g).is_nan()),
                _ => (f16::from_f32(v).to_bits(), f16::from_bits(g).is_nan()),
            };
            if v.is_nan() {
                assert!(
                    is_nan,
                    "{dtype:?} #{i}: NaN {:#x} became {g:#06x}",
                    v.to_bits()
                );
                if dtype == DType::BF16 {
                    assert_eq!(g >> 15, (v.to_bits() >> 31) as u16, "NaN sign");
                }
            } else {
                assert_eq!(g, want, "{dtype:?} #{i}: {v:e} ({:#x})", v.to_bits());
            }
        }
        gpu.free(y.ptr()).unwrap();
    }
    gpu.free(x.ptr()).unwrap();
    assert_eq!(gpu.live_bytes(), 0);
}

/// `out = x·wᵀ` in f64 from the values the device multiplies (x rounded
/// to the weights' type), and the sum of |products| per output, which
/// bounds the rounding error of an f32 accumulation.
fn reference(x: &[f32], w: &[f32], dims: MatmulDims, dtype: DType) -> (Vec<f64>, Vec<f64>) {
    let MatmulDims { m, n, k } = dims;
    let round = |v: f32| match dtype {
        DType::BF16 => bf16::from_f32(v).to_f32(),
        DType::F16 => f16::from_f32(v).to_f32(),
        _ => v,
    };
    let mut out = vec![0.0; m * n];
    let mut mag = vec![0.0; m * n];
    for i in 0..m {
        for j in 0..n {
            for l in 0..k {
                let p = round(x[i * k + l]) as f64 * w[j * k + l] as f64;
                out[i * n + j] += p;
                mag[i * n + j] += p.abs();
            }
        }
    }
    (out, mag)
}

fn weights_bytes(w: &[f32], dtype: DType) -> (Vec<f32>, Vec<u8>) {
    match dtype {
        DType::BF16 => {
            let h: Vec<bf16> = w.iter().map(|&v| bf16::from_f32(v)).collect();
            (
                h.iter().map(|v| v.to_f32()).collect(),
                h.iter().flat_map(|v| v.to_bits().to_le_bytes()).collect(),
            )
        }
        DType::F16 => {
            let h: Vec<f16> = w.iter().map(|&v| f16::from_f32(v)).collect();
            (
                h.iter().map(|v| v.to_f32()).collect(),
                h.iter().flat_map(|v| v.to_bits().to_le_bytes()).collect(),
            )
        }
        _ => (w.to_vec(), f32_bytes(w)),
    }
}

fn pseudo_random(len: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

#[test]
fn gemm_matches_the_reference_for_every_weight_type() {
    let Some(b) = device() else { return };
    let gpu: &dyn GpuBackend = &b;
    let shapes = [
        (1, 1, 1),
        (1, 8, 16),
        (3, 5, 7), // odd leading dimensions
        (2, 64, 128),
        (17, 33, 64),
        (64, 256, 512),
        (5, 1000, 1024),
        (300, 96, 2048),
    ];
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        for (si, &(m, n, k)) in shapes.iter().enumerate() {
            // `w` one row into its allocation (as a sub-slice of a fused
            // weight would be), so A is not 256-byte aligned.
            for offset_rows in [0, 1] {
                let dims = MatmulDims { m, n, k };
                let x = pseudo_random(m * k, si as u64 + 1);
                let w_full = pseudo_random((n + offset_rows) * k, si as u64 + 100);
                let (w_vals, w_bytes) = weights_bytes(&w_full, dtype);
                let xs = upload(gpu, DType::F32, &f32_bytes(&x));
                let ws_all = upload(gpu, dtype, &w_bytes);
                let ws = ws_all.slice(offset_rows * k, n * k).unwrap();
                let out = gpu.alloc_slice(DType::F32, m * n, "test").unwrap();
                b.gemm(xs, ws, out, dims)
                    .unwrap_or_else(|e| panic!("{dtype:?} m={m} n={n} k={k} +{offset_rows}: {e}"));
                let got = f32s(&download(gpu, out));
                let (want, mag) = reference(&x, &w_vals[offset_rows * k..], dims, dtype);
                // f32 accumulation: each of k additions rounds by at most
                // 2^-24 relative; k·2^-24·Σ|p| bounds the error (plus slack).
                let tol = |i: usize| 2.0 * (k as f64 + 2.0) * 2f64.powi(-24) * mag[i] + 1e-30;
                for i in 0..m * n {
                    let err = (got[i] as f64 - want[i]).abs();
                    assert!(
                        err <= tol(i),
                        "{dtype:?} m={m} n={n} k={k} +{offset_rows}: out[{i}] = {} want {} (err {err:e} > {:e})",
                        got[i],
                        want[i],
                        tol(i)
                    );
                }
                for s in [xs, ws_all, out] {
                    gpu.free(s.ptr()).unwrap();
                }
            }
        }
    }
    assert!(b.scratch_bytes() >= super::gemm::WORKSPACE_BYTES);
    assert_eq!(gpu.live_bytes(), 0, "scratch is outside the ledger");
}

#[test]
fn gemm_edge_cases() {
    let Some(b) = device() else { return };
    let gpu: &dyn GpuBackend = &b;
    // k = 0: zeros.
    let x = gpu.alloc_slice(DType::F32, 1, "test").unwrap();
    let w = gpu.alloc_slice(DType::BF16, 1, "test").unwrap();
    let out = upload(gpu, DType::F32, &f32_bytes(&[7.0; 6]));
    b.gemm(x, w, out, MatmulDims { m: 2, n: 3, k: 0 }).unwrap();
    assert_eq!(f32s(&download(gpu, out)), vec![0.0; 6]);
    // m = 0: nothing.
    b.gemm(x, w, out, MatmulDims { m: 0, n: 3, k: 1 }).unwrap();
    // Too short an operand, a wrong type: refused.
    assert!(matches!(
        b.gemm(x, w, out, MatmulDims { m: 2, n: 3, k: 1 }),
        Err(GpuError::Shape { .. })
    ));
    assert!(matches!(
        b.gemm(w, w, out, MatmulDims { m: 1, n: 1, k: 1 }),
        Err(GpuError::UnsupportedDType { .. })
    ));
    for s in [x, w, out] {
        gpu.free(s.ptr()).unwrap();
    }
    assert_eq!(gpu.live_bytes(), 0);
}

#[test]
fn scratch_grows_and_stays_off_the_ledger() {
    let Some(b) = device() else { return };
    let p1 = b.scratch(Scratch::AttnPartials, 100).unwrap();
    assert_eq!(b.scratch_bytes(), 1 << 20);
    // Within the buffer: the same one.
    assert_eq!(b.scratch(Scratch::AttnPartials, 1 << 20).unwrap(), p1);
    b.scratch(Scratch::AttnPartials, (3 << 20) + 1).unwrap();
    assert_eq!(b.scratch_bytes(), 4 << 20);
    b.scratch(Scratch::GemmInput, 1).unwrap();
    assert_eq!(b.scratch_bytes(), 5 << 20);
    assert_eq!(b.live_bytes(), 0);
    b.synchronize().unwrap();
}

#[test]
fn bandwidth_probe_measures_and_frees() {
    let Some(b) = device() else { return };
    let bw = b.bandwidth_probe().unwrap();
    eprintln!("{}: {:.1} GB/s", b.device_name(), bw / 1e9);
    // Any GPU this runs on moves more than 50 GB/s and less than 100 TB/s.
    assert!(bw > 5e10 && bw < 1e14, "{bw}");
    assert_eq!(b.live_bytes(), 0);
}
