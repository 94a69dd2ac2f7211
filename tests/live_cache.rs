//! The live hot cache end to end on the CPU pipeline: `synth --skew domains:D` routes by
//! domain; any sequence of automatic updates, online-policy admissions and evictions and manual
//! applies, interleaved with requests,
//! keeps the output equal to the reference, never grows the cache, and never applies a manual
//! change during a request; the shift scenario's online policy climbs toward the best static one.

mod common;

use common::synth_options;
use moe_lanes::cache::observe::Observations;
use moe_lanes::cache::policy::{PolicyConfig, PolicyKind};
use moe_lanes::cache::update::{UpdateMode, UpdatePolicy};
use moe_lanes::cache::weighting::{WeightMode, Weighting};
use moe_lanes::engine::{
    build_engine, Engine, EngineKind, EngineOptions, HotBudget, HotChoice, LiveCache, UpdateKind,
};
use moe_lanes::hot_set::HotSet;
use moe_lanes::model::Model;
use moe_lanes::perf::ModelFingerprint;
use moe_lanes::phase::Phase;
use moe_lanes::scenario::domain_sample;
use moe_lanes::scenario::{run_shift, ShiftOptions, ShiftPolicy};
use moe_lanes::synth::{write_synthetic, DimOverrides, Skew, SynthFormat};
use proptest::prelude::*;
use proptest::test_runner::{RngSeed, TestRunner};
use std::sync::Arc;

fn domains_model(dir: &std::path::Path, n_domains: usize) -> Arc<Model> {
    let mut opts = synth_options("qwen3_moe", SynthFormat::Gguf, dir.join("dom.gguf"), 5);
    opts.skew = Skew::Domains(n_domains);
    opts.dims = DimOverrides { n_experts: Some(16), n_experts_used: Some(2), ..DimOverrides::default() };
    write_synthetic(&opts, &mut |_, _| {}).unwrap();
    Arc::new(Model::open(&opts.out).unwrap())
}

fn engine(model: &Arc<Model>, kind: EngineKind) -> Box<dyn Engine + '_> {
    let mut opts = EngineOptions::new(model.config().max_positions);
    opts.kind = Some(kind);
    opts.cold_threads = moe_lanes::threads::ColdThreads::Fixed(1);
    opts.hot = HotChoice::Budget(HotBudget::Fraction(0.5));
    build_engine(model, opts).unwrap().0
}

fn counts_of(engine: &mut dyn Engine, model: &Model, tokens: &[u32]) -> Vec<Vec<u64>> {
    let before = engine.perf().unwrap().report().clone();
    let mut cache = engine.new_cache(tokens.len()).unwrap();
    engine.forward(tokens, Phase::Prefill, &mut cache).unwrap();
    Observations::between(&before, engine.perf().unwrap().report(), &ModelFingerprint::of(model)).counts()
}

fn top(c: &[u64], n: usize) -> Vec<usize> {
    let mut ids: Vec<usize> = (0..c.len()).collect();
    ids.sort_by(|&a, &b| c[b].cmp(&c[a]).then(a.cmp(&b)));
    ids.truncate(n);
    ids.sort();
    ids
}

#[test]
fn domains_route_to_their_own_experts() {
    let dir = tempfile::tempdir().unwrap();
    let model = domains_model(dir.path(), 2);
    let vocab = model.config().vocab;
    let mut e = engine(&model, EngineKind::Pipeline);
    let a = counts_of(e.as_mut(), &model, &domain_sample(vocab, 2, 0, 256, 0));
    let b = counts_of(e.as_mut(), &model, &domain_sample(vocab, 2, 1, 256, 0));
    for (layer, (ca, cb)) in a.iter().zip(&b).enumerate() {
        let (ta, tb) = (top(ca, 4), top(cb, 4));
        let shared = ta.iter().filter(|x| tb.contains(x)).count();
        assert!(shared < 4, "layer {layer}: both domains' top experts are {ta:?}");
        // Skewed inside a domain: the top half of the experts takes most of the slots.
        let total: u64 = ca.iter().sum();
        let top_half: u64 = top(ca, 8).iter().map(|&e| ca[e]).sum();
        assert!(top_half as f64 > 0.7 * total as f64, "layer {layer}: {ca:?}");
    }
}

/// One step of a property case.
#[derive(Debug, Clone)]
enum Op {
    /// A request from `domain`: `prompt` tokens then `gen` decode tokens; a manual apply of a
    /// random target is asked mid-request when `manual_seed` is set.
    Request { domain: usize, prompt: usize, gen: usize, manual_seed: Option<u64> },
    /// A manual apply between requests.
    Manual(u64),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0..2usize, 1..16usize, 8..32usize, proptest::option::of(any::<u64>()))
            .prop_map(|(domain, prompt, gen, manual_seed)| Op::Request { domain, prompt, gen, manual_seed }),
        1 => any::<u64>().prop_map(Op::Manual),
    ]
}

/// A target with the current per-layer slot counts, drawn from `seed`.
fn random_target(current: &HotSet, seed: u64) -> HotSet {
    let mut state = seed | 1;
    let lists: Vec<Vec<usize>> = current
        .layers
        .iter()
        .map(|l| {
            let mut ids: Vec<usize> = (0..current.n_experts).collect();
            for i in (1..ids.len()).rev() {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                ids.swap(i, (state % (i as u64 + 1)) as usize);
            }
            ids.truncate(l.n_hot());
            ids
        })
        .collect();
    HotSet::from_lists(current.layers.len(), current.n_experts, current.n_lanes, &lists)
}

fn same_experts(a: &HotSet, b: &HotSet) -> bool {
    a.layers.iter().zip(&b.layers).all(|(x, y)| x.hot_mask() == y.hot_mask())
}

fn close(a: &[f32], b: &[f32]) -> bool {
    let scale = b.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-6);
    a.iter().zip(b).all(|(x, y)| (x - y).abs() <= 1e-4 * scale)
}

struct Rig<'m> {
    engine: Box<dyn Engine + 'm>,
    reference: Box<dyn Engine + 'm>,
    live: LiveCache,
    capacity: Vec<usize>,
    hot_bytes: u64,
    vocab: usize,
    stream: usize,
}

impl Rig<'_> {
    fn check_capacity(&self) -> Result<(), TestCaseError> {
        let hs = self.engine.hot_set().unwrap();
        prop_assert_eq!(hs.layers.iter().map(|l| l.n_hot()).collect::<Vec<_>>(), self.capacity.clone());
        prop_assert!(self.engine.hot_bytes() <= self.hot_bytes);
        Ok(())
    }

    fn request(
        &mut self,
        domain: usize,
        prompt: usize,
        gen: usize,
        manual: Option<u64>,
    ) -> Result<(), TestCaseError> {
        self.stream += prompt + gen;
        let tokens = domain_sample(self.vocab, 2, domain, self.stream, 0);
        let tokens = &tokens[self.stream - prompt - gen..];
        let mut cache = self.engine.new_cache(prompt + gen).unwrap();
        let mut rcache = self.reference.new_cache(prompt + gen).unwrap();
        self.live.begin_request();
        let got = self.engine.forward(&tokens[..prompt], Phase::Prefill, &mut cache).unwrap();
        let want = self.reference.forward(&tokens[..prompt], Phase::Prefill, &mut rcache).unwrap();
        prop_assert!(close(&got.data, &want.data), "prefill differs from the reference");
        let mut pending: Option<(HotSet, HotSet)> = None;
        for (i, &t) in tokens[prompt..].iter().enumerate() {
            if i == gen / 2 {
                if let Some(seed) = manual {
                    let before = self.engine.hot_set().unwrap().clone();
                    let target = random_target(&before, seed);
                    let out = self.live.request_manual(self.engine.as_mut(), &target).unwrap();
                    prop_assert!(out.is_none(), "a manual apply ran during a request");
                    pending = Some((before, target));
                }
            }
            if let Some(o) = self.live.after_tokens(self.engine.as_mut(), 1).unwrap() {
                prop_assert!(pending.is_none(), "an automatic update ran while a manual apply waited: {o:?}");
            }
            if let Some((before, _)) = &pending {
                prop_assert!(
                    same_experts(before, self.engine.hot_set().unwrap()),
                    "the cache changed mid-request"
                );
            }
            let got = self.engine.forward(&[t], Phase::Decode, &mut cache).unwrap();
            let want = self.reference.forward(&[t], Phase::Decode, &mut rcache).unwrap();
            prop_assert!(close(&got.data, &want.data), "decode differs from the reference");
            self.check_capacity()?;
        }
        let out = self.live.end_request(self.engine.as_mut()).unwrap();
        if let Some((_, target)) = pending {
            prop_assert_eq!(out.map(|o| o.kind), Some(UpdateKind::Manual));
            prop_assert!(same_experts(&target, self.engine.hot_set().unwrap()));
        }
        self.check_capacity()
    }
}

#[test]
fn any_exchange_sequence_keeps_output_equal_to_the_reference() {
    let dir = tempfile::tempdir().unwrap();
    let model = domains_model(dir.path(), 2);
    let ops = (proptest::collection::vec(op(), 1..8), 0..3usize, 0..2usize, 0..5usize, 0..5usize);
    let config = ProptestConfig {
        cases: 16,
        rng_seed: RngSeed::Fixed(0x11fe_cace),
        failure_persistence: None,
        ..ProptestConfig::default()
    };
    let updates = std::cell::Cell::new((0u64, 0u64, 0u64));
    TestRunner::new(config)
        .run(&ops, |(ops, rate_idx, every, mode_idx, kind_idx)| {
            let engine = engine(&model, EngineKind::Pipeline);
            let reference = engine_ref(&model);
            let policy = UpdatePolicy {
                mode: UpdateMode::Auto,
                rate: [0.1, 0.5, 1.0][rate_idx],
                margin: 0.0,
                every_tokens: every * 3,
                weighting: Weighting { mode: WeightMode::ALL[mode_idx], layer_curve: 0.5 },
                cache: PolicyConfig {
                    // the step's exchanges applied before the next call (0) or the one after;
                    // `every` (tokens between updates) is the updater's, unused by the online
                    // policies, so it picks their lag
                    lag_steps: every,
                    ..PolicyConfig::of(
                        [
                            PolicyKind::Planned,
                            PolicyKind::Lru,
                            PolicyKind::Lfu,
                            PolicyKind::TinyLfu,
                            PolicyKind::Reuse,
                        ][kind_idx],
                    )
                },
            };
            let live = LiveCache::new(
                engine.as_ref(),
                ModelFingerprint::of(&model),
                model.layer_expert_bytes(),
                policy,
            );
            let hs = engine.hot_set().unwrap();
            let mut rig = Rig {
                capacity: hs.layers.iter().map(|l| l.n_hot()).collect(),
                hot_bytes: engine.hot_bytes(),
                engine,
                reference,
                live,
                vocab: model.config().vocab,
                stream: 0,
            };
            for op in ops {
                match op {
                    Op::Request { domain, prompt, gen, manual_seed } => {
                        rig.request(domain, prompt, gen, manual_seed)?
                    }
                    Op::Manual(seed) => {
                        let target = random_target(rig.engine.hot_set().unwrap(), seed);
                        let out = rig.live.request_manual(rig.engine.as_mut(), &target).unwrap();
                        prop_assert_eq!(
                            out.map(|o| o.kind),
                            Some(UpdateKind::Manual),
                            "idle: applied at once"
                        );
                        prop_assert!(same_experts(&target, rig.engine.hot_set().unwrap()));
                        rig.check_capacity()?;
                    }
                }
            }
            let stats = rig.engine.perf().unwrap().report().cache_updates;
            prop_assert!(stats.bytes_copied == stats.exchanges * model.expert_bytes() as u64);
            // a CPU hot lane loads the slot as it exchanges: every exchange has landed
            prop_assert_eq!(stats.exchanges_landed, stats.exchanges);
            let (auto, manual, admitted) = updates.get();
            let layers = &rig.engine.perf().unwrap().report().layers;
            let policy_admissions = if kind_idx > 0 { layers.iter().map(|l| l.admissions).sum() } else { 0 };
            updates.set((
                auto + stats.auto_updates,
                manual + stats.manual_applies,
                admitted + policy_admissions,
            ));
            Ok(())
        })
        .unwrap();
    let (auto, manual, admitted) = updates.get();
    assert!(
        auto > 3 && manual > 5 && admitted > 20,
        "the cases must exercise every kind: {auto} automatic updates, {manual} manual applies, \
         {admitted} admissions under online policies"
    );
}

fn engine_ref(model: &Arc<Model>) -> Box<dyn Engine + '_> {
    let mut opts = EngineOptions::new(model.config().max_positions);
    opts.kind = Some(EngineKind::Reference);
    build_engine(model, opts).unwrap().0
}

#[test]
fn online_policy_climbs_toward_the_best_static_cache_after_the_shift() {
    let dir = tempfile::tempdir().unwrap();
    let model = domains_model(dir.path(), 2);
    let mut e = engine(&model, EngineKind::Pipeline);
    let opts = ShiftOptions {
        n_domains: 2,
        domains: (0, 1),
        n_requests: 6,
        n_prompt_tokens: 8,
        n_gen_tokens: 48,
        update: UpdatePolicy { rate: 0.25, ..UpdatePolicy::default() },
    };
    let report = run_shift(e.as_mut(), &model, &opts, &mut |_, _| {}).unwrap();
    assert_eq!(report.requests.len(), 36);
    let mean = |policy: ShiftPolicy, from: usize| {
        let rows: Vec<f64> = report
            .requests
            .iter()
            .filter(|r| r.policy == policy && r.index >= from)
            .map(|r| r.hit_rate)
            .collect();
        rows.iter().sum::<f64>() / rows.len() as f64
    };
    // The last three requests of the second domain.
    let (stale, online, best) =
        (mean(ShiftPolicy::StaticFirst, 9), mean(ShiftPolicy::Online, 9), mean(ShiftPolicy::StaticSecond, 9));
    eprintln!("second domain, last 3 requests: static_first {stale:.3}, online {online:.3}, static_second {best:.3}");
    assert!(best > stale + 0.1, "the domains must differ: stale {stale}, best {best}");
    assert!(
        online > stale + 0.5 * (best - stale),
        "online {online} did not climb (stale {stale}, best {best})"
    );
    assert!(online >= 0.85 * best, "online {online} vs best {best}");
    let exchanges: usize =
        report.requests.iter().filter(|r| r.policy == ShiftPolicy::Online).map(|r| r.exchanges).sum();
    assert!(exchanges > 0);
    assert!(report.requests.iter().filter(|r| r.policy != ShiftPolicy::Online).all(|r| r.exchanges == 0));
    let json = serde_json::to_value(&report).unwrap();
    let row = &json["requests"][0];
    for field in ["index", "domain", "policy", "hit_rate", "tg_tokens_per_s", "exchanges"] {
        assert!(row.get(field).is_some(), "{field} missing in {row}");
    }
    assert_eq!(row["policy"], "static_first");
}

/// A manual apply longer than the updater's queue: what fits is applied in order, the rest is
/// refused with an error, counted in the perf JSON and the metric, never dropped silently.
#[test]
fn a_full_updater_queue_is_counted_and_reported() {
    use moe_lanes::actors::updater::MAX_PENDING_EXCHANGES;
    use moe_lanes::actors::{Exchange, UpdaterError};
    use moe_lanes::engine::EngineError;
    let dir = tempfile::tempdir().unwrap();
    let model = domains_model(dir.path(), 2);
    let mut engine = engine(&model, EngineKind::Pipeline);
    let policy = UpdatePolicy::default();
    let mut live =
        LiveCache::new(engine.as_ref(), ModelFingerprint::of(&model), model.layer_expert_bytes(), policy);
    let layer = &engine.hot_set().unwrap().layers[0];
    let hot = (0..16).find(|&e| layer.is_hot(e)).unwrap();
    let cold = (0..16).find(|&e| !layer.is_hot(e)).unwrap();
    // Swapping back and forth keeps every exchange valid in order; 3 too many for the queue.
    let exchanges: Vec<Exchange> = (0..MAX_PENDING_EXCHANGES + 3)
        .map(|i| if i % 2 == 0 { (hot, cold) } else { (cold, hot) })
        .map(|(evict, add)| Exchange { layer_idx: 0, evict, add })
        .collect();
    let err = live.request_manual_exchanges(engine.as_mut(), exchanges).unwrap_err();
    assert!(matches!(err, EngineError::Updater(UpdaterError::Full { .. })), "{err}");
    let report = engine.perf().unwrap().report();
    assert_eq!(report.cache_updates.exchanges_refused, 3);
    assert_eq!(report.updates, MAX_PENDING_EXCHANGES as u64, "what was queued was applied");
    // An even number of swaps leaves the layer as it was.
    assert!(engine.hot_set().unwrap().layers[0].is_hot(hot));
}

/// `PolicyConfig::lag_steps`: with 0 (the default) the step on a call's experts is waited for
/// and its exchanges applied before the next call; with 1 they come a call later.
#[test]
fn an_online_policy_without_lag_applies_its_exchanges_before_the_next_call() {
    let dir = tempfile::tempdir().unwrap();
    let model = domains_model(dir.path(), 2);
    let first_step = |lag_steps: usize| {
        let mut engine = engine(&model, EngineKind::Pipeline);
        let cache = PolicyConfig { lag_steps, ..PolicyConfig::of(PolicyKind::Lru) };
        let policy = UpdatePolicy { cache, ..UpdatePolicy::default() };
        let mut live =
            LiveCache::new(engine.as_ref(), ModelFingerprint::of(&model), model.layer_expert_bytes(), policy);
        let tokens = domain_sample(model.config().vocab, 2, 1, 24, 0);
        let mut kv = engine.new_cache(tokens.len()).unwrap();
        live.begin_request();
        engine.forward(&tokens[..16], Phase::Prefill, &mut kv).unwrap();
        let before = engine.hot_set().unwrap().clone();
        let first = live.after_tokens(engine.as_mut(), 1).unwrap().map_or(0, |o| o.exchanges);
        let moved = !same_experts(&before, engine.hot_set().unwrap());
        engine.forward(&tokens[16..17], Phase::Decode, &mut kv).unwrap();
        let second = live.after_tokens(engine.as_mut(), 1).unwrap().map_or(0, |o| o.exchanges);
        (first, moved, second)
    };
    let (first, moved, _) = first_step(0);
    assert!(first > 0 && moved, "LRU admitted the prefill's misses before the next call: {first}");
    let (first, moved, second) = first_step(1);
    assert!(first == 0 && !moved, "one call later: nothing applied yet ({first})");
    assert!(second > 0, "the first step's exchanges, a call later: {second}");
}
