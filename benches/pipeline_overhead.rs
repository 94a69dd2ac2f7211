//! Per-layer decode overhead of the lane pipeline with the expert math excluded: route (top-k
//! over router logits) + dispatch (worklist build + consistency check) + lane messages (hot lane
//! and cold worker round trips) + join (merge of the k rows). Shape: one decode token,
//! 128 experts, k = 8, hidden 2048 (Qwen3-30B-A3B), half the experts hot.
//!
//! Two data planes are measured side by side:
//! - `crossbeam`: the engine's own `LaneSet` (dedicated threads, bounded crossbeam channels);
//! - `kameo`: the same stages with the hot lane and cold worker as kameo actors (`ask`, bounded
//!   mailboxes) on a tokio runtime.
//!
//! Criterion prints its estimates; at the end the bench prints the medians of a plain timing
//! loop (`MEDIAN ...` lines), the figures quoted in ARCHITECTURE.md.

use criterion::{black_box, Criterion};
use kameo::message::{Context, Message};
use moe_lanes::actors::lanes::run_entries;
use moe_lanes::actors::messages::{recv_spin, LaneBuffer, LayerInput, GROUP_TOKENS_MAX, LANE_SPIN};
use moe_lanes::actors::{HotLane, LaneError, LaneSet};
use moe_lanes::arch::RoutingVariant;
use moe_lanes::expert_math::{ExpertKernel, FfnDims, FfnScratch, NullKernel};
use moe_lanes::hot_set::HotSet;
use moe_lanes::perf::LayerTiming;
use moe_lanes::phase::MergeKind;
use moe_lanes::routing::{Router, RouterOptions};
use moe_lanes::worklist::{Worklist, WorklistOrder};
use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

const N_EXPERTS: usize = 128;
const K: usize = 8;
const HIDDEN: usize = 2048;
const FF: usize = 768;
const DIMS: FfnDims = FfnDims { hidden: HIDDEN, ff: FF };

/// A hot lane that moves the data like the real one but does no math.
struct NullHotLane {
    scratch: FfnScratch,
}

impl HotLane for NullHotLane {
    fn run(
        &mut self,
        lane_idx: usize,
        input: &LayerInput,
        range: Range<usize>,
        reduce: bool,
        out: &mut LaneBuffer,
    ) -> Result<(), LaneError> {
        let s = &input.worklist.hot[lane_idx];
        run_entries(
            input,
            range,
            |i| (s.hot_id[i], s.hot_token_id[i], s.hot_weight[i]),
            reduce,
            out,
            &mut self.scratch,
            |_, n, sc| {
                sc.ys[..n * HIDDEN].iter_mut().for_each(|y| *y = 0.0);
                Ok(())
            },
        )
    }
    fn load_slot(&mut self, _: usize, _: u32, _: usize) -> Result<(), LaneError> {
        Ok(())
    }
}

fn logits(seed: u64) -> Vec<f32> {
    let mut s = seed | 1;
    (0..N_EXPERTS)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s % 10_000) as f32 / 1000.0
        })
        .collect()
}

fn router() -> Router {
    Router::new(
        RouterOptions {
            variant: RoutingVariant::SoftmaxThenTopK,
            n_experts: N_EXPERTS,
            n_experts_used: K,
            norm_topk_prob: true,
            bias: false,
            selection_bias: false,
            n_group: 1,
            topk_group: 1,
            scale: 1.0,
            scaled_input: false,
            per_expert_scale: false,
        },
        1,
    )
}

fn hot_set() -> HotSet {
    HotSet::from_fraction(1, N_EXPERTS, 1, 0.5, None).unwrap()
}

/// The crossbeam data plane: the engine's LaneSet.
struct CrossbeamLayer {
    router: Router,
    lanes: LaneSet,
    hot: HotSet,
    out: Vec<f32>,
    x: Vec<f32>,
    logits: Vec<Vec<f32>>,
    i: usize,
}

impl CrossbeamLayer {
    fn new(n_cold_workers: usize, spin: Option<Duration>, driver_cold: bool) -> CrossbeamLayer {
        let hot_lane: Box<dyn HotLane> =
            Box::new(NullHotLane { scratch: FfnScratch::new(DIMS, GROUP_TOKENS_MAX) });
        let cold: Arc<dyn ExpertKernel> = Arc::new(NullKernel(DIMS));
        CrossbeamLayer {
            router: router(),
            lanes: match spin {
                None => LaneSet::start(vec![hot_lane], cold, n_cold_workers, 1, K, N_EXPERTS),
                Some(s) => {
                    LaneSet::start_with(vec![hot_lane], cold, n_cold_workers, 1, K, N_EXPERTS, s, driver_cold)
                }
            },
            hot: hot_set(),
            out: vec![0.0; HIDDEN],
            x: vec![0.5; HIDDEN],
            logits: (0..64).map(logits).collect(),
            i: 0,
        }
    }

    fn layer(&mut self) {
        self.i += 1;
        let routes = self.router.route(&self.logits[self.i % 64], 1).unwrap();
        let input = self.lanes.input_mut().unwrap();
        input.call_idx = self.i as u64;
        input.n_tokens = 1;
        input.x[..HIDDEN].copy_from_slice(&self.x);
        input
            .worklist
            .build(
                &routes.expert_ids,
                &routes.weights,
                1,
                K,
                Some(&self.hot.layers[0]),
                WorklistOrder::TokenMajor,
            )
            .unwrap();
        input.worklist.check_consistency(Some(&self.hot.layers[0])).unwrap();
        let mut timing = LayerTiming::default();
        self.lanes.run_layer(MergeKind::Direct, false, &mut self.out, &mut timing, || {}).unwrap();
        black_box(&self.out);
    }
}

// ---- the kameo data plane ----

#[derive(kameo::Reply)]
struct LaneReply(LaneBuffer);

struct KTask {
    input: Arc<LayerInput>,
    range: Range<usize>,
    out: LaneBuffer,
}

#[derive(kameo::Actor)]
struct KHot {
    lane: NullHotLane,
}

impl Message<KTask> for KHot {
    type Reply = LaneReply;
    async fn handle(&mut self, mut t: KTask, _: &mut Context<Self, LaneReply>) -> LaneReply {
        self.lane.run(0, &t.input, t.range.clone(), false, &mut t.out).unwrap();
        LaneReply(t.out)
    }
}

#[derive(kameo::Actor)]
struct KCold {
    scratch: FfnScratch,
}

impl Message<KTask> for KCold {
    type Reply = LaneReply;
    async fn handle(&mut self, mut t: KTask, _: &mut Context<Self, LaneReply>) -> LaneReply {
        let wl = &t.input.worklist;
        run_entries(
            &t.input,
            t.range.clone(),
            |i| (wl.cold_id[i], wl.cold_token_id[i], wl.cold_weight[i]),
            false,
            &mut t.out,
            &mut self.scratch,
            |_, n, sc| {
                sc.ys[..n * HIDDEN].iter_mut().for_each(|y| *y = 0.0);
                Ok(())
            },
        )
        .unwrap();
        LaneReply(t.out)
    }
}

struct KameoLayer {
    rt: tokio::runtime::Runtime,
    hot_actor: kameo::actor::ActorRef<KHot>,
    cold_actor: kameo::actor::ActorRef<KCold>,
    router: Router,
    hot: HotSet,
    input: Arc<LayerInput>,
    bufs: Option<(LaneBuffer, LaneBuffer)>,
    out: Vec<f32>,
    logits: Vec<Vec<f32>>,
    i: usize,
}

impl KameoLayer {
    fn new() -> KameoLayer {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        let (hot_actor, cold_actor) = {
            let _g = rt.enter();
            use kameo::Actor;
            (
                KHot::spawn_with_mailbox(
                    KHot { lane: NullHotLane { scratch: FfnScratch::new(DIMS, GROUP_TOKENS_MAX) } },
                    kameo::mailbox::bounded(2),
                ),
                KCold::spawn_with_mailbox(
                    KCold { scratch: FfnScratch::new(DIMS, GROUP_TOKENS_MAX) },
                    kameo::mailbox::bounded(2),
                ),
            )
        };
        let buf = || LaneBuffer { entry_rows: vec![0.0; K * HIDDEN], token_rows: vec![0.0; HIDDEN] };
        KameoLayer {
            rt,
            hot_actor,
            cold_actor,
            router: router(),
            hot: hot_set(),
            input: Arc::new(LayerInput {
                call_idx: 0,
                layer_idx: 0,
                n_tokens: 1,
                hidden: HIDDEN,
                x: vec![0.5; HIDDEN],
                worklist: Worklist::new(1, K, N_EXPERTS),
            }),
            bufs: Some((buf(), buf())),
            out: vec![0.0; HIDDEN],
            logits: (0..64).map(logits).collect(),
            i: 0,
        }
    }

    fn layer(&mut self) {
        self.i += 1;
        let routes = self.router.route(&self.logits[self.i % 64], 1).unwrap();
        let input = Arc::get_mut(&mut self.input).unwrap();
        input
            .worklist
            .build(
                &routes.expert_ids,
                &routes.weights,
                1,
                K,
                Some(&self.hot.layers[0]),
                WorklistOrder::TokenMajor,
            )
            .unwrap();
        input.worklist.check_consistency(Some(&self.hot.layers[0])).unwrap();
        let (hb, cb) = self.bufs.take().unwrap();
        let hot_task =
            KTask { input: self.input.clone(), range: 0..self.input.worklist.hot[0].hot_count, out: hb };
        let cold_task =
            KTask { input: self.input.clone(), range: 0..self.input.worklist.cold_count, out: cb };
        let (hot_actor, cold_actor) = (&self.hot_actor, &self.cold_actor);
        let (h, c) = self.rt.block_on(async move {
            let (h, c) = tokio::join!(hot_actor.ask(hot_task).send(), cold_actor.ask(cold_task).send());
            (h.unwrap().0, c.unwrap().0)
        });
        // Join: sum the k rows in slot order.
        let wl = &self.input.worklist;
        self.out.iter_mut().for_each(|v| *v = 0.0);
        for (rows, weights, n) in [
            (&h.entry_rows, &wl.hot[0].hot_weight, wl.hot[0].hot_count),
            (&c.entry_rows, &wl.cold_weight, wl.cold_count),
        ] {
            for e in 0..n {
                for (o, v) in self.out.iter_mut().zip(&rows[e * HIDDEN..(e + 1) * HIDDEN]) {
                    *o += weights[e] * v;
                }
            }
        }
        self.bufs = Some((h, c));
        black_box(&self.out);
    }
}

fn route_dispatch(router: &mut Router, wl: &mut Worklist, hot: &HotSet, logits: &[f32]) {
    let routes = router.route(logits, 1).unwrap();
    wl.build(&routes.expert_ids, &routes.weights, 1, K, Some(&hot.layers[0]), WorklistOrder::TokenMajor)
        .unwrap();
    wl.check_consistency(Some(&hot.layers[0])).unwrap();
    black_box(&wl.cold_count);
}

/// The floor: one message to a thread blocked in `recv` and one back (bounded crossbeam
/// channels; back to back, crossbeam's short backoff usually catches it before it parks).
struct PingPong {
    tx: crossbeam_channel::Sender<u64>,
    rx: crossbeam_channel::Receiver<u64>,
}

impl PingPong {
    fn new() -> PingPong {
        let (tx, peer_rx) = crossbeam_channel::bounded::<u64>(1);
        let (peer_tx, rx) = crossbeam_channel::bounded::<u64>(1);
        std::thread::spawn(move || {
            while let Ok(v) = peer_rx.recv() {
                if peer_tx.send(v + 1).is_err() {
                    return;
                }
            }
        });
        PingPong { tx, rx }
    }
    fn round_trip(&self) {
        self.tx.send(1).unwrap();
        black_box(self.rx.recv().unwrap());
    }
}

/// A polled round trip that carries `rows` output rows back, as a lane does: the peer writes
/// them, the caller reads them (the cross-core cache-line traffic of one layer's hot rows).
struct PolledRows {
    tx: crossbeam_channel::Sender<Vec<f32>>,
    rx: crossbeam_channel::Receiver<Vec<f32>>,
    buf: Option<Vec<f32>>,
}

impl PolledRows {
    fn new(rows: usize) -> PolledRows {
        let (tx, peer_rx) = crossbeam_channel::bounded::<Vec<f32>>(1);
        let (peer_tx, rx) = crossbeam_channel::bounded::<Vec<f32>>(1);
        std::thread::spawn(move || {
            while let Ok(mut v) = recv_spin(&peer_rx, LANE_SPIN, None) {
                v.iter_mut().for_each(|x| *x += 1.0);
                if peer_tx.send(v).is_err() {
                    return;
                }
            }
        });
        PolledRows { tx, rx, buf: Some(vec![0.0; rows * HIDDEN]) }
    }
    fn round_trip(&mut self) {
        self.tx.send(self.buf.take().unwrap()).unwrap();
        let v = recv_spin(&self.rx, LANE_SPIN, None).unwrap();
        black_box(v.iter().sum::<f32>());
        self.buf = Some(v);
    }
}

fn median_us(mut f: impl FnMut(), n: usize) -> f64 {
    for _ in 0..n / 10 {
        f();
    }
    let mut samples: Vec<Duration> = (0..n)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed()
        })
        .collect();
    samples.sort();
    samples[n / 2].as_secs_f64() * 1e6
}

fn main() {
    let mut c = Criterion::default()
        .configure_from_args()
        .measurement_time(Duration::from_secs(3))
        .warm_up_time(Duration::from_secs(1));
    let mut group = c.benchmark_group("decode_layer_overhead");
    // Engine default: the driver computes the cold share itself (1 cold participant).
    let mut cb = CrossbeamLayer::new(1, None, true);
    group.bench_function("crossbeam", |b| b.iter(|| cb.layer()));
    // One cold worker thread besides the driver, parking at once.
    let mut cb_park = CrossbeamLayer::new(1, Some(Duration::ZERO), false);
    group.bench_function("crossbeam_cold_thread_park", |b| b.iter(|| cb_park.layer()));
    // Driver + one cold worker thread (2 cold participants), parking at once.
    let mut cb_two = CrossbeamLayer::new(2, Some(Duration::ZERO), true);
    group.bench_function("crossbeam_driver_plus_cold_thread", |b| b.iter(|| cb_two.layer()));
    let mut cb_spin = CrossbeamLayer::new(1, Some(LANE_SPIN), false);
    group.bench_function("crossbeam_cold_thread_poll", |b| b.iter(|| cb_spin.layer()));
    let mut km = KameoLayer::new();
    group.bench_function("kameo", |b| b.iter(|| km.layer()));
    let (mut r, mut wl, hot, lg) = (router(), Worklist::new(1, K, N_EXPERTS), hot_set(), logits(3));
    group.bench_function("route_dispatch_only", |b| b.iter(|| route_dispatch(&mut r, &mut wl, &hot, &lg)));
    let ping = PingPong::new();
    group.bench_function("bare_round_trip", |b| b.iter(|| ping.round_trip()));
    group.finish();
    c.final_summary();

    let n = 20_000;
    let rd = median_us(|| route_dispatch(&mut r, &mut wl, &hot, &lg), n);
    let cross = median_us(|| cb.layer(), n);
    let park = median_us(|| cb_park.layer(), n);
    let spin = median_us(|| cb_spin.layer(), n);
    let two = median_us(|| cb_two.layer(), n);
    let kameo = median_us(|| km.layer(), n);
    let floor = median_us(|| ping.round_trip(), n);
    let mut polled0 = PolledRows::new(0);
    let polled0_us = median_us(|| polled0.round_trip(), n);
    let mut polled4 = PolledRows::new(4);
    let polled4_us = median_us(|| polled4.round_trip(), n);
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    println!("MEDIAN per-layer decode overhead, {N_EXPERTS} experts, k={K}, hidden={HIDDEN}, expert math excluded:");
    println!("MEDIAN route+dispatch only:                                     {rd:8.2} us");
    println!("MEDIAN machine: {cores} cores");
    println!("MEDIAN floor: bare crossbeam round trip:                         {floor:8.2} us");
    println!("MEDIAN floor: polled round trip, no rows:                        {polled0_us:8.2} us");
    println!("MEDIAN floor: polled round trip, 4 rows written there, read here: {polled4_us:8.2} us");
    println!("MEDIAN crossbeam, engine default (driver takes the cold share): {cross:8.2} us");
    println!("MEDIAN crossbeam, cold worker thread, park at once:             {park:8.2} us");
    println!("MEDIAN crossbeam, driver + cold worker thread, park at once:    {two:8.2} us");
    println!(
        "MEDIAN crossbeam, cold worker thread, poll {:>3} us first:        {spin:8.2} us",
        LANE_SPIN.as_micros()
    );
    println!("MEDIAN kameo actors (ask, bounded mailbox, cold actor):         {kameo:8.2} us");
}
