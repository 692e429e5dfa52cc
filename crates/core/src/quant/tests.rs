//! The codecs against gguf-py's vectors (`tests/data/gen_quant_vectors.py`),
//! bit for bit, and round-trip error bounds on random rows.

use super::*;
use proptest::prelude::*;

struct Vector {
    input: Option<Vec<f32>>,
    q: Vec<u8>,
    deq: Vec<f32>,
}

fn load(name: &str, ty: GgmlType) -> Vector {
    let path = format!("{}/tests/data/quant/{name}.bin", env!("CARGO_MANIFEST_DIR"));
    let b = std::fs::read(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    let u32_at = |o: usize| u32::from_le_bytes(b[o..o + 4].try_into().unwrap()) as usize;
    let f32s = |o: usize, n: usize| -> Vec<f32> {
        b[o..o + 4 * n]
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect()
    };
    let (n, has_input) = (u32_at(0), u32_at(4) == 1);
    let mut o = 8;
    let input = has_input.then(|| {
        o += 4 * n;
        f32s(8, n)
    });
    let qb = ty.row_bytes(n).unwrap();
    let q = b[o..o + qb].to_vec();
    o += qb;
    let deq = f32s(o, n);
    assert_eq!(o + 4 * n, b.len(), "{name}: trailing bytes");
    Vector { input, q, deq }
}

const VECTORS: [(&str, GgmlType); 12] = [
    ("q8_0", GgmlType::Q8_0),
    ("q4_0", GgmlType::Q4_0),
    ("q4_1", GgmlType::Q4_1),
    ("q5_0", GgmlType::Q5_0),
    ("q5_1", GgmlType::Q5_1),
    ("q2_k", GgmlType::Q2K),
    ("q3_k", GgmlType::Q3K),
    ("q4_k", GgmlType::Q4K),
    ("q5_k", GgmlType::Q5K),
    ("q6_k", GgmlType::Q6K),
    ("q8_k", GgmlType::Q8K),
    ("iq4_nl", GgmlType::Iq4Nl),
];

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn dequantize_matches_gguf_py_bit_for_bit() {
    for (name, ty) in VECTORS {
        let v = load(name, ty);
        let mut out = vec![0f32; v.deq.len()];
        dequantize_row(ty, &v.q, &mut out).unwrap();
        let first = bits(&out)
            .iter()
            .zip(bits(&v.deq))
            .position(|(a, b)| *a != b);
        assert_eq!(first, None, "{name}: first mismatch at {first:?}");
    }
}

#[test]
fn quantize_matches_gguf_py_bit_for_bit() {
    let mut checked = 0;
    for (name, ty) in VECTORS {
        let v = load(name, ty);
        let Some(x) = v.input else { continue };
        let mut q = vec![0u8; v.q.len()];
        quantize_row(ty, &x, &mut q).unwrap();
        let first = q.iter().zip(&v.q).position(|(a, b)| a != b);
        assert_eq!(first, None, "{name}: first differing byte at {first:?}");
        checked += 1;
    }
    assert_eq!(checked, 5);
}

#[test]
fn bad_lengths_are_errors() {
    let mut out = vec![0f32; 48];
    assert!(matches!(
        dequantize_row(GgmlType::Q4_0, &[0; 27], &mut out),
        Err(QuantError::NotWholeBlocks { elems: 48, .. })
    ));
    let mut out = vec![0f32; 64];
    assert!(matches!(
        dequantize_row(GgmlType::Q4_0, &[0; 35], &mut out),
        Err(QuantError::ByteLength {
            expected: 36,
            bytes: 35,
            ..
        })
    ));
    let mut q = vec![0u8; 144];
    assert!(matches!(
        quantize_row(GgmlType::Q4K, &[0.0; 255], &mut q),
        Err(QuantError::NotWholeBlocks { .. })
    ));
    assert!(matches!(
        quantize_row(GgmlType::Iq2Xxs, &[0.0; 256], &mut [0; 66]),
        Err(QuantError::Unsupported { .. })
    ));
    let e: crate::CoreError = QuantError::Unsupported {
        ty: GgmlType::Iq1S,
        op: "quantize",
    }
    .into();
    assert_eq!(e.to_string(), "quantize is not implemented for iq1_s");
}

#[test]
fn nearest_int_rounds_half_to_even() {
    use super::kquants::nearest_int;
    for (f, i) in [
        (0.5, 0),
        (1.5, 2),
        (-0.5, 0),
        (-1.5, -2),
        (2.49, 2),
        (-3.7, -4),
    ] {
        assert_eq!(nearest_int(f), i, "{f}");
    }
}

#[test]
fn q8k_block_matches_its_bytes() {
    let x: Vec<f32> = (0..256).map(|i| ((i * 37) % 101) as f32 - 50.0).collect();
    let mut q = vec![0u8; 292];
    quantize_row(GgmlType::Q8K, &x, &mut q).unwrap();
    let b = Q8KBlock::quantize(&x);
    assert_eq!(f32::from_le_bytes(q[0..4].try_into().unwrap()), b.d);
    assert_eq!(b.qs.iter().map(|&v| v as u8).collect::<Vec<_>>(), q[4..260]);
    assert_eq!(b.bsums[3], b.qs[48..64].iter().map(|&v| v as i16).sum());
}

/// Largest error a round trip may make relative to the block's largest
/// magnitude: half a step of the format's grid plus the f16 rounding of
/// its scales, with slack for the K-quants' 6-bit scales and fitted mins.
fn bound(ty: GgmlType) -> f32 {
    use GgmlType::*;
    match ty {
        Q8_0 | Q8_1 | Q8K => 0.5 / 127.0 + 0.002,
        // The level opposite the largest magnitude stops one step short.
        Q4_0 => 1.0 / 8.0 + 0.004,
        Q4_1 => 1.0 / 15.0 + 0.003,
        Q5_0 => 1.0 / 16.0 + 0.004,
        Q5_1 => 1.0 / 31.0 + 0.003,
        Q2K => 0.6,
        Q3K => 0.4,
        Q4K => 0.20,
        Q5K => 0.10,
        Q6K => 0.05,
        Iq4Nl => 0.2,
        _ => unreachable!(),
    }
}

fn row() -> impl Strategy<Value = Vec<f32>> {
    (
        1usize..=2,
        prop::collection::vec(-1.0f32..1.0, 512),
        0.001f32..100.0,
    )
        .prop_map(|(blocks, v, scale)| v[..256 * blocks].iter().map(|x| x * scale).collect())
}

proptest! {
    #[test]
    fn round_trip_error_is_bounded(x in row()) {
        use GgmlType::*;
        for ty in [Q8_0, Q8_1, Q4_0, Q4_1, Q5_0, Q5_1, Q2K, Q3K, Q4K, Q5K, Q6K, Q8K, Iq4Nl] {
            let mut q = vec![0u8; ty.row_bytes(x.len()).unwrap()];
            quantize_row(ty, &x, &mut q).unwrap();
            let mut y = vec![0f32; x.len()];
            dequantize_row(ty, &q, &mut y).unwrap();
            // Per 256-element span (every format's blocks nest in it).
            for (xs, ys) in x.chunks(256).zip(y.chunks(256)) {
                let amax = xs.iter().fold(0f32, |a, v| a.max(v.abs()));
                for (a, b) in xs.iter().zip(ys) {
                    prop_assert!((a - b).abs() <= bound(ty) * amax,
                        "{ty}: {a} -> {b} (amax {amax})");
                }
            }
        }
    }
}
