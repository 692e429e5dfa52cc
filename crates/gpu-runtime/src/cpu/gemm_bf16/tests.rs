//! The bf16 GEMM against a reference and against itself: packed at load
//! or per call, alone or among other rows, the same bits; with each kernel
//! this CPU runs.

use super::*;

/// `matmul` into a fresh output (NaN-filled: every element must be
/// written).
#[allow(clippy::too_many_arguments)]
fn product(
    kernel: Kernel,
    team: Option<&Team>,
    x: &[f32],
    w: Operand<'_>,
    up: Option<Operand<'_>>,
    m: usize,
    n: usize,
    k: usize,
) -> Vec<f32> {
    let mut out = vec![f32::NAN; m * n];
    assert!(matmul(kernel, team, x, w, up, &mut out, m, n, k));
    out
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|f| f.to_bits()).collect()
}

/// Each kernel against its reference in f64: the activations rounded to
/// bf16 ([`Kernel::Dot`]) or as they are ([`Kernel::Fma`]), on shapes with
/// odd `k`, partial panels, and whole and partial tiles (Dot's of eight
/// rows, Fma's of six, Amx's of 16 and 32 and `k`'s pairs short of 16).
#[test]
fn matches_the_reference_on_odd_shapes() {
    let team = Team::new(2);
    for kernel in Kernel::available_here() {
        for &(m, n, k) in &[
            (1, 1, 1),
            (9, 33, 7),
            (17, 70, 130),
            (9, 64, 100),
            (4, 48, 9),
            (5, 40, 66),
            (40, 64, 768),
            (33, 50, 34),
            (64, 96, 1536),
        ] {
            let (x, w) = operands(m, n, k);
            let out = product(kernel, Some(&team), &x, Operand::Rows(&w), None, m, n, k);
            let act = |v: f32| match kernel {
                Kernel::Dot | Kernel::Amx => bf16::from_f32(v).to_f32() as f64,
                Kernel::Fma => v as f64,
            };
            for i in 0..m {
                for j in 0..n {
                    let want: f64 = (0..k)
                        .map(|c| act(x[i * k + c]) * w[j * k + c].to_f32() as f64)
                        .sum();
                    let got = out[i * n + j] as f64;
                    assert!(
                        (got - want).abs() <= 1e-4 * (1.0 + want.abs()),
                        "{kernel:?} {m}x{n}x{k} [{i},{j}]: {got} vs {want}"
                    );
                }
            }
        }
    }
}

/// The two kernels differ exactly where Dot rounds the activations: with
/// activations that bf16 holds exactly, the same sums up to their order.
#[test]
fn the_kernels_differ_only_by_the_rounding_of_the_activations() {
    let team = Team::new(2);
    if Kernel::available_here().len() < 2 {
        return;
    }
    let (m, n, k) = (9, 64, 96);
    let (x, w) = operands(m, n, k);
    let rows = Operand::Rows(&w);
    let both = |x: &[f32]| {
        let run = |kernel| product(kernel, Some(&team), x, rows, None, m, n, k);
        (run(Kernel::Dot), run(Kernel::Fma))
    };
    let on_grid: Vec<f32> = x.iter().map(|&v| bf16::from_f32(v).to_f32()).collect();
    let (dot, fma) = both(&on_grid);
    for (a, b) in dot.iter().zip(&fma) {
        assert!((a - b).abs() <= 1e-5 * (1.0 + a.abs()), "{a} vs {b}");
    }
    // And with the activations off the bf16 grid they do differ.
    let (dot, fma) = both(&x);
    assert!(
        dot.iter()
            .zip(&fma)
            .any(|(a, b)| (a - b).abs() > 1e-4 * (1.0 + a.abs()))
    );
}

fn operands(m: usize, n: usize, k: usize) -> (Vec<f32>, Vec<bf16>) {
    let x = (0..m * k)
        .map(|i| ((i * 37 % 101) as f32 - 50.0) / 37.0)
        .collect();
    let w = (0..n * k)
        .map(|i| bf16::from_f32(((i * 53 % 97) as f32 - 48.0) / 48.0))
        .collect();
    (x, w)
}

fn packed(w: &[bf16], n: usize, k: usize) -> Vec<u32> {
    let mut p: Vec<u32> = w
        .chunks(2)
        .map(|c| c[0].to_bits() as u32 | (c[1].to_bits() as u32) << 16)
        .collect();
    pack_in_place(&mut p, n, k);
    p
}

#[test]
fn panels_packed_at_load_give_the_bits_of_packing_per_call() {
    let team = Team::new(2);
    for kernel in Kernel::available_here() {
        // Full panels, a partial last panel (16 and 48 rows), one row.
        for &(m, n, k) in &[
            (3, 64, 96),
            (9, 48, 64),
            (1, 80, 768),
            (17, 1, 34),
            (40, 96, 130),
        ] {
            let (x, w) = operands(m, n, k);
            let p = packed(&w, n, k);
            let (rows, panels) = (Operand::Rows(&w), Operand::Panels(&p));
            let a = product(kernel, Some(&team), &x, rows, None, m, n, k);
            let b = product(kernel, None, &x, panels, None, m, n, k);
            assert_eq!(bits(&a), bits(&b), "{kernel:?} {m}x{n}x{k}");
            // Fused SwiGLU alike.
            let c = product(kernel, Some(&team), &x, rows, Some(rows), m, n, k);
            let d = product(kernel, Some(&team), &x, panels, Some(panels), m, n, k);
            assert_eq!(bits(&c), bits(&d), "{kernel:?} swiglu {m}x{n}x{k}");
        }
    }
}

#[test]
fn a_rows_sums_do_not_depend_on_the_rows_beside_it() {
    let team = Team::new(2);
    let (n, k) = (96, 200);
    let (x, w) = operands(70, n, k);
    let p = packed(&w, n, k);
    let panels = Operand::Panels(&p);
    for kernel in Kernel::available_here() {
        let all = product(kernel, Some(&team), &x, panels, None, 70, n, k);
        for m in [1, 2, 7, 8, 9, 33, 64] {
            let start = 70 - m;
            let part = product(kernel, Some(&team), &x[start * k..], panels, None, m, n, k);
            for (i, row) in part.chunks(n).enumerate() {
                let want = &all[(start + i) * n..(start + i + 1) * n];
                assert_eq!(
                    bits(row),
                    bits(want),
                    "{kernel:?} row {} among {m}",
                    start + i
                );
            }
        }
    }
}

#[test]
fn panel_rows_read_back_the_matrix() {
    let (n, k) = (70, 6);
    let (_, w) = operands(1, n, k);
    let p = packed(&w, n, k);
    let mut row = vec![0f32; k];
    for j in 0..n {
        panel_row(&p, n, k, j, &mut row);
        let want: Vec<f32> = w[j * k..(j + 1) * k].iter().map(|v| v.to_f32()).collect();
        assert_eq!(row, want, "row {j}");
    }
}

/// AMX computes what Dot does (bf16 activations, pairs of products summed
/// in f32), in its own order: the same sums to f32 rounding, on shapes
/// whose tiles are whole, partial, and padded in `k`.
#[test]
fn amx_tiles_give_the_dot_products_sums() {
    if !Kernel::available_here().contains(&Kernel::Amx) {
        eprintln!("skipped: this CPU or OS runs no AMX tiles");
        return;
    }
    let team = Team::new(2);
    for &(m, n, k) in &[(1, 64, 768), (16, 32, 32), (17, 96, 200), (64, 70, 1536)] {
        let (x, w) = operands(m, n, k);
        let p = packed(&w, n, k);
        let run = |kernel| product(kernel, Some(&team), &x, Operand::Panels(&p), None, m, n, k);
        let (dot, amx) = (run(Kernel::Dot), run(Kernel::Amx));
        let scale = (k as f32).sqrt();
        for (i, (a, b)) in dot.iter().zip(&amx).enumerate() {
            assert!(
                (a - b).abs() <= 1e-5 * scale * (1.0 + a.abs()),
                "{m}x{n}x{k} [{i}]: {a} vs {b}"
            );
        }
    }
}
