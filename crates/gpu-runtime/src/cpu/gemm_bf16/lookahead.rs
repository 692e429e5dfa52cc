//! The next panel's prefetch during a decode step's current one
//! (`Lookahead`), and the prefetch of the rows a row-major operand's next
//! panel is packed from (`prefetch_part`).

use half::bf16;

use super::Operand;

/// The prefetch of the next panel a decode step multiplies, into L2, spread
/// evenly over the steps of the current one (every pass of every tile), so
/// that memory streams the weights for as long as the FMAs run on them. A
/// decode step reads each panel from memory once and then from cache, and
/// its few streams leave the hardware prefetcher behind: prefetching all of
/// the next panel during the first pass left memory idle during the others
/// (a batch-16 step's three).
#[derive(Clone, Copy)]
pub(super) struct Lookahead<'a> {
    next: &'a [u32],
    /// Lines of `next` prefetched so far.
    line: usize,
    /// `lines · steps so far - line · steps` (Bresenham's error term).
    due: usize,
    lines: usize,
    steps: usize,
}

impl<'a> Lookahead<'a> {
    /// Prefetches the 64-byte lines of `w`'s panel `next` over `steps`
    /// calls of [`step`](Self::step); nothing for no panel, or one not
    /// packed at load.
    pub(super) fn new(
        w: Operand<'a>,
        next: Option<usize>,
        n: usize,
        k: usize,
        steps: usize,
    ) -> Self {
        let next = next.and_then(|t| w.panel_at_load(t, n, k)).unwrap_or(&[]);
        Lookahead {
            next,
            line: 0,
            due: 0,
            lines: if steps == 0 {
                0
            } else {
                next.len().div_ceil(16)
            },
            steps,
        }
    }

    /// One step over the current panel: the lines now due.
    #[inline(always)]
    pub(super) fn step(&mut self) {
        if self.lines > 0 && self.lines == 2 * self.steps {
            // One pass over the panel (a tile of all the rows): two lines
            // a step, without the general case's loop (whose instructions
            // cost a lone row's decode a few percent).
            self.fetch(self.line);
            self.fetch(self.line + 1);
            self.line += 2;
            return;
        }
        self.due += self.lines;
        while self.due >= self.steps && self.lines > 0 {
            self.due -= self.steps;
            self.fetch(self.line);
            self.line += 1;
        }
    }

    /// Prefetches line `line` of the next panel into L2.
    #[inline(always)]
    fn fetch(&self, line: usize) {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: a prefetch never faults, whatever the address (and
        // `lines` counts the next panel's own). The pointer is only
        // computed, never read through.
        unsafe {
            use std::arch::x86_64::{_MM_HINT_T1, _mm_prefetch};
            let at = self.next.as_ptr().wrapping_add(line * 16);
            _mm_prefetch::<_MM_HINT_T1>(at.cast());
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = line;
    }
}

/// Prefetches part `i` of `parts` of `data` (whole cache lines) into L1.
pub(super) fn prefetch_part(data: &[bf16], i: usize, parts: usize) {
    const LINE: usize = 32; // bf16s per 64-byte line
    let lines = data.len().div_ceil(LINE);
    let per = lines.div_ceil(parts);
    let (l0, l1) = (i * per, ((i + 1) * per).min(lines));
    super::super::simd::prefetch(data, l0 * LINE, l1 * LINE);
}
