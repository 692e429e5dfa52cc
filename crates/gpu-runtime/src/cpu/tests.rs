//! Tests of the dense ops against scalar f64 references.

use metrale_core::BlockId;

use super::recurrent::tests::{Env, Rng, assert_close};
use crate::error::GpuError;
use crate::ops::dense::{AttnParams, DenseOps, KvLayer};

mod moe;

/// One sequence of an attention test: its queries' rows and its cache.
struct SeqCase {
    q_start: usize,
    q_len: usize,
    kv_len: usize,
    blocks: Vec<BlockId>,
}

/// Attention of every query row, in f64: softmax over the visible keys.
/// `keys[c][t]` / `values[c][t]` are token `t`'s rows of sequence `c`.
fn attention_ref(
    q: &[f32],
    keys: &[Vec<Vec<f32>>],
    values: &[Vec<Vec<f32>>],
    cases: &[SeqCase],
    p: &AttnParams,
) -> Vec<f64> {
    let (hd, width) = (p.head_dim, p.n_heads * p.head_dim);
    let rows = cases.iter().map(|c| c.q_start + c.q_len).max().unwrap_or(0);
    let mut out = vec![0f64; rows * width];
    for (ci, c) in cases.iter().enumerate() {
        for i in 0..c.q_len {
            let (r, pos) = (c.q_start + i, c.kv_len - c.q_len + i);
            let first = p.sliding_window.map_or(0, |w| (pos + 1).saturating_sub(w));
            for h in 0..p.n_heads {
                let kvh = h / (p.n_heads / p.n_kv_heads);
                let qh = &q[r * width + h * hd..][..hd];
                let head = |rows: &[Vec<f32>], t: usize| rows[t][kvh * hd..][..hd].to_vec();
                let scores: Vec<f64> = (first..=pos)
                    .map(|t| {
                        let kt = head(&keys[ci], t);
                        qh.iter()
                            .zip(&kt)
                            .map(|(&a, &b)| a as f64 * b as f64)
                            .sum::<f64>()
                            * p.scale as f64
                    })
                    .collect();
                let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                let sum: f64 = e.iter().sum();
                let o = &mut out[r * width + h * hd..][..hd];
                for (t, w) in (first..=pos).zip(&e) {
                    for (o, &vv) in o.iter_mut().zip(&head(&values[ci], t)) {
                        *o += w / sum * vv as f64;
                    }
                }
            }
        }
    }
    out
}

/// Writes every token of every case into a fresh cache through `kv_store`
/// (random rows); returns the cache and the rows per case and token.
#[allow(clippy::type_complexity)]
fn filled_cache(
    env: &mut Env,
    rng: &mut Rng,
    cases: &[SeqCase],
    blocks: usize,
    block_size: usize,
    kv_width: usize,
) -> (KvLayer, Vec<Vec<Vec<f32>>>, Vec<Vec<Vec<f32>>>) {
    let zeros = vec![0.0; blocks * block_size * kv_width];
    let cache = KvLayer {
        k: env.up(&zeros),
        v: env.up(&zeros),
        block_size,
    };
    let (mut keys, mut values, mut slots) = (vec![], vec![], vec![]);
    let (mut kf, mut vf) = (vec![], vec![]);
    for c in cases {
        let k: Vec<Vec<f32>> = (0..c.kv_len)
            .map(|_| rng.vec(kv_width, -2.0, 2.0))
            .collect();
        let v: Vec<Vec<f32>> = (0..c.kv_len)
            .map(|_| rng.vec(kv_width, -1.0, 1.0))
            .collect();
        for t in 0..c.kv_len {
            slots.push((c.blocks[t / block_size].index() * block_size + t % block_size) as u32);
            kf.extend_from_slice(&k[t]);
            vf.extend_from_slice(&v[t]);
        }
        keys.push(k);
        values.push(v);
    }
    let (ks, vs, slots) = (env.up(&kf), env.up(&vf), env.u32s(&slots));
    env.cpu
        .kv_store(ks, vs, &cache, slots, kv_width)
        .expect("kv_store");
    (cache, keys, values)
}

/// A prefill from position 0, a decode step and a chunk after cached
/// tokens, batched, over scattered blocks; with and without a window.
#[test]
fn paged_attention_matches_reference() {
    let blocks = |ids: &[u32]| ids.iter().map(|&b| BlockId(b)).collect::<Vec<_>>();
    for (block_size, hd, window) in [
        (4, 8, None),
        (4, 64, Some(5)),
        (16, 64, None),
        (16, 40, Some(3)),
        (16, 128, Some(17)),
    ] {
        let mut env = Env::new();
        let mut rng = Rng::new((block_size * 1000 + hd) as u64 * 31 + window.unwrap_or(0) as u64);
        let p = AttnParams {
            n_heads: 6,
            n_kv_heads: 2,
            head_dim: hd,
            scale: 1.0 / (hd as f32).sqrt(),
            sliding_window: window,
        };
        let cases = [
            SeqCase {
                q_start: 0,
                q_len: 19,
                kv_len: 19,
                blocks: blocks(&[5, 2, 9, 0, 7]),
            },
            SeqCase {
                q_start: 19,
                q_len: 1,
                kv_len: 7,
                blocks: blocks(&[1, 11]),
            },
            SeqCase {
                q_start: 20,
                q_len: 3,
                kv_len: 10,
                blocks: blocks(&[3, 8, 6]),
            },
        ];
        let (width, kv_width) = (p.n_heads * hd, p.n_kv_heads * hd);
        let rows = 23;
        let q = rng.vec(rows * width, -2.0, 2.0);
        let qs = env.up(&q);
        let out = env.up(&vec![f32::NAN; rows * width]);
        let (cache, keys, values) =
            filled_cache(&mut env, &mut rng, &cases, 12, block_size, kv_width);
        let seqs: Vec<(usize, usize, usize, &[BlockId])> = cases
            .iter()
            .map(|c| (c.q_start, c.q_len, c.kv_len, &c.blocks[..]))
            .collect();
        let seqs = env.attn(&seqs);
        env.cpu
            .paged_attention(qs, &cache, out, &seqs, &p)
            .expect("attention");
        let want = attention_ref(&q, &keys, &values, &cases, &p);
        assert_close(
            &env.down(out),
            &want,
            1e-5,
            &format!("hd {hd} window {window:?}"),
        );
        env.finish();
    }
}

/// Each query row's result depends on its own sequence only: the same
/// rows alone or batched with others, on one thread or several, are
/// bitwise equal.
#[test]
fn paged_attention_rows_do_not_depend_on_the_batch() {
    let (block_size, hd) = (16, 64);
    let p = AttnParams {
        n_heads: 4,
        n_kv_heads: 1,
        head_dim: hd,
        scale: 0.125,
        sliding_window: None,
    };
    let width = p.n_heads * hd;
    let mut rng = Rng::new(7);
    let table = [BlockId(2), BlockId(0), BlockId(3)];
    let k = rng.vec(4 * block_size * hd, -2.0, 2.0);
    let v = rng.vec(4 * block_size * hd, -1.0, 1.0);
    let q = rng.vec(40 * width, -2.0, 2.0);
    let run = |threads: usize, seqs: &[(usize, usize, usize)]| {
        let mut env = Env::with_threads(threads);
        let (qs, ks, vs) = (env.up(&q), env.up(&k), env.up(&v));
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
    // Query rows 0..40 at positions 5..45 of one sequence, as one call ...
    let whole = run(1, &[(0, 40, 45)]);
    // ... and as a decode-like single row, a chunk, and the rest, batched, on 3 threads.
    let split = run(3, &[(0, 1, 6), (1, 17, 23), (18, 22, 45)]);
    assert_eq!(whole, split);
}

/// The fused SwiGLU gives the bits of two matmuls and `silu_mul`, on every
/// path: the GEMV (few rows), the f32 GEMM, and the bf16-dot GEMM with its
/// fused epilogue (where the CPU has AVX512-BF16).
#[test]
fn matmul_swiglu_equals_two_matmuls_and_silu_mul() {
    use crate::cpu::CpuBackend;
    use crate::ops::dense::MatmulDims;
    let (n, k) = (70, 96);
    for bf16_dot in [false, true] {
        for m in [3, 40] {
            for bf16_weights in [false, true] {
                let cpu = CpuBackend::with_threads(2).with_bf16_dot_products(bf16_dot);
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
                let what = format!("m {m}, bf16 weights {bf16_weights}, bf16 dot {bf16_dot}");
                assert_eq!(env.down(fused), env.down(unfused), "{what}");
                env.finish();
            }
        }
    }
}

/// A bias is stored like its weight: a bf16 bias (Qwen2's q/k/v biases in
/// its published bf16 checkpoints) adds the same values as the f32 one.
#[test]
fn matmul_adds_a_bias_in_any_stored_dtype() {
    use crate::ops::dense::MatmulDims;
    let (m, n, k) = (3, 10, 8);
    let mut env = Env::new();
    let mut rng = Rng::new(11);
    let x = env.up(&rng.vec(m * k, -1.0, 1.0));
    let (w, wv) = env.up_bf16(&rng.vec(n * k, -0.5, 0.5));
    let (b16, bv) = env.up_bf16(&rng.vec(n, -1.0, 1.0));
    let b32 = env.up(&bv);
    let zeros = vec![0.0; m * n];
    let (with16, with32) = (env.up(&zeros), env.up(&zeros));
    let d = MatmulDims { m, n, k };
    env.cpu
        .matmul(x, w, Some(b16), with16, d)
        .expect("bf16 bias");
    env.cpu
        .matmul(x, w, Some(b32), with32, d)
        .expect("f32 bias");
    let xs = env.down(x);
    let want: Vec<f64> = (0..m * n)
        .map(|i| {
            let (r, c) = (i / n, i % n);
            let dot: f64 = (0..k)
                .map(|j| xs[r * k + j] as f64 * wv[c * k + j] as f64)
                .sum();
            dot + bv[c] as f64
        })
        .collect();
    assert_eq!(env.down(with16), env.down(with32));
    assert_close(&env.down(with16), &want, 1e-5, "matmul with bias");
    env.finish();
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
    let (q, out) = (env.up(&vec![0.0; 32]), env.up(&vec![0.0; 32]));
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
            .causal_conv1d(x, w, None, y, pool, &seqs, ch, k, true),
    );
    assert!(err.contains("slot 2") && err.contains("pool of 2"), "{err}");

    // A token id beyond a vocabulary of 5.
    let table = env.up(&vec![0.0; 5 * 8]);
    let ids = env.u32s(&[4, 5]);
    let err = message(env.cpu.embedding(table, ids, 8, out));
    assert!(
        err.contains("token id 5") && err.contains("vocabulary of 5"),
        "{err}"
    );

    // A row beyond a gather's source of 5 rows.
    let rows = env.u32s(&[0, 5]);
    let err = message(env.cpu.gather_rows(table, rows, 8, out));
    assert!(err.contains("row 5 beyond"), "{err}");
    env.finish();
}

/// `gather_rows` moves rows of any dtype as they are: bf16 rows (weights
/// permuted at load) arrive bit for bit; a dtype change is refused.
#[test]
fn gather_rows_moves_bf16_rows() {
    use metrale_core::DType;
    let mut env = Env::new();
    let mut rng = Rng::new(17);
    let (rows, width) = (5, 6);
    let (src, vals) = env.up_bf16(&rng.vec(rows * width, -3.0, 3.0));
    let order = [4u32, 0, 4, 2];
    let idx = env.u32s(&order);
    let out = env
        .gpu()
        .alloc_slice(DType::BF16, order.len() * width, "test")
        .expect("alloc");
    env.cpu.gather_rows(src, idx, width, out).expect("gather");
    let mut bytes = vec![0u8; out.bytes()];
    env.gpu()
        .copy_d2h(out.ptr(), 0, &mut bytes)
        .expect("download");
    let got: Vec<f32> = bytes
        .chunks(2)
        .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
        .collect();
    let want: Vec<f32> = order
        .iter()
        .flat_map(|&r| vals[r as usize * width..][..width].to_vec())
        .collect();
    assert_eq!(got, want);
    let f32_out = env.up(&vec![0.0; order.len() * width]);
    assert!(matches!(
        env.cpu.gather_rows(src, idx, width, f32_out),
        Err(GpuError::Shape { .. })
    ));
    env.gpu().free(out.ptr()).expect("free");
    env.finish();
}
