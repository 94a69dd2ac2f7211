//! A routing process with short-term memory (issue 47): `synth --skew locality:p=P,drift=R` and
//! `bench --scenario locality:p=P,drift=R`.
//!
//! The model: the vocabulary splits into `topics` equal token ranges (as `domains:D`), and each
//! topic has, per layer, its own sharply ranked experts ([`LOCALITY_EXPONENT`]: a topic's top-k
//! wins nearly every time), so a token's routed experts in every layer follow its topic.
//!
//! The workload (the token ids `bench --scenario locality` feeds, [`LocalityProcess`]): token
//! `t`'s topic is, with probability `p`, the topic of one of the previous `window` tokens
//! (uniform among them: a re-pick, so every layer re-picks experts a recent token used), else a
//! draw from the popular distribution: Zipf (`1 / (1 + rank)`) over a ranking of the topics.
//! The ranking drifts: after each token, with probability `drift`, one topic of the popular half
//! trades places with one of the other half (the popular set changes by one topic; `drift` is
//! the expected turnover per token). The token is uniform within its topic's range. Everything
//! follows from the seed.

use serde::Serialize;

/// The router bias exponent of a locality model: sharp, so a topic's top-k experts win.
pub const LOCALITY_EXPONENT: f32 = 24.0;
/// Default topics (the vocabulary's ranges, each its own experts per layer).
pub const DEFAULT_TOPICS: usize = 16;
/// Default memory: a re-pick chooses among the previous 8 tokens' topics.
pub const DEFAULT_WINDOW: usize = 8;

/// The process's parameters, written `locality:p=P,drift=R[,topics=G][,window=W]`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct LocalityParams {
    /// Probability that a token re-picks a recent token's topic.
    pub p: f64,
    /// Probability per token that the popular set changes by one topic.
    pub drift: f64,
    pub topics: usize,
    pub window: usize,
}

/// A locality spec that does not parse.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum LocalityError {
    #[error("locality '{spec}': {field}: {reason} (expected locality:p=P,drift=R[,topics=G][,window=W])")]
    Invalid { spec: String, field: String, reason: String },
}

impl std::str::FromStr for LocalityParams {
    type Err = LocalityError;
    fn from_str(spec: &str) -> Result<LocalityParams, LocalityError> {
        let bad = |field: &str, reason: &str| LocalityError::Invalid {
            spec: spec.into(),
            field: field.into(),
            reason: reason.into(),
        };
        let body = spec.strip_prefix("locality:").ok_or_else(|| bad("locality", "missing prefix"))?;
        let (mut p, mut drift) = (None, None);
        let mut out = LocalityParams { p: 0.0, drift: 0.0, topics: DEFAULT_TOPICS, window: DEFAULT_WINDOW };
        for part in body.split(',') {
            let (key, value) = part.split_once('=').ok_or_else(|| bad(part, "expected key=value"))?;
            let fraction = |v: &str| v.parse::<f64>().ok().filter(|x| (0.0..=1.0).contains(x));
            let count = |v: &str| v.parse::<usize>().ok().filter(|&x| x >= 1);
            match key {
                "p" => p = Some(fraction(value).ok_or_else(|| bad("p", "a probability in 0..=1"))?),
                "drift" => {
                    drift = Some(fraction(value).ok_or_else(|| bad("drift", "a probability in 0..=1"))?)
                }
                "topics" => {
                    out.topics = count(value)
                        .filter(|&g| g >= 2)
                        .ok_or_else(|| bad("topics", "a whole number >= 2"))?
                }
                "window" => out.window = count(value).ok_or_else(|| bad("window", "a whole number >= 1"))?,
                other => return Err(bad(other, "unknown parameter")),
            }
        }
        out.p = p.ok_or_else(|| bad("p", "missing"))?;
        out.drift = drift.ok_or_else(|| bad("drift", "missing"))?;
        Ok(out)
    }
}

impl std::fmt::Display for LocalityParams {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "locality:p={},drift={},topics={},window={}", self.p, self.drift, self.topics, self.window)
    }
}

/// SplitMix64 (stable across versions, as `synth`'s).
#[derive(Debug, Clone)]
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n.max(1) as u64) as usize
    }
}

/// The topic and token sequence of a locality workload (module docs).
#[derive(Debug, Clone)]
pub struct LocalityProcess {
    params: LocalityParams,
    rng: Rng,
    /// `ranking[r]`: the topic at popularity rank `r`.
    ranking: Vec<usize>,
    /// Cumulative Zipf weights over ranks.
    cumulative: Vec<f64>,
    recent: std::collections::VecDeque<usize>,
    /// Re-picks and drift events so far (for the tests and the scenario's report).
    pub repicks: u64,
    pub drifts: u64,
    pub tokens: u64,
}

impl LocalityProcess {
    pub fn new(params: LocalityParams, seed: u64) -> LocalityProcess {
        let g = params.topics.max(2);
        let mut rng = Rng(seed ^ 0x10CA_1177);
        let mut ranking: Vec<usize> = (0..g).collect();
        for i in (1..g).rev() {
            ranking.swap(i, rng.below(i + 1));
        }
        let mut acc = 0.0;
        let cumulative = (0..g)
            .map(|r| {
                acc += 1.0 / (1.0 + r as f64);
                acc
            })
            .collect();
        LocalityProcess {
            params,
            rng,
            ranking,
            cumulative,
            recent: Default::default(),
            repicks: 0,
            drifts: 0,
            tokens: 0,
        }
    }

    pub fn params(&self) -> &LocalityParams {
        &self.params
    }

    /// The popular half of the topics now (rank order).
    pub fn popular_set(&self) -> &[usize] {
        &self.ranking[..self.ranking.len() / 2]
    }

    /// The chance that a popular draw (not a re-pick) picks `topic` now.
    pub fn popular_probability(&self, topic: usize) -> f64 {
        let total = *self.cumulative.last().expect("two topics or more");
        let rank = self.ranking.iter().position(|&t| t == topic).unwrap_or(0);
        (1.0 / (1.0 + rank as f64)) / total
    }

    /// The topics of the re-pick window now (oldest first).
    pub fn recent(&self) -> impl Iterator<Item = &usize> {
        self.recent.iter()
    }

    /// The next token's topic.
    pub fn next_topic(&mut self) -> usize {
        let topic = if !self.recent.is_empty() && self.rng.unit() < self.params.p {
            self.repicks += 1;
            self.recent[self.rng.below(self.recent.len())]
        } else {
            let total = *self.cumulative.last().expect("two topics or more");
            let x = self.rng.unit() * total;
            let rank = self.cumulative.iter().position(|&c| x < c).unwrap_or(self.cumulative.len() - 1);
            self.ranking[rank]
        };
        self.recent.push_back(topic);
        if self.recent.len() > self.params.window {
            self.recent.pop_front();
        }
        if self.rng.unit() < self.params.drift {
            let half = self.ranking.len() / 2;
            let (a, b) = (self.rng.below(half), half + self.rng.below(self.ranking.len() - half));
            self.ranking.swap(a, b);
            self.drifts += 1;
        }
        self.tokens += 1;
        topic
    }

    /// The next token id of a `vocab`-token model (uniform within its topic's range).
    pub fn next_token(&mut self, vocab: usize) -> u32 {
        let topic = self.next_topic();
        let range = domain_tokens(vocab, self.params.topics, topic);
        range.start + self.rng.below((range.end - range.start) as usize) as u32
    }

    /// `n` tokens.
    pub fn tokens(&mut self, vocab: usize, n: usize) -> Vec<u32> {
        (0..n).map(|_| self.next_token(vocab)).collect()
    }
}

/// The domain of `token` when the vocabulary splits into `n_domains` equal ranges.
pub fn domain_of_token(token: u32, vocab: usize, n_domains: usize) -> usize {
    ((token as usize * n_domains.max(1)) / vocab.max(1)).min(n_domains.max(1) - 1)
}

/// The token range of `domain`.
pub fn domain_tokens(vocab: usize, n_domains: usize, domain: usize) -> std::ops::Range<u32> {
    let d = n_domains.max(1);
    let first = (0..vocab).find(|&t| domain_of_token(t as u32, vocab, d) == domain).unwrap_or(vocab);
    let end = (first..vocab).find(|&t| domain_of_token(t as u32, vocab, d) != domain).unwrap_or(vocab);
    first as u32..end as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(p: f64, drift: f64) -> LocalityParams {
        LocalityParams { p, drift, topics: 32, window: 8 }
    }

    #[test]
    fn specs_parse_with_defaults_and_errors_name_the_field() {
        let l: LocalityParams = "locality:p=0.8,drift=0.01".parse().unwrap();
        assert_eq!(l, LocalityParams { p: 0.8, drift: 0.01, topics: DEFAULT_TOPICS, window: DEFAULT_WINDOW });
        let l: LocalityParams = "locality:p=0.5,drift=0,topics=8,window=4".parse().unwrap();
        assert_eq!((l.topics, l.window), (8, 4));
        assert_eq!(l.to_string().parse::<LocalityParams>().unwrap(), l);
        for (spec, field) in [
            ("locality:p=1.5,drift=0", "p"),
            ("locality:p=0.5", "drift"),
            ("locality:p=0.5,drift=0,topics=1", "topics"),
            ("locality:p=0.5,drift=0,speed=3", "speed"),
        ] {
            let LocalityError::Invalid { field: f, .. } = spec.parse::<LocalityParams>().unwrap_err();
            assert_eq!(f, field, "{spec}");
        }
    }

    #[test]
    fn the_same_seed_gives_the_same_tokens() {
        let a = LocalityProcess::new(params(0.7, 0.05), 9).tokens(4096, 500);
        let b = LocalityProcess::new(params(0.7, 0.05), 9).tokens(4096, 500);
        let c = LocalityProcess::new(params(0.7, 0.05), 10).tokens(4096, 500);
        assert_eq!(a, b);
        assert_ne!(a, c);
        let topic = |t: u32| domain_of_token(t, 4096, 32);
        assert!(a.iter().all(|&t| (t as usize) < 4096) && topic(a[0]) < 32);
    }

    /// The share of tokens whose topic is among the previous `window` topics is, in
    /// expectation, `p + (1 - p) * q_t`, `q_t` the chance that a popular draw lands in the window
    /// (from the popular distribution at that token); the popular set's turnover per token is
    /// `drift`; the process's own count of re-picks is `p`.
    #[test]
    fn measured_repick_rate_and_drift_match_the_parameters() {
        for (p, drift) in [(0.0, 0.0), (0.5, 0.01), (0.8, 0.05), (0.95, 0.2)] {
            let n = 40_000;
            let mut proc = LocalityProcess::new(params(p, drift), 1);
            let (mut turnover, mut in_window, mut expected) = (0usize, 0usize, 0.0);
            let mut popular: Vec<usize> = proc.popular_set().to_vec();
            for _ in 0..n {
                let mut window: Vec<usize> = proc.recent().copied().collect();
                window.sort();
                window.dedup();
                let q: f64 = window.iter().map(|&t| proc.popular_probability(t)).sum();
                let topic = proc.next_topic();
                if !window.is_empty() {
                    expected += p + (1.0 - p) * q;
                    in_window += usize::from(window.contains(&topic));
                }
                let now = proc.popular_set();
                turnover += now.iter().filter(|t| !popular.contains(t)).count();
                popular = now.to_vec();
            }
            let (measured, expected) = (in_window as f64 / (n - 1) as f64, expected / (n - 1) as f64);
            assert!(
                (measured - expected).abs() < 0.015,
                "p {p}: measured {measured:.3}, expected {expected:.3}"
            );
            let rate = turnover as f64 / n as f64;
            assert!((rate - drift).abs() < 0.01 + 0.1 * drift, "drift {drift}: measured {rate:.4}");
            let repicks = proc.repicks as f64 / n as f64;
            assert!((repicks - p).abs() < 0.01, "p {p}: re-picks {repicks:.3}");
        }
    }
}
