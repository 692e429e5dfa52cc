//! The OpenAI-compatible HTTP server of metrale, as a crate of its own:
//! [`metrale::server`] re-exported (the server lives in the `metrale`
//! package behind its `server` feature, so that `cargo install --path
//! crates/metrale` gives a binary that serves).

pub use metrale::server::*;
