//! Empty on purpose: this crate exists for its `Cargo.toml`, which asks
//! for the dependency features that `cargo test --workspace` turns on, so
//! that `cargo run -p metrale` builds every dependency the same way and the
//! two commands share their artifacts (see the manifest's comment).
