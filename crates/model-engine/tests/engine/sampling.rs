//! The sampler: each parameter changes what is drawn, seeds reproduce,
//! greedy is an exact argmax.

use metrale_model_engine::sampling::{Finish, Sampler, SamplingParams};

fn sampler(params: SamplingParams) -> Sampler {
    Sampler::new(&params, 0).expect("valid params")
}

/// Logits whose softmax is `probs` (up to a constant).
fn logits_of(probs: &[f64]) -> Vec<f32> {
    probs.iter().map(|p| p.ln() as f32).collect()
}

/// Counts of each token over `n` draws from the same logits.
fn histogram(params: SamplingParams, logits: &[f32], n: usize) -> Vec<usize> {
    let mut s = sampler(params);
    let mut counts = vec![0; logits.len()];
    for _ in 0..n {
        counts[s.sample(logits, &[]).expect("sample").token as usize] += 1;
    }
    counts
}

fn seeded(seed: u64) -> SamplingParams {
    SamplingParams {
        seed: Some(seed),
        ..SamplingParams::default()
    }
}

#[test]
fn validation_rejects_out_of_range_values() {
    let cases: Vec<(SamplingParams, &str)> = vec![
        (
            SamplingParams {
                temperature: -0.5,
                ..Default::default()
            },
            "temperature",
        ),
        (
            SamplingParams {
                temperature: f32::NAN,
                ..Default::default()
            },
            "temperature",
        ),
        (
            SamplingParams {
                top_p: 0.0,
                ..Default::default()
            },
            "top_p",
        ),
        (
            SamplingParams {
                top_p: 1.5,
                ..Default::default()
            },
            "top_p",
        ),
        (
            SamplingParams {
                min_p: 1.5,
                ..Default::default()
            },
            "min_p",
        ),
        (
            SamplingParams {
                min_p: -0.1,
                ..Default::default()
            },
            "min_p",
        ),
        (
            SamplingParams {
                repetition_penalty: 0.0,
                ..Default::default()
            },
            "repetition_penalty",
        ),
        (
            SamplingParams {
                presence_penalty: 2.5,
                ..Default::default()
            },
            "presence_penalty",
        ),
        (
            SamplingParams {
                frequency_penalty: -3.0,
                ..Default::default()
            },
            "frequency_penalty",
        ),
        (
            SamplingParams {
                max_tokens: Some(0),
                ..Default::default()
            },
            "max_tokens",
        ),
        (
            SamplingParams {
                stop: vec![String::new()],
                ..Default::default()
            },
            "stop",
        ),
    ];
    for (params, name) in cases {
        let err = params.validate().expect_err(name).to_string();
        assert!(err.contains(name), "{name}: {err}");
        assert!(Sampler::new(&params, 0).is_err(), "{name}");
    }
    SamplingParams::default()
        .validate()
        .expect("defaults are valid");
    SamplingParams {
        top_p: 1.0,
        min_p: 1.0,
        temperature: 0.0,
        ..Default::default()
    }
    .validate()
    .expect("edges are valid");
}

#[test]
fn greedy_is_exact_argmax_lowest_id_on_ties() {
    let mut s = sampler(SamplingParams::greedy());
    let logits = [0.5, 3.0, -1.0, 3.0, 2.999_999, f32::NAN];
    assert_eq!(s.sample(&logits, &[]).expect("sample").token, 1);
    let logits = [f32::NEG_INFINITY, 1.0, 1.000_000_1];
    assert_eq!(s.sample(&logits, &[]).expect("sample").token, 2);
    // Greedy ignores the seed entirely.
    for seed in [1, 2, 3] {
        let mut s = sampler(SamplingParams {
            seed: Some(seed),
            ..SamplingParams::greedy()
        });
        assert_eq!(s.sample(&[0.0, 0.1, 0.05], &[]).expect("sample").token, 1);
    }
}

#[test]
fn seeds_reproduce_and_differ() {
    let logits = vec![0.0f32; 64];
    let run = |seed| {
        let mut s = sampler(seeded(seed));
        (0..40)
            .map(|_| s.sample(&logits, &[]).expect("sample").token)
            .collect::<Vec<_>>()
    };
    assert_eq!(run(7), run(7));
    assert_ne!(run(7), run(8));
    // Unseeded samplers are seeded from the OS: two of them differ.
    let unseeded = || {
        let mut s = sampler(SamplingParams::default());
        (0..40)
            .map(|_| s.sample(&logits, &[]).expect("sample").token)
            .collect::<Vec<_>>()
    };
    assert_ne!(unseeded(), unseeded());
}

#[test]
fn sampling_follows_the_softmax() {
    let probs = [0.5, 0.3, 0.15, 0.05];
    let counts = histogram(seeded(1), &logits_of(&probs), 20_000);
    for (count, p) in counts.iter().zip(probs) {
        let freq = *count as f64 / 20_000.0;
        assert!((freq - p).abs() < 0.015, "{counts:?}");
    }
}

#[test]
fn temperature_sharpens_and_flattens() {
    let logits = [2.0f32, 1.0, 0.0];
    let top_share = |temperature: f32| {
        let counts = histogram(
            SamplingParams {
                temperature,
                ..seeded(3)
            },
            &logits,
            10_000,
        );
        counts[0] as f64 / 10_000.0
    };
    // softmax([2, 1, 0] / t)[0]: t=1 -> 0.665, t=0.25 -> 0.982, t=4 -> 0.419
    assert!((top_share(1.0) - 0.665).abs() < 0.02);
    assert!((top_share(0.25) - 0.982).abs() < 0.01);
    assert!((top_share(4.0) - 0.419).abs() < 0.02);
}

#[test]
fn top_k_keeps_only_the_k_best() {
    let logits: Vec<f32> = (0..10).map(|i| i as f32 * 0.1).collect();
    let counts = histogram(
        SamplingParams {
            top_k: 3,
            ..seeded(4)
        },
        &logits,
        3000,
    );
    assert!(counts[..7].iter().all(|&c| c == 0), "{counts:?}");
    assert!(counts[7..].iter().all(|&c| c > 0), "{counts:?}");
}

#[test]
fn top_p_keeps_the_nucleus() {
    let logits = logits_of(&[0.05, 0.5, 0.15, 0.3]);
    let counts = histogram(
        SamplingParams {
            top_p: 0.75,
            ..seeded(5)
        },
        &logits,
        4000,
    );
    assert_eq!(counts[0] + counts[2], 0, "{counts:?}");
    // Renormalised over {0.5, 0.3}: 0.625 / 0.375.
    let share = counts[1] as f64 / 4000.0;
    assert!((share - 0.625).abs() < 0.03, "{counts:?}");
}

#[test]
fn top_p_applies_after_top_k() {
    // top_k=2 leaves {0.4, 0.35}; renormalised 0.53 / 0.47, so top_p=0.5
    // keeps only the first. Without top_k first, top_p=0.5 would keep two.
    let logits = logits_of(&[0.4, 0.35, 0.25]);
    let counts = histogram(
        SamplingParams {
            top_k: 2,
            top_p: 0.5,
            ..seeded(6)
        },
        &logits,
        1000,
    );
    assert_eq!(counts, vec![1000, 0, 0]);
    let counts = histogram(
        SamplingParams {
            top_p: 0.5,
            ..seeded(6)
        },
        &logits,
        1000,
    );
    assert!(counts[1] > 0 && counts[2] == 0, "{counts:?}");
}

#[test]
fn min_p_drops_unlikely_tokens() {
    let logits = logits_of(&[0.5, 0.3, 0.15, 0.05]);
    // Threshold 0.25 * 0.5 = 0.125: the 0.05 token goes.
    let counts = histogram(
        SamplingParams {
            min_p: 0.25,
            ..seeded(7)
        },
        &logits,
        4000,
    );
    assert_eq!(counts[3], 0, "{counts:?}");
    assert!(counts[..3].iter().all(|&c| c > 0), "{counts:?}");
}

#[test]
fn repetition_penalty_covers_prompt_and_output() {
    let params = SamplingParams {
        repetition_penalty: 1.2,
        ..SamplingParams::greedy()
    };
    // Positive logits are divided: 2.0 / 1.2 = 1.67 < 1.9.
    let mut s = Sampler::new(&params, 1).expect("valid");
    assert_eq!(
        s.sample(&[2.0, 1.9, 0.0], &[0]).expect("sample").token,
        1,
        "prompt token penalised"
    );
    // Negative logits are multiplied: -1.0 * 1.2 = -1.2 < -1.1.
    let mut s = Sampler::new(&params, 1).expect("valid");
    assert_eq!(
        s.sample(&[-1.0, -1.1, -5.0], &[2, 0])
            .expect("sample")
            .token,
        1,
        "output token penalised"
    );
    // Unseen tokens are untouched.
    let mut s = Sampler::new(&params, 1).expect("valid");
    assert_eq!(s.sample(&[2.0, 1.9, 0.0], &[2]).expect("sample").token, 0);
}

#[test]
fn presence_penalty_counts_generated_tokens_once() {
    let params = SamplingParams {
        presence_penalty: 1.0,
        ..SamplingParams::greedy()
    };
    let logits = [2.0, 1.5];
    // Prompt tokens are not penalised.
    let mut s = Sampler::new(&params, 1).expect("valid");
    assert_eq!(s.sample(&logits, &[0]).expect("sample").token, 0);
    // Once generated: 2.0 - 1.0 < 1.5.
    assert_eq!(s.sample(&logits, &[0, 0]).expect("sample").token, 1);
    // Generated many times: still 1.0 subtracted, no more.
    let mut s = Sampler::new(&params, 0).expect("valid");
    assert_eq!(
        s.sample(&[3.5, 1.5], &[0, 0, 0, 0]).expect("sample").token,
        0
    );
}

#[test]
fn frequency_penalty_scales_with_count() {
    let params = SamplingParams {
        frequency_penalty: 0.5,
        ..SamplingParams::greedy()
    };
    let logits = [3.0, 1.75];
    let mut s = Sampler::new(&params, 0).expect("valid");
    let mut history = vec![0];
    assert_eq!(
        s.sample(&logits, &history).expect("sample").token,
        0,
        "3.0 - 0.5"
    );
    history.push(0);
    assert_eq!(
        s.sample(&logits, &history).expect("sample").token,
        0,
        "3.0 - 1.0"
    );
    history.push(0);
    assert_eq!(
        s.sample(&logits, &history).expect("sample").token,
        1,
        "3.0 - 1.5 < 1.75"
    );
}

#[test]
fn penalties_come_before_temperature_and_filters() {
    // The penalty moves token 0 out of the top-1, so top_k=1 picks token 1
    // even at a high temperature.
    let params = SamplingParams {
        temperature: 5.0,
        top_k: 1,
        presence_penalty: 2.0,
        ..seeded(9)
    };
    let mut s = Sampler::new(&params, 0).expect("valid");
    for _ in 0..20 {
        assert_eq!(s.sample(&[1.0, 0.5, -3.0], &[0]).expect("sample").token, 1);
    }
}

#[test]
fn logprob_is_the_raw_log_softmax() {
    let logits = [1.0f32, 2.0, 0.5, -1.0];
    let lse = logits.iter().map(|&x| (x as f64).exp()).sum::<f64>().ln();
    let mut s = sampler(SamplingParams::greedy());
    let out = s.sample(&logits, &[]).expect("sample");
    assert_eq!(out.token, 1);
    assert!((out.logprob as f64 - (2.0 - lse)).abs() < 1e-6);
    // Temperature and filters do not change the reported value.
    let mut s = sampler(SamplingParams {
        temperature: 0.3,
        top_k: 2,
        ..seeded(2)
    });
    for _ in 0..20 {
        let out = s.sample(&logits, &[]).expect("sample");
        let expected = logits[out.token as usize] as f64 - lse;
        assert!((out.logprob as f64 - expected).abs() < 1e-6);
    }
}

#[test]
fn nan_and_masked_logits_are_never_chosen() {
    let logits = [f32::NAN, f32::NEG_INFINITY, 0.0, f32::NAN];
    let counts = histogram(seeded(10), &logits, 200);
    assert_eq!(counts, vec![0, 0, 200, 0]);
    let mut s = sampler(seeded(10));
    assert!(s.sample(&[f32::NAN, f32::NEG_INFINITY], &[]).is_err());
    assert!(s.sample(&[], &[]).is_err());
    let mut g = sampler(SamplingParams::greedy());
    assert!(g.sample(&[f32::NAN; 3], &[]).is_err());
}

#[test]
fn stop_token_ids_eos_and_max_tokens_finish() {
    let eos = [2];
    let params = SamplingParams {
        stop_token_ids: vec![7],
        max_tokens: Some(3),
        ..Default::default()
    };
    assert_eq!(params.token_finish(5, &eos, 1), None);
    assert_eq!(params.token_finish(2, &eos, 1), Some(Finish::Eos(2)));
    assert_eq!(params.token_finish(7, &eos, 1), Some(Finish::StopToken(7)));
    assert_eq!(params.token_finish(5, &eos, 2), None);
    assert_eq!(params.token_finish(5, &eos, 3), Some(Finish::Length));
    assert_eq!(Finish::Length.reason(), "length");
    assert_eq!(Finish::StopToken(7).reason(), "stop");

    let ignore = SamplingParams {
        ignore_eos: true,
        stop_token_ids: vec![7],
        ..Default::default()
    };
    assert_eq!(ignore.token_finish(2, &eos, 1), None);
    assert_eq!(ignore.token_finish(7, &eos, 1), Some(Finish::StopToken(7)));
    assert_eq!(
        SamplingParams::default().token_finish(5, &eos, 1_000_000),
        None
    );
}
