//! Choosing the next token from a row of logits: greedy, or sampled after penalties,
//! temperature, top-k, top-p and min-p, with a seeded generator of our own (same seed, same
//! tokens), plus the log-probabilities OpenAI reports.
//!
//! The order of the steps is the one of Hugging Face `generate` and vLLM (what an OpenAI-style
//! client expects): penalties on the raw logits (over the last `penalty_last_n` tokens of the
//! context, prompt included, as llama.cpp does), then temperature, then top-k, top-p and min-p
//! on the tempered distribution, then one draw. Temperature 0 is greedy: the first index of the
//! largest (penalised) logit, which is the engine's own argmax when no penalty applies.
//!
//! Log-probabilities come from the unmodified distribution (log-softmax of the raw row), as
//! OpenAI's are: the chosen token's, and the `top_logprobs` most likely on request.

mod rng;

pub use rng::SplitMix64;

use crate::forward::argmax;
use std::collections::HashMap;

/// Most alternatives `top_logprobs` may ask for (OpenAI's chat limit).
pub const MAX_TOP_LOGPROBS: usize = 20;
/// Default window of the repetition, presence and frequency penalties (llama.cpp's).
pub const DEFAULT_PENALTY_LAST_N: usize = 64;

/// How to choose tokens. `SamplingParams::default()` is greedy with no penalty.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SamplingParams {
    /// 0 = greedy; otherwise logits are divided by it before the draw.
    pub temperature: f32,
    /// Keep only the `top_k` most likely tokens; 0 = off.
    pub top_k: usize,
    /// Keep the smallest set of most likely tokens whose probability reaches `top_p`; 1 = off.
    pub top_p: f32,
    /// Drop tokens less likely than `min_p` times the most likely one; 0 = off.
    pub min_p: f32,
    /// Divide positive (multiply negative) logits of tokens in the window; 1 = off.
    pub repetition_penalty: f32,
    /// Subtract from the logit of every token in the window; 0 = off.
    pub presence_penalty: f32,
    /// Subtract, per occurrence in the window; 0 = off.
    pub frequency_penalty: f32,
    /// The penalties look at this many last tokens of the context.
    pub penalty_last_n: usize,
    /// Same seed, same tokens; `None`: a seed from the clock.
    pub seed: Option<u64>,
    /// Report the chosen token's log-probability, and this many alternatives (0..=20).
    pub logprobs: Option<usize>,
}

impl Default for SamplingParams {
    fn default() -> SamplingParams {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            penalty_last_n: DEFAULT_PENALTY_LAST_N,
            seed: None,
            logprobs: None,
        }
    }
}

/// A sampling parameter out of its range.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{field} = {value}: must be {expected}")]
pub struct SamplingError {
    /// The field's name as the API spells it (`temperature`, `top_p`, ...).
    pub field: &'static str,
    pub value: String,
    pub expected: &'static str,
}

fn check(
    ok: bool,
    field: &'static str,
    value: impl ToString,
    expected: &'static str,
) -> Result<(), SamplingError> {
    if ok {
        Ok(())
    } else {
        Err(SamplingError { field, value: value.to_string(), expected })
    }
}

impl SamplingParams {
    /// Greedy decoding (temperature 0, no penalty).
    pub fn greedy() -> SamplingParams {
        SamplingParams::default()
    }

    /// Every field in range, or an error naming the first that is not.
    pub fn validate(&self) -> Result<(), SamplingError> {
        let t = self.temperature;
        check(t.is_finite() && t >= 0.0, "temperature", t, "a finite number >= 0 (0 = greedy)")?;
        let p = self.top_p;
        check(p > 0.0 && p <= 1.0, "top_p", p, "in (0, 1] (1 = off)")?;
        check((0.0..=1.0).contains(&self.min_p), "min_p", self.min_p, "in [0, 1] (0 = off)")?;
        let r = self.repetition_penalty;
        check(r.is_finite() && r > 0.0, "repetition_penalty", r, "a finite number > 0 (1 = off)")?;
        let range = "in [-2, 2] (0 = off)";
        check(
            (-2.0..=2.0).contains(&self.presence_penalty),
            "presence_penalty",
            self.presence_penalty,
            range,
        )?;
        check(
            (-2.0..=2.0).contains(&self.frequency_penalty),
            "frequency_penalty",
            self.frequency_penalty,
            range,
        )?;
        if let Some(n) = self.logprobs {
            check(n <= MAX_TOP_LOGPROBS, "top_logprobs", n, "at most 20")?;
        }
        Ok(())
    }

    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }

    fn has_penalties(&self) -> bool {
        self.penalty_last_n > 0
            && (self.repetition_penalty != 1.0
                || self.presence_penalty != 0.0
                || self.frequency_penalty != 0.0)
    }

    /// Whether choosing a token needs the logits row (greedy without penalties or logprobs
    /// needs only the engine's argmax).
    pub fn needs_logits(&self) -> bool {
        !self.is_greedy() || self.has_penalties() || self.logprobs.is_some()
    }
}

/// One token with its log-probability.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct TokenLogprob {
    pub id: u32,
    pub logprob: f32,
}

/// The chosen token's log-probability and the most likely alternatives (most likely first).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Logprobs {
    pub chosen: TokenLogprob,
    pub top: Vec<TokenLogprob>,
}

/// Chooses tokens one at a time with [`SamplingParams`]; owns the seeded generator.
#[derive(Debug, Clone)]
pub struct Sampler {
    params: SamplingParams,
    rng: SplitMix64,
    /// Scratch: (id, logit) of the candidates still in play.
    candidates: Vec<(u32, f32)>,
}

impl Sampler {
    /// Validates `params`; the seed (or the clock) starts the generator.
    pub fn new(params: SamplingParams) -> Result<Sampler, SamplingError> {
        params.validate()?;
        let seed = params.seed.unwrap_or_else(clock_seed);
        Ok(Sampler { params, rng: SplitMix64::new(seed), candidates: Vec::new() })
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Choose from `logits` (the raw row) after `context` (prompt and generated tokens so far).
    pub fn sample(&mut self, logits: &[f32], context: &[u32]) -> u32 {
        let mut row = logits.to_vec();
        if self.params.has_penalties() {
            apply_penalties(&mut row, context, &self.params);
        }
        if self.params.is_greedy() {
            return argmax(&row);
        }
        self.candidates = filtered(&row, &self.params);
        if self.candidates.is_empty() {
            return argmax(&row); // every logit was NaN
        }
        let probs = softmax_of(&self.candidates);
        let x = self.rng.next_f64();
        let mut acc = 0.0;
        for (p, &(id, _)) in probs.iter().zip(&self.candidates) {
            acc += p;
            if x < acc {
                return id;
            }
        }
        self.candidates.last().expect("at least one candidate").0
    }

    /// The log-probabilities OpenAI reports for `chosen`, if they were asked for.
    pub fn logprobs(&self, logits: &[f32], chosen: u32) -> Option<Logprobs> {
        self.params.logprobs.map(|n| logprobs(logits, chosen, n))
    }
}

fn clock_seed() -> u64 {
    let nanos =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
    nanos as u64 ^ (std::process::id() as u64).rotate_left(32)
}

/// Repetition (divide positive, multiply negative logits), presence and frequency penalties for
/// the tokens of the last `penalty_last_n` of `context`. Ids outside the row are ignored.
pub fn apply_penalties(row: &mut [f32], context: &[u32], params: &SamplingParams) {
    let window = &context[context.len().saturating_sub(params.penalty_last_n)..];
    let mut counts: HashMap<u32, u32> = HashMap::new();
    for &t in window {
        *counts.entry(t).or_default() += 1;
    }
    for (&id, &n) in &counts {
        let Some(l) = row.get_mut(id as usize) else { continue };
        if params.repetition_penalty != 1.0 {
            *l = if *l > 0.0 { *l / params.repetition_penalty } else { *l * params.repetition_penalty };
        }
        *l -= n as f32 * params.frequency_penalty + params.presence_penalty;
    }
}

/// Temperature, then top-k, top-p and min-p: the candidates left, most likely first, with their
/// tempered logits. Never empty (the most likely token always stays).
pub fn filtered(row: &[f32], params: &SamplingParams) -> Vec<(u32, f32)> {
    let t = params.temperature;
    let mut c: Vec<(u32, f32)> =
        row.iter().enumerate().filter(|(_, l)| !l.is_nan()).map(|(i, &l)| (i as u32, l / t)).collect();
    // Most likely first; equal logits keep the lower id first (stable sort).
    c.sort_by(|a, b| b.1.total_cmp(&a.1));
    if params.top_k > 0 {
        c.truncate(params.top_k);
    }
    if params.top_p < 1.0 {
        let probs = softmax_of(&c);
        let mut acc = 0.0;
        let keep = probs.iter().position(|p| {
            acc += p;
            acc >= params.top_p as f64
        });
        c.truncate(keep.map_or(c.len(), |i| i + 1));
    }
    if params.min_p > 0.0 && !c.is_empty() {
        // p_i >= min_p * p_max  <=>  l_i >= l_max + ln(min_p)
        let floor = c[0].1 + params.min_p.ln();
        c.retain(|&(_, l)| l >= floor);
    }
    c
}

/// Softmax over the candidates' logits, in f64 (the sum of many small terms stays exact enough).
pub fn softmax_of(c: &[(u32, f32)]) -> Vec<f64> {
    let max = c.iter().map(|x| x.1).fold(f32::NEG_INFINITY, f32::max) as f64;
    let e: Vec<f64> = c.iter().map(|x| (x.1 as f64 - max).exp()).collect();
    let sum: f64 = e.iter().sum();
    e.into_iter().map(|v| v / sum).collect()
}

/// Log-softmax of the raw row at `chosen`, and the `top_n` most likely tokens (lower id first
/// among equals).
pub fn logprobs(row: &[f32], chosen: u32, top_n: usize) -> Logprobs {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let lse = max + row.iter().map(|&l| (l as f64 - max).exp()).sum::<f64>().ln();
    let lp = |id: u32| (row[id as usize] as f64 - lse) as f32;
    let mut ids: Vec<u32> = (0..row.len() as u32).collect();
    let n = top_n.min(ids.len());
    if n > 0 {
        let by_logit = |a: &u32, b: &u32| row[*b as usize].total_cmp(&row[*a as usize]).then(a.cmp(b));
        ids.select_nth_unstable_by(n - 1, by_logit);
        ids.truncate(n);
        ids.sort_by(by_logit);
    } else {
        ids.clear();
    }
    Logprobs {
        chosen: TokenLogprob { id: chosen, logprob: lp(chosen) },
        top: ids.into_iter().map(|id| TokenLogprob { id, logprob: lp(id) }).collect(),
    }
}

#[cfg(test)]
mod tests;
