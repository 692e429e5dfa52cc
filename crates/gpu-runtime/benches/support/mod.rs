//! What the benches and `examples/quant_gemv.rs` share (each includes this
//! file with `#[path]`; Cargo takes no bench target from a subdirectory
//! without a `main.rs`).

/// `n` seeded values in [-0.05, 0.05): an LCG, the same on every machine.
pub fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.1
        })
        .collect()
}

/// `v` as the little-endian bytes of `dtype`: bf16 (rounded to nearest
/// even) or f32.
#[allow(dead_code)] // each includer uses its own share of these helpers
pub fn le_bytes(v: &[f32], dtype: metrale_core::DType) -> Vec<u8> {
    match dtype {
        metrale_core::DType::BF16 => v
            .iter()
            .flat_map(|x| half::bf16::from_f32(*x).to_le_bytes())
            .collect(),
        metrale_core::DType::F16 => v
            .iter()
            .flat_map(|x| half::f16::from_f32(*x).to_le_bytes())
            .collect(),
        _ => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
    }
}

/// The number in the environment variable `name`, else `default`.
#[allow(dead_code)]
pub fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}
