//! Bench scenarios: `bench --scenario shift`, a workload that moves.
//!
//! On a model written with `synth --skew domains:D` (each token range routes to its own popular
//! experts), requests come from one domain, then from another. Three policies run the same
//! request sequence on one engine, each starting from its own cache contents (a manual apply,
//! so every policy has the engine's per-layer slot counts):
//! - `static_first`: the cache learnt on the first domain, never updated (the stale cache);
//! - `online`: the same start, with the automatic updater on (`update_rate`, weighting; the
//!   planned updater: the scenario sets no per-token policy, `cache::policy`);
//! - `static_second`: the cache learnt on the second domain, never updated (the best static
//!   choice after the shift).
//!
//! "Learnt" is a prefill of [`LEARN_TOKENS`] tokens of that domain on the engine itself, read
//! off its perf counts. Each request prefills `n_prompt_tokens` of its domain and generates
//! `n_gen_tokens`, feeding token ids drawn from the same domain (as `bench` feeds random ids).
//! Per request: the decode hit rate, tg, and the exchanges the updater made after it.

use crate::cache::hot_set::HotSet;
use crate::cache::observe::Observations;
use crate::cache::perf::{ModelFingerprint, PerfMode, PerfReport};
use crate::cache::policy::{PolicyConfig, PolicyKind};
use crate::cache::update::{UpdateMode, UpdatePolicy};
use crate::engine::{Engine, EngineError, LiveCache};
use crate::inspect::sample_tokens;
use crate::model::Model;
use crate::moe::phase::Phase;
use crate::synth::domain_tokens;
use serde::Serialize;
use std::time::Instant;

/// Tokens of the learn pass per domain.
pub const LEARN_TOKENS: usize = 256;

/// The policies, in the order they run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ShiftPolicy {
    StaticFirst,
    Online,
    StaticSecond,
}

impl ShiftPolicy {
    pub const ALL: [ShiftPolicy; 3] =
        [ShiftPolicy::StaticFirst, ShiftPolicy::Online, ShiftPolicy::StaticSecond];

    pub fn name(self) -> &'static str {
        match self {
            ShiftPolicy::StaticFirst => "static_first",
            ShiftPolicy::Online => "online",
            ShiftPolicy::StaticSecond => "static_second",
        }
    }
}

#[derive(Debug, Clone)]
pub struct ShiftOptions {
    /// Domains the vocabulary splits into (the model's `domains:D`).
    pub n_domains: usize,
    /// The domain before the shift and the one after it.
    pub domains: (usize, usize),
    /// Requests per domain.
    pub n_requests: usize,
    pub n_prompt_tokens: usize,
    pub n_gen_tokens: usize,
    /// The online policy's updater (its mode is forced to `auto`).
    pub update: UpdatePolicy,
}

#[derive(Debug, thiserror::Error)]
pub enum ShiftError {
    #[error(transparent)]
    Engine(#[from] EngineError),
    #[error("scenario shift: {field}: {reason}")]
    Invalid { field: &'static str, reason: String },
}

/// One request of one policy.
#[derive(Debug, Clone, Serialize)]
pub struct ShiftRequest {
    pub index: usize,
    pub domain: usize,
    pub policy: ShiftPolicy,
    pub hit_rate: f64,
    pub tg_tokens_per_s: f64,
    /// Exchanges the updater made after this request.
    pub exchanges: usize,
    pub pp_hit_rate: f64,
}

/// What `bench --scenario shift --json` prints.
#[derive(Debug, Clone, Serialize)]
pub struct ShiftReport {
    pub device: String,
    pub engine: String,
    pub n_hot_experts: usize,
    pub domains: [usize; 2],
    pub n_domains: usize,
    pub update: UpdatePolicy,
    pub requests: Vec<ShiftRequest>,
}

fn invalid(field: &'static str, reason: String) -> ShiftError {
    ShiftError::Invalid { field, reason }
}

/// `n` tokens of `domain`, the `offset`-th stretch of that domain's sampled stream.
pub fn domain_sample(vocab: usize, n_domains: usize, domain: usize, n: usize, offset: usize) -> Vec<u32> {
    let range = domain_tokens(vocab, n_domains, domain);
    let width = (range.end - range.start) as usize;
    sample_tokens(width, n + offset).split_off(offset).into_iter().map(|t| range.start + t).collect()
}

fn snapshot(engine: &dyn Engine) -> PerfReport {
    engine.perf().map(|p| p.report().clone()).unwrap_or_default()
}

/// Per layer, the engine's slot count filled with the most routed experts of a learn pass on
/// `domain`.
fn learn_target(
    engine: &mut dyn Engine,
    fp: &ModelFingerprint,
    tokens: &[u32],
) -> Result<HotSet, ShiftError> {
    let current = engine.hot_set().cloned().ok_or(EngineError::NoHotCache { engine: engine.kind() })?;
    let before = snapshot(engine);
    let mut cache = engine.new_cache(tokens.len())?;
    engine.forward(tokens, Phase::Prefill, &mut cache)?;
    let counts = Observations::between(&before, &snapshot(engine), fp).counts();
    let lists: Vec<Vec<usize>> = counts
        .iter()
        .zip(&current.layers)
        .map(|(c, layer)| {
            let mut ids: Vec<usize> = (0..c.len()).collect();
            ids.sort_by(|&a, &b| c[b].cmp(&c[a]).then(a.cmp(&b)));
            ids.truncate(layer.n_hot());
            ids
        })
        .collect();
    Ok(HotSet::from_lists(fp.n_layers, fp.n_experts, current.n_lanes, &lists))
}

fn check(engine: &dyn Engine, model: &Model, o: &ShiftOptions) -> Result<(), ShiftError> {
    let c = model.config();
    if o.n_domains < 2
        || o.domains.0 >= o.n_domains
        || o.domains.1 >= o.n_domains
        || o.domains.0 == o.domains.1
    {
        return Err(invalid(
            "domains",
            format!(
                "two different domains below {} are needed (a model from synth --skew domains:D, D >= 2)",
                o.n_domains
            ),
        ));
    }
    if o.n_requests == 0 || o.n_prompt_tokens == 0 || o.n_gen_tokens == 0 {
        return Err(invalid(
            "requests",
            "requests, prompt tokens and generated tokens must be at least 1".into(),
        ));
    }
    let need = (o.n_prompt_tokens + o.n_gen_tokens).max(LEARN_TOKENS);
    if need > c.max_positions {
        return Err(invalid("positions", format!("{need} positions exceed the model's {}", c.max_positions)));
    }
    match engine.perf().map(|p| p.mode()) {
        None | Some(PerfMode::Off) => {
            Err(invalid("perf_mode", "the scenario reads perf counts: use perf mode full or update".into()))
        }
        _ => Ok(()),
    }
}

/// Run the scenario on `engine`. `progress(done, total)` ticks once per request.
pub fn run_shift(
    engine: &mut dyn Engine,
    model: &Model,
    o: &ShiftOptions,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<ShiftReport, ShiftError> {
    check(engine, model, o)?;
    engine.set_copy_logits(false);
    let c = model.config().clone();
    let fp = ModelFingerprint::of(model);
    let (a, b) = o.domains;
    let target_a = learn_target(engine, &fp, &domain_sample(c.vocab, o.n_domains, a, LEARN_TOKENS, 50_000))?;
    let target_b = learn_target(engine, &fp, &domain_sample(c.vocab, o.n_domains, b, LEARN_TOKENS, 50_000))?;
    let mut requests = Vec::new();
    let total = (3 * 2 * o.n_requests) as u64;
    for policy in ShiftPolicy::ALL {
        let start = if policy == ShiftPolicy::StaticSecond { &target_b } else { &target_a };
        let mode = if policy == ShiftPolicy::Online { UpdateMode::Auto } else { UpdateMode::Off };
        // The scenario compares the planned updater with static caches: no per-token policy.
        let update = UpdatePolicy { mode, cache: PolicyConfig::of(PolicyKind::Planned), ..o.update };
        let mut live = LiveCache::new(engine, fp.clone(), model.layer_expert_bytes(), update);
        live.request_manual(engine, start)?;
        for index in 0..2 * o.n_requests {
            let domain = if index < o.n_requests { a } else { b };
            requests.push(one_request(engine, &mut live, &c, o, policy, index, domain)?);
            progress(requests.len() as u64, total);
        }
    }
    Ok(ShiftReport {
        device: engine.device(),
        engine: engine.kind().name().to_string(),
        n_hot_experts: target_a.layers.iter().map(|l| l.n_hot()).sum(),
        domains: [a, b],
        n_domains: o.n_domains,
        update: UpdatePolicy {
            mode: UpdateMode::Auto,
            cache: PolicyConfig::of(PolicyKind::Planned),
            ..o.update
        },
        requests,
    })
}

fn hit_rate(before: &PerfReport, after: &PerfReport) -> f64 {
    let sum = |r: &PerfReport, hot: bool| -> u64 {
        r.layers.iter().map(|l| if hot { l.hot_slots_total } else { l.cold_slots_total }).sum()
    };
    let hot = sum(after, true) - sum(before, true);
    let cold = sum(after, false) - sum(before, false);
    if hot + cold == 0 {
        0.0
    } else {
        hot as f64 / (hot + cold) as f64
    }
}

fn one_request(
    engine: &mut dyn Engine,
    live: &mut LiveCache,
    c: &crate::model::config::ModelConfig,
    o: &ShiftOptions,
    policy: ShiftPolicy,
    index: usize,
    domain: usize,
) -> Result<ShiftRequest, ShiftError> {
    // The same requests for every policy; request i's tokens are its own stretch of the stream.
    let offset = index * (o.n_prompt_tokens + o.n_gen_tokens);
    let prompt = domain_sample(c.vocab, o.n_domains, domain, o.n_prompt_tokens, offset);
    let feed = domain_sample(c.vocab, o.n_domains, domain, o.n_gen_tokens, offset + o.n_prompt_tokens);
    let mut cache = engine.new_cache(o.n_prompt_tokens + o.n_gen_tokens)?;
    live.begin_request();
    let before = snapshot(engine);
    let mut next = *engine.forward(&prompt, Phase::Prefill, &mut cache)?.argmax.last().expect("rows");
    let mid = snapshot(engine);
    let start = Instant::now();
    for &fed in feed.iter().take(o.n_gen_tokens - 1) {
        engine.forward(&[next], Phase::Decode, &mut cache)?;
        next = fed;
        live.after_tokens(engine, 1)?;
    }
    engine.forward(&[next], Phase::Decode, &mut cache)?;
    let tg_tokens_per_s = o.n_gen_tokens as f64 / start.elapsed().as_secs_f64();
    let after = snapshot(engine);
    let exchanges = live.end_request(engine)?.map_or(0, |u| u.exchanges);
    Ok(ShiftRequest {
        index,
        domain,
        policy,
        hit_rate: hit_rate(&mid, &after),
        tg_tokens_per_s,
        exchanges,
        pp_hit_rate: hit_rate(&before, &mid),
    })
}

impl ShiftReport {
    pub fn to_text(&self) -> String {
        let mut out = format!(
            "device        {} (engine {})\nscenario      shift: domain {} then {} of {}, {} hot experts, update rate {}\n",
            self.device, self.engine, self.domains[0], self.domains[1], self.n_domains, self.n_hot_experts, self.update.rate
        );
        out += "policy          request  domain  hit rate        tg  exchanges\n";
        for r in &self.requests {
            out += &format!(
                "{:<15} {:>7} {:>7} {:>8.1}% {:>9.1} {:>10}\n",
                r.policy.name(),
                r.index,
                r.domain,
                r.hit_rate * 100.0,
                r.tg_tokens_per_s,
                r.exchanges
            );
        }
        out
    }
}
