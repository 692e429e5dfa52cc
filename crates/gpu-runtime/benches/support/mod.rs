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
