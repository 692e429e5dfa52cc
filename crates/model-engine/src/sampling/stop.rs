//! Stop conditions: why a sequence finished, and stop strings found in
//! streamed text.

/// Why generation of a sequence ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Finish {
    /// The model produced one of its EOS ids.
    Eos(u32),
    /// The model produced one of the request's stop token ids.
    StopToken(u32),
    /// The output reached one of the request's stop strings (left out of
    /// the output).
    StopString(String),
    /// `max_tokens` were generated.
    Length,
    /// The output completed the request's structured-output grammar and
    /// nothing may follow it.
    Grammar,
}

impl Finish {
    /// The OpenAI `finish_reason`: "length" or "stop".
    pub fn reason(&self) -> &'static str {
        match self {
            Finish::Length => "length",
            _ => "stop",
        }
    }
}

/// What [`StopChecker::push`] lets out.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StopOutput {
    /// Text safe to emit now.
    pub text: String,
    /// The stop string found, if any: the output ends with `text`.
    pub stopped: Option<String>,
}

/// Finds stop strings in streamed text, even split across deltas.
///
/// Text is let out as soon as it cannot be the start of a stop string; a
/// trailing part that could still grow into one is held back until the next
/// delta settles it. When a stop string appears, the text before it is let
/// out and everything from it on is dropped. Of several stop strings, the one
/// that starts first in the text wins (the one listed first on a tie).
#[derive(Clone, Debug, Default)]
pub struct StopChecker {
    stops: Vec<String>,
    held: String,
    stopped: bool,
}

impl StopChecker {
    /// A checker for `stops` (empty strings are ignored).
    pub fn new(stops: &[String]) -> Self {
        let stops = stops.iter().filter(|s| !s.is_empty()).cloned().collect();
        Self {
            stops,
            held: String::new(),
            stopped: false,
        }
    }

    /// Whether a stop string was found.
    pub fn is_stopped(&self) -> bool {
        self.stopped
    }

    /// Text held back because it may start a stop string.
    pub fn held(&self) -> &str {
        &self.held
    }

    /// Takes the next text delta; after a stop, returns nothing more.
    pub fn push(&mut self, delta: &str) -> StopOutput {
        if self.stopped {
            return StopOutput::default();
        }
        if self.stops.is_empty() {
            return StopOutput {
                text: delta.to_owned(),
                stopped: None,
            };
        }
        self.held.push_str(delta);
        // Earlier deltas let out no text that a stop string could start in,
        // so any match starts within `held`.
        let partial = self.partial_match_start();
        match self.earliest_match() {
            // A stop string that could still complete before this one waits.
            Some((pos, index)) if partial >= pos => self.stop_at(pos, index),
            _ => {
                let rest = self.held.split_off(partial);
                let text = std::mem::replace(&mut self.held, rest);
                StopOutput {
                    text,
                    stopped: None,
                }
            }
        }
    }

    /// At the end of generation: the text still held, cut at a stop string
    /// if it holds one.
    pub fn finish(&mut self) -> StopOutput {
        if self.stopped {
            return StopOutput::default();
        }
        match self.earliest_match() {
            Some((pos, index)) => self.stop_at(pos, index),
            None => StopOutput {
                text: std::mem::take(&mut self.held),
                stopped: None,
            },
        }
    }

    fn stop_at(&mut self, pos: usize, index: usize) -> StopOutput {
        let mut text = std::mem::take(&mut self.held);
        text.truncate(pos);
        self.stopped = true;
        StopOutput {
            text,
            stopped: self.stops.get(index).cloned(),
        }
    }

    /// The complete stop string in `held` that starts first (the shortest
    /// of those starting there, which is the first to complete in a
    /// stream): its position and index.
    fn earliest_match(&self) -> Option<(usize, usize)> {
        self.stops
            .iter()
            .enumerate()
            .filter_map(|(index, stop)| {
                self.held
                    .find(stop.as_str())
                    .map(|pos| (pos, stop.len(), index))
            })
            .min()
            .map(|(pos, _, index)| (pos, index))
    }

    /// Where the longest suffix of `held` that is a proper prefix of some
    /// stop string starts (`held.len()` if none).
    fn partial_match_start(&self) -> usize {
        let longest = self.stops.iter().map(String::len).max().unwrap_or(0);
        let earliest = self.held.len().saturating_sub(longest.saturating_sub(1));
        self.held
            .char_indices()
            .map(|(i, _)| i)
            .filter(|&i| i >= earliest)
            .find(|&i| {
                let tail = &self.held[i..];
                self.stops
                    .iter()
                    .any(|stop| stop.len() > tail.len() && stop.starts_with(tail))
            })
            .unwrap_or(self.held.len())
    }
}
