//! Tests of causal conv1d and the gated RMSNorm against scalar f64
//! references, shape errors of every op, and the shared test helpers.

use metrale_core::{BlockId, DType};

use crate::cpu::CpuBackend;
use crate::error::GpuError;
use crate::fault::{FaultInjecting, FaultPlan};
use crate::gpu::{DeviceSlice, GpuBackend};
use crate::ops::recurrent::{DeltaParams, GateOrder, RecurrentOps, SsdParams};
use crate::ops::step::{AttnBatch, RecurrentBatch, Staged, StateSlots};

/// Deterministic uniform numbers (xorshift64*).
pub(in crate::cpu) struct Rng(u64);

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
}

/// A CPU backend and the slices a test allocated (step metadata staged
/// through [`Staged`]); `finish` frees them and checks that nothing leaked.
pub(in crate::cpu) struct Env {
    pub cpu: CpuBackend,
    slices: Vec<DeviceSlice>,
    staged: Staged,
}

impl Env {
    pub fn new() -> Self {
        Self::with_threads(0)
    }

    pub fn with_threads(threads: usize) -> Self {
        Self::with_backend(CpuBackend::with_threads(threads))
    }

    pub fn with_backend(cpu: CpuBackend) -> Self {
        Self {
            cpu,
            slices: Vec::new(),
            staged: Staged::new(),
        }
    }

    pub fn gpu(&self) -> &dyn GpuBackend {
        &self.cpu
    }

    pub fn up(&mut self, v: &[f32]) -> DeviceSlice {
        let s = self
            .gpu()
            .alloc_slice(DType::F32, v.len(), "test")
            .expect("alloc");
        self.gpu().upload_f32(v, s).expect("upload");
        self.slices.push(s);
        s
    }

    /// Uploads `v` rounded to bf16; returns the slice and the rounded values.
    pub fn up_bf16(&mut self, v: &[f32]) -> (DeviceSlice, Vec<f32>) {
        let h: Vec<half::bf16> = v.iter().map(|&x| half::bf16::from_f32(x)).collect();
        let bytes: Vec<u8> = h.iter().flat_map(|b| b.to_bits().to_le_bytes()).collect();
        let s = self
            .gpu()
            .alloc_slice(DType::BF16, v.len(), "test")
            .expect("alloc");
        self.gpu().copy_h2d(&bytes, s.ptr(), 0).expect("upload");
        self.slices.push(s);
        (s, h.iter().map(|b| b.to_f32()).collect())
    }

    /// `v` as a device `u64` slice (expert address tables).
    pub fn up_u64(&mut self, v: &[u64]) -> DeviceSlice {
        let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        let s = self
            .gpu()
            .alloc_slice(DType::U64, v.len(), "test")
            .expect("alloc");
        self.gpu().copy_h2d(&bytes, s.ptr(), 0).expect("upload");
        self.slices.push(s);
        s
    }

    /// The `u32` elements of `s`.
    pub fn down_u32(&self, s: DeviceSlice) -> Vec<u32> {
        let mut bytes = vec![0u8; s.len() * 4];
        self.gpu()
            .copy_d2h(s.ptr(), 0, &mut bytes)
            .expect("download");
        bytes
            .chunks(4)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect()
    }

    /// `words` as a device `u32` slice (token ids, positions, slots, rows).
    pub fn u32s(&mut self, words: &[u32]) -> DeviceSlice {
        self.staged.u32s(&self.cpu, words).expect("stage u32s")
    }

    /// An attention batch of `(q_start, q_len, kv_len, block table)`.
    pub fn attn(&mut self, seqs: &[(usize, usize, usize, &[BlockId])]) -> AttnBatch {
        self.staged
            .attn(&self.cpu, seqs)
            .expect("stage attention batch")
    }

    /// A recurrent batch of `(row_start, len, slot)`.
    pub fn batch(&mut self, seqs: &[(usize, usize, usize)]) -> RecurrentBatch {
        self.staged
            .recurrent(&self.cpu, seqs)
            .expect("stage recurrent batch")
    }

    /// A recurrent batch of `(row_start, len)` spans, span `i` in slot `i`.
    pub fn batch_of(&mut self, spans: &[(usize, usize)]) -> RecurrentBatch {
        let seqs: Vec<(usize, usize, usize)> = spans
            .iter()
            .enumerate()
            .map(|(i, &(r0, len))| (r0, len, i))
            .collect();
        self.batch(&seqs)
    }

    /// A state pool holding `states` (all of one length), one per slot.
    pub fn pool(&mut self, states: &[Vec<f32>]) -> StateSlots {
        let per_slot = states.first().map_or(0, Vec::len);
        assert!(states.iter().all(|s| s.len() == per_slot));
        StateSlots {
            states: self.up(&states.concat()),
            per_slot,
        }
    }

    /// The state in `slot` of `pool`.
    pub fn slot(&self, pool: StateSlots, slot: usize) -> Vec<f32> {
        self.down(pool.slot("test", slot as u32).expect("slot"))
    }

    pub fn down(&self, s: DeviceSlice) -> Vec<f32> {
        self.gpu().download_f32(s).expect("download")
    }

    pub fn finish(self) {
        let Env {
            cpu,
            slices,
            staged,
        } = self;
        let gpu: &dyn GpuBackend = &cpu;
        staged.free(gpu).expect("free staged");
        for s in &slices {
            gpu.free(s.ptr()).expect("free");
        }
        assert_eq!(gpu.live_bytes(), 0);
    }
}

/// `|got - want| <= tol * (1 + |want|)` elementwise.
pub(in crate::cpu) fn assert_close(got: &[f32], want: &[f64], tol: f64, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g as f64 - w).abs() <= tol * (1.0 + w.abs()),
            "{what}[{i}]: got {g}, want {w}"
        );
    }
}

fn silu64(x: f64) -> f64 {
    x / (1.0 + (-x).exp())
}

/// Causal conv of one sequence: returns its output rows and the new state.
fn conv_ref(
    x: &[f32],
    w: &[f32],
    bias: Option<&[f32]>,
    state: &[f32],
    ch: usize,
    k: usize,
    silu: bool,
) -> (Vec<f64>, Vec<f64>) {
    let len = x.len() / ch;
    let mut out = vec![0f64; len * ch];
    let mut new_state = vec![0f64; ch * (k - 1)];
    for c in 0..ch {
        // The state is tap-major: `[k - 1, ch]`, oldest first.
        let mut hist: Vec<f64> = (0..k - 1).map(|j| state[j * ch + c] as f64).collect();
        hist.extend((0..len).map(|t| x[t * ch + c] as f64));
        for t in 0..len {
            let mut acc = bias.map_or(0.0, |b| b[c] as f64);
            for j in 0..k {
                acc += w[c * k + j] as f64 * hist[t + j];
            }
            out[t * ch + c] = if silu { silu64(acc) } else { acc };
        }
        for (j, &h) in hist[len..].iter().enumerate() {
            new_state[j * ch + c] = h;
        }
    }
    (out, new_state)
}

fn check_conv(ch: usize, k: usize, bias: bool, bf16: bool, silu: bool) {
    let mut rng = Rng::new((ch * 31 + k) as u64);
    let mut env = Env::new();
    // Out of order, with unused rows 1, 2 and 8, 9 between them.
    let spans = [(3usize, 5usize), (0, 1), (10, 2), (12, 9), (21, 0)];
    let rows = 21;
    let x = rng.vec(rows * ch, -2.0, 2.0);
    let w = rng.vec(ch * k, -1.0, 1.0);
    let b = rng.vec(ch, -0.5, 0.5);
    let (ws, w) = if bf16 {
        env.up_bf16(&w)
    } else {
        (env.up(&w), w)
    };
    let bs = if bias { Some(env.up(&b)) } else { None };
    let states0: Vec<Vec<f32>> = spans
        .iter()
        .map(|_| rng.vec(ch * (k - 1), -1.0, 1.0))
        .collect();
    let states = env.pool(&states0);
    let (xs, out) = (env.up(&x), env.up(&vec![7.0; rows * ch]));
    let seqs = env.batch_of(&spans);
    env.cpu
        .causal_conv1d(xs, ws, bs, out, states, &seqs, ch, k, silu)
        .expect("conv");
    let got = env.down(out);
    for (i, &(r0, len)) in spans.iter().enumerate() {
        let (o, st) = conv_ref(
            &x[r0 * ch..(r0 + len) * ch],
            &w,
            bias.then_some(&b[..]),
            &states0[i],
            ch,
            k,
            silu,
        );
        assert_close(&got[r0 * ch..(r0 + len) * ch], &o, 1e-5, "conv out");
        assert_close(&env.slot(states, i), &st, 0.0, "conv state");
    }
    for r in [1, 2, 8, 9] {
        assert!(
            got[r * ch..(r + 1) * ch].iter().all(|&v| v == 7.0),
            "row {r} outside every sequence was written"
        );
    }
    env.finish();
}

#[test]
fn causal_conv1d_matches_reference() {
    check_conv(6, 4, true, false, true);
    check_conv(5, 2, false, true, false);
    check_conv(3, 1, true, false, true);
    check_conv(40, 4, true, true, true);
}

#[test]
fn causal_conv1d_continues_through_the_state() {
    let (ch, k, n) = (7, 4, 11);
    let mut rng = Rng::new(5);
    let mut env = Env::new();
    let x = rng.vec(n * ch, -2.0, 2.0);
    let (w, b) = (
        env.up(&rng.vec(ch * k, -1.0, 1.0)),
        env.up(&rng.vec(ch, -1.0, 1.0)),
    );
    let s0 = rng.vec(ch * (k - 1), -1.0, 1.0);
    let (st_a, st_b) = (env.pool(&[s0.clone()]), env.pool(&[s0]));
    let (xs, out_a, out_b) = (
        env.up(&x),
        env.up(&vec![0.0; n * ch]),
        env.up(&vec![0.0; n * ch]),
    );
    let whole = env.batch_of(&[(0, n)]);
    env.cpu
        .causal_conv1d(xs, w, Some(b), out_a, st_a, &whole, ch, k, true)
        .expect("one call");
    // Two tokens, then one, then the rest: rows stay where they are.
    for (r0, len) in [(0, 2), (2, 1), (3, n - 3)] {
        let piece = env.batch_of(&[(r0, len)]);
        env.cpu
            .causal_conv1d(xs, w, Some(b), out_b, st_b, &piece, ch, k, true)
            .expect("piece");
    }
    assert_eq!(env.down(out_a), env.down(out_b));
    assert_eq!(env.down(st_a.states), env.down(st_b.states));
    env.finish();
}

fn norm_ref(
    x: &[f32],
    g: &[f32],
    w: &[f32],
    dim: usize,
    gs: usize,
    eps: f64,
    order: GateOrder,
) -> Vec<f64> {
    let mut out = vec![0f64; x.len()];
    for (r, o) in out.chunks_mut(dim).enumerate() {
        for grp in 0..dim / gs {
            let idx = |i: usize| r * dim + grp * gs + i;
            let h: Vec<f64> = (0..gs)
                .map(|i| match order {
                    GateOrder::BeforeNorm => x[idx(i)] as f64 * silu64(g[idx(i)] as f64),
                    GateOrder::AfterNorm => x[idx(i)] as f64,
                })
                .collect();
            let rs = 1.0 / (h.iter().map(|v| v * v).sum::<f64>() / gs as f64 + eps).sqrt();
            for i in 0..gs {
                let mut v = h[i] * rs * w[grp * gs + i] as f64;
                if order == GateOrder::AfterNorm {
                    v *= silu64(g[idx(i)] as f64);
                }
                o[grp * gs + i] = v;
            }
        }
    }
    out
}

#[test]
fn gated_rms_norm_matches_reference() {
    let (rows, dim) = (5, 24);
    let mut rng = Rng::new(9);
    for (gs, order, bf16) in [
        (24, GateOrder::BeforeNorm, false),
        (8, GateOrder::BeforeNorm, true),
        (6, GateOrder::AfterNorm, false),
        (24, GateOrder::AfterNorm, true),
    ] {
        let mut env = Env::new();
        let (x, g, w) = (
            rng.vec(rows * dim, -3.0, 3.0),
            rng.vec(rows * dim, -3.0, 3.0),
            rng.vec(dim, 0.5, 1.5),
        );
        let (ws, w) = if bf16 {
            env.up_bf16(&w)
        } else {
            (env.up(&w), w)
        };
        let (xs, gsl, out) = (env.up(&x), env.up(&g), env.up(&vec![0.0; rows * dim]));
        env.cpu
            .gated_rms_norm(xs, gsl, ws, out, rows, dim, gs, 1e-5, order)
            .expect("norm");
        assert_close(
            &env.down(out),
            &norm_ref(&x, &g, &w, dim, gs, 1e-5, order),
            1e-5,
            "gated norm",
        );
        env.finish();
    }
}

#[test]
fn fault_injecting_passes_recurrent_ops_through() {
    let fi = FaultInjecting::new(CpuBackend::new(), FaultPlan::default());
    let gpu: &dyn GpuBackend = &fi;
    let up = |v: &[f32]| {
        let s = gpu.alloc_slice(DType::F32, v.len(), "test").expect("alloc");
        gpu.upload_f32(v, s).expect("upload");
        s
    };
    let (x, g, w, out) = (
        up(&[1.0, 2.0, 3.0, 4.0]),
        up(&[0.5; 4]),
        up(&[1.0; 4]),
        up(&[0.0; 4]),
    );
    gpu.gated_rms_norm(x, g, w, out, 1, 4, 4, 1e-6, GateOrder::AfterNorm)
        .expect("through the wrapper");
    let want = norm_ref(
        &[1.0, 2.0, 3.0, 4.0],
        &[0.5; 4],
        &[1.0; 4],
        4,
        4,
        1e-6,
        GateOrder::AfterNorm,
    );
    assert_close(
        &gpu.download_f32(out).expect("download"),
        &want,
        1e-6,
        "wrapped norm",
    );
    for s in [x, g, w, out] {
        gpu.free(s.ptr()).expect("free");
    }
    assert_eq!(gpu.live_bytes(), 0);
}

fn is_shape(r: crate::error::Result<()>) -> bool {
    matches!(r, Err(GpuError::Shape { .. }))
}

#[test]
fn shape_errors_are_errors() {
    let mut env = Env::new();
    let big = env.up(&vec![0.0; 4096]);
    let small = env.up(&[0.0; 3]);
    let st = env.up(&vec![0.0; 512]);
    let out = env.up(&vec![0.0; 4096]);
    let (bf, _) = env.up_bf16(&[0.0; 64]);
    let one = [1, 2, 3, 5].map(|len| env.batch(&[(0, len, 0)]));
    let [one1, one2, one3, one5] = [&one[0], &one[1], &one[2], &one[3]];
    // Rows 0..3 and 2..4 overlap; two sequences in one slot.
    let overlapping = env.batch(&[(0, 3, 0), (2, 2, 1)]);
    let same_state = env.batch(&[(0, 1, 0), (1, 1, 0)]);
    let cpu = &env.cpu;
    // Pools of `st` with slots of `per_slot`; the conv's state is 4 channels
    // x 3 taps, the scan's 4 heads x 2 x 4, the delta rule's 4 x 4 x 4.
    let pool = |per_slot| StateSlots {
        states: st,
        per_slot,
    };
    let (conv_st, ssd_st, delta_st) = (pool(12), pool(32), pool(64));
    // Slots narrower than the op's state.
    let (conv_narrow, ssd_narrow, delta_narrow) = (pool(11), pool(31), pool(63));

    // causal_conv1d
    assert!(is_shape(
        cpu.causal_conv1d(big, big, None, out, conv_st, one2, 4, 0, true)
    ));
    assert!(is_shape(cpu.causal_conv1d(
        big, small, None, out, conv_st, one2, 4, 4, true
    )));
    assert!(is_shape(cpu.causal_conv1d(
        big,
        big,
        None,
        out,
        conv_narrow,
        one2,
        4,
        4,
        true
    )));
    assert!(is_shape(cpu.causal_conv1d(
        small, big, None, out, conv_st, one2, 4, 4, true
    )));
    assert!(is_shape(cpu.causal_conv1d(
        big,
        big,
        None,
        out,
        conv_st,
        &overlapping,
        4,
        4,
        true
    )));
    assert!(matches!(
        cpu.causal_conv1d(big, big, None, out, conv_st, &same_state, 4, 4, true),
        Err(GpuError::Aliasing { .. })
    ));
    assert!(matches!(
        cpu.causal_conv1d(big, big, None, big, conv_st, one1, 4, 4, true),
        Err(GpuError::Aliasing { .. })
    ));
    let in_input = StateSlots {
        states: big,
        per_slot: 12,
    };
    assert!(matches!(
        cpu.causal_conv1d(big, big, None, out, in_input, one1, 4, 4, true),
        Err(GpuError::Aliasing { .. })
    ));

    // ssd_scan
    let p = SsdParams {
        n_heads: 4,
        head_dim: 2,
        d_state: 4,
        n_groups: 2,
        chunk_size: 4,
        dt_min: 0.0,
        dt_max: f32::INFINITY,
        input_row_stride: None,
    };
    let ssd = |p: &SsdParams, x: DeviceSlice, states: StateSlots, seqs: &RecurrentBatch| {
        cpu.ssd_scan(x, big, big, big, big, big, big, out, states, seqs, p)
    };
    assert!(ssd(&p, big, ssd_st, one3).is_ok());
    assert!(is_shape(ssd(
        &SsdParams { n_groups: 3, ..p },
        big,
        ssd_st,
        one3
    )));
    assert!(is_shape(ssd(
        &SsdParams { chunk_size: 0, ..p },
        big,
        ssd_st,
        one3
    )));
    assert!(is_shape(ssd(
        &SsdParams {
            dt_min: 1.0,
            dt_max: 0.5,
            ..p
        },
        big,
        ssd_st,
        one3
    )));
    assert!(is_shape(ssd(&p, small, ssd_st, one3)));
    assert!(is_shape(ssd(&p, big, ssd_narrow, one3)));
    assert!(is_shape(ssd(&p, big, ssd_st, &overlapping)));
    assert!(is_shape(cpu.ssd_scan(
        big, big, big, big, small, big, big, out, ssd_st, one3, &p
    )));

    // gated_rms_norm
    assert!(is_shape(cpu.gated_rms_norm(
        big,
        big,
        big,
        out,
        2,
        12,
        5,
        1e-6,
        GateOrder::BeforeNorm
    )));
    assert!(is_shape(cpu.gated_rms_norm(
        big,
        big,
        small,
        out,
        2,
        12,
        4,
        1e-6,
        GateOrder::BeforeNorm
    )));
    assert!(is_shape(cpu.gated_rms_norm(
        small,
        big,
        big,
        out,
        2,
        12,
        4,
        1e-6,
        GateOrder::AfterNorm
    )));

    // gated_delta_rule
    let dp = DeltaParams {
        n_k_heads: 2,
        n_v_heads: 4,
        k_head_dim: 4,
        v_head_dim: 4,
        chunk_size: 4,
    };
    let delta = |p: &DeltaParams, q: DeviceSlice, states: StateSlots, seqs: &RecurrentBatch| {
        cpu.gated_delta_rule(q, big, big, big, big, big, big, out, states, seqs, p)
    };
    assert!(delta(&dp, big, delta_st, one5).is_ok());
    assert!(is_shape(delta(
        &DeltaParams { n_v_heads: 3, ..dp },
        big,
        delta_st,
        one5
    )));
    assert!(is_shape(delta(
        &DeltaParams {
            chunk_size: 0,
            ..dp
        },
        big,
        delta_st,
        one5
    )));
    assert!(is_shape(delta(&dp, small, delta_st, one5)));
    assert!(is_shape(delta(&dp, big, delta_narrow, one5)));

    // A bf16 activation is refused, not misread.
    assert!(matches!(
        cpu.causal_conv1d(bf, big, None, out, conv_st, one1, 4, 4, true),
        Err(GpuError::UnsupportedDType { .. })
    ));
    env.finish();
}
