//! Tests of the CPU backend's own behaviour: rows independent of the batch,
//! the bf16-dot paths, errors for bad shapes, metadata and expert tables,
//! memory limits and thread counts. What every backend must do (each op
//! against its f64 reference) is the conformance suite's
//! (`crate::conformance`, run by `tests/conformance.rs`).

use metrale_core::{BlockId, DType};

use super::recurrent::tests::{Env, Rng};
use crate::error::GpuError;
use crate::ops::dense::{AttnParams, DenseOps, KvLayer};
use crate::ops::moe::{ExpertGroups, ExpertTable, MoeOps};
use crate::ops::recurrent::ConvAct;

/// Each query row's result depends on its own sequence only: the same
/// rows alone or batched with others, on one thread or several, are
/// bitwise equal. A long call runs tiles of rows that share each block's
/// loads (the prefill path), a row alone runs by itself (the decode path):
/// the same bits, with f32 and bf16 caches, with and without a sliding
/// window.
#[test]
fn paged_attention_rows_do_not_depend_on_the_batch() {
    for (bf16_cache, window) in [
        (false, None),
        (true, None),
        (false, Some(9)),
        (true, Some(20)),
    ] {
        rows_alone_and_batched_agree(bf16_cache, window);
    }
}

fn rows_alone_and_batched_agree(bf16_cache: bool, sliding_window: Option<usize>) {
    let (block_size, hd) = (16, 64);
    let p = AttnParams {
        n_heads: 4,
        n_kv_heads: 1,
        head_dim: hd,
        scale: 0.125,
        sliding_window,
    };
    let width = p.n_heads * hd;
    let mut rng = Rng::new(7);
    let table = [BlockId(2), BlockId(0), BlockId(3), BlockId(1)];
    let k = rng.vec(4 * block_size * hd, -2.0, 2.0);
    let v = rng.vec(4 * block_size * hd, -1.0, 1.0);
    let q = rng.vec(40 * width, -2.0, 2.0);
    let run_q = |threads: usize, q: &[f32], seqs: &[(usize, usize, usize)]| {
        let mut env = Env::with_threads(threads);
        let (ks, vs) = if bf16_cache {
            (env.up_bf16(&k).0, env.up_bf16(&v).0)
        } else {
            (env.up(&k), env.up(&v))
        };
        let qs = env.up(q);
        let out = env.up(&vec![0.0; 40 * width]);
        let cache = KvLayer {
            k: ks,
            v: vs,
            block_size,
        };
        let seqs: Vec<(usize, usize, usize, &[BlockId])> = seqs
            .iter()
            .map(|&(q_start, q_len, kv_len)| (q_start, q_len, kv_len, &table[..]))
            .collect();
        let seqs = env.attn(&seqs);
        env.cpu
            .paged_attention(qs, &cache, out, &seqs, &p)
            .expect("attention");
        let got = env.down(out);
        env.finish();
        got
    };
    let run = |threads: usize, seqs: &[(usize, usize, usize)]| run_q(threads, &q, seqs);
    let what = format!("bf16 cache {bf16_cache}, window {sliding_window:?}");
    // Query rows 0..40 at positions 5..45 of one sequence, as one call ...
    let whole = run(1, &[(0, 40, 45)]);
    // ... and as a decode-like single row, a chunk, and the rest, batched, on 3 threads ...
    let split = run(3, &[(0, 1, 6), (1, 17, 23), (18, 22, 45)]);
    assert_eq!(whole, split, "{what}");
    // ... and in tiles of rows of two sequences, on 2 threads.
    let pair = run(2, &[(0, 21, 26), (21, 19, 45)]);
    assert_eq!(whole, pair, "{what}");
    // Each row alone, by the decode path (fewer rows than 4 per thread).
    for r in [0, 7, 16, 29, 39] {
        let row = r * width..(r + 1) * width;
        let alone = run_q(2, &q[row.clone()], &[(0, 1, r + 6)]);
        assert_eq!(whole[row], alone[..width], "{what}, row {r}");
    }
}

/// The fused SwiGLU gives the bits of two matmuls and `silu_mul` with bf16
/// dot products too: the GEMV (few rows), and the bf16-dot GEMM with its
/// fused epilogue (where the CPU has AVX512-BF16). The f32 paths are the
/// conformance suite's.
#[test]
fn matmul_swiglu_equals_two_matmuls_and_silu_mul_with_bf16_dots() {
    use crate::cpu::CpuBackend;
    use crate::ops::dense::MatmulDims;
    let (n, k) = (70, 96);
    for m in [3, 40] {
        for bf16_weights in [false, true] {
            let cpu = CpuBackend::with_threads(2).with_bf16_dot_products(true);
            let mut env = Env::with_backend(cpu);
            let mut rng = Rng::new(m as u64 * 7 + bf16_weights as u64);
            let x = env.up(&rng.vec(m * k, -1.0, 1.0));
            let (gv, uv) = (rng.vec(n * k, -0.3, 0.3), rng.vec(n * k, -0.3, 0.3));
            let (gate, up) = if bf16_weights {
                (env.up_bf16(&gv).0, env.up_bf16(&uv).0)
            } else {
                (env.up(&gv), env.up(&uv))
            };
            let zeros = vec![0.0; m * n];
            let (fused, g, u, unfused) = (
                env.up(&zeros),
                env.up(&zeros),
                env.up(&zeros),
                env.up(&zeros),
            );
            let scratch = env.up(&zeros);
            let d = MatmulDims { m, n, k };
            env.cpu
                .matmul_swiglu(x, gate, up, fused, scratch, d)
                .expect("fused");
            env.cpu.matmul(x, gate, None, g, d).expect("gate");
            env.cpu.matmul(x, up, None, u, d).expect("up");
            env.cpu.silu_mul(g, u, unfused, m * n).expect("silu_mul");
            let what = format!("m {m}, bf16 weights {bf16_weights}");
            assert_eq!(env.down(fused), env.down(unfused), "{what}");
            env.finish();
        }
    }
}

/// Bad shapes are errors naming the op, not panics: zero block size or head
/// size, heads that do not divide, a block table too short, a slot beyond
/// the cache.
#[test]
fn paged_attention_and_kv_store_reject_bad_shapes() {
    let mut env = Env::new();
    let buf = env.up(&vec![0.0; 4096]);
    let seqs = env.attn(&[(0, 1, 4, &[BlockId(0)])]);
    let good = AttnParams {
        n_heads: 4,
        n_kv_heads: 2,
        head_dim: 8,
        scale: 1.0,
        sliding_window: None,
    };
    let cache = |block_size| KvLayer {
        k: buf,
        v: buf,
        block_size,
    };
    let cases = [
        (cache(0), good),
        (
            cache(4),
            AttnParams {
                head_dim: 0,
                ..good
            },
        ),
        (
            cache(4),
            AttnParams {
                n_kv_heads: 3,
                ..good
            },
        ),
        (cache(2), good), // 4 cached tokens, one block of 2
    ];
    for (i, (c, p)) in cases.iter().enumerate() {
        let err = env
            .cpu
            .paged_attention(buf, c, buf, &seqs, p)
            .expect_err("bad shape");
        assert!(
            err.to_string().contains("paged_attention"),
            "case {i}: {err}"
        );
    }
    let slot = env.u32s(&[4096]);
    let err = env
        .cpu
        .kv_store(buf, buf, &cache(4), slot, 16)
        .expect_err("slot beyond the cache");
    assert!(err.to_string().contains("capacity"), "{err}");
    env.finish();
}

/// Out-of-memory errors name the allocation's owner (they read `for ""`),
/// a size that overflows is one too, and the backend reports what it has
/// left under its limit.
#[test]
fn out_of_memory_names_the_owner() {
    use crate::cpu::CpuBackend;
    use crate::gpu::GpuBackend;
    use metrale_core::DType;
    let cpu = CpuBackend::with_threads(1).with_memory_limit(4096);
    let g: &dyn GpuBackend = &cpu;
    let err = g
        .alloc_slice(DType::F32, 2048, "kv cache")
        .unwrap_err()
        .to_string();
    assert!(err.contains("for \"kv cache\""), "{err}");
    let err = g
        .alloc_slice(DType::F32, usize::MAX / 2, "huge")
        .unwrap_err()
        .to_string();
    assert!(err.contains("huge"), "{err}");
    let s = g.alloc_slice(DType::F32, 256, "some").expect("fits");
    assert!(g.available_memory().is_some_and(|a| a <= 4096 - 1024));
    g.free(s.ptr()).unwrap();
    assert_eq!(g.live_bytes(), 0);
}

#[test]
fn thread_counts_beyond_the_machine_are_refused() {
    use crate::cpu::{CpuBackend, MAX_THREADS_PER_CORE};
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let err = CpuBackend::try_with_threads(cores * MAX_THREADS_PER_CORE + 1)
        .err()
        .expect("too many threads")
        .to_string();
    assert!(err.contains("per core"), "{err}");
    assert!(CpuBackend::try_with_threads(cores).is_ok());
}

/// Bad step metadata is a clear error naming what is wrong, not a read
/// beyond an allocation: a block id beyond the cache, a block table beyond
/// the tables, a state slot beyond the pool, a token id beyond the
/// vocabulary, a row beyond a gather's source.
#[test]
fn bad_step_metadata_is_an_error() {
    use crate::ops::recurrent::RecurrentOps;
    use crate::ops::step::{AttnBatch, StateSlots};
    let mut env = Env::new();
    let (bs, kv_width) = (4, 16);
    let p = AttnParams {
        n_heads: 4,
        n_kv_heads: 2,
        head_dim: 8,
        scale: 1.0,
        sliding_window: None,
    };
    // A cache of 3 blocks.
    let zeros = vec![0.0; 3 * bs * kv_width];
    let cache = KvLayer {
        k: env.up(&zeros),
        v: env.up(&zeros),
        block_size: bs,
    };
    let (q, out) = (env.up(&[0.0; 32]), env.up(&[0.0; 32]));
    let message = |r: crate::error::Result<()>| match r {
        Err(e @ GpuError::Shape { .. }) => e.to_string(),
        other => panic!("expected a shape error, got {other:?}"),
    };

    let beyond = env.attn(&[(0, 1, 6, &[BlockId(1), BlockId(3)])]);
    let err = message(env.cpu.paged_attention(q, &cache, out, &beyond, &p));
    assert!(err.contains("block 3 beyond a cache of 3"), "{err}");

    // Sequence 1's table starts past the end of the tables.
    let words = env.u32s(&[0, 1, 4, 0, 1, 1, 4, 7]);
    let tables = env.u32s(&[0, 1]);
    let batch = AttnBatch {
        seqs: words,
        n_seqs: 2,
        block_tables: tables,
    };
    let err = message(env.cpu.paged_attention(q, &cache, out, &batch, &p));
    assert!(
        err.contains("sequence 1") && err.contains("outside"),
        "{err}"
    );
    // Fewer sequence words than sequences.
    let short = AttnBatch { n_seqs: 3, ..batch };
    assert!(matches!(
        env.cpu.paged_attention(q, &cache, out, &short, &p),
        Err(GpuError::Shape { .. })
    ));

    // A state slot beyond a pool of 2.
    let (ch, k) = (4, 4);
    let pool = StateSlots {
        states: env.up(&vec![0.0; 2 * ch * (k - 1)]),
        per_slot: ch * (k - 1),
    };
    let (x, w) = (env.up(&vec![0.0; 2 * ch]), env.up(&vec![0.0; ch * k]));
    let y = env.up(&vec![0.0; 2 * ch]);
    let seqs = env.batch(&[(0, 1, 1), (1, 1, 2)]);
    let err = message(
        env.cpu
            .causal_conv1d(x, w, None, y, pool, &seqs, ch, k, ConvAct::Silu),
    );
    assert!(err.contains("slot 2") && err.contains("pool of 2"), "{err}");

    // A token id beyond a vocabulary of 5.
    let table = env.up(&[0.0; 5 * 8]);
    let ids = env.u32s(&[4, 5]);
    let err = message(env.cpu.embedding(table, ids, 8, out));
    assert!(
        err.contains("token id 5") && err.contains("vocabulary of 5"),
        "{err}"
    );

    // A row beyond a gather's source of 5 rows; a gather that changes the dtype.
    let rows = env.u32s(&[0, 5]);
    let err = message(env.cpu.gather_rows(table, rows, 8, out));
    assert!(err.contains("row 5 beyond"), "{err}");
    let (bf16_table, _) = env.up_bf16(&[0.0; 5 * 8]);
    let rows = env.u32s(&[0, 1]);
    let err = message(env.cpu.gather_rows(bf16_table, rows, 8, out));
    assert!(err.contains("bf16 rows gathered into f32"), "{err}");
    env.finish();
}

/// A table entry that is not the address of a live allocation (null, or
/// inside none, or running past the end of one) is a shape error, not a
/// read of someone else's memory.
#[test]
fn a_bad_expert_address_is_an_error() {
    let mut env = Env::new();
    let (n, k, n_experts) = (8, 16, 4);
    // Two tokens, each routed to experts 0 and 1.
    let groups = ExpertGroups {
        offsets: env.u32s(&[0, 2, 4, 4, 4]),
        rows: env.u32s(&[0, 1, 0, 1]),
        weights: env.up(&[1.0; 4]),
        n_experts,
    };
    let w = env.up(&vec![0.1; n * k]);
    let live = w.ptr().raw();
    let good = ExpertTable {
        ptrs: env.up_u64(&[live; 4]),
        dtype: DType::F32,
        n,
        k,
    };
    let x = env.up(&vec![1.0; 4 * k]);
    let (out, scratch) = (env.up(&vec![0.0; 4 * n]), env.up(&vec![0.0; 4 * n]));
    env.cpu
        .grouped_matmul(x, &good, &groups, out)
        .expect("a good table");
    for bad in [0x40u64, 0, live + 4] {
        let table = ExpertTable {
            ptrs: env.up_u64(&[live, bad, live, live]),
            ..good
        };
        let r = env.cpu.grouped_matmul(x, &table, &groups, out);
        assert!(matches!(r, Err(GpuError::Shape { .. })), "{bad:#x}: {r:?}");
        let r = env
            .cpu
            .grouped_matmul_swiglu(x, &table, &good, &groups, out, scratch);
        assert!(matches!(r, Err(GpuError::Shape { .. })), "{bad:#x}: {r:?}");
    }
    env.finish();
}
