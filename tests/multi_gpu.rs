//! The GPU engine split by layers over several devices (issue 45: `--devices`, `--tensor-split`)
//! against the one-device engine and the reference oracle, through the one `Engine` interface:
//! every GPU fixture at hot fractions 0, 0.5 and 1 on devices [0, 0] (two contexts' streams on
//! one GPU: always, on any GPU machine) and [0, 1] (when two GPUs are visible): the prompt's
//! rows, then greedy decode steps (the first eager, the rest through each device's decode graph
//! or segments), every row within the GPU tolerance of the one-device engine's row and, where
//! that row is within it of the reference's, of the reference's; the greedy tokens identical to
//! the one-device engine's wherever its top-2 gap is clear. Also: batched prefill and decode
//! (with a mixed step), exchanges on every device's layers, the tensor split's layer ranges,
//! and bad device lists refused by name.
//!
//! Every test prints "SKIP: no CUDA device: ..." and passes when CUDA is not usable (CI), unless
//! MOE_LANES_REQUIRE_GPU is set (the GPU machine), where that is a failure.

mod common;
mod fixture_checks;

use fixture_checks::{hot_set, GPU_TOLERANCE, HOT_FRACTIONS};
use moe_lanes::actors::Exchange;
use moe_lanes::engine::{build_engine, BatchSeq, Engine, EngineError, EngineKind, EngineOptions, HotChoice};
use moe_lanes::model::Model;
use moe_lanes::phase::Phase;
use moe_lanes::reference::{NoObserver, Reference};
use std::sync::{Arc, Mutex, MutexGuard};

const POSITIONS: usize = 128;
/// Decode steps: the first runs eagerly (the hot lanes' timing sample), the second captures each
/// device's graphs, the rest replay them.
const N_DECODE: usize = 4;
/// GPT-OSS's bound, as tests/gpu_parity.rs.
const GPT_OSS_TOLERANCE: f32 = 3e-3;

/// The tests of this file run one at a time (each holds two engines' device memory).
static GPU: Mutex<()> = Mutex::new(());

/// `None` (the test skips) without a usable GPU; else the hold on [`GPU`].
fn gpu() -> Option<MutexGuard<'static, ()>> {
    let hold = GPU.lock().unwrap_or_else(|e| e.into_inner());
    common::gpu_usable().then_some(hold)
}

/// The device lists to split over: [0, 0] always, [0, 1] when two GPUs are visible.
fn device_lists() -> Vec<Vec<usize>> {
    let visible = moe_lanes_kernels::cuda::device_count().unwrap_or(1);
    let mut lists = vec![vec![0, 0]];
    if visible >= 2 {
        lists.push(vec![0, 1]);
    } else {
        eprintln!("one GPU visible: the [0, 1] split is not run");
    }
    lists
}

fn open(name: &str) -> Arc<Model> {
    Arc::new(Model::open(&common::fixtures_root().join(name)).unwrap())
}

fn prompt(name: &str) -> Vec<u32> {
    let text = std::fs::read_to_string(common::fixtures_root().join(name).join("golden.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    v["prompt"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

/// The fixtures the GPU engine runs that have a layer for each of two devices.
fn split_fixture_names() -> Vec<String> {
    let runs = |name: &String| {
        let model = open(name);
        match moe_lanes::gpu::GpuModel::supports(&model) {
            Ok(()) => model.config().n_layers >= 2,
            Err(e) => {
                eprintln!("{name}: not on the GPU engine: {e}");
                false
            }
        }
    };
    common::fixture_names().into_iter().filter(runs).collect()
}

fn tolerance(model: &Model) -> f32 {
    match model.plan().expert_activation() {
        moe_lanes::arch::FfnActivation::SwigluOai => GPT_OSS_TOLERANCE,
        _ => GPU_TOLERANCE,
    }
}

/// The GPU engine on `devices` (split by `tensor_split`, empty: by free memory) with `fraction`
/// of each layer's experts hot.
fn engine<'m>(
    model: &'m Arc<Model>,
    fraction: f64,
    devices: &[usize],
    tensor_split: &[f64],
) -> Result<Box<dyn Engine + 'm>, EngineError> {
    let mut opts = EngineOptions::new(POSITIONS);
    opts.kind = Some(EngineKind::Gpu);
    opts.cuda = moe_lanes::env::cuda_config().unwrap();
    opts.hot = HotChoice::Set(hot_set(model, fraction));
    opts.cold_threads = moe_lanes::threads::ColdThreads::Fixed(2);
    opts.gpu.devices = devices.to_vec();
    opts.gpu.tensor_split = tensor_split.to_vec();
    // the three-row decode steps of the batched case take the grouped hot lane
    opts.gpu.hot_grouped_min_rows = 2;
    opts.gpu.hot_grouped_min_rows_quantized = 2;
    let (engine, report) = build_engine(model, opts)?;
    assert_eq!(report.kind, EngineKind::Gpu);
    Ok(engine)
}

fn scale(row: &[f32]) -> f32 {
    row.iter().fold(0f32, |m, v| m.max(v.abs())).max(f32::MIN_POSITIVE)
}

/// max |got - want| / max |want|, the rows finite.
fn rel_err(got: &[f32], want: &[f32]) -> f32 {
    assert!(got.iter().all(|v| v.is_finite()), "non-finite logits");
    got.iter().zip(want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max) / scale(want)
}

fn top2_gap(row: &[f32]) -> f32 {
    let mut s = row.to_vec();
    s.sort_by(|a, b| b.total_cmp(a));
    s[0] - s[1]
}

/// The split engine's row against the one-device engine's and (where that is within `tol` of
/// it: a near-tied routing choice can move a row further, tests/gpu_parity.rs) the reference's.
fn check_row(what: &str, split: &[f32], one: &[f32], reference: &[f32], tol: f32) -> f32 {
    let err = rel_err(split, one);
    assert!(err <= tol, "{what}: split against one device {err:e} > {tol}");
    if rel_err(one, reference) <= tol {
        let err = rel_err(split, reference);
        assert!(err <= tol, "{what}: split against the reference {err:e} > {tol}");
    }
    err
}

/// The split engine's device reports: one per device in order, the layer ranges covering the
/// model, the cached experts those of the hot set in each range.
fn check_devices(what: &str, engine: &dyn Engine, model: &Model, devices: &[usize]) {
    let reports = engine.device_reports();
    assert_eq!(reports.len(), devices.len(), "{what}: {reports:?}");
    let set = engine.hot_set().unwrap();
    let mut next = 0;
    for (r, &ordinal) in reports.iter().zip(devices) {
        assert_eq!(r.ordinal, ordinal, "{what}: {reports:?}");
        assert!(r.layers[0] == next && r.layers[1] > next, "{what}: {reports:?}");
        let cached: usize = set.layers[r.layers[0]..r.layers[1]].iter().map(|l| l.n_hot()).sum();
        assert_eq!(r.experts_cached, cached, "{what}: {reports:?}");
        next = r.layers[1];
    }
    assert_eq!(next, model.config().n_layers, "{what}: {reports:?}");
    assert_eq!(engine.device().matches(" + ").count(), devices.len() - 1, "{what}: {}", engine.device());
}

/// Prefill the fixture's prompt, then `N_DECODE` greedy steps on the split engine's tokens, on
/// the one-device engine, the split one and the reference; every row compared ([`check_row`]),
/// the greedy tokens identical wherever the one-device row's top-2 gap exceeds twice the
/// tolerance. Returns the worst error against the one-device engine.
fn compare_steps(what: &str, model: &Model, one: &mut dyn Engine, split: &mut dyn Engine) -> f32 {
    let (reference, tol) = (Reference::new(model).unwrap(), tolerance(model));
    let prompt = prompt(&model_name(model));
    let mut rc = reference.new_cache();
    let (mut c1, mut c2) = (one.new_cache(POSITIONS).unwrap(), split.new_cache(POSITIONS).unwrap());
    let want = reference.forward(&mut rc, &prompt, &mut NoObserver).unwrap();
    let a = one.forward(&prompt, Phase::Prefill, &mut c1).unwrap();
    let b = split.forward(&prompt, Phase::Prefill, &mut c2).unwrap();
    let mut worst = 0f32;
    for (i, w) in want.iter().enumerate() {
        worst = worst.max(check_row(&format!("{what} prefill row {i}"), b.row(i), a.row(i), w, tol));
    }
    let (mut next, mut last_one) = (*b.argmax.last().unwrap(), a.row(a.n_rows - 1).to_vec());
    assert_greedy(what, "prefill", &last_one, *a.argmax.last().unwrap(), next, tol);
    for step in 0..N_DECODE {
        let want = reference.forward(&mut rc, &[next], &mut NoObserver).unwrap();
        let a = one.forward(&[next], Phase::Decode, &mut c1).unwrap();
        let b = split.forward(&[next], Phase::Decode, &mut c2).unwrap();
        worst = worst.max(check_row(&format!("{what} decode {step}"), b.row(0), a.row(0), &want[0], tol));
        last_one = a.row(0).to_vec();
        assert_greedy(what, &format!("decode {step}"), &last_one, a.argmax[0], b.argmax[0], tol);
        next = b.argmax[0];
    }
    worst
}

/// The split engine's greedy token is the one-device engine's where that row's top-2 gap is
/// clear.
fn assert_greedy(what: &str, at: &str, one_row: &[f32], one: u32, split: u32, tol: f32) {
    if top2_gap(one_row) > 2.0 * tol * scale(one_row) {
        assert_eq!(split, one, "{what} {at}: the split engine's greedy token differs");
    }
}

/// The fixture directory's name (its golden prompt).
fn model_name(model: &Model) -> String {
    model.path().file_name().unwrap().to_string_lossy().into_owned()
}

fn no_fallbacks(what: &str, engine: &dyn Engine) {
    let fallbacks: u64 = engine.perf().unwrap().report().layers.iter().map(|l| l.parallel_fallbacks).sum();
    assert_eq!(fallbacks, 0, "{what}: no fallback without a fault");
}

fn run_split(fraction: f64) {
    let Some(_gpu) = gpu() else { return };
    for devices in device_lists() {
        let mut worst = 0f32;
        for name in split_fixture_names() {
            let model = open(&name);
            let what = format!("{name} hot {fraction} on {devices:?}");
            let mut one = engine(&model, fraction, &[0], &[]).unwrap();
            let mut split = engine(&model, fraction, &devices, &[]).unwrap();
            check_devices(&what, split.as_ref(), &model, &devices);
            worst = worst.max(compare_steps(&what, &model, one.as_mut(), split.as_mut()));
            no_fallbacks(&what, split.as_ref());
        }
        eprintln!("hot {fraction} on {devices:?}: worst relative error against one device {worst:e}");
    }
}

#[test]
fn split_fixtures_hot_none() {
    run_split(HOT_FRACTIONS[0]);
}

#[test]
fn split_fixtures_hot_half() {
    run_split(HOT_FRACTIONS[1]);
}

#[test]
fn split_fixtures_hot_all() {
    run_split(HOT_FRACTIONS[2]);
}

/// The decode tokens fed to sequence `i` at step `s`.
fn decode_token(vocab: usize, i: usize, s: usize) -> u32 {
    ((7 + 31 * i + 13 * s) % vocab) as u32
}

/// Three sequences of different lengths: one prefill call, `steps` batched decode calls, then a
/// call where sequence 1 takes a two-token chunk while the others decode; every call's rows.
fn batched(engine: &mut dyn Engine, prompt: &[u32], steps: usize) -> Vec<Vec<Vec<f32>>> {
    let (vocab, n) = (engine.config().vocab, prompt.len());
    let prompts =
        [prompt.to_vec(), prompt[n / 3..].to_vec(), prompt.iter().rev().take(n / 2 + 1).copied().collect()];
    let mut caches: Vec<_> = prompts.iter().map(|_| engine.new_cache(POSITIONS).unwrap()).collect();
    let mut calls = vec![prompts.to_vec()];
    calls.extend((0..steps).map(|s| (0..3).map(|i| vec![decode_token(vocab, i, s)]).collect()));
    let mixed = |i: usize| match i {
        1 => vec![decode_token(vocab, i, 90), decode_token(vocab, i, 91)],
        _ => vec![decode_token(vocab, i, 90)],
    };
    calls.push((0..3).map(mixed).collect());
    let mut rows = Vec::new();
    for (c, inputs) in calls.iter().enumerate() {
        let mut seqs: Vec<BatchSeq<'_>> =
            inputs.iter().zip(caches.iter_mut()).map(|(t, cache)| BatchSeq { tokens: t, cache }).collect();
        let phase = if c == 0 || c == steps + 1 { Phase::Prefill } else { Phase::Decode };
        let logits = engine.forward_batch(&mut seqs, phase).unwrap();
        assert_eq!(logits.n_rows, 3);
        rows.push((0..3).map(|i| logits.row(i).to_vec()).collect());
    }
    rows
}

/// Batched prefill, decode and a mixed step on the split engine: every sequence's row within the
/// tolerance of the one-device engine's.
#[test]
fn split_batched_calls_match_one_device() {
    let Some(_gpu) = gpu() else { return };
    for devices in device_lists() {
        for name in split_fixture_names() {
            let model = open(&name);
            for fraction in [0.5, 1.0] {
                let what = format!("{name} hot {fraction} on {devices:?}");
                let mut one = engine(&model, fraction, &[0], &[]).unwrap();
                let mut split = engine(&model, fraction, &devices, &[]).unwrap();
                let (want, got) =
                    (batched(one.as_mut(), &prompt(&name), 3), batched(split.as_mut(), &prompt(&name), 3));
                let tol = tolerance(&model);
                for (c, (w, g)) in want.iter().zip(&got).enumerate() {
                    for (i, (wr, gr)) in w.iter().zip(g).enumerate() {
                        let err = rel_err(gr, wr);
                        assert!(err <= tol, "{what}: call {c} sequence {i}: {err:e} > {tol}");
                    }
                }
                no_fallbacks(&what, split.as_ref());
            }
        }
    }
}

/// An exchange in every layer with experts (on both devices) keeps the split engine within the
/// tolerance of the one-device engine given the same exchanges.
#[test]
fn split_exchanges_match_one_device() {
    let Some(_gpu) = gpu() else { return };
    for name in split_fixture_names() {
        let model = open(&name);
        let c = model.config().clone();
        let mut one = engine(&model, 0.5, &[0], &[]).unwrap();
        let mut split = engine(&model, 0.5, &[0, 0], &[]).unwrap();
        for l in (0..c.n_layers).filter(|&l| model.plan().layer(l).has_experts()) {
            let set = split.hot_set().unwrap();
            let evict = (0..c.n_experts).find(|&e| set.layers[l].is_hot(e)).unwrap();
            let add = (0..c.n_experts).find(|&e| !set.layers[l].is_hot(e)).unwrap();
            for e in [&mut one, &mut split] {
                e.request_exchange(Exchange { layer_idx: l, evict, add }).unwrap();
            }
        }
        compare_steps(&format!("{name} after exchanges"), &model, one.as_mut(), split.as_mut());
        assert_eq!(split.hot_set(), one.hot_set(), "{name}: the same hot set after the exchanges");
        assert_eq!(split.hot_bytes(), one.hot_bytes(), "{name}: the same cache bytes, split");
        compare_steps(&format!("{name} after landing"), &model, one.as_mut(), split.as_mut());
    }
}

/// `--tensor-split 3,1` gives the layer ranges `split::assign_layers` gives those shares, and the
/// same rows.
#[test]
fn tensor_split_sets_the_layer_ranges() {
    let Some(_gpu) = gpu() else { return };
    for name in split_fixture_names() {
        let model = open(&name);
        let c = model.config();
        let hot: Vec<u64> = model.layer_expert_bytes().iter().map(|b| b * c.n_experts as u64).collect();
        let kv_type = moe_lanes::gpu::GpuOptions::default().kv_type;
        let bytes = moe_lanes::gpu::split::layer_bytes(&model, kv_type, POSITIONS.min(c.max_positions), &hot);
        let want = moe_lanes::gpu::split::assign_layers(&bytes, &[3.0, 1.0]).unwrap();
        let mut one = engine(&model, 1.0, &[0], &[]).unwrap();
        let mut split = engine(&model, 1.0, &[0, 0], &[3.0, 1.0]).unwrap();
        let got: Vec<_> = split.device_reports().iter().map(|r| r.layers[0]..r.layers[1]).collect();
        assert_eq!(got, want, "{name}");
        compare_steps(&format!("{name} split 3,1"), &model, one.as_mut(), split.as_mut());
    }
}

/// Devices the driver does not have, and shares that do not fit the device list, are refused by
/// name before anything is allocated.
#[test]
fn bad_device_lists_are_refused_by_name() {
    let Some(_gpu) = gpu() else { return };
    let model = open("qwen3_moe_a");
    let visible = moe_lanes_kernels::cuda::device_count().unwrap();
    let err = |devices: &[usize], split: &[f64]| {
        engine(&model, 0.5, devices, split).err().expect("refused").to_string()
    };
    let e = err(&[0, visible], &[]);
    assert!(e.contains(&format!("--devices names device {visible}")), "{e}");
    let e = err(&[0, 0], &[1.0]);
    assert!(e.contains("--tensor-split gives 1 share(s) for 2 device(s)"), "{e}");
    let e = err(&[0, 0], &[1.0, 0.0]);
    assert!(e.contains("--tensor-split share 1 is 0"), "{e}");
    // one device takes no split but its own share
    let e = err(&[0], &[3.0, 1.0]);
    assert!(e.contains("2 share(s) for 1 device(s)"), "{e}");
}
