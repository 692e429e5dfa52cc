//! Stop strings found in streamed text, across token boundaries.

use std::path::Path;

use metrale_model_engine::sampling::{StopChecker, StopOutput};
use metrale_model_engine::tokenizer::Tokenizer;
use proptest::prelude::*;

fn stops(list: &[&str]) -> Vec<String> {
    list.iter().map(|s| s.to_string()).collect()
}

/// Feeds `deltas`; returns the emitted text and the stop string found.
fn run(checker: &mut StopChecker, deltas: &[&str]) -> (String, Option<String>) {
    let mut text = String::new();
    for delta in deltas {
        let StopOutput { text: out, stopped } = checker.push(delta);
        text.push_str(&out);
        if stopped.is_some() {
            return (text, stopped);
        }
    }
    let StopOutput { text: out, stopped } = checker.finish();
    text.push_str(&out);
    (text, stopped)
}

#[test]
fn stop_string_straddling_deltas_is_found_and_cut() {
    let mut checker = StopChecker::new(&stops(&["END"]));
    let out = checker.push("foo E");
    assert_eq!(
        out,
        StopOutput {
            text: "foo ".into(),
            stopped: None
        }
    );
    assert_eq!(checker.held(), "E");
    let out = checker.push("N");
    assert_eq!(out.text, "");
    assert_eq!(checker.held(), "EN");
    let out = checker.push("D bar");
    assert_eq!(
        out,
        StopOutput {
            text: String::new(),
            stopped: Some("END".into())
        }
    );
    assert!(checker.is_stopped());
    assert_eq!(checker.push("more"), StopOutput::default());
}

#[test]
fn false_starts_are_released() {
    let mut checker = StopChecker::new(&stops(&["END"]));
    assert_eq!(checker.push("xE").text, "x");
    assert_eq!(checker.push("Nx").text, "ENx");
    assert_eq!(checker.push("EEN").text, "E");
    assert_eq!(
        checker.finish(),
        StopOutput {
            text: "EN".into(),
            stopped: None
        }
    );
}

#[test]
fn earliest_stop_wins_and_text_before_it_comes_out() {
    let mut checker = StopChecker::new(&stops(&["world", "lo w"]));
    assert_eq!(
        run(&mut checker, &["hel", "lo wor", "ld"]),
        ("hel".into(), Some("lo w".into()))
    );
    let mut checker = StopChecker::new(&stops(&["\n\n", "User:"]));
    assert_eq!(
        run(&mut checker, &["Answer: 4", "\n", "\nUser:"]),
        ("Answer: 4".into(), Some("\n\n".into()))
    );
    // "b" completes first, but "abc" may still start before it: wait.
    let mut checker = StopChecker::new(&stops(&["b", "abc"]));
    assert_eq!(checker.push("xab").text, "x");
    assert_eq!(
        checker.push("c"),
        StopOutput {
            text: String::new(),
            stopped: Some("abc".into())
        }
    );
    let mut checker = StopChecker::new(&stops(&["b", "abc"]));
    assert_eq!(
        run(&mut checker, &["xab", "d"]),
        ("xa".into(), Some("b".into()))
    );
    // Generation ending while waiting: the complete one applies.
    let mut checker = StopChecker::new(&stops(&["b", "abc"]));
    assert_eq!(run(&mut checker, &["xab"]), ("xa".into(), Some("b".into())));
}

#[test]
fn multibyte_stop_strings() {
    let mut checker = StopChecker::new(&stops(&["世界"]));
    assert_eq!(
        run(&mut checker, &["你好", "世", "界!"]),
        ("你好".into(), Some("世界".into()))
    );
    let mut checker = StopChecker::new(&stops(&["🦀🦀"]));
    assert_eq!(run(&mut checker, &["a🦀", "b🦀"]), ("a🦀b🦀".into(), None));
}

#[test]
fn without_stop_strings_everything_passes() {
    let mut checker = StopChecker::new(&[]);
    assert_eq!(run(&mut checker, &["a", "b"]), ("ab".into(), None));
}

#[test]
fn stop_string_split_across_tokens_of_the_fixture_tokenizer() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tokenizer");
    let tok = Tokenizer::from_dir(dir).expect("fixture tokenizer");
    let text = "The answer is 42. Observation: done";
    let ids = tok.encode(text, false).expect("encode");
    // The stop string must not be a single token, or the test is moot.
    assert!(
        ids.iter()
            .all(|&id| !tok.decode(&[id]).expect("decode").contains("Observation"))
    );

    let mut detok = tok.detokenizer(false);
    let mut checker = StopChecker::new(&stops(&["Observation:"]));
    let mut out = String::new();
    let mut stopped = None;
    for &id in &ids {
        if let Some(delta) = detok.step(id).expect("step") {
            let step = checker.push(&delta);
            out.push_str(&step.text);
            if step.stopped.is_some() {
                stopped = step.stopped;
                break;
            }
        }
    }
    assert_eq!(stopped.as_deref(), Some("Observation:"));
    assert_eq!(out, "The answer is 42. ");
}

proptest! {
    /// For any text cut into any deltas, the output is the text up to the
    /// first stop string (or all of it), whatever the cuts.
    #[test]
    fn output_is_independent_of_delta_boundaries(
        text in "[ab🦀c]{0,40}",
        cuts in proptest::collection::vec(0usize..60, 0..12),
        stop_list in proptest::collection::vec("[ab🦀]{1,4}", 1..3),
    ) {
        let chars: Vec<char> = text.chars().collect();
        let mut bounds: Vec<usize> = cuts.into_iter().map(|c| c.min(chars.len())).collect();
        bounds.push(0);
        bounds.push(chars.len());
        bounds.sort_unstable();
        bounds.dedup();
        let pieces: Vec<String> = bounds
            .windows(2)
            .map(|w| chars[w[0]..w[1]].iter().collect())
            .collect();
        let refs: Vec<&str> = pieces.iter().map(String::as_str).collect();

        let expected = stop_list
            .iter()
            .filter_map(|s| text.find(s.as_str()).map(|pos| (pos, s.len(), s.clone())))
            .min()
            .map(|(pos, _, s)| (pos, s));
        let mut checker = StopChecker::new(&stop_list);
        let (out, stopped) = run(&mut checker, &refs);
        match expected {
            Some((pos, stop)) => {
                prop_assert_eq!(&out, &text[..pos]);
                prop_assert_eq!(stopped, Some(stop));
            }
            None => {
                prop_assert_eq!(&out, &text);
                prop_assert_eq!(stopped, None);
            }
        }
    }
}
