//! What [`run`](super::run) found, per op.

use std::fmt;
use std::time::Duration;

use crate::ops::Op;

/// How one op fared.
#[derive(Clone, Debug, PartialEq)]
pub enum Status {
    /// Every case within its tolerance.
    Passed,
    /// Why not: the first result outside its tolerance, an error the op
    /// returned, memory left allocated, a panic, or an op the backend says
    /// it lacks that ran without an error.
    Failed(String),
    /// The backend does not support the op, and calling it is an error.
    Unsupported,
    /// The architecture has no layer that runs the op; not run.
    NotUsed,
}

/// One op's line of the report.
#[derive(Clone, Debug)]
pub struct OpReport {
    pub op: Op,
    pub status: Status,
    /// Calls of the op checked.
    pub cases: usize,
    /// The largest `|got - want|` against the f64 references.
    pub max_abs: f64,
    /// The largest `|got - want| / (1 + |want|)`: what the tolerance bounds.
    pub max_rel: f64,
    /// The largest tolerance of the op's cases (0: exact).
    pub tolerance: f64,
    pub elapsed: Duration,
}

/// The suite's findings on one backend at one architecture's shapes.
#[derive(Clone, Debug)]
pub struct Report {
    /// The backend's [`name`](crate::gpu::GpuBackend::name).
    pub backend: String,
    /// The [`ArchShapes::name`](super::ArchShapes::name).
    pub arch: String,
    /// Every op, in [`Op::ALL`] order.
    pub ops: Vec<OpReport>,
    /// Bytes still allocated at the end that were not at the start.
    pub leaked_bytes: usize,
    pub elapsed: Duration,
}

impl Report {
    /// The status of `op` (`None`: the report has no line for it, which
    /// `run` never leaves out).
    pub fn status(&self, op: Op) -> Option<&Status> {
        self.ops.iter().find(|r| r.op == op).map(|r| &r.status)
    }

    /// The ops that failed, with why.
    pub fn failures(&self) -> Vec<(Op, &str)> {
        self.ops
            .iter()
            .filter_map(|r| match &r.status {
                Status::Failed(why) => Some((r.op, why.as_str())),
                _ => None,
            })
            .collect()
    }

    /// The ops with each status.
    pub fn with_status(&self, pick: impl Fn(&Status) -> bool) -> Vec<Op> {
        self.ops
            .iter()
            .filter(|r| pick(&r.status))
            .map(|r| r.op)
            .collect()
    }

    /// The ops the backend lacks (each an error when called).
    pub fn unsupported(&self) -> Vec<Op> {
        self.with_status(|s| *s == Status::Unsupported)
    }

    /// Panics, with the whole report, if any op failed or memory leaked.
    /// Unsupported ops pass (calling them was an error, as it must be);
    /// ops the architecture does not use were not run.
    #[track_caller]
    pub fn assert_all_passed(&self) {
        if !self.failures().is_empty() || self.leaked_bytes > 0 {
            panic!("conformance failed:\n{self}");
        }
    }
}

fn num(v: f64) -> String {
    if v == 0.0 {
        "0".into()
    } else {
        format!("{v:.1e}")
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let count = |pick: fn(&Status) -> bool| self.ops.iter().filter(|r| pick(&r.status)).count();
        writeln!(
            f,
            "conformance of {} at {}: {} passed, {} failed, {} unsupported, {} not used; \
             {} bytes leaked; {:.2} s",
            self.backend,
            self.arch,
            count(|s| *s == Status::Passed),
            count(|s| matches!(s, Status::Failed(_))),
            count(|s| *s == Status::Unsupported),
            count(|s| *s == Status::NotUsed),
            self.leaked_bytes,
            self.elapsed.as_secs_f64(),
        )?;
        writeln!(
            f,
            "  {:<22} {:<11} {:>5} {:>8} {:>8} {:>8} {:>7}",
            "op", "status", "cases", "max abs", "max rel", "tol", "ms"
        )?;
        for r in &self.ops {
            let status = match &r.status {
                Status::Passed => "passed",
                Status::Failed(_) => "FAILED",
                Status::Unsupported => "unsupported",
                Status::NotUsed => "not used",
            };
            write!(f, "  {:<22} {:<11} {:>5}", r.op.name(), status, r.cases)?;
            if r.cases > 0 {
                write!(
                    f,
                    " {:>8} {:>8} {:>8} {:>7.1}",
                    num(r.max_abs),
                    num(r.max_rel),
                    num(r.tolerance),
                    r.elapsed.as_secs_f64() * 1e3
                )?;
            }
            writeln!(f)?;
            if let Status::Failed(why) = &r.status {
                writeln!(f, "      {why}")?;
            }
        }
        Ok(())
    }
}
