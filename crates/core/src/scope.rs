//! Ownership of device memory: resources that are released explicitly, in order.
//!
//! `Drop` is the wrong tool for device memory: it cannot order releases across
//! values (the KV cache before the weights its layers point into) and it cannot
//! report a failure. A [`ModelResource`] is released by an explicit call that
//! returns a `Result`; a [`Teardown`] releases several, newest first, attempting
//! every one and reporting every failure.

use crate::error::CoreError;

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

/// Releases registered resources newest first; attempts every one even after
/// a failure and reports all failures together.
///
/// Used for partially built state: register each resource as it is built, and
/// if a later step fails, `run` frees what was built so far.
pub struct Teardown<'a, Cx: ?Sized> {
    resources: Vec<&'a mut dyn ModelResource<Cx>>,
}

impl<Cx: ?Sized> Default for Teardown<'_, Cx> {
    fn default() -> Self {
        Self {
            resources: Vec::new(),
        }
    }
}

impl<'a, Cx: ?Sized> Teardown<'a, Cx> {
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers a resource; it will be released before everything registered
    /// earlier.
    pub fn register(&mut self, resource: &'a mut dyn ModelResource<Cx>) -> &mut Self {
        self.resources.push(resource);
        self
    }

    /// How many resources are registered.
    pub fn len(&self) -> usize {
        self.resources.len()
    }

    pub fn is_empty(&self) -> bool {
        self.resources.is_empty()
    }

    /// Releases every registered resource, newest first.
    ///
    /// Returns `Err(CoreError::Teardown)` listing every failure with its label.
    pub fn run(self, cx: &Cx) -> Result<(), CoreError> {
        let mut failures = Vec::new();
        for resource in self.resources.into_iter().rev() {
            if let Err(e) = resource.release(cx) {
                failures.push((resource.label().to_string(), e));
            }
        }
        if failures.is_empty() {
            Ok(())
        } else {
            Err(CoreError::Teardown(failures))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::RefCell;

    struct Probe {
        name: &'static str,
        fail: bool,
        released: bool,
    }

    impl ModelResource<RefCell<Vec<&'static str>>> for Probe {
        fn label(&self) -> &str {
            self.name
        }
        fn release(&mut self, log: &RefCell<Vec<&'static str>>) -> anyhow::Result<()> {
            if self.released {
                return Ok(());
            }
            self.released = true;
            log.borrow_mut().push(self.name);
            if self.fail {
                anyhow::bail!("{} failed", self.name)
            } else {
                Ok(())
            }
        }
    }

    #[test]
    fn releases_newest_first_and_reports_every_failure() {
        let log = RefCell::new(Vec::new());
        let mut a = Probe {
            name: "a",
            fail: true,
            released: false,
        };
        let mut b = Probe {
            name: "b",
            fail: false,
            released: false,
        };
        let mut c = Probe {
            name: "c",
            fail: true,
            released: false,
        };
        let mut t = Teardown::new();
        t.register(&mut a).register(&mut b).register(&mut c);
        let err = t.run(&log).unwrap_err();
        assert_eq!(*log.borrow(), vec!["c", "b", "a"]);
        match err {
            CoreError::Teardown(f) => {
                let labels: Vec<_> = f.iter().map(|(l, _)| l.as_str()).collect();
                assert_eq!(labels, vec!["c", "a"]);
            }
            other => panic!("unexpected {other}"),
        }
    }

    #[test]
    fn empty_teardown_succeeds() {
        let log = RefCell::new(Vec::new());
        Teardown::<RefCell<Vec<&'static str>>>::new()
            .run(&log)
            .unwrap();
    }
}
