//! What the cases are made of: ledgered memory that frees itself, random
//! data, the steps' token layouts, and the comparisons that keep the
//! statistics of the report.

use metrale_core::{BlockId, DType};

use super::ArchShapes;
use crate::error::{GpuError, Result};
use crate::gpu::{DevicePtr, DeviceSlice, GpuBackend};
use crate::ops::Op;
use crate::ops::step::{AttnBatch, RecurrentBatch, Staged};

/// The weight dtypes an op that takes weights is run with.
pub(super) const WEIGHT_DTYPES: [DType; 3] = [DType::F32, DType::BF16, DType::F16];

/// Deterministic uniform numbers (xorshift64*).
pub(crate) struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    pub fn uniform(&mut self, lo: f32, hi: f32) -> f32 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        let u = (self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 40) as f32 / (1u64 << 24) as f32;
        lo + (hi - lo) * u
    }

    pub fn vec(&mut self, n: usize, lo: f32, hi: f32) -> Vec<f32> {
        (0..n).map(|_| self.uniform(lo, hi)).collect()
    }

    /// A number in `0..n`.
    pub fn below(&mut self, n: usize) -> usize {
        (self.uniform(0.0, n as f32) as usize).min(n.saturating_sub(1))
    }
}

/// `v` rounded to `dtype` (f32, bf16 or f16) and back, and its bytes.
pub(crate) fn round_to(v: &[f32], dtype: DType) -> (Vec<f32>, Vec<u8>) {
    match dtype {
        DType::BF16 => {
            let h: Vec<half::bf16> = v.iter().map(|&x| half::bf16::from_f32(x)).collect();
            (
                h.iter().map(|b| b.to_f32()).collect(),
                h.iter().flat_map(|b| b.to_le_bytes()).collect(),
            )
        }
        DType::F16 => {
            let h: Vec<half::f16> = v.iter().map(|&x| half::f16::from_f32(x)).collect();
            (
                h.iter().map(|b| b.to_f32()).collect(),
                h.iter().flat_map(|b| b.to_le_bytes()).collect(),
            )
        }
        DType::Quant(q) => {
            // Quantized and back: what the blocks hold. `v` is whole blocks
            // (the cases choose their shapes so); anything else is NaN,
            // which no tolerance accepts.
            let ty = q.ggml();
            let mut bytes = vec![0u8; DType::Quant(q).bytes_for(v.len()).unwrap_or(0)];
            let mut back = vec![f32::NAN; v.len()];
            if metrale_core::quant::quantize_row(ty, v, &mut bytes).is_err()
                || metrale_core::quant::dequantize_row(ty, &bytes, &mut back).is_err()
            {
                back.fill(f32::NAN);
            }
            (back, bytes)
        }
        _ => (v.to_vec(), v.iter().flat_map(|x| x.to_le_bytes()).collect()),
    }
}

/// Every GGML block format metrale can write (so the suite can make
/// weights of it): a backend multiplies those it says it does
/// ([`GpuBackend::supports_weights`]) and must refuse the others.
pub(super) fn quant_dtypes() -> Vec<DType> {
    metrale_core::GgmlType::ALL
        .iter()
        .filter(|t| metrale_core::quant::can_quantize(t.ty))
        .filter_map(|t| metrale_core::QuantFormat::new(t.ty))
        .map(DType::Quant)
        .collect()
}

/// Device memory of one case: everything allocated through it is freed when
/// it drops, whatever the case returned.
pub(crate) struct Mem<'a> {
    pub gpu: &'a dyn GpuBackend,
    ptrs: Vec<DevicePtr>,
    staged: Option<Staged>,
}

impl<'a> Mem<'a> {
    pub fn new(gpu: &'a dyn GpuBackend) -> Self {
        Self {
            gpu,
            ptrs: Vec::new(),
            staged: Some(Staged::new()),
        }
    }

    fn staged(&mut self) -> &mut Staged {
        self.staged.get_or_insert_with(Staged::new)
    }

    /// `len` zeroed elements of `dtype`.
    pub fn alloc(&mut self, dtype: DType, len: usize) -> Result<DeviceSlice> {
        let s = self
            .gpu
            .alloc_slice(dtype, len.max(1), "conformance")?
            .slice(0, len)?;
        self.ptrs.push(s.ptr());
        Ok(s)
    }

    /// Raw bytes as a slice of `len` elements of `dtype`.
    pub fn bytes(&mut self, dtype: DType, len: usize, bytes: &[u8]) -> Result<DeviceSlice> {
        let s = self.alloc(dtype, len)?;
        self.gpu.copy_h2d(bytes, s.ptr(), 0)?;
        Ok(s)
    }

    pub fn f32s(&mut self, v: &[f32]) -> Result<DeviceSlice> {
        self.staged_f32(v)
    }

    fn staged_f32(&mut self, v: &[f32]) -> Result<DeviceSlice> {
        let gpu = self.gpu;
        self.staged().f32s(gpu, v)
    }

    /// `n` copies of `value`, f32.
    pub fn fill(&mut self, n: usize, value: f32) -> Result<DeviceSlice> {
        self.f32s(&vec![value; n])
    }

    /// `v` stored as `dtype`; returns the slice and the stored values.
    pub fn weights(&mut self, v: &[f32], dtype: DType) -> Result<(DeviceSlice, Vec<f32>)> {
        let (rounded, bytes) = round_to(v, dtype);
        Ok((self.bytes(dtype, v.len(), &bytes)?, rounded))
    }

    pub fn u32s(&mut self, v: &[u32]) -> Result<DeviceSlice> {
        let gpu = self.gpu;
        self.staged().u32s(gpu, v)
    }

    pub fn u64s(&mut self, v: &[u64]) -> Result<DeviceSlice> {
        let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        self.bytes(DType::U64, v.len(), &bytes)
    }

    /// An attention batch of `(q_start, q_len, kv_len, block table)`.
    pub fn attn(&mut self, seqs: &[(usize, usize, usize, &[BlockId])]) -> Result<AttnBatch> {
        let gpu = self.gpu;
        self.staged().attn(gpu, seqs)
    }

    /// A recurrent batch of `(row_start, len, slot)`.
    pub fn recurrent(&mut self, seqs: &[(usize, usize, usize)]) -> Result<RecurrentBatch> {
        let gpu = self.gpu;
        self.staged().recurrent(gpu, seqs)
    }

    pub fn down(&self, s: DeviceSlice) -> Result<Vec<f32>> {
        self.gpu.download_f32(s)
    }

    pub fn down_bytes(&self, s: DeviceSlice) -> Result<Vec<u8>> {
        let mut b = vec![0u8; s.bytes()];
        self.gpu.copy_d2h(s.ptr(), 0, &mut b)?;
        Ok(b)
    }

    pub fn down_u32(&self, s: DeviceSlice) -> Result<Vec<u32>> {
        if s.dtype() != DType::U32 {
            return Err(GpuError::UnsupportedDType {
                op: "download_u32",
                dtype: s.dtype(),
            });
        }
        let b = self.down_bytes(s)?;
        Ok(b.chunks(4)
            .map(|w| u32::from_le_bytes([w[0], w[1], w[2], w[3]]))
            .collect())
    }
}

impl Drop for Mem<'_> {
    fn drop(&mut self) {
        // Errors show as bytes left on the ledger, which `run` reports.
        let _ = self.gpu.free_all(self.ptrs.drain(..));
        if let Some(s) = self.staged.take() {
            let _ = s.free(self.gpu);
        }
    }
}

/// Why a case did not pass.
#[derive(Debug)]
pub(super) enum Fail {
    /// The op under test returned an error.
    Op(GpuError),
    /// Setting the case up failed: an allocation, a copy, or a helper op
    /// (another op the case needs, named).
    Setup(String),
    /// Results outside the tolerance, or unequal where they must be equal.
    Mismatch(String),
}

impl From<GpuError> for Fail {
    fn from(e: GpuError) -> Self {
        Fail::Setup(e.to_string())
    }
}

pub(super) type Outcome = std::result::Result<(), Fail>;

/// The error statistics of one op over its cases.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Stats {
    pub cases: usize,
    pub max_abs: f64,
    pub max_rel: f64,
    pub tolerance: f64,
}

/// What the cases of one op work with.
pub(super) struct Cx<'a> {
    pub gpu: &'a dyn GpuBackend,
    pub shapes: &'a ArchShapes,
    pub rng: Rng,
    pub stats: Stats,
}

impl<'a> Cx<'a> {
    pub fn new(gpu: &'a dyn GpuBackend, shapes: &'a ArchShapes, seed: u64) -> Self {
        Self {
            gpu,
            shapes,
            rng: Rng::new(seed),
            stats: Stats::default(),
        }
    }

    pub fn mem(&self) -> Mem<'a> {
        Mem::new(self.gpu)
    }

    /// The result of the op under test; one more case run.
    pub fn tested<T>(&mut self, r: Result<T>) -> std::result::Result<T, Fail> {
        self.stats.cases += 1;
        r.map_err(Fail::Op)
    }

    /// `x` as the backend's matmuls see it next to weights of `weights`:
    /// rounded to [`GpuBackend::matmul_input_rounding`]'s type, if any.
    pub fn matmul_input(&self, x: &[f32], weights: DType) -> Vec<f32> {
        match self.gpu.matmul_input_rounding(weights) {
            Some(dtype) => round_to(x, dtype).0,
            None => x.to_vec(),
        }
    }

    /// Whether helper `op` can be used (a case skips a cross-check whose
    /// helper is unsupported).
    pub fn has(&self, op: Op) -> bool {
        self.gpu.supports(op)
    }

    /// The result of a helper op the case cannot do without.
    pub fn helper(&self, op: Op, r: Result<()>) -> Outcome {
        if !self.gpu.supports(op) {
            return Err(Fail::Setup(format!(
                "needs {op}, which the backend does not support"
            )));
        }
        r.map_err(|e| Fail::Setup(format!("helper {op}: {e}")))
    }

    /// `|got - want| <= tol * (1 + |want|)` elementwise; records the largest
    /// absolute error and the largest error relative to `1 + |want|`.
    pub fn close(&mut self, got: &[f32], want: &[f64], tol: f64, what: &str) -> Outcome {
        self.stats.tolerance = self.stats.tolerance.max(tol);
        if got.len() != want.len() {
            return Err(Fail::Mismatch(format!(
                "{what}: {} values, want {}",
                got.len(),
                want.len()
            )));
        }
        let mut first_bad = None;
        for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
            let err = (g as f64 - w).abs();
            let rel = err / (1.0 + w.abs());
            let bad = rel.is_nan() || rel > tol;
            if err.is_finite() {
                self.stats.max_abs = self.stats.max_abs.max(err);
                self.stats.max_rel = self.stats.max_rel.max(rel);
            } else {
                self.stats.max_abs = f64::INFINITY;
                self.stats.max_rel = f64::INFINITY;
            }
            if bad && first_bad.is_none() {
                first_bad = Some((i, g, w));
            }
        }
        match first_bad {
            None => Ok(()),
            Some((i, g, w)) => Err(Fail::Mismatch(format!(
                "{what}[{i}]: got {g}, want {w} (tolerance {tol:e} x (1 + |want|))"
            ))),
        }
    }

    /// Equal values (to the bit, for floats).
    pub fn equal<T: PartialEq + std::fmt::Debug + Bits>(
        &mut self,
        got: &[T],
        want: &[T],
        what: &str,
    ) -> Outcome {
        if got.len() != want.len() {
            return Err(Fail::Mismatch(format!(
                "{what}: {} values, want {}",
                got.len(),
                want.len()
            )));
        }
        match got.iter().zip(want).position(|(g, w)| g.bits() != w.bits()) {
            None => Ok(()),
            Some(i) => Err(Fail::Mismatch(format!(
                "{what}[{i}]: got {:?}, want {:?} (must be equal)",
                got[i], want[i]
            ))),
        }
    }
}

/// A value's bits, for equality checks that do not forgive -0.0 or NaN.
pub(super) trait Bits {
    fn bits(&self) -> u64;
}

impl Bits for f32 {
    fn bits(&self) -> u64 {
        self.to_bits() as u64
    }
}

impl Bits for u32 {
    fn bits(&self) -> u64 {
        *self as u64
    }
}

impl Bits for u8 {
    fn bits(&self) -> u64 {
        *self as u64
    }
}

/// The token layout of one step: each sequence's cached tokens before the
/// step and its new tokens, where its rows are and which state slot it has.
pub(super) struct Step {
    pub name: &'static str,
    /// `(cached, new)` per sequence.
    pub seqs: Vec<(usize, usize)>,
    /// Each sequence's first row.
    pub row_starts: Vec<usize>,
    /// Rows of the step's operands (unused rows between sequences included).
    pub rows: usize,
}

impl Step {
    /// Sequences in rows of their own order, each `gap` rows after the last.
    fn new(name: &'static str, seqs: Vec<(usize, usize)>, reversed: bool, gap: usize) -> Self {
        let mut row_starts = vec![0; seqs.len()];
        let mut at = 0;
        let order: Vec<usize> = if reversed {
            (0..seqs.len()).rev().collect()
        } else {
            (0..seqs.len()).collect()
        };
        for i in order {
            row_starts[i] = at;
            at += seqs[i].1 + gap;
        }
        Self {
            name,
            rows: at - gap.min(at),
            seqs,
            row_starts,
        }
    }

    /// New tokens in all.
    pub fn tokens(&self) -> usize {
        self.seqs.iter().map(|s| s.1).sum()
    }
}

/// The token counts every batched op runs at: one decode token; a mixed
/// step (a prefill, a decode step, a chunk after cached tokens, a one-token
/// prompt and an idle sequence, laid out in reverse order with an unused
/// row after each); and one long prefill that crosses chunks and blocks.
pub(super) fn steps(shapes: &ArchShapes) -> Vec<Step> {
    vec![
        Step::new("decode", vec![(5, 1)], false, 0),
        Step::new(
            "mixed",
            vec![(0, 7), (6, 1), (5, 3), (0, 1), (3, 0)],
            true,
            1,
        ),
        Step::new("long", vec![(0, shapes.long_len())], false, 0),
    ]
}

/// Row counts of the ops without sequences: as many as the steps' tokens.
pub(super) fn row_counts(shapes: &ArchShapes) -> Vec<usize> {
    steps(shapes).iter().map(Step::tokens).collect()
}

pub(super) fn silu64(x: f64) -> f64 {
    x / (1.0 + (-x).exp())
}

pub(super) fn sigmoid64(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

pub(super) fn softplus64(x: f64) -> f64 {
    if x > 20.0 { x } else { x.exp().ln_1p() }
}

/// `x · wᵀ` in f64: `x` `[m, k]`, `w` `[n, k]`.
pub(super) fn matmul64(x: &[f32], w: &[f32], m: usize, n: usize, k: usize) -> Vec<f64> {
    let mut out = vec![0f64; m * n];
    for r in 0..m {
        let xr = &x[r * k..(r + 1) * k];
        for c in 0..n {
            out[r * n + c] = xr
                .iter()
                .zip(&w[c * k..(c + 1) * k])
                .map(|(&a, &b)| a as f64 * b as f64)
                .sum();
        }
    }
    out
}
