//! Parts of a checkpoint that are read but not loaded: the vision tower of a
//! vision-language model run text-only, the multi-token prediction layers
//! that speculative decoding may load later. Each part gets one message
//! for all of its tensors, not one warning per tensor, and the tensors the
//! caller names are checked against their headers (present, shape), so a
//! part that could not be used later is reported now.

use std::collections::{HashMap, HashSet};

use super::LoadProgress;

/// One part of a checkpoint that is not loaded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SetAside {
    /// What it is, for messages ("vision tower").
    pub what: String,
    /// Its tensors' name prefixes (`model.visual.`).
    pub prefixes: Vec<String>,
    /// Why it is not loaded, for the notice ("the model runs text-only").
    pub why: String,
    /// Tensors it must hold, with their shapes; empty: whatever is under
    /// the prefixes.
    pub expected: Vec<(String, Vec<usize>)>,
    /// Whether its notice is a warning (what the user loses, such as image
    /// input) rather than information.
    pub warn: bool,
}

impl SetAside {
    pub fn holds(&self, name: &str) -> bool {
        self.prefixes.iter().any(|p| name.starts_with(p.as_str()))
    }
}

/// What the set-aside parts of a checkpoint come to.
pub(super) struct AsideReport {
    /// Tensor names that belong to a part (not reported one by one).
    pub names: HashSet<String>,
    /// One line per part found (a warning when the part says so), and one
    /// warning per expected tensor that does not match; each names the
    /// checkpoint. `(warning, text)`.
    pub messages: Vec<(bool, String)>,
}

impl AsideReport {
    /// Logs each message and sends it through `progress`: a warning as
    /// [`LoadProgress::Warning`], the rest as [`LoadProgress::Notice`].
    pub fn send(&mut self, progress: &mut dyn FnMut(LoadProgress)) {
        for (warn, message) in self.messages.drain(..) {
            if warn {
                tracing::warn!("{message}");
                progress(LoadProgress::Warning(message));
            } else {
                tracing::info!("{message}");
                progress(LoadProgress::Notice(message));
            }
        }
    }
}

/// One stored tensor as [`report`] sees it.
pub(super) struct Stored<'a> {
    pub name: &'a str,
    pub shape: &'a [usize],
    pub bytes: usize,
}

/// Sorts the stored tensors (`entries`, of the checkpoint `source`) that
/// `seen` (the expected ones) leaves into `parts`, and says what each part
/// holds.
pub(super) fn report(
    source: &std::path::Path,
    entries: &[Stored<'_>],
    seen: &HashSet<&str>,
    parts: &[SetAside],
) -> AsideReport {
    let source = source.display();
    // Indexed once, and only where a part lists its expected tensors: a
    // checkpoint may hold tens of thousands, a part thousands.
    let by_name: HashMap<&str, &Stored<'_>> = match parts.iter().any(|p| !p.expected.is_empty()) {
        true => entries.iter().map(|t| (t.name, t)).collect(),
        false => HashMap::new(),
    };
    let mut names = HashSet::new();
    let mut messages = Vec::new();
    for part in parts {
        let mut count = 0usize;
        let mut bytes = 0usize;
        for t in entries {
            if !seen.contains(t.name) && part.holds(t.name) {
                count += 1;
                bytes += t.bytes;
                names.insert(t.name.to_string());
            }
        }
        if count > 0 {
            messages.push((
                part.warn,
                format!(
                    "{source}: the {} ({count} tensors, {:.1} MB) is not loaded: {}",
                    part.what,
                    bytes as f64 / 1e6,
                    part.why
                ),
            ));
        } else if !part.expected.is_empty() {
            messages.push((
                true,
                format!(
                    "{source}: the config describes the {}, but the checkpoint holds none of \
                     its tensors",
                    part.what
                ),
            ));
            continue;
        }
        let mut missing = Vec::new();
        for (name, shape) in &part.expected {
            match by_name.get(name.as_str()) {
                None => missing.push(name.as_str()),
                Some(t) if t.shape != shape.as_slice() => messages.push((
                    true,
                    format!(
                        "{source}: tensor {name:?} of the {} has shape {:?}, the config says \
                         {shape:?}; that part could not be used",
                        part.what, t.shape
                    ),
                )),
                Some(_) => {}
            }
        }
        if let Some(first) = missing.first() {
            messages.push((
                true,
                format!(
                    "{source}: {} of the {} tensors the config describes for the {} are \
                     missing (the first: {first:?}); that part could not be used",
                    missing.len(),
                    part.expected.len(),
                    part.what
                ),
            ));
        }
    }
    AsideReport { names, messages }
}
