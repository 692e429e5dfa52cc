//! Ownership of device memory: resources that are released explicitly, in order.
//!
//! `Drop` is the wrong tool for device memory: it cannot order releases across
//! values (the KV cache before the weights its layers point into) and it cannot
//! report a failure. A [`ModelResource`] is released by an explicit call that
//! returns a `Result`; the model's teardown (model-engine's
//! `model/types/teardown.rs`) releases its resources in the specified order,
//! attempting every one and reporting every failure.

/// State that owns device memory.
///
/// `Cx` is the context needed to free it; for device state it is
/// `dyn GpuBackend` (kept generic so that this crate needs no backend).
pub trait ModelResource<Cx: ?Sized> {
    /// A short name for reports ("kv cache", "ssm state pool", ...).
    fn label(&self) -> &str;

    /// Frees everything this resource owns. Idempotent: a second call does
    /// nothing and succeeds. After an error the resource must not hold on to
    /// memory it can no longer free (the backend's ledger has dropped it).
    fn release(&mut self, cx: &Cx) -> anyhow::Result<()>;
}
