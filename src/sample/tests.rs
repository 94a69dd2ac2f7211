use super::*;

fn params() -> SamplingParams {
    SamplingParams { temperature: 1.0, ..SamplingParams::default() }
}

fn ids(c: &[(u32, f32)]) -> Vec<u32> {
    c.iter().map(|x| x.0).collect()
}

#[test]
fn validation_names_the_field() {
    let bad = [
        (SamplingParams { temperature: -0.5, ..params() }, "temperature"),
        (SamplingParams { temperature: f32::NAN, ..params() }, "temperature"),
        (SamplingParams { top_p: 0.0, ..params() }, "top_p"),
        (SamplingParams { top_p: 1.5, ..params() }, "top_p"),
        (SamplingParams { min_p: -0.1, ..params() }, "min_p"),
        (SamplingParams { min_p: 1.1, ..params() }, "min_p"),
        (SamplingParams { repetition_penalty: 0.0, ..params() }, "repetition_penalty"),
        (SamplingParams { presence_penalty: 2.5, ..params() }, "presence_penalty"),
        (SamplingParams { frequency_penalty: -3.0, ..params() }, "frequency_penalty"),
        (SamplingParams { logprobs: Some(21), ..params() }, "top_logprobs"),
    ];
    for (p, field) in bad {
        let e = p.validate().unwrap_err();
        assert_eq!(e.field, field);
        assert!(Sampler::new(p).is_err());
    }
    assert_eq!(
        SamplingParams { top_p: 0.0, ..params() }.validate().unwrap_err().to_string(),
        "top_p = 0: must be in (0, 1] (1 = off)"
    );
    params().validate().unwrap();
    SamplingParams::greedy().validate().unwrap();
}

#[test]
fn top_k_keeps_the_k_largest_most_likely_first() {
    let row = [0.1, 3.0, -1.0, 2.0, 2.5];
    let c = filtered(&row, &SamplingParams { top_k: 3, ..params() });
    assert_eq!(ids(&c), vec![1, 4, 3]);
    // top_k past the vocabulary keeps everything
    assert_eq!(filtered(&row, &SamplingParams { top_k: 99, ..params() }).len(), 5);
}

#[test]
fn top_p_keeps_the_smallest_set_reaching_p() {
    // probabilities 0.5, 0.25, 0.125, 0.125 (logits are their logs)
    let row = [0.5f32.ln(), 0.25f32.ln(), 0.125f32.ln(), 0.125f32.ln()];
    let keep = |p: f32| ids(&filtered(&row, &SamplingParams { top_p: p, ..params() }));
    assert_eq!(keep(0.5), vec![0]);
    assert_eq!(keep(0.6), vec![0, 1]);
    assert_eq!(keep(0.75), vec![0, 1]);
    assert_eq!(keep(0.8), vec![0, 1, 2]);
    assert_eq!(keep(1.0), vec![0, 1, 2, 3]);
    assert_eq!(keep(0.01), vec![0]);
}

#[test]
fn min_p_drops_tokens_below_a_fraction_of_the_best() {
    let row = [0.5f32.ln(), 0.25f32.ln(), 0.125f32.ln(), 0.05f32.ln()];
    let keep = |p: f32| ids(&filtered(&row, &SamplingParams { min_p: p, ..params() }));
    assert_eq!(keep(0.2), vec![0, 1, 2]); // 0.05 < 0.1
    assert_eq!(keep(0.5), vec![0, 1]);
    assert_eq!(keep(0.6), vec![0]);
    assert_eq!(keep(0.0), vec![0, 1, 2, 3]);
}

#[test]
fn temperature_sharpens_and_flattens() {
    let row = [2.0, 1.0, 0.0];
    let p = |t: f32| softmax_of(&filtered(&row, &SamplingParams { temperature: t, ..params() }));
    let (cold, warm, hot) = (p(0.5), p(1.0), p(4.0));
    assert!(cold[0] > warm[0] && warm[0] > hot[0]);
    // at T = 1 the probabilities are the plain softmax
    let e: Vec<f64> = row.iter().map(|&x| (x as f64).exp()).collect();
    let s: f64 = e.iter().sum();
    for (got, want) in warm.iter().zip(e.iter().map(|v| v / s)) {
        assert!((got - want).abs() < 1e-9);
    }
    // temperature applies before top_p: at T = 0.25 the best token alone passes p = 0.9
    let sharp = filtered(&row, &SamplingParams { temperature: 0.25, top_p: 0.9, ..params() });
    assert_eq!(ids(&sharp), vec![0]);
    assert_eq!(filtered(&row, &SamplingParams { top_p: 0.9, ..params() }).len(), 2);
}

#[test]
fn penalties_change_only_tokens_in_the_window() {
    let row = [2.0, -2.0, 1.0, 0.5];
    let ctx = [0, 1, 1, 3];
    let mut r = row;
    apply_penalties(&mut r, &ctx, &SamplingParams { repetition_penalty: 2.0, ..params() });
    assert_eq!(r, [1.0, -4.0, 1.0, 0.25]);
    let mut r = row;
    apply_penalties(
        &mut r,
        &ctx,
        &SamplingParams { presence_penalty: 0.5, frequency_penalty: 0.25, ..params() },
    );
    assert_eq!(r, [2.0 - 0.75, -2.0 - 1.0, 1.0, 0.5 - 0.75]);
    // the window: only the last two tokens (1, 3)
    let mut r = row;
    apply_penalties(&mut r, &ctx, &SamplingParams { presence_penalty: 1.0, penalty_last_n: 2, ..params() });
    assert_eq!(r, [2.0, -3.0, 1.0, -0.5]);
    // ids past the row are ignored, not a panic
    let mut r = row;
    apply_penalties(&mut r, &[99], &SamplingParams { presence_penalty: 1.0, ..params() });
    assert_eq!(r, row);
}

#[test]
fn greedy_is_the_argmax_and_penalties_can_move_it() {
    let row = [0.3, 4.0, 4.0, -1.0];
    let mut s = Sampler::new(SamplingParams::greedy()).unwrap();
    assert_eq!(s.sample(&row, &[]), argmax(&row));
    assert_eq!(s.sample(&row, &[]), 1); // first of equals
    let mut s = Sampler::new(SamplingParams { repetition_penalty: 2.0, ..SamplingParams::greedy() }).unwrap();
    assert_eq!(s.sample(&row, &[1]), 2);
    assert!(!SamplingParams::greedy().needs_logits());
    assert!(SamplingParams { repetition_penalty: 1.1, ..SamplingParams::greedy() }.needs_logits());
    assert!(SamplingParams { logprobs: Some(0), ..SamplingParams::greedy() }.needs_logits());
    assert!(params().needs_logits());
}

#[test]
fn same_seed_same_tokens_other_seed_other_tokens() {
    let row: Vec<f32> = (0..50).map(|i| ((i * 7919) % 13) as f32 * 0.3).collect();
    let draw = |seed| {
        let mut s = Sampler::new(SamplingParams { seed: Some(seed), ..params() }).unwrap();
        (0..64).map(|_| s.sample(&row, &[])).collect::<Vec<_>>()
    };
    assert_eq!(draw(42), draw(42));
    assert_ne!(draw(42), draw(43));
}

#[test]
fn draws_follow_the_filtered_distribution() {
    // p = 0.5, 0.25, 0.125, 0.125; top_k 3 renormalises to 4/7, 2/7, 1/7
    let row = [0.5f32.ln(), 0.25f32.ln(), 0.125f32.ln(), 0.125f32.ln()];
    let mut s = Sampler::new(SamplingParams { top_k: 3, seed: Some(1), ..params() }).unwrap();
    let n = 70_000;
    let mut counts = [0usize; 4];
    for _ in 0..n {
        counts[s.sample(&row, &[]) as usize] += 1;
    }
    assert_eq!(counts[3], 0, "filtered out");
    for (i, want) in [4.0 / 7.0, 2.0 / 7.0, 1.0 / 7.0].iter().enumerate() {
        let got = counts[i] as f64 / n as f64;
        assert!((got - want).abs() < 0.01, "token {i}: {got} vs {want}");
    }
}

#[test]
fn logprobs_come_from_the_raw_distribution() {
    let row = [0.5f32.ln(), 0.25f32.ln(), 0.125f32.ln(), 0.125f32.ln()];
    let lp = logprobs(&row, 2, 3);
    assert_eq!(lp.chosen.id, 2);
    assert!((lp.chosen.logprob - 0.125f32.ln()).abs() < 1e-6);
    assert_eq!(lp.top.iter().map(|t| t.id).collect::<Vec<_>>(), vec![0, 1, 2]);
    assert!((lp.top[1].logprob - 0.25f32.ln()).abs() < 1e-6);
    assert!(logprobs(&row, 0, 0).top.is_empty());
    assert_eq!(logprobs(&row, 0, 10).top.len(), 4);
    // the sampler reports the unfiltered figure even when top_k cut the distribution
    let s =
        Sampler::new(SamplingParams { top_k: 1, temperature: 0.5, logprobs: Some(1), ..params() }).unwrap();
    let got = s.logprobs(&row, 0).unwrap();
    assert!((got.chosen.logprob - 0.5f32.ln()).abs() < 1e-6);
    assert!(Sampler::new(params()).unwrap().logprobs(&row, 0).is_none());
}

#[test]
fn nan_logits_are_never_chosen_by_sampling() {
    let row = [f32::NAN, 1.0, f32::NAN, 0.0];
    let mut s = Sampler::new(SamplingParams { seed: Some(3), ..params() }).unwrap();
    for _ in 0..200 {
        let t = s.sample(&row, &[]);
        assert!(t == 1 || t == 3);
    }
}
