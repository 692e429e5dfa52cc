//! The CPU tests' helpers, and tests of the recurrent ops that are the CPU
//! backend's own: a conv fed in pieces gives the bits of one call, shape
//! errors of every op, the fault-injecting wrapper. The ops against their
//! f64 references are the conformance suite's (`crate::conformance`).

use metrale_core::{BlockId, DType};

use crate::cpu::CpuBackend;
use crate::error::GpuError;
use crate::fault::FaultPlan;
use crate::gpu::{DeviceSlice, GpuBackend};
use crate::ops::recurrent::{ConvAct, DeltaParams, GateOrder, RecurrentOps, SsdParams};
use crate::ops::step::{AttnBatch, RecurrentBatch, Staged, StateSlots};

/// The suite's deterministic numbers.
pub(in crate::cpu) use crate::conformance::harness::Rng;

/// A CPU backend and the slices a test allocated (step metadata staged
/// through [`Staged`]); `finish` frees them and checks that nothing leaked.
pub(in crate::cpu) struct Env {
    pub cpu: CpuBackend,
    slices: Vec<DeviceSlice>,
    staged: Staged,
    /// `pool` holds its states in bf16 (as a CPU backend's SSM pool under
    /// `with_bf16_ssm_state`).
    pub bf16_states: bool,
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
            bf16_states: false,
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
        let all = states.concat();
        let states = match self.bf16_states {
            true => self.up_bf16(&all).0,
            false => self.up(&all),
        };
        StateSlots { states, per_slot }
    }

    /// The state in `slot` of `pool` (widened from bf16 where it is held so).
    pub fn slot(&self, pool: StateSlots, slot: usize) -> Vec<f32> {
        let s = pool.slot("test", slot as u32).expect("slot");
        if s.dtype() != DType::BF16 {
            return self.down(s);
        }
        let mut bytes = vec![0u8; s.len() * 2];
        self.gpu()
            .copy_d2h(s.ptr(), 0, &mut bytes)
            .expect("download");
        bytes
            .chunks_exact(2)
            .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect()
    }

    pub fn down(&self, s: DeviceSlice) -> Vec<f32> {
        self.gpu().download_f32(s).expect("download")
    }

    pub fn finish(self) {
        let Env {
            cpu,
            slices,
            staged,
            ..
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

/// One call against the same tokens in pieces (two tokens, one, the
/// rest): the same bits, state included (the decode path sums in the
/// prefill path's order), with and without a bias, for Mamba's four taps
/// and for another kernel size; 19 channels, so that the decode step's
/// vector loop runs its body and its tail.
#[test]
fn causal_conv1d_continues_through_the_state() {
    for (k, with_bias) in [(4, true), (4, false), (3, true)] {
        let (ch, n) = (19, 11);
        let mut rng = Rng::new(5);
        let mut env = Env::new();
        let x = rng.vec(n * ch, -2.0, 2.0);
        let w = env.up(&rng.vec(ch * k, -1.0, 1.0));
        let bv = rng.vec(ch, -1.0, 1.0);
        let b = with_bias.then(|| env.up(&bv));
        let s0 = rng.vec(ch * (k - 1), -1.0, 1.0);
        let (st_a, st_b) = (env.pool(std::slice::from_ref(&s0)), env.pool(&[s0]));
        let (xs, out_a, out_b) = (
            env.up(&x),
            env.up(&vec![0.0; n * ch]),
            env.up(&vec![0.0; n * ch]),
        );
        let whole = env.batch_of(&[(0, n)]);
        env.cpu
            .causal_conv1d(xs, w, b, out_a, st_a, &whole, ch, k, ConvAct::Silu)
            .expect("one call");
        // Two tokens, then one, then the rest: rows stay where they are.
        for (r0, len) in [(0, 2), (2, 1), (3, n - 3)] {
            let piece = env.batch_of(&[(r0, len)]);
            env.cpu
                .causal_conv1d(xs, w, b, out_b, st_b, &piece, ch, k, ConvAct::Silu)
                .expect("piece");
        }
        let what = format!("kernel {k}, bias {with_bias}");
        assert_eq!(env.down(out_a), env.down(out_b), "{what}");
        assert_eq!(env.down(st_a.states), env.down(st_b.states), "{what}");
        env.finish();
    }
}

/// Every op runs as before with a fault plan installed in the hooks (one
/// that fails nothing): the conformance suite through them.
#[test]
fn every_op_conforms_with_a_fault_plan_installed() {
    let cpu = CpuBackend::with_threads(2);
    cpu.hooks().set_faults(FaultPlan::default());
    for shapes in crate::conformance::ArchShapes::small_set() {
        let report = crate::conformance::run(&cpu, &shapes);
        report.assert_all_passed();
        assert!(report.unsupported().is_empty(), "{report}");
    }
    assert!(cpu.hooks().transfers().op_launches > 0);
    assert_eq!(cpu.live_bytes(), 0);
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
    assert!(is_shape(cpu.causal_conv1d(
        big,
        big,
        None,
        out,
        conv_st,
        one2,
        4,
        0,
        ConvAct::Silu
    )));
    assert!(is_shape(cpu.causal_conv1d(
        big,
        small,
        None,
        out,
        conv_st,
        one2,
        4,
        4,
        ConvAct::Silu
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
        ConvAct::Silu
    )));
    assert!(is_shape(cpu.causal_conv1d(
        small,
        big,
        None,
        out,
        conv_st,
        one2,
        4,
        4,
        ConvAct::Silu
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
        ConvAct::Silu
    )));
    assert!(matches!(
        cpu.causal_conv1d(
            big,
            big,
            None,
            out,
            conv_st,
            &same_state,
            4,
            4,
            ConvAct::Silu
        ),
        Err(GpuError::Aliasing { .. })
    ));
    assert!(matches!(
        cpu.causal_conv1d(big, big, None, big, conv_st, one1, 4, 4, ConvAct::Silu),
        Err(GpuError::Aliasing { .. })
    ));
    let in_input = StateSlots {
        states: big,
        per_slot: 12,
    };
    assert!(matches!(
        cpu.causal_conv1d(big, big, None, out, in_input, one1, 4, 4, ConvAct::Silu),
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
        tiled_v_heads: false,
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
        cpu.causal_conv1d(bf, big, None, out, conv_st, one1, 4, 4, ConvAct::Silu),
        Err(GpuError::UnsupportedDType { .. })
    ));
    env.finish();
}
