//! Host-side tests of the Mamba-2 ops on CUDA (`recurrent.rs`): operand
//! checks that fail before any launch, the rows every operand holds, and
//! the launch shapes. No device needed.

use metrale_core::DType;

use super::launch::Ptr;
use super::recurrent::{
    MAX_D_STATE, conv_launch, gated_norm_launch, rows_held, ssd_launch, ssd_row_blocks,
};
use crate::error::GpuError;
use crate::gpu::{DevicePtr, DeviceSlice};
use crate::ops::ConvAct;
use crate::ops::{GateOrder, RecurrentBatch, SsdParams, StateSlots};

/// A slice at a made-up address (never dereferenced).
fn s(dtype: DType, len: usize) -> DeviceSlice {
    DeviceSlice::new(DevicePtr::from_raw(0x10_0000).unwrap(), dtype, len)
}

fn f(len: usize) -> DeviceSlice {
    s(DType::F32, len)
}

fn is_shape<T>(r: crate::error::Result<T>) -> bool {
    matches!(r, Err(GpuError::Shape { .. }))
}

fn is_dtype<T>(r: crate::error::Result<T>) -> bool {
    matches!(r, Err(GpuError::UnsupportedDType { .. }))
}

fn batch(n_seqs: usize) -> RecurrentBatch {
    RecurrentBatch {
        seqs: s(DType::U32, 3 * n_seqs),
        n_seqs,
    }
}

fn pool(slots: usize, per_slot: usize) -> StateSlots {
    StateSlots {
        states: f(slots * per_slot),
        per_slot,
    }
}

#[test]
fn rows_held_counts_strided_rows() {
    assert_eq!(rows_held(0, 10, 4), 0);
    assert_eq!(rows_held(3, 10, 4), 0);
    assert_eq!(rows_held(4, 10, 4), 1);
    assert_eq!(rows_held(13, 10, 4), 1);
    assert_eq!(rows_held(14, 10, 4), 2);
    assert_eq!(rows_held(40, 4, 4), 10);
}

#[test]
fn conv_launch_shapes() {
    let (ch, k) = (600, 4);
    let w = s(DType::BF16, ch * k);
    let b = s(DType::F16, ch);
    let l = conv_launch(
        f(10 * ch),
        w,
        Some(b),
        f(12 * ch),
        pool(4, ch * 3),
        &batch(2),
        ch,
        k,
        ConvAct::Silu,
    )
    .unwrap()
    .unwrap();
    let a = l.out.args;
    assert_eq!((a.6, a.7, a.8), (2, ch as i32, k as i32));
    assert_eq!(a.9, (ch * 3) as i64, "per_slot");
    assert_eq!(a.10, 4, "slots");
    assert_eq!(a.11, 10, "rows bound: the shorter of x and out");
    assert_eq!((a.12, a.13, a.14), (1, 2, 1), "bf16 weight, f16 bias, silu");
    assert_eq!(l.out.cfg.grid.1, 2, "one grid row per sequence");
    // 10 rows of 600 channels: 24 blocks of 256 cover any one sequence.
    assert_eq!(l.out.cfg.grid.0, 24);
    let st = l.state.unwrap();
    assert_eq!(st.cfg.grid, (3, 2, 1));
    assert_eq!(
        (st.args.4, st.args.5, st.args.6),
        (ch as i32, k as i32, 1800)
    );
    // No bias: a null pointer.
    let l = conv_launch(
        f(ch),
        w,
        None,
        f(ch),
        pool(1, ch * 3),
        &batch(1),
        ch,
        k,
        ConvAct::Linear,
    )
    .unwrap()
    .unwrap();
    assert_eq!(l.out.args.2, Ptr::NULL);
    assert_eq!(l.out.args.14, 0);
    // Kernel 1: no state to keep, any pool.
    let l = conv_launch(
        f(ch),
        s(DType::F32, ch),
        None,
        f(ch),
        pool(0, 0),
        &batch(1),
        ch,
        1,
        ConvAct::Linear,
    )
    .unwrap()
    .unwrap();
    assert!(l.state.is_none());
    assert_eq!(l.out.args.10, u32::MAX);
}

#[test]
fn conv_grid_spreads_long_prefills_and_covers_decode_rows() {
    let ch = 5376;
    let rows = 4096;
    let w = s(DType::F32, ch * 4);
    let one = conv_launch(
        f(rows * ch),
        w,
        None,
        f(rows * ch),
        pool(1, ch * 3),
        &batch(1),
        ch,
        4,
        ConvAct::Silu,
    )
    .unwrap()
    .unwrap();
    assert_eq!(one.out.cfg.grid, (4096, 1, 1));
    let many = conv_launch(
        f(rows * ch),
        w,
        None,
        f(rows * ch),
        pool(256, ch * 3),
        &batch(256),
        ch,
        4,
        ConvAct::Silu,
    )
    .unwrap()
    .unwrap();
    // At least one row of channels per sequence.
    assert_eq!(many.out.cfg.grid, (21, 256, 1));
}

#[test]
fn conv_checks_fail_before_launch() {
    let (ch, k) = (8, 4);
    let (x, w, out, st, sq) = (f(2 * ch), f(ch * k), f(2 * ch), pool(2, 3 * ch), batch(2));
    let ok = |x, w, b, out, st, sq: &RecurrentBatch, ch, k| {
        conv_launch(x, w, b, out, st, sq, ch, k, ConvAct::Linear)
    };
    assert!(ok(x, w, None, out, st, &sq, ch, k).unwrap().is_some());
    assert!(is_shape(ok(x, w, None, out, st, &sq, 0, k)));
    assert!(is_shape(ok(x, w, None, out, st, &sq, ch, 0)));
    assert!(is_shape(ok(x, f(ch * k - 1), None, out, st, &sq, ch, k)));
    assert!(is_shape(ok(x, w, Some(f(ch - 1)), out, st, &sq, ch, k)));
    assert!(is_dtype(ok(
        x,
        s(DType::U8, ch * k),
        None,
        out,
        st,
        &sq,
        ch,
        k
    )));
    assert!(is_dtype(ok(
        x,
        w,
        Some(s(DType::U32, ch)),
        out,
        st,
        &sq,
        ch,
        k
    )));
    assert!(is_dtype(ok(
        s(DType::BF16, 2 * ch),
        w,
        None,
        out,
        st,
        &sq,
        ch,
        k
    )));
    assert!(is_dtype(ok(
        x,
        w,
        None,
        s(DType::BF16, 2 * ch),
        st,
        &sq,
        ch,
        k
    )));
    // Slots too small for [kernel - 1, channels].
    assert!(is_shape(ok(
        x,
        w,
        None,
        out,
        pool(2, 3 * ch - 1),
        &sq,
        ch,
        k
    )));
    let bf16_pool = StateSlots {
        states: s(DType::BF16, 6 * ch),
        per_slot: 3 * ch,
    };
    assert!(is_dtype(ok(x, w, None, out, bf16_pool, &sq, ch, k)));
    // Descriptors: u32, three words a sequence.
    let short = RecurrentBatch {
        seqs: s(DType::U32, 5),
        n_seqs: 2,
    };
    assert!(is_shape(ok(x, w, None, out, st, &short, ch, k)));
    let wrong = RecurrentBatch {
        seqs: f(6),
        n_seqs: 2,
    };
    assert!(is_dtype(ok(x, w, None, out, st, &wrong, ch, k)));
    // Nothing to do.
    assert!(ok(x, w, None, out, st, &batch(0), ch, k).unwrap().is_none());
    assert!(ok(f(0), w, None, out, st, &sq, ch, k).unwrap().is_none());
}

#[test]
fn gated_norm_launch_shapes_and_checks() {
    let (rows, dim) = (3, 512);
    let (x, g, out, w) = (
        f(rows * dim),
        f(rows * dim),
        f(rows * dim),
        s(DType::BF16, dim),
    );
    let l = gated_norm_launch(x, g, w, out, rows, dim, 128, 1e-5, GateOrder::BeforeNorm)
        .unwrap()
        .unwrap();
    assert_eq!(l.cfg.grid, (12, 1, 1), "a block per (row, group)");
    assert_eq!(l.cfg.block, (32, 1, 1));
    assert_eq!((l.args.4, l.args.5, l.args.6), (12, 512, 128));
    assert_eq!((l.args.8, l.args.9), (0, 1));
    let l = gated_norm_launch(x, g, w, out, rows, dim, dim, 1e-6, GateOrder::AfterNorm)
        .unwrap()
        .unwrap();
    assert_eq!(l.cfg.grid, (3, 1, 1));
    assert_eq!(l.cfg.block, (128, 1, 1));
    assert_eq!((l.args.7, l.args.8), (1e-6, 1));
    let big = gated_norm_launch(
        f(8192),
        f(8192),
        f(8192),
        f(8192),
        1,
        8192,
        8192,
        1e-5,
        GateOrder::BeforeNorm,
    )
    .unwrap()
    .unwrap();
    assert_eq!(big.cfg.block, (1024, 1, 1));
    let order = GateOrder::BeforeNorm;
    assert!(is_shape(gated_norm_launch(
        x, g, w, out, rows, dim, 100, 1e-5, order
    )));
    assert!(is_shape(gated_norm_launch(
        x, g, w, out, rows, dim, 0, 1e-5, order
    )));
    assert!(is_shape(gated_norm_launch(
        x, g, w, out, rows, 0, 1, 1e-5, order
    )));
    assert!(is_shape(gated_norm_launch(
        f(10),
        g,
        w,
        out,
        rows,
        dim,
        dim,
        1e-5,
        order
    )));
    assert!(is_shape(gated_norm_launch(
        x,
        f(10),
        w,
        out,
        rows,
        dim,
        dim,
        1e-5,
        order
    )));
    assert!(is_shape(gated_norm_launch(
        x,
        g,
        w,
        f(10),
        rows,
        dim,
        dim,
        1e-5,
        order
    )));
    assert!(is_shape(gated_norm_launch(
        x,
        g,
        s(DType::BF16, dim - 1),
        out,
        rows,
        dim,
        dim,
        1e-5,
        order
    )));
    assert!(is_dtype(gated_norm_launch(
        x,
        g,
        s(DType::U8, dim),
        out,
        rows,
        dim,
        dim,
        1e-5,
        order
    )));
    assert!(is_dtype(gated_norm_launch(
        s(DType::BF16, rows * dim),
        g,
        w,
        out,
        rows,
        dim,
        dim,
        1e-5,
        order
    )));
    assert!(
        gated_norm_launch(x, g, w, out, 0, dim, dim, 1e-5, order)
            .unwrap()
            .is_none()
    );
}

fn ssd_params() -> SsdParams {
    SsdParams {
        n_heads: 8,
        head_dim: 64,
        d_state: 128,
        n_groups: 2,
        chunk_size: 256,
        dt_min: 0.0,
        dt_max: f32::INFINITY,
        input_row_stride: None,
    }
}

/// Operands of `rows` rows for `p` (contiguous x, B and C).
struct Ssd {
    x: DeviceSlice,
    dt: DeviceSlice,
    b: DeviceSlice,
    c: DeviceSlice,
    a: DeviceSlice,
    d: DeviceSlice,
    bias: DeviceSlice,
    y: DeviceSlice,
    st: StateSlots,
}

impl Ssd {
    fn new(p: &SsdParams, rows: usize, slots: usize) -> Self {
        let (w, bc) = (p.n_heads * p.head_dim, p.n_groups * p.d_state);
        Self {
            x: f(rows * w),
            dt: f(rows * p.n_heads),
            b: f(rows * bc),
            c: f(rows * bc),
            a: f(p.n_heads),
            d: s(DType::BF16, p.n_heads),
            bias: s(DType::F16, p.n_heads),
            y: f(rows * w),
            st: pool(slots, w * p.d_state),
        }
    }

    fn launch(
        &self,
        p: &SsdParams,
        seqs: &RecurrentBatch,
    ) -> crate::error::Result<Option<super::args::Launch<super::recurrent::SsdArgs>>> {
        ssd_launch(
            self.x, self.dt, self.b, self.c, self.a, self.d, self.bias, self.y, self.st, seqs, p,
        )
    }
}

#[test]
fn ssd_launch_shapes() {
    let p = ssd_params();
    let o = Ssd::new(&p, 5, 3);
    let l = o.launch(&p, &batch(2)).unwrap().unwrap();
    // 64 rows of state per head: 4 blocks of 16 rows, 8 heads.
    assert_eq!(ssd_row_blocks(64), 4);
    assert_eq!(l.cfg.grid, (2, 32, 1));
    assert_eq!(l.cfg.block, (128, 1, 1));
    let a = l.args;
    assert_eq!((a.10, a.11, a.12, a.13, a.14), (2, 8, 64, 128, 2));
    assert_eq!((a.15, a.16), (0.0, f32::INFINITY));
    assert_eq!((a.17, a.18), (512, 256), "contiguous strides");
    assert_eq!((a.19, a.20, a.21), (512 * 128, 3, 5));
    assert_eq!(
        (a.22, a.23, a.24),
        (0, 1, 2),
        "f32 A_log, bf16 D, f16 dt_bias"
    );
    // Head dims that are no multiple of 16 take a partial block.
    assert_eq!(ssd_row_blocks(24), 2);
    assert_eq!(ssd_row_blocks(1), 1);
}

#[test]
fn ssd_rows_bound_reads_x_b_c_in_place() {
    let p = SsdParams {
        input_row_stride: Some(512 + 2 * 256),
        ..ssd_params()
    };
    let (rows, stride) = (7, 1024);
    let mut o = Ssd::new(&p, rows, 1);
    // The three parts of one [rows, x | B | C] buffer: the last row of
    // each part ends where its columns do.
    o.x = f((rows - 1) * stride + 512);
    o.b = f((rows - 1) * stride + 256);
    o.c = f((rows - 1) * stride + 256);
    let l = o.launch(&p, &batch(1)).unwrap().unwrap();
    assert_eq!((l.args.17, l.args.18), (1024, 1024));
    assert_eq!(l.args.21, rows as i64);
    // A shorter C bounds the rows.
    o.c = f((rows - 2) * stride + 256);
    assert_eq!(o.launch(&p, &batch(1)).unwrap().unwrap().args.21, 6);
    // A stride narrower than x or B | C.
    let narrow = SsdParams {
        input_row_stride: Some(511),
        ..ssd_params()
    };
    assert!(is_shape(o.launch(&narrow, &batch(1))));
}

#[test]
fn ssd_checks_fail_before_launch() {
    let p = ssd_params();
    let o = Ssd::new(&p, 4, 2);
    let sq = batch(2);
    assert!(o.launch(&p, &sq).unwrap().is_some());
    for bad in [
        SsdParams { n_heads: 0, ..p },
        SsdParams { head_dim: 0, ..p },
        SsdParams { d_state: 0, ..p },
        SsdParams { n_groups: 0, ..p },
        SsdParams { n_groups: 3, ..p },
        SsdParams { chunk_size: 0, ..p },
        SsdParams {
            dt_min: 1.0,
            dt_max: 0.5,
            ..p
        },
        SsdParams {
            dt_min: f32::NAN,
            ..p
        },
        SsdParams {
            d_state: MAX_D_STATE + 1,
            ..p
        },
    ] {
        assert!(is_shape(o.launch(&bad, &sq)), "{bad:?}");
    }
    // d_state up to the limit is fine (slots sized for it).
    let wide = SsdParams {
        d_state: MAX_D_STATE,
        ..p
    };
    assert!(Ssd::new(&wide, 4, 2).launch(&wide, &sq).unwrap().is_some());
    // Per-head parameters: a weight dtype, n_heads long.
    let mut bad = Ssd::new(&p, 4, 2);
    bad.a = f(7);
    assert!(is_shape(bad.launch(&p, &sq)));
    bad.a = s(DType::U8, 8);
    assert!(is_dtype(bad.launch(&p, &sq)));
    let mut bad = Ssd::new(&p, 4, 2);
    bad.x = s(DType::BF16, 4 * 512);
    assert!(is_dtype(bad.launch(&p, &sq)));
    let mut bad = Ssd::new(&p, 4, 2);
    bad.y = s(DType::F16, 4 * 512);
    assert!(is_dtype(bad.launch(&p, &sq)));
    // Slots smaller than [n_heads, head_dim, d_state].
    let mut bad = Ssd::new(&p, 4, 2);
    bad.st = pool(2, 512 * 128 - 1);
    assert!(is_shape(bad.launch(&p, &sq)));
    // Descriptors too short.
    let short = RecurrentBatch {
        seqs: s(DType::U32, 5),
        n_seqs: 2,
    };
    assert!(is_shape(o.launch(&p, &short)));
    // Nothing to do: no sequences, or no rows.
    assert!(o.launch(&p, &batch(0)).unwrap().is_none());
    let mut empty = Ssd::new(&p, 4, 2);
    empty.y = f(0);
    assert!(empty.launch(&p, &sq).unwrap().is_none());
}
