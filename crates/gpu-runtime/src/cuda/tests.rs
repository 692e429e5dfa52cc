//! Host-side tests of the CUDA ops: operand checks that fail before any
//! launch, launch shapes and the attention split policy. No device needed.

use metrale_core::DType;

use super::args;
use super::attention::{
    BLOCKS_PER_SM, MAX_SPLITS, PARTIALS_BUDGET, attention_launch, block_plan, choose_splits,
    kv_store_launch, split_bounds,
};
use super::launch::Ptr;
use crate::error::GpuError;
use crate::gpu::{DevicePtr, DeviceSlice};
use crate::ops::{AttnBatch, AttnParams, KvLayer, RopeParams};

/// A slice at a made-up address (never dereferenced).
fn s(dtype: DType, len: usize) -> DeviceSlice {
    DeviceSlice::new(DevicePtr::from_raw(0x10_0000).unwrap(), dtype, len)
}

fn at(addr: u64, dtype: DType, len: usize) -> DeviceSlice {
    DeviceSlice::new(DevicePtr::from_raw(addr).unwrap(), dtype, len)
}

fn is_shape<T>(r: crate::error::Result<T>) -> bool {
    matches!(r, Err(GpuError::Shape { .. }))
}

fn is_dtype<T>(r: crate::error::Result<T>) -> bool {
    matches!(r, Err(GpuError::UnsupportedDType { .. }))
}

#[test]
fn embedding_checks_dtypes_and_lengths() {
    let (table, ids) = (s(DType::BF16, 100 * 8), s(DType::U32, 3));
    let l = args::embedding(table, ids, 8, s(DType::F32, 24))
        .unwrap()
        .unwrap();
    assert_eq!(l.args.3, 3);
    assert_eq!(l.args.5, 100, "vocab");
    assert_eq!(l.args.6, 1, "bf16 code");
    assert!(is_shape(args::embedding(table, ids, 8, s(DType::F32, 23))));
    assert!(is_dtype(args::embedding(
        s(DType::U8, 800),
        ids,
        8,
        s(DType::F32, 24)
    )));
    assert!(is_dtype(args::embedding(
        table,
        s(DType::F32, 3),
        8,
        s(DType::F32, 24)
    )));
    assert!(
        args::embedding(table, s(DType::U32, 0), 8, s(DType::F32, 0))
            .unwrap()
            .is_none()
    );
}

#[test]
fn matmul_checks() {
    let (x, w, out) = (s(DType::F32, 6), s(DType::F16, 12), s(DType::F32, 8));
    assert_eq!(
        args::matmul("matmul", x, &[(w, "w")], None, out, 2, 4, 3).unwrap(),
        None
    );
    let b = s(DType::BF16, 4);
    assert_eq!(
        args::matmul("matmul", x, &[(w, "w")], Some(b), out, 2, 4, 3).unwrap(),
        Some(1)
    );
    assert!(is_shape(args::matmul(
        "matmul",
        x,
        &[(w, "w")],
        Some(s(DType::F32, 3)),
        out,
        2,
        4,
        3
    )));
    assert!(is_shape(args::matmul(
        "matmul",
        x,
        &[(w, "w")],
        None,
        out,
        2,
        4,
        4
    )));
    assert!(is_dtype(args::matmul(
        "matmul",
        x,
        &[(s(DType::U32, 12), "w")],
        None,
        out,
        2,
        4,
        3
    )));
    assert!(is_dtype(args::matmul(
        "matmul",
        s(DType::BF16, 6),
        &[(w, "w")],
        None,
        out,
        2,
        4,
        3
    )));
    let bl = args::bias_add(out, b, 1, 2, 4).unwrap();
    assert_eq!((bl.args.2, bl.args.3, bl.args.4), (2, 4, 1));
}

#[test]
fn rms_norm_launch_shape() {
    let x = s(DType::F32, 4 * 4096);
    let l = args::rms_norm(x, s(DType::F16, 4096), x, 4, 4096, 1e-6, 1.0)
        .unwrap()
        .unwrap();
    assert_eq!(l.cfg.grid, (4, 1, 1));
    assert_eq!(l.cfg.block, (1024, 1, 1));
    assert_eq!(l.args.7, 2);
    let l = args::rms_norm(x, s(DType::F32, 128), x, 32, 128, 1e-6, 0.0)
        .unwrap()
        .unwrap();
    assert_eq!(l.cfg.block.0 % 32, 0);
    assert!(is_shape(args::rms_norm(
        x,
        s(DType::F32, 100),
        x,
        4,
        128,
        1e-6,
        0.0
    )));
    assert!(
        args::rms_norm(x, s(DType::F32, 0), x, 0, 0, 1e-6, 0.0)
            .unwrap()
            .is_none()
    );
}

#[test]
fn rope_checks() {
    let p = |rot: usize, freqs: usize| RopeParams {
        inv_freq: s(DType::F32, freqs),
        attention_scaling: 1.0,
        n_heads: 4,
        head_dim: 64,
        rotary_dim: rot,
    };
    let (x, pos) = (s(DType::F32, 3 * 4 * 64), s(DType::U32, 3));
    let l = args::rope(x, pos, &p(32, 16)).unwrap().unwrap();
    assert_eq!(l.args.6, 32);
    assert!(is_shape(args::rope(x, pos, &p(31, 16))));
    assert!(is_shape(args::rope(x, pos, &p(32, 15))));
    assert!(is_shape(args::rope(x, pos, &p(66, 40))));
    assert!(is_shape(args::rope(s(DType::F32, 100), pos, &p(32, 16))));
    assert!(is_dtype(args::rope(x, s(DType::I32, 3), &p(32, 16))));
}

#[test]
fn elementwise_and_columns() {
    let a = s(DType::F32, 10);
    assert_eq!(
        args::elementwise("silu_mul", &[(a, "gate"), (a, "up")], 10).unwrap(),
        Some(10)
    );
    assert_eq!(args::elementwise("relu2", &[(a, "x")], 0).unwrap(), None);
    assert!(is_shape(args::elementwise("relu2", &[(a, "x")], 11)));
    assert!(is_dtype(args::elementwise(
        "relu2",
        &[(s(DType::BF16, 10), "x")],
        10
    )));
    assert!(is_shape(args::copy_cols(s(DType::F32, 20), 10, 8, 3, a, 2)));
    let l = args::copy_cols(s(DType::F32, 20), 10, 7, 3, s(DType::F32, 6), 2)
        .unwrap()
        .unwrap();
    assert_eq!(l.args.2..=l.args.5, 2..=3);
    assert!(is_shape(args::scatter_cols(
        s(DType::F32, 6),
        3,
        s(DType::F32, 19),
        10,
        7,
        2
    )));
    assert!(
        args::scatter_cols(s(DType::F32, 6), 3, s(DType::F32, 20), 10, 7, 2)
            .unwrap()
            .is_some()
    );
}

#[test]
fn gather_rows_moves_widest_units() {
    let idx = s(DType::U32, 4);
    // bf16 rows of 6 elements (12 bytes), aligned: words.
    let l = args::gather_rows(s(DType::BF16, 60), idx, 6, s(DType::BF16, 24))
        .unwrap()
        .unwrap();
    assert_eq!((l.args.4, l.args.5, l.args.6), (3, 10, 4));
    // bf16 rows of 3 elements: half words.
    let l = args::gather_rows(s(DType::BF16, 30), idx, 3, s(DType::BF16, 12))
        .unwrap()
        .unwrap();
    assert_eq!((l.args.4, l.args.6), (3, 2));
    // A misaligned f32 view cannot happen; an odd bf16 offset can.
    let src = at(0x10_0002, DType::BF16, 60);
    let l = args::gather_rows(src, idx, 6, s(DType::BF16, 24))
        .unwrap()
        .unwrap();
    assert_eq!((l.args.4, l.args.6), (6, 2));
    let l = args::gather_rows(s(DType::U8, 50), idx, 5, s(DType::U8, 20))
        .unwrap()
        .unwrap();
    assert_eq!(l.args.6, 1);
    assert!(is_shape(args::gather_rows(
        s(DType::F32, 60),
        idx,
        6,
        s(DType::BF16, 24)
    )));
    assert!(is_shape(args::gather_rows(
        s(DType::F32, 60),
        idx,
        6,
        s(DType::F32, 23)
    )));
}

#[test]
fn scatter_add_rows_checks() {
    let (src, rows, dst) = (s(DType::F32, 3 * 8), s(DType::U32, 3), s(DType::F32, 16));
    let l = args::scatter_add_rows(src, rows, s(DType::F32, 3), 8, dst)
        .unwrap()
        .unwrap();
    assert_eq!((l.args.4, l.args.5, l.args.6), (3, 8, 2));
    assert!(is_shape(args::scatter_add_rows(
        src,
        rows,
        s(DType::F32, 2),
        8,
        dst
    )));
    assert!(is_shape(args::scatter_add_rows(
        s(DType::F32, 23),
        rows,
        s(DType::F32, 3),
        8,
        dst
    )));
    assert!(is_dtype(args::scatter_add_rows(
        src,
        rows,
        s(DType::BF16, 3),
        8,
        dst
    )));
}

fn cache(dtype: DType, blocks: usize, kv_width: usize, bs: usize) -> KvLayer {
    KvLayer {
        k: s(dtype, blocks * kv_width * bs),
        v: s(dtype, blocks * kv_width * bs),
        block_size: bs,
    }
}

#[test]
fn kv_store_checks() {
    let (k, slots) = (s(DType::F32, 5 * 256), s(DType::U32, 5));
    let c = cache(DType::BF16, 10, 256, 16);
    let l = kv_store_launch(k, k, &c, slots, 256).unwrap().unwrap();
    assert_eq!(l.args.8, 160, "capacity in slots");
    assert_eq!(l.args.9, 1);
    let f16 = kv_store_launch(k, k, &cache(DType::F16, 10, 256, 16), slots, 256);
    assert_eq!(f16.unwrap().unwrap().args.9, 2, "DT_F16");
    assert!(is_dtype(kv_store_launch(
        k,
        k,
        &cache(DType::U32, 10, 256, 16),
        slots,
        256
    )));
    let mixed = KvLayer {
        v: s(DType::F32, c.v.len()),
        ..c
    };
    assert!(is_shape(kv_store_launch(k, k, &mixed, slots, 256)));
    assert!(is_shape(kv_store_launch(
        s(DType::F32, 100),
        k,
        &c,
        slots,
        256
    )));
    assert!(is_shape(kv_store_launch(
        k,
        k,
        &cache(DType::F32, 1, 256, 0),
        slots,
        256
    )));
}

#[test]
fn block_plan_fits_shared_memory() {
    for hd in [32, 64, 80, 96, 128, 192, 256] {
        for group in [1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 32, 64] {
            let b = block_plan(group, hd);
            assert!(
                group.is_multiple_of(b.hpb) && b.hpb <= 16,
                "{group} {hd} {b:?}"
            );
            assert!(b.shared_bytes <= 47 * 1024, "{group} {hd} {b:?}");
            let tiles = if b.separate_kv { 2 } else { 1 };
            assert_eq!(b.shared_bytes, 4 * (b.hpb * hd + tiles * 32 * hd));
        }
    }
    // Llama-style 128: 8 heads a block, keys and values side by side.
    let b = block_plan(8, 128);
    assert_eq!((b.hpb, b.separate_kv), (8, true));
    // 256: one tile, reused for the values.
    let b = block_plan(8, 256);
    assert_eq!((b.hpb, b.separate_kv), (8, false));
}

#[test]
fn splits_policy() {
    let target = 4 * 132;
    // Decode of one sequence, 8 kv heads: split wide.
    assert_eq!(choose_splits(1, 32, 4, 128, target), MAX_SPLITS);
    // A big decode batch already fills the GPU.
    assert_eq!(choose_splits(256, 32, 4, 128, target), 1);
    // A long prefill: one split.
    assert_eq!(choose_splits(4096, 32, 4, 128, target), 1);
    // In between: enough blocks for the target.
    assert_eq!(choose_splits(16, 32, 4, 128, target), target.div_ceil(64));
    // The partials stay within their budget.
    for rows in [1, 2, 7, 33, 100, 1000] {
        for (nh, hd) in [(32, 128), (64, 256), (128, 64)] {
            let s = choose_splits(rows, nh, 1, hd, 4000);
            assert!((1..=MAX_SPLITS).contains(&s));
            if s > 1 {
                assert!(rows * nh * s * (hd + 2) * 4 <= PARTIALS_BUDGET);
            }
        }
    }
}

#[test]
fn split_bounds_cover_every_row_count() {
    let target = 4 * 132;
    for rows_bound in [1, 3, 40, 131, 600, 8192] {
        let b = split_bounds(rows_bound, 32, 8, 128, target);
        let mut items = 0;
        for rows in 1..=rows_bound {
            let s = choose_splits(rows, 32, 8, 128, target);
            items = items.max(rows * s);
            if s > 1 {
                assert!(rows <= b.split_rows);
                assert!(rows * 32 * s * 130 * 4 <= b.partial_bytes);
            }
        }
        assert_eq!(b.items, items, "{rows_bound}");
        assert!(b.partial_bytes <= PARTIALS_BUDGET);
    }
    // Rows that fill the GPU alone: no partials at all.
    let b = split_bounds(10, 32, 64, 128, 64);
    assert_eq!((b.items, b.partial_bytes, b.split_rows), (10, 0, 0));
}

fn attn_params(window: Option<usize>) -> AttnParams {
    AttnParams {
        n_heads: 32,
        n_kv_heads: 8,
        head_dim: 128,
        scale: 0.088,
        sliding_window: window,
    }
}

#[test]
fn attention_launch_shapes() {
    let c = cache(DType::BF16, 64, 8 * 128, 16);
    let batch = AttnBatch {
        seqs: s(DType::U32, 2 * 4),
        n_seqs: 2,
        block_tables: s(DType::U32, 10),
    };
    let p = attn_params(Some(4096));
    // A buffer of 2 rows: decode splits, partials and a reduce.
    let q = s(DType::F32, 2 * 32 * 128);
    let a = attention_launch(q, &c, q, &batch, &p, 132)
        .unwrap()
        .unwrap();
    assert_eq!(
        a.main.cfg.grid.1,
        32 / 4,
        "one block per kv head's group of 4"
    );
    assert_eq!(a.main.cfg.block, (4 * 32, 1, 1));
    assert_eq!(
        a.main.cfg.grid.0 as usize,
        2 * MAX_SPLITS,
        "two rows of 32 splits"
    );
    assert_eq!(a.partial_bytes, 2 * 32 * MAX_SPLITS * 130 * 4);
    let r = a.reduce.unwrap();
    assert_eq!(r.cfg.grid.0, 2 * 32);
    assert_eq!(
        (r.args.0, r.args.4, r.args.5, r.args.6, r.args.7),
        (Ptr::NULL, 32, 8, 128, 2)
    );
    assert_eq!(a.main.args.6, Ptr::NULL);
    assert_eq!(a.main.args.12, 4096, "window");
    assert_eq!(a.main.args.13, 64, "blocks");
    assert_eq!(a.main.args.14, 10, "table entries");
    assert_eq!(
        a.main.args.15,
        1 | 2 | 4,
        "bf16, keys and values side by side, 16-byte units"
    );
    assert_eq!(
        (a.main.args.16, a.main.args.17),
        (2, BLOCKS_PER_SM as i32 * 132)
    );
    // The engine's whole buffer of 2048 rows: the grid covers a few waves,
    // and a decode among them still splits.
    let q = s(DType::F32, 2048 * 32 * 128);
    let a = attention_launch(q, &c, q, &batch, &attn_params(None), 132)
        .unwrap()
        .unwrap();
    assert_eq!(
        a.main.cfg.grid.0 as usize,
        (4 * BLOCKS_PER_SM * 132).div_ceil(8)
    );
    assert!(a.partial_bytes > 0 && a.partial_bytes <= PARTIALS_BUDGET);
    assert_eq!(a.main.args.12, 0);
    // f32 cache, head_dim 256: one shared tile.
    let c = cache(DType::F32, 64, 256, 16);
    let p = AttnParams {
        n_heads: 8,
        n_kv_heads: 1,
        head_dim: 256,
        ..p
    };
    let q = s(DType::F32, 8 * 256);
    let a = attention_launch(q, &c, q, &batch, &p, 132)
        .unwrap()
        .unwrap();
    assert_eq!(a.main.args.15, 4, "f32, one tile, 16-byte units");
    // An f16 cache: FLAG_F16.
    let c16 = cache(DType::F16, 64, 256, 16);
    let a = attention_launch(q, &c16, q, &batch, &p, 132)
        .unwrap()
        .unwrap();
    assert_eq!(a.main.args.15, 8 | 4, "f16, one tile, 16-byte units");
    // Blocks of 12 tokens, or a cache at an odd offset: element by element.
    let c12 = cache(DType::F32, 64, 256, 12);
    let a = attention_launch(q, &c12, q, &batch, &p, 132)
        .unwrap()
        .unwrap();
    assert_eq!(a.main.args.15, 0);
    let odd = KvLayer {
        k: at(0x10_0008, DType::F32, 64 * 256 * 16),
        ..c
    };
    let a = attention_launch(q, &odd, q, &batch, &p, 132)
        .unwrap()
        .unwrap();
    assert_eq!(a.main.args.15, 0);
}

#[test]
fn attention_rejects_before_launching() {
    let c = cache(DType::F32, 4, 8 * 128, 16);
    let batch = AttnBatch {
        seqs: s(DType::U32, 4),
        n_seqs: 1,
        block_tables: s(DType::U32, 4),
    };
    let q = s(DType::F32, 32 * 128);
    let p = attn_params(None);
    assert!(
        attention_launch(q, &c, q, &batch, &p, 132)
            .unwrap()
            .is_some()
    );
    let bad = |p: AttnParams| is_shape(attention_launch(q, &c, q, &batch, &p, 132));
    assert!(bad(AttnParams { n_kv_heads: 5, ..p }));
    assert!(bad(AttnParams { n_kv_heads: 0, ..p }));
    assert!(bad(AttnParams { head_dim: 0, ..p }));
    assert!(bad(AttnParams {
        n_heads: 2,
        n_kv_heads: 1,
        head_dim: 512,
        ..p
    }));
    assert!(bad(attn_params(Some(0))));
    // Short descriptors, a short output, odd dtypes.
    let short = AttnBatch { n_seqs: 2, ..batch };
    assert!(is_shape(attention_launch(q, &c, q, &short, &p, 132)));
    assert!(is_shape(attention_launch(
        q,
        &c,
        s(DType::F32, 100),
        &batch,
        &p,
        132
    )));
    assert!(is_dtype(attention_launch(
        q,
        &cache(DType::U32, 4, 1024, 16),
        q,
        &batch,
        &p,
        132
    )));
    assert!(is_dtype(attention_launch(
        s(DType::BF16, 4096),
        &c,
        q,
        &batch,
        &p,
        132
    )));
    let words = AttnBatch {
        seqs: s(DType::I32, 4),
        ..batch
    };
    assert!(is_dtype(attention_launch(q, &c, q, &words, &p, 132)));
    // Nothing to do.
    let none = AttnBatch { n_seqs: 0, ..batch };
    assert!(
        attention_launch(q, &c, q, &none, &p, 132)
            .unwrap()
            .is_none()
    );
}
