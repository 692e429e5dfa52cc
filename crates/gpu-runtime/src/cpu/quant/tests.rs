//! Every path against the portable one, bit for bit; the portable one
//! against f32 arithmetic on the dequantized values; activations against
//! `metrale_core`'s reference quantizers; the driver's rows independent of
//! `m` and of the thread count.

use metrale_core::GgmlType;
use metrale_core::quant::{dequantize_row, quantize_row};

use super::*;

fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed;
    (0..n)
        .map(|i| {
            s = s
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            let v = ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 2.0;
            // Outliers, and blocks of very different scales.
            let scale = [0.01, 1.0, 30.0][(i / 32) % 3];
            if i % 97 == 5 {
                v * scale * 12.0
            } else {
                v * scale
            }
        })
        .collect()
}

fn random_bytes(n: usize, seed: u64) -> Vec<u8> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            (s >> 56) as u8
        })
        .collect()
}

/// Byte offsets of a block's f16 scales (overwritten in random blocks so
/// that they are finite).
fn scale_offsets(ty: GgmlType) -> &'static [usize] {
    match ty {
        GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4K | GgmlType::Q5K => &[0, 2],
        GgmlType::Q6K => &[208],
        _ => &[0],
    }
}

/// `rows` rows of `k`: quantized from floats, or (odd rows) random bytes
/// with finite scales, which reach every quant value (Q8_0's −128 too).
fn weights(ty: GgmlType, rows: usize, k: usize, seed: u64) -> Vec<u8> {
    let rb = ty.row_bytes(k).unwrap();
    let mut w = vec![0u8; rows * rb];
    for (r, row) in w.chunks_exact_mut(rb).enumerate() {
        if r % 2 == 0 {
            quantize_row(ty, &values(k, seed + r as u64), row).unwrap();
        } else {
            row.copy_from_slice(&random_bytes(rb, seed + r as u64));
            for blk in row.chunks_exact_mut(ty.block_bytes()) {
                for &o in scale_offsets(ty) {
                    let d = half::f16::from_f32(0.001 * (1 + blk[o + 1] % 50) as f32);
                    blk[o..o + 2].copy_from_slice(&d.to_le_bytes());
                }
            }
        }
    }
    w
}

fn act(scratch: &mut QuantScratch, ty: GgmlType, x: &[f32], k: usize) {
    if uses_q8_k(ty) {
        scratch.quantize_q8_k(None, x, x.len() / k, k);
    } else {
        scratch.quantize_q8_0(None, x, x.len() / k, k);
    }
}

fn row(scratch: &QuantScratch, ty: GgmlType, i: usize, k: usize) -> ActRow<'_> {
    if uses_q8_k(ty) {
        scratch.q8_k_row(i, k)
    } else {
        scratch.q8_0_row(i, k)
    }
}

#[test]
fn activations_match_the_reference_quantizers() {
    let k = 512;
    let x = values(2 * k, 7);
    let mut s = QuantScratch::new();
    s.quantize_q8_0(None, &x, 2, k);
    s.quantize_q8_k(None, &x, 2, k);
    for i in 0..2 {
        let xi = &x[i * k..(i + 1) * k];
        let mut q80 = vec![0u8; GgmlType::Q8_0.row_bytes(k).unwrap()];
        let mut q81 = vec![0u8; GgmlType::Q8_1.row_bytes(k).unwrap()];
        let mut q8k = vec![0u8; GgmlType::Q8K.row_bytes(k).unwrap()];
        quantize_row(GgmlType::Q8_0, xi, &mut q80).unwrap();
        quantize_row(GgmlType::Q8_1, xi, &mut q81).unwrap();
        quantize_row(GgmlType::Q8K, xi, &mut q8k).unwrap();
        let a = s.q8_0_row(i, k);
        for b in 0..k / 32 {
            let (b0, b1) = (&q80[34 * b..34 * b + 34], &q81[36 * b..36 * b + 36]);
            assert_eq!(a.d[b], scalar::f16_at(b0, 0));
            assert_eq!(a.s[b], scalar::f16_at(b1, 2));
            let qs: Vec<i8> = b0[2..].iter().map(|&q| q as i8).collect();
            assert_eq!(&a.qs[32 * b..32 * b + 32], &qs[..]);
            assert_eq!(a.sum[b], qs.iter().map(|&q| q as i32).sum::<i32>());
        }
        let a = s.q8_k_row(i, k);
        for b in 0..k / 256 {
            let blk = &q8k[292 * b..292 * b + 292];
            assert_eq!(a.d[b].to_le_bytes(), blk[0..4]);
            let qs: Vec<u8> = a.qs[256 * b..256 * b + 256]
                .iter()
                .map(|&q| q as u8)
                .collect();
            assert_eq!(qs, blk[4..260]);
            for (j, s) in a.bsums[16 * b..16 * b + 16].iter().enumerate() {
                assert_eq!(s.to_le_bytes(), blk[260 + 2 * j..262 + 2 * j]);
            }
        }
    }
}

/// The Q8_K quantizer (AVX-512 where the CPU has it) on blocks the random
/// rows never hold: all zeros, a NaN, an infinity, the largest magnitude
/// twice with both signs (the first one sets the scale), subnormals, and
/// values a hair off the rounding ties; the reference's bits every time.
#[test]
fn q8_k_activations_keep_the_reference_bits_on_odd_blocks() {
    let base = values(256, 3);
    let mut blocks: Vec<Vec<f32>> = vec![vec![0.0; 256], vec![-0.0; 256]];
    for (at, v) in [(5, f32::NAN), (200, f32::INFINITY), (17, f32::NEG_INFINITY)] {
        let mut b = base.clone();
        b[at] = v;
        blocks.push(b);
    }
    let mut b = base.clone();
    // In one 16-lane vector and across two.
    (b[36], b[40], b[90]) = (-1e4, 1e4, -1e4);
    blocks.push(b);
    blocks.push((0..256).map(|i| f32::from_bits(1 + i as u32)).collect());
    // Halves of the quant step: 127 · v / max lands on x.5.
    blocks.push(
        (0..256)
            .map(|i| (i as f32 - 128.0) * 0.5 / 127.0 * 2.0)
            .collect(),
    );
    let x: Vec<f32> = blocks.concat();
    let m = blocks.len();
    let mut s = QuantScratch::new();
    s.quantize_q8_k(None, &x, m, 256);
    for (i, blk) in blocks.iter().enumerate() {
        let want = metrale_core::quant::Q8KBlock::quantize(blk);
        let a = s.q8_k_row(i, 256);
        assert_eq!(a.d[0].to_bits(), want.d.to_bits(), "block {i}: d");
        assert_eq!(a.qs, &want.qs[..], "block {i}: quants");
        assert_eq!(a.bsums, &want.bsums[..], "block {i}: sums");
    }
}

/// The Q8_0 quantizer on AVX-512 gives the scalar block's bits: random
/// blocks, zeros of both signs, a NaN, infinities, subnormals, and values
/// landing exactly on the rounding ties (halves round away from zero) and
/// a hair either side of them.
#[test]
fn q8_0_activations_on_avx512_keep_the_scalar_bits() {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::is_x86_feature_detected as has;
        if !(has!("avx512f") && has!("avx512bw")) {
            eprintln!("skipped: no AVX-512 on this CPU");
            return;
        }
        let mut blocks: Vec<Vec<f32>> = values(32 * 40, 11)
            .chunks(32)
            .map(<[f32]>::to_vec)
            .collect();
        blocks.push(vec![0.0; 32]);
        blocks.push(vec![-0.0; 32]);
        for (at, v) in [(5, f32::NAN), (20, f32::INFINITY), (31, f32::NEG_INFINITY)] {
            let mut b = blocks[0].clone();
            b[at] = v;
            blocks.push(b);
        }
        blocks.push((0..32).map(|i| f32::from_bits(1 + i as u32)).collect());
        // max 127: v itself is the scaled value, ties at every x.5.
        let ties: Vec<f32> = (0..32)
            .map(|i| (i as f32 - 16.0) * 3.5 + 0.5)
            .chain([127.0])
            .collect();
        blocks.push(ties[1..].to_vec());
        let near: Vec<f32> = ties[1..]
            .iter()
            .enumerate()
            .map(|(i, &v)| {
                if i % 2 == 0 {
                    v.next_up()
                } else {
                    v.next_down()
                }
            })
            .collect();
        blocks.push(near);
        for (i, b) in blocks.iter().enumerate() {
            let (mut want, mut got) = ([0i8; 32], [0i8; 32]);
            let (d0, s0) = act::q8_0_block(b, &mut want);
            // SAFETY: AVX-512F/BW checked above; 32 values and quants.
            let (d1, s1) = unsafe { act::q8_0_avx512(b, &mut got) };
            assert_eq!(d0.to_bits(), d1.to_bits(), "block {i}: d");
            assert_eq!(want, got, "block {i}: quants");
            assert_eq!(s0, s1, "block {i}: sum");
        }
    }
}

fn sizes(ty: GgmlType) -> &'static [usize] {
    if uses_q8_k(ty) {
        &[256, 768, 1280]
    } else {
        &[32, 96, 128, 800]
    }
}

#[test]
fn every_isa_gives_the_portable_bits() {
    let isas = QuantIsa::available();
    eprintln!("testing {isas:?}");
    for ty in SUPPORTED {
        for &k in sizes(ty) {
            let rows = 6;
            let w = weights(ty, rows, k, k as u64);
            let x = values(k, 99 + k as u64);
            let mut s = QuantScratch::new();
            act(&mut s, ty, &x, k);
            let a = row(&s, ty, 0, k);
            let rb = ty.row_bytes(k).unwrap();
            for wr in w.chunks_exact(rb) {
                let want = scalar::vec_dot(ty, wr, a);
                for &isa in &isas {
                    let got = vec_dot(isa, ty, wr, a);
                    assert_eq!(
                        got.to_bits(),
                        want.to_bits(),
                        "{ty} k={k} {isa:?}: {got} vs {want}"
                    );
                }
            }
        }
    }
}

/// Decode's GEMV (one activation row) gives every row the portable bits,
/// on every ISA, with and without a team (whose shares split the rows).
#[test]
fn decode_rows_give_the_portable_bits() {
    let team = Team::new(2);
    for ty in SUPPORTED {
        for &k in sizes(ty) {
            let n = 11;
            let w = weights(ty, n, k, 7 + k as u64);
            let wm = QuantMatrix::new(ty, &w, n, k).unwrap();
            let x = values(k, 31 + k as u64);
            let mut s = QuantScratch::new();
            act(&mut s, ty, &x, k);
            let want: Vec<u32> = w
                .chunks_exact(ty.row_bytes(k).unwrap())
                .map(|wr| scalar::vec_dot(ty, wr, row(&s, ty, 0, k)).to_bits())
                .collect();
            for isa in QuantIsa::available() {
                for team in [None, Some(&team)] {
                    let mut out = vec![0f32; n];
                    quant_matmul_with(isa, false, team, &x, wm, &mut out, 1, &mut s).unwrap();
                    let got: Vec<u32> = out.iter().map(|v| v.to_bits()).collect();
                    assert_eq!(got, want, "{ty} k={k} {isa:?} team {}", team.is_some());
                }
            }
        }
    }
}

/// The integer dot product equals the f32 dot product of the dequantized
/// weights and dequantized activations, up to f32 rounding.
#[test]
fn portable_dot_is_the_dequantized_dot() {
    for ty in SUPPORTED {
        let k = if uses_q8_k(ty) { 512 } else { 96 };
        let w = weights(ty, 4, k, 3);
        let x = values(k, 5);
        let mut s = QuantScratch::new();
        act(&mut s, ty, &x, k);
        let a = row(&s, ty, 0, k);
        let (aty, abytes) = if uses_q8_k(ty) {
            (GgmlType::Q8K, GgmlType::Q8K.row_bytes(k).unwrap())
        } else {
            (GgmlType::Q8_1, GgmlType::Q8_1.row_bytes(k).unwrap())
        };
        let mut qa = vec![0u8; abytes];
        quantize_row(aty, &x, &mut qa).unwrap();
        let mut xa = vec![0f32; k];
        dequantize_row(aty, &qa, &mut xa).unwrap();
        let rb = ty.row_bytes(k).unwrap();
        for wr in w.chunks_exact(rb) {
            let mut wf = vec![0f32; k];
            dequantize_row(ty, wr, &mut wf).unwrap();
            let want: f64 = wf.iter().zip(&xa).map(|(p, q)| *p as f64 * *q as f64).sum();
            let mag: f64 = wf
                .iter()
                .zip(&xa)
                .map(|(p, q)| (*p as f64 * *q as f64).abs())
                .sum();
            let got = scalar::vec_dot(ty, wr, a) as f64;
            // Q4_1/Q5_1 use Q8_1's f16-rounded block sum for the min term.
            let tol = if matches!(ty, GgmlType::Q4_1 | GgmlType::Q5_1) {
                2e-3
            } else {
                1e-5
            };
            assert!(
                (got - want).abs() <= tol * mag + 1e-6,
                "{ty}: {got} vs {want} (magnitude {mag})"
            );
        }
    }
}

#[test]
fn rows_do_not_depend_on_m_or_threads() {
    let team = Team::new(3);
    for ty in SUPPORTED {
        let (n, k) = (37, if uses_q8_k(ty) { 512 } else { 160 });
        let w = weights(ty, n, k, 11);
        let wm = QuantMatrix::new(ty, &w, n, k).unwrap();
        let m = 5;
        let x = values(m * k, 13);
        let mut s = QuantScratch::new();
        let mut all = vec![0f32; m * n];
        quant_matmul(Some(&team), &x, wm, &mut all, m, &mut s, true).unwrap();
        for i in 0..m {
            let mut one = vec![0f32; n];
            quant_matmul(None, &x[i * k..(i + 1) * k], wm, &mut one, 1, &mut s, true).unwrap();
            let a: Vec<u32> = all[i * n..(i + 1) * n]
                .iter()
                .map(|v| v.to_bits())
                .collect();
            let b: Vec<u32> = one.iter().map(|v| v.to_bits()).collect();
            assert_eq!(a, b, "{ty} row {i}");
        }
        for isa in QuantIsa::available() {
            let mut one = vec![0f32; m * n];
            quant_matmul_with(isa, false, Some(&team), &x, wm, &mut one, m, &mut s).unwrap();
            assert_eq!(one, all, "{ty} {isa:?}");
        }
    }
}

/// Prefill's path: activations quantized on the team and the rows taken in
/// several L2 tiles (`ACT_TILE_BYTES / k` rows each, the last one ragged),
/// Q4_K's, Q6_K's and Q8_0's weight rows packed sixteen at a time on VNNI
/// (19 rows: one panel and three rows left over); every row must still
/// equal the one-row product bit for bit.
#[test]
fn tiled_prefill_rows_match_single_rows() {
    let team = Team::new(3);
    for ty in SUPPORTED {
        let (n, k) = (19, 8192);
        assert!(super::ACT_TILE_BYTES / k < 70 / 2, "several tiles");
        let w = weights(ty, n, k, 5);
        let wm = QuantMatrix::new(ty, &w, n, k).unwrap();
        let m = 70;
        let x = values(m * k, 17);
        let mut s = QuantScratch::new();
        let mut all = vec![0f32; m * n];
        quant_matmul(Some(&team), &x, wm, &mut all, m, &mut s, true).unwrap();
        for i in 0..m {
            let mut one = vec![0f32; n];
            quant_matmul(None, &x[i * k..(i + 1) * k], wm, &mut one, 1, &mut s, true).unwrap();
            let a: Vec<u32> = all[i * n..(i + 1) * n]
                .iter()
                .map(|v| v.to_bits())
                .collect();
            let b: Vec<u32> = one.iter().map(|v| v.to_bits()).collect();
            assert_eq!(a, b, "{ty} row {i}");
        }
    }
}

/// Q8_0, Q4_K and Q6_K on AMX-INT8 tiles (`tiles/`): two panels of 32
/// weight rows and five rows left to the other paths; 5 super-blocks (a
/// ragged slice of the K-quants' unpacking; 40 Q8_0 blocks) and 37 Q8_0
/// blocks (the tile sets and accumulators ragged); the K-quants also
/// grouped as at load; activation rows from the fewest the tiles take to
/// three groups and a ragged one: every product the bits of the
/// tiles-off path, and of the one-row product.
#[test]
fn tiles_give_the_row_bits() {
    if !int8_tiles_available() {
        eprintln!(
            "tiles_give_the_row_bits: this CPU or OS has no AMX-INT8; the tiles are untested here"
        );
        return;
    }
    let team = Team::new(3);
    let n = 69;
    let cases = [
        (GgmlType::Q8_0, 32 * 37, false),
        (GgmlType::Q8_0, 256 * 5, false),
        (GgmlType::Q4K, 256 * 5, false),
        (GgmlType::Q4K, 256 * 5, true),
        (GgmlType::Q5K, 256 * 5, false),
        (GgmlType::Q5K, 256 * 5, true),
        (GgmlType::Q6K, 256 * 5, false),
        (GgmlType::Q6K, 256 * 5, true),
    ];
    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    for (ty, k, grouped) in cases {
        let mut w = weights(ty, n, k, 23);
        let wm = if grouped {
            group_rows(ty, &mut w, n, k).unwrap();
            QuantMatrix::grouped(ty, &w, n, k).unwrap()
        } else {
            QuantMatrix::new(ty, &w, n, k).unwrap()
        };
        let mut s = QuantScratch::new();
        for m in [8, 16, 17, 33, 64, 70] {
            let x = values(m * k, 29 + m as u64);
            let (mut tiled, mut plain) = (vec![0f32; m * n], vec![0f32; m * n]);
            let isa = QuantIsa::Vnni;
            quant_matmul_with(isa, true, Some(&team), &x, wm, &mut tiled, m, &mut s).unwrap();
            quant_matmul_with(isa, false, Some(&team), &x, wm, &mut plain, m, &mut s).unwrap();
            let case = format!("{ty} k = {k}, grouped {grouped}, m = {m}");
            assert_eq!(bits(&tiled), bits(&plain), "{case}");
            let i = m - 1;
            let mut one = vec![0f32; n];
            quant_matmul(None, &x[i * k..(i + 1) * k], wm, &mut one, 1, &mut s, false).unwrap();
            assert_eq!(bits(&tiled[i * n..]), bits(&one), "{case}, last row alone");
        }
    }
}

#[test]
fn bad_shapes_are_errors() {
    let w = vec![0u8; 2 * 34];
    assert!(QuantMatrix::new(GgmlType::Q8_0, &w, 2, 32).is_ok());
    assert!(QuantMatrix::new(GgmlType::Q8_0, &w, 2, 48).is_err());
    assert!(QuantMatrix::new(GgmlType::Q8_0, &w, 3, 32).is_err());
    assert!(QuantMatrix::new(GgmlType::Q2K, &w, 1, 256).is_err());
    let wm = QuantMatrix::new(GgmlType::Q8_0, &w, 2, 32).unwrap();
    let mut out = vec![0f32; 1];
    let mut s = QuantScratch::new();
    assert!(quant_matmul(None, &[0.0; 32], wm, &mut out, 1, &mut s, true).is_err());
    let mut out = vec![0f32; 2];
    assert!(quant_matmul(None, &[0.0; 31], wm, &mut out, 1, &mut s, true).is_err());
    assert!(quant_matmul(None, &[1.0; 32], wm, &mut out, 1, &mut s, true).is_ok());
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(64))]
    /// Random formats, lengths, contents and row counts: every ISA's
    /// multi-row kernel gives the portable one-row bits.
    #[test]
    fn random_rows_agree_everywhere(t in 0..SUPPORTED.len(), blocks in 1usize..12, rows in 1usize..=MAX_ROWS, seed in 0u64..1 << 40) {
        let ty = SUPPORTED[t];
        let k = blocks * if uses_q8_k(ty) { 256 } else { 32 };
        let w = weights(ty, 2, k, seed);
        let x = values(rows * k, seed ^ 0x5eed);
        let mut s = QuantScratch::new();
        act(&mut s, ty, &x, k);
        let acts: Vec<ActRow<'_>> = (0..rows).map(|i| row(&s, ty, i, k)).collect();
        for wr in w.chunks_exact(ty.row_bytes(k).unwrap()) {
            let want: Vec<u32> = acts.iter().map(|&a| scalar::vec_dot(ty, wr, a).to_bits()).collect();
            for isa in QuantIsa::available() {
                let mut got = [0f32; MAX_ROWS];
                vec_dot_rows(isa, ty, wr, &acts, &mut got[..rows]);
                let got: Vec<u32> = got[..rows].iter().map(|v| v.to_bits()).collect();
                proptest::prop_assert_eq!(&got, &want, "{} k={} rows={} {:?}", ty, k, rows, isa);
            }
        }
    }
}

/// Grouped matrices (`group_rows`, what `pack_matmul_weight` makes at load)
/// give the row-major matrix's bits: decode through the group kernels and
/// the gathered rows of a ragged last group, prefill through the tiles and
/// (m ≥ 33 on VNNI) the packed panels, every ISA, with and without a team;
/// and every row dequantizes to the same values.
#[test]
fn grouped_matrices_give_the_row_major_bits() {
    let team = Team::new(2);
    for ty in SUPPORTED {
        // 32-element formats: 3 blocks (a group kernel's tail alone) and 13
        // (three runs of four blocks, then the tail).
        let ks: &[usize] = if uses_q8_k(ty) { &[768] } else { &[96, 416] };
        for (&k, n) in ks.iter().flat_map(|k| [1, 3, 4, 6, 9, 19].map(|n| (k, n))) {
            let w = weights(ty, n, k, 23 + n as u64);
            let mut g = w.clone();
            group_rows(ty, &mut g, n, k).unwrap();
            assert_eq!(g == w, n == 1, "{ty} n={n}: one row is its own group");
            let (rm, gm) = (
                QuantMatrix::new(ty, &w, n, k).unwrap(),
                QuantMatrix::grouped(ty, &g, n, k).unwrap(),
            );
            let rb = ty.row_bytes(k).unwrap();
            for j in 0..n {
                let (mut want, mut got) = (vec![0f32; k], vec![0f32; k]);
                dequantize_row(ty, &w[j * rb..(j + 1) * rb], &mut want).unwrap();
                dequantize_grouped_row(ty, &g, j, &mut got);
                assert!(
                    want.iter()
                        .zip(&got)
                        .all(|(a, b)| a.to_bits() == b.to_bits())
                );
            }
            for m in [1, 2, 9, 40] {
                let x = values(m * k, 41 + m as u64);
                let mut s = QuantScratch::new();
                for isa in QuantIsa::available() {
                    for team in [None, Some(&team)] {
                        let (mut want, mut got) = (vec![0f32; m * n], vec![0f32; m * n]);
                        quant_matmul_with(isa, false, team, &x, rm, &mut want, m, &mut s).unwrap();
                        quant_matmul_with(isa, false, team, &x, gm, &mut got, m, &mut s).unwrap();
                        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                        assert_eq!(bits(&got), bits(&want), "{ty} n={n} m={m} {isa:?}");
                    }
                }
            }
        }
    }
    let mut none: [u8; 0] = [];
    assert!(
        group_rows(GgmlType::Q4K, &mut none, 4, 0).is_ok(),
        "no columns"
    );
    let mut short = vec![0u8; 100];
    assert!(group_rows(GgmlType::Q8_0, &mut short, 3, 32).is_err());
    let mut out = [0f32; 32];
    dequantize_grouped_row(GgmlType::Q8_0, &short, 99, &mut out);
    assert!(
        out.iter().all(|v| v.is_nan()),
        "a row outside the matrix is NaN"
    );
}
