//! Host-side tests of the CUDA MoE ops (`moe_args.rs`): operand checks that
//! fail before any launch, launch shapes, and the grouped matmuls' tile
//! bound. No device needed.

use metrale_core::DType;

use super::launch::Ptr;
use super::moe_args::{self as args, GROUP_THREADS, ROUTER_THREADS, TILE};
use crate::error::GpuError;
use crate::gpu::{DevicePtr, DeviceSlice};
use crate::ops::{ExpertGroups, ExpertTable, GroupedTopK, Routes};

/// A slice at a made-up address (never dereferenced).
fn s(dtype: DType, len: usize) -> DeviceSlice {
    DeviceSlice::new(DevicePtr::from_raw(0x10_0000).unwrap(), dtype, len)
}

fn is_shape<T>(r: crate::error::Result<T>) -> bool {
    matches!(r, Err(GpuError::Shape { .. }))
}

fn is_dtype<T>(r: crate::error::Result<T>) -> bool {
    matches!(r, Err(GpuError::UnsupportedDType { .. }))
}

fn routes(rows: usize, k: usize) -> Routes {
    Routes {
        experts: s(DType::U32, rows * k),
        weights: s(DType::F32, rows * k),
        rows,
        k,
    }
}

fn groups(entries: usize, n_experts: usize) -> ExpertGroups {
    ExpertGroups {
        offsets: s(DType::U32, n_experts + 1),
        rows: s(DType::U32, entries),
        weights: s(DType::F32, entries),
        n_experts,
    }
}

fn table(n_experts: usize, n: usize, k: usize, dtype: DType) -> ExpertTable {
    ExpertTable {
        ptrs: s(DType::U64, n_experts),
        dtype,
        n,
        k,
    }
}

fn grouping(k: usize, n_group: usize, topk_group: usize) -> GroupedTopK {
    GroupedTopK {
        k,
        n_group,
        topk_group,
        renormalize: true,
        renorm_eps: 1e-20,
        scale: 2.5,
    }
}

#[test]
fn softmax_topk_checks_and_launches_a_block_per_row() {
    let l = args::softmax_topk(s(DType::F32, 3 * 64), 64, true, &routes(3, 8))
        .unwrap()
        .unwrap();
    assert_eq!(l.cfg.grid, (3, 1, 1));
    assert_eq!(l.cfg.block, (ROUTER_THREADS, 1, 1));
    assert_eq!(l.cfg.shared_bytes, 64 * 5, "probabilities and taken flags");
    assert_eq!((l.args.3, l.args.4, l.args.5, l.args.6), (3, 64, 8, 1));
    let logits = s(DType::F32, 3 * 64);
    assert!(is_shape(args::softmax_topk(
        logits,
        64,
        true,
        &routes(3, 0)
    )));
    assert!(is_shape(args::softmax_topk(logits, 4, true, &routes(3, 5))));
    assert!(is_shape(args::softmax_topk(
        s(DType::F32, 3 * 64 - 1),
        64,
        true,
        &routes(3, 8)
    )));
    let mut r = routes(3, 8);
    r.experts = s(DType::F32, 24);
    assert!(is_dtype(args::softmax_topk(logits, 64, false, &r)));
    let mut r = routes(3, 8);
    r.weights = s(DType::F32, 23);
    assert!(is_shape(args::softmax_topk(logits, 64, false, &r)));
    assert!(
        args::softmax_topk(s(DType::F32, 0), 64, true, &routes(0, 8))
            .unwrap()
            .is_none()
    );
}

#[test]
fn sigmoid_topk_checks_groups_bias_and_routes() {
    let logits = s(DType::F32, 2 * 256);
    let p = grouping(8, 8, 4);
    let l = args::sigmoid_topk(logits, Some(s(DType::BF16, 256)), 256, &p, &routes(2, 8))
        .unwrap()
        .unwrap();
    assert_eq!(l.cfg.grid, (2, 1, 1));
    assert_eq!(l.cfg.shared_bytes as usize, 8 * 256 + 4 * 8 + 256 + 8);
    assert_eq!(l.args.2, 1, "bf16 bias");
    assert_eq!(
        (l.args.5, l.args.6, l.args.7, l.args.8, l.args.9, l.args.10),
        (2, 256, 8, 8, 4, 1)
    );
    assert_eq!(l.args.11, 2.5);
    let none = args::sigmoid_topk(logits, None, 256, &p, &routes(2, 8))
        .unwrap()
        .unwrap();
    assert_eq!(none.args.1, Ptr::NULL);
    // The CPU's impossible shapes (cpu/routing.rs's tests), and more.
    let l6 = s(DType::F32, 6);
    for bad in [
        grouping(2, 4, 1),
        grouping(3, 3, 1),
        grouping(1, 3, 4),
        grouping(0, 3, 1),
        grouping(1, 0, 1),
        grouping(1, 3, 0),
    ] {
        let r = routes(1, bad.k);
        assert!(
            is_shape(args::sigmoid_topk(l6, None, 6, &bad, &r)),
            "{bad:?}"
        );
    }
    assert!(is_shape(args::sigmoid_topk(
        logits,
        None,
        256,
        &p,
        &routes(2, 6)
    )));
    assert!(is_shape(args::sigmoid_topk(
        logits,
        Some(s(DType::F32, 255)),
        256,
        &p,
        &routes(2, 8)
    )));
    assert!(is_dtype(args::sigmoid_topk(
        logits,
        Some(s(DType::U8, 256)),
        256,
        &p,
        &routes(2, 8)
    )));
    assert!(
        args::sigmoid_topk(s(DType::F32, 0), None, 256, &p, &routes(0, 8))
            .unwrap()
            .is_none()
    );
}

#[test]
fn moe_group_is_one_block_even_without_entries() {
    let l = args::moe_group(&routes(5, 2), &groups(10, 4)).unwrap();
    assert_eq!(l.cfg.grid, (1, 1, 1));
    assert_eq!(l.cfg.block, (GROUP_THREADS, 1, 1));
    assert_eq!(l.cfg.shared_bytes, 16);
    assert_eq!((l.args.5, l.args.6, l.args.7), (10, 2, 4));
    // No entries: the offsets are still written (all zero).
    let l = args::moe_group(&routes(0, 2), &groups(0, 4)).unwrap();
    assert_eq!((l.args.5, l.args.7), (0, 4));
    assert!(is_shape(args::moe_group(&routes(5, 2), &groups(9, 4))));
    let mut g = groups(10, 4);
    g.offsets = s(DType::U32, 4);
    assert!(is_shape(args::moe_group(&routes(5, 2), &g)));
    let mut g = groups(10, 4);
    g.rows = s(DType::F32, 10);
    assert!(is_dtype(args::moe_group(&routes(5, 2), &g)));
    assert!(is_shape(args::moe_group(
        &routes(5, 2),
        &groups(10, 20_000)
    )));
}

/// The tiles `find_tile` (moe.cu) maps grid row `t` to, on the host: expert
/// e's rows `a..b` in tiles of TILE, the experts in order.
fn tile_of(offsets: &[u32], t: usize) -> Option<(usize, usize, usize)> {
    let mut before = 0;
    for e in 0..offsets.len() - 1 {
        let (a, b) = (offsets[e] as usize, offsets[e + 1] as usize);
        let tiles = (b - a).div_ceil(TILE);
        if t < before + tiles {
            return Some((e, a + (t - before) * TILE, b));
        }
        before += tiles;
    }
    None
}

#[test]
fn the_grid_bounds_every_expert_tile() {
    // Skewed splits of the entries over the experts, empty groups included.
    let mut seed = 12345u64;
    for &(entries, n_experts) in &[(1, 1), (8, 64), (64, 8), (65, 3), (4096, 128), (3000, 512)] {
        for _ in 0..20 {
            let mut counts = vec![0u32; n_experts];
            for _ in 0..entries {
                seed = seed
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                let r = (seed >> 33) as usize;
                // Half the entries to expert 0, the rest anywhere.
                let e = if r.is_multiple_of(2) {
                    0
                } else {
                    (r / 2) % n_experts
                };
                counts[e] += 1;
            }
            let mut offsets = vec![0u32];
            for c in &counts {
                offsets.push(offsets.last().unwrap() + c);
            }
            let (rows, cols, _) = args::grouped_grid(entries, 100, n_experts);
            assert_eq!(cols, 2);
            let mut covered = vec![0u8; entries];
            for t in 0..rows as usize {
                if let Some((e, r0, end)) = tile_of(&offsets, t) {
                    assert!(r0 < end && end <= offsets[e + 1] as usize);
                    covered[r0..end.min(r0 + TILE)]
                        .iter_mut()
                        .for_each(|c| *c += 1);
                }
            }
            assert!(covered.iter().all(|&c| c == 1), "{entries} x {n_experts}");
        }
    }
}

#[test]
fn grouped_matmul_checks_tables_and_buffers() {
    let (entries, n, k, experts) = (24, 96, 40, 6);
    let g = groups(entries, experts);
    let w = table(experts, n, k, DType::BF16);
    let (x, out) = (s(DType::F32, entries * k), s(DType::F32, entries * n));
    let l = args::grouped_matmul(x, &w, &g, out).unwrap().unwrap();
    assert_eq!(l.cfg.grid, (1 + 6, 2, 1));
    assert_eq!(l.cfg.block, (args::GM_THREADS, 1, 1));
    assert_eq!(l.args.2, 1, "bf16");
    assert_eq!((l.args.5, l.args.6, l.args.7, l.args.8), (24, 96, 40, 6));
    assert!(is_shape(args::grouped_matmul(
        s(DType::F32, entries * k - 1),
        &w,
        &g,
        out
    )));
    assert!(is_shape(args::grouped_matmul(
        x,
        &w,
        &g,
        s(DType::F32, entries * n - 1)
    )));
    let mut bad = w;
    bad.ptrs = s(DType::U32, experts * 2);
    assert!(is_dtype(args::grouped_matmul(x, &bad, &g, out)));
    assert!(is_shape(args::grouped_matmul(
        x,
        &table(experts - 1, n, k, DType::BF16),
        &g,
        out
    )));
    assert!(is_dtype(args::grouped_matmul(
        x,
        &table(experts, n, k, DType::U8),
        &g,
        out
    )));
    // No entries: nothing to launch.
    let none = args::grouped_matmul(s(DType::F32, 0), &w, &groups(0, experts), s(DType::F32, 0));
    assert!(none.unwrap().is_none());
}

#[test]
fn grouped_matmul_swiglu_needs_matching_tables_and_scratch() {
    let (entries, n, k, experts) = (10, 64, 32, 4);
    let g = groups(entries, experts);
    let (gate, up) = (
        table(experts, n, k, DType::F16),
        table(experts, n, k, DType::F16),
    );
    let (x, out) = (s(DType::F32, entries * k), s(DType::F32, entries * n));
    let scratch = s(DType::F32, entries * n);
    let l = args::grouped_matmul_swiglu(x, &gate, &up, &g, out, scratch)
        .unwrap()
        .unwrap();
    assert_eq!(l.cfg.grid, (1 + 4, 1, 1));
    assert_eq!(l.args.3, 2, "f16");
    let other = table(experts, n + 1, k, DType::F16);
    assert!(is_shape(args::grouped_matmul_swiglu(
        x, &gate, &other, &g, out, scratch
    )));
    let bf = table(experts, n, k, DType::BF16);
    assert!(is_shape(args::grouped_matmul_swiglu(
        x, &gate, &bf, &g, out, scratch
    )));
    assert!(is_shape(args::grouped_matmul_swiglu(
        x,
        &gate,
        &up,
        &g,
        out,
        s(DType::F32, entries * n - 1)
    )));
}

#[test]
fn sigmoid_gate_add_checks_lengths() {
    let l = args::sigmoid_gate_add(s(DType::F32, 12), s(DType::F32, 12), s(DType::F32, 3), 3, 4)
        .unwrap()
        .unwrap();
    assert_eq!((l.args.3, l.args.4), (4, 12));
    assert!(is_shape(args::sigmoid_gate_add(
        s(DType::F32, 12),
        s(DType::F32, 12),
        s(DType::F32, 2),
        3,
        4
    )));
    assert!(is_dtype(args::sigmoid_gate_add(
        s(DType::F32, 12),
        s(DType::BF16, 12),
        s(DType::F32, 3),
        3,
        4
    )));
    assert!(
        args::sigmoid_gate_add(s(DType::F32, 0), s(DType::F32, 0), s(DType::F32, 0), 0, 4)
            .unwrap()
            .is_none()
    );
}
