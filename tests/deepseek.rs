//! DeepSeek-V3 (issue 42, first part) against the `transformers` fixture of
//! tests/fixtures/make_deepseek.py: latent attention (low-rank q, a 32-wide latent, RoPE on the
//! 8-wide parts, interleaved, YaRN with `mscale_all_dim`), a dense first layer, sigmoid routing
//! with a selection bias over 4 groups of which 2 are kept, `routed_scaling_factor` 2.5, an
//! ungated shared expert. The oracle and the CPU pipeline at hot fractions 0, 0.5 and 1: prefill,
//! a second chunk on the same session, decode token by token, greedy tokens; the GPU engine at
//! hot fractions 0, 0.5 and 1 within the GPU tolerance (2e-3), greedy tokens identical.

mod common;
mod fixture_checks;

use common::*;
use fixture_checks::{Golden, HOT_FRACTIONS, TOLERANCE};
use moe_lanes::arch::{Ffn, Mixer, RoutingVariant};
use moe_lanes::engine::{build_engine, EngineKind, EngineOptions, HotChoice};
use moe_lanes::hot_set::HotSet;
use moe_lanes::model::Model;
use moe_lanes::phase::Phase;
use moe_lanes::pipeline::{Pipeline, PipelineOptions};
use moe_lanes::reference::{NoObserver, Reference};
use std::sync::Arc;

const NAME: &str = "deepseek_v3_a";

fn open() -> (Arc<Model>, Golden) {
    fixture_checks::open(NAME)
}

fn pipeline(model: &Arc<Model>, hot_fraction: f64, max_batch_tokens: usize) -> Pipeline {
    fixture_checks::pipeline(model, hot_fraction, max_batch_tokens)
}

#[test]
fn the_plan_says_what_deepseek_v3_is() {
    let (model, _) = open();
    let plan = model.plan();
    for (l, spec) in plan.layers().iter().enumerate() {
        let Mixer::LatentAttention(m) = spec.mixer else { panic!("layer {l}: {:?}", spec.mixer) };
        assert_eq!(
            (m.q_lora_rank, m.kv_lora_rank, m.nope_dim, m.rope_dim, m.v_dim),
            (Some(24), 32, 16, 8, 12)
        );
        assert!(m.rope.yarn.is_some());
        match (l, &spec.ffn) {
            (0, Ffn::Dense(d)) => assert_eq!(d.ff, 48),
            (0, other) => panic!("layer 0 is dense: {other:?}"),
            (_, Ffn::Moe(moe)) => {
                let r = moe.router;
                assert_eq!(r.variant, RoutingVariant::Sigmoid);
                assert!(r.selection_bias && r.norm_topk_prob);
                assert_eq!((r.n_group, r.topk_group, r.scale), (4, 2, 2.5));
                assert!(moe.shared.is_some_and(|s| !s.gated));
            }
            (_, other) => panic!("layer {l} routes: {other:?}"),
        }
    }
    let summary = plan.summary().join("\n");
    assert!(summary.contains("latent attention") && summary.contains("dense ffn"), "{summary}");
    assert!(summary.contains("2 of 4 groups") && summary.contains("ungated shared expert"), "{summary}");
    assert_eq!(plan.expert_layers(), vec![false, true, true, true]);
    assert_eq!(model.expert_bytes_of_layer(0), 0);
}

#[test]
fn reference_matches_transformers_prefill_second_chunk_and_greedy() {
    fixture_checks::check_reference(NAME);
}

#[test]
fn pipeline_prefill_and_a_second_chunk_match_transformers_at_every_hot_fraction() {
    fixture_checks::check_pipeline_prefill(NAME, &[8, 512]);
}

#[test]
fn pipeline_decode_token_by_token_equals_transformers() {
    fixture_checks::check_pipeline_decode(NAME, &HOT_FRACTIONS, usize::MAX);
}

#[test]
fn pipeline_greedy_continuations_are_identical() {
    fixture_checks::check_pipeline_greedy(NAME, &HOT_FRACTIONS);
}

/// A hot set that names experts of the dense layer is refused by name.
#[test]
fn a_hot_set_in_the_dense_layer_is_refused() {
    let (model, _) = open();
    let c = model.config();
    let all = HotSet::from_fraction(c.n_layers, c.n_experts, 1, 0.5, None).unwrap();
    let opts = PipelineOptions { hot_set: Some(all), ..Default::default() };
    let err = Pipeline::new(model.clone(), opts).err().expect("refused").to_string();
    assert!(err.contains("layer 0") && err.contains("dense"), "{err}");
}

/// The GPU engine takes the plan (latent attention, the dense first layer, sigmoid routing):
/// `supports` says so without a device; the default engine is the GPU engine where a GPU exists
/// (else the pipeline) and matches transformers at a 50% byte budget.
#[test]
fn the_gpu_engine_takes_the_plan_and_the_default_engine_matches() {
    let (model, g) = open();
    moe_lanes::gpu::GpuModel::supports(&model).unwrap();
    let mut opts = EngineOptions::new(128);
    opts.hot = HotChoice::Budget(moe_lanes::engine::HotBudget::Fraction(0.5));
    opts.cold_threads = moe_lanes::threads::ColdThreads::Fixed(2);
    if gpu_usable() {
        opts.cuda = moe_lanes::env::cuda_config().unwrap();
    }
    let (mut engine, report) = build_engine(&model, opts).unwrap();
    let want = if gpu_usable() { EngineKind::Gpu } else { EngineKind::Pipeline };
    assert_eq!(report.kind, want);
    let mut cache = engine.new_cache(128).unwrap();
    let prefill = engine.forward(&g.prompt, Phase::Prefill, &mut cache).unwrap().rows();
    let err = max_rel_err(&prefill, &g.logits);
    // The GPU engine's tolerance (issue 42: 2e-3); the pipeline meets 1e-3 above.
    assert!(err < fixture_checks::GPU_TOLERANCE, "{err}");
}

/// The GPU engine (latent attention in the absorbed form, prefill and decode graphs; the dense
/// first layer; sigmoid routing) against transformers at hot fractions 0, 0.5 and 1: prefill, a
/// second chunk, greedy tokens identical.
#[test]
fn gpu_engine_matches_transformers() {
    fixture_checks::check_gpu(NAME, &HOT_FRACTIONS);
}

/// The GPU engine against the oracle on DeepSeek-V3-shaped synthetic files (the preset's
/// latent attention: rank 512, rope 64, nope 128, v 128, q_lora 1536, YaRN x40 with
/// `mscale_all_dim`; its 3 dense layers of 18432; 4 heads, hidden 256, two MoE layers of 16
/// experts), one property varied at a time: the file's type and format, YaRN or none, a plain q
/// or the low-rank one, the tiny preset's rank 32. Each is compared with the oracle on the
/// weights the GPU holds (float matrices and `k_b` / `v_b` rounded to bf16: `gpu_weights`), at
/// hot 0.5 (the cold lane) and 1 (decode graphs); rows whose routing was a near tie are left out
/// (`preset_gpu::NEAR_TIE`). Every error is printed.
#[test]
fn gpu_engine_on_deepseek_preset_files_follows_the_oracle() {
    if !gpu_usable() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mut errors = Vec::new();
    for case in &preset_gpu::CASES {
        let (gpu_file, oracle_file) = preset_gpu::files(dir.path(), case);
        for hot in [0.5, 1.0] {
            errors.push((case, hot, preset_gpu::compare(case.name, &gpu_file, &oracle_file, hot)));
        }
    }
    let line = |(c, hot, err): &(&preset_gpu::Case, f64, f32)| {
        format!("{} hot {hot}: {err:.2e} (bound {:.0e})", c.name, c.bound)
    };
    println!("{}", errors.iter().map(line).collect::<Vec<_>>().join("\n"));
    let failed: Vec<String> =
        errors.iter().filter(|(c, _, err)| err.is_nan() || *err >= c.bound).map(line).collect();
    assert!(failed.is_empty(), "{failed:?}");
}

/// The Q4_K_M preset file alone (`synth --quant q4_k_m`: `attn_k_b` Q5_0 / Q8_0, `attn_v_b`
/// Q4_K, which the GPU dequantizes to bf16 at upload) against the oracle on the weights the GPU
/// holds, at hot 0.5 and 1, near ties left out.
#[test]
fn gpu_engine_on_quantized_deepseek_follows_the_oracle() {
    if !gpu_usable() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let case = preset_gpu::CASES.iter().find(|c| c.name == "q4_k_m").unwrap();
    let (gpu_file, oracle_file) = preset_gpu::files(dir.path(), case);
    for hot in [0.5, 1.0] {
        let err = preset_gpu::compare(case.name, &gpu_file, &oracle_file, hot);
        assert!(err < case.bound, "q4_k_m hot {hot}: gpu vs oracle {err}");
    }
}

/// Why the GPU engine's first runs on the preset's files "failed" (1.8e-1 against the oracle on
/// the Q4_K_M file, 3.7e-1 against llama.cpp on the F32 one) with nothing on the GPU: the oracle
/// itself moves that far when only `k_b` / `v_b` are rounded to bf16 as the GPU holds them, at
/// the rows where DeepSeek's group choice (8 groups, 4 kept) is a near tie; every other row
/// stays within 3e-3 (and the F32 file's matrices in bf16 move it by about 5e-3). The margin now
/// sees group ties (`choice_margin`), so the GPU tests leave those rows out. Every case of the
/// GPU test opens and runs on the oracle here.
#[test]
fn bf16_k_b_moves_the_preset_only_where_the_group_choice_is_a_near_tie() {
    let dir = tempfile::tempdir().unwrap();
    let prompt = preset_gpu::prompt();
    let run = |p: &std::path::Path| {
        let model = Arc::new(Model::open(p).unwrap());
        moe_lanes::gpu::GpuModel::supports(&model).unwrap();
        let r = Reference::new(&model).unwrap();
        let mut ties = common::NearTies::new(preset_gpu::NEAR_TIE);
        let rows = r.forward(&mut r.new_cache(), &prompt, &mut ties).unwrap();
        (rows, ties.positions)
    };
    for case in &preset_gpu::CASES {
        let (file, rounded) = preset_gpu::files(dir.path(), case);
        let (exact, ties) = run(&file);
        println!("{}: rows {ties:?} near ties", case.name);
        if !matches!(case.name, "f32" | "q4_k_m") {
            continue; // the file holds what the GPU holds
        }
        let (near, ties_rounded) = run(&rounded);
        let all = max_rel_err(&near, &exact);
        let ties: std::collections::BTreeSet<usize> = ties.union(&ties_rounded).copied().collect();
        let mut rest = 0f32;
        for (i, (a, b)) in near.iter().zip(&exact).enumerate().filter(|(i, _)| !ties.contains(i)) {
            let err = max_rel_err(std::slice::from_ref(a), std::slice::from_ref(b));
            rest = rest.max(err);
            let bound = if case.name == "q4_k_m" { 3e-3 } else { 1e-2 };
            assert!(err < bound, "{}: row {i} (no near tie) moved by {err}", case.name);
        }
        println!("{}: the GPU's weights move every row {all:.2e}, the rest {rest:.2e}", case.name);
    }
}

/// The files of `gpu_engine_on_deepseek_preset_files_follows_the_oracle` and how they compare.
mod preset_gpu {
    use super::*;
    use common::{rebuild_gguf, Rebuilt};
    use moe_lanes::gguf::MetaValue;
    use moe_lanes::synth::{write_synthetic, write_synthetic_quantized, DimOverrides, Preset, SynthFormat};
    use std::path::{Path, PathBuf};

    /// A routing margin below this share of the largest score is a near tie (as gpu_parity's):
    /// the GPU's rounding may choose the other expert or group, and that row leaves the oracle
    /// by 1e-1 or more.
    pub const NEAR_TIE: f32 = 2e-3;

    /// What a case's file is made of.
    #[derive(Clone, Copy, PartialEq)]
    pub enum Make {
        Float(moe_lanes::dtype::DType, SynthFormat),
        Q4KM,
        /// The BF16 GGUF file without YaRN (its `rope.scaling.*` keys dropped).
        NoYarn,
        /// The BF16 GGUF file with a plain q (`attn_q`, new values) instead of `q_a`/`q_b`.
        PlainQ,
        /// The tiny preset (rank 32, rope 8, nope 16, q_lora 32) in BF16.
        Rank32,
    }

    pub struct Case {
        pub name: &'static str,
        pub make: Make,
        pub bound: f32,
    }

    use moe_lanes::dtype::DType;
    pub const CASES: [Case; 7] = [
        Case { name: "bf16", make: Make::Float(DType::BF16, SynthFormat::Gguf), bound: 2e-3 },
        Case { name: "f32", make: Make::Float(DType::F32, SynthFormat::Gguf), bound: 2e-3 },
        Case {
            name: "bf16 safetensors",
            make: Make::Float(DType::BF16, SynthFormat::Safetensors),
            bound: 2e-3,
        },
        Case { name: "q4_k_m", make: Make::Q4KM, bound: 3e-2 },
        Case { name: "bf16 no yarn", make: Make::NoYarn, bound: 2e-3 },
        Case { name: "bf16 plain q", make: Make::PlainQ, bound: 2e-3 },
        Case { name: "bf16 rank 32", make: Make::Rank32, bound: 2e-3 },
    ];

    /// The GPU's split latent attention takes a prompt in chunks of this many rows
    /// (`MLA_ATTENTION_ROWS`).
    const MLA_ROWS: usize = 64;

    /// 72 tokens: two chunks of the GPU's split latent attention ([`MLA_ROWS`]).
    pub fn prompt() -> Vec<u32> {
        (0..72).map(|i| (i * 53 + 7) % 1000).collect()
    }

    fn options(dir: &Path, name: &str, make: Make) -> moe_lanes::synth::SynthOptions {
        let (dtype, format) = match make {
            Make::Float(d, f) => (d, f),
            _ => (DType::BF16, SynthFormat::Gguf),
        };
        let mut o = synth_options("deepseek_v3", format, dir.join(name), 3);
        if format == SynthFormat::Gguf {
            o.out.set_extension("gguf");
        }
        o.dtype = dtype;
        o.preset = if make == Make::Rank32 { Preset::Tiny } else { "deepseek-v3".parse().unwrap() };
        o.dims = DimOverrides {
            // the preset's 3 dense layers then 2 with experts; the tiny preset's 1 then 2
            n_layers: Some(if make == Make::Rank32 { 3 } else { 5 }),
            hidden: Some(256),
            n_heads: Some(4),
            n_experts: Some(16),
            n_experts_used: Some(4),
            expert_ff: Some(256),
            shared_expert_ff: Some(256),
            vocab: Some(1024),
            ..Default::default()
        };
        o
    }

    /// The case's file for the GPU engine and the file of the weights it holds, for the oracle.
    pub fn files(dir: &Path, case: &Case) -> (PathBuf, PathBuf) {
        let name = case.name.replace(' ', "-");
        let o = options(dir, &name, case.make);
        let bf16_base = |dir: &Path| {
            let base = options(dir, "bf16-base", Make::Float(DType::BF16, SynthFormat::Gguf));
            if !base.out.exists() {
                write_synthetic(&base, &mut |_, _| {}).unwrap();
            }
            base.out
        };
        let file = match case.make {
            Make::Float(..) | Make::Rank32 => {
                write_synthetic(&o, &mut |_, _| {}).unwrap();
                o.out
            }
            Make::Q4KM => {
                write_synthetic_quantized(&o, moe_lanes::quantize::QuantMix::Q4_K_M, &mut |_, _| {}).unwrap();
                o.out
            }
            Make::NoYarn => {
                let no_yarn = |k: &str, v: &MetaValue| (!k.contains("rope.scaling")).then(|| v.clone());
                rebuild_gguf(&bf16_base(dir), &o.out, no_yarn, |_| Rebuilt::Keep, Vec::new());
                o.out
            }
            Make::PlainQ => {
                plain_q(&bf16_base(dir), &o.out);
                o.out
            }
        };
        (file.clone(), gpu_weights(&file, dir.join(format!("{name}-gpu-weights.gguf"))))
    }

    /// The weights the GPU engine holds for `file` (float matrices and every `k_b` / `v_b` as
    /// bf16) as a GGUF file for the oracle; a safetensors directory is read as it is (BF16).
    fn gpu_weights(file: &Path, out: PathBuf) -> PathBuf {
        if file.extension().is_none_or(|e| e != "gguf") {
            return file.to_path_buf();
        }
        let edit = |i: &moe_lanes::gguf::GgufTensorInfo| {
            let latent = i.name.contains("attn_k_b") || i.name.contains("attn_v_b");
            let float_matrix = i.shape.len() >= 2 && matches!(i.dtype, DType::F32 | DType::F16);
            if latent || float_matrix {
                Rebuilt::Bf16
            } else {
                Rebuilt::Keep
            }
        };
        rebuild_gguf(file, &out, |_, v| Some(v.clone()), edit, Vec::new());
        out
    }

    /// `src` with each layer's `q_a`, its norm and `q_b` replaced by a plain `attn_q` (`[q_dim,
    /// hidden]`, values of the scale of a projection of `hidden`) and no `q_lora_rank`.
    fn plain_q(src: &Path, out: &Path) {
        let file = moe_lanes::gguf::GgufFile::open(src).unwrap();
        let mut extra = Vec::new();
        for info in file.tensor_infos().iter().filter(|i| i.name.ends_with("attn_q_b.weight")) {
            let hidden = file.tensor(&info.name.replace("attn_q_b", "attn_q_a")).unwrap().shape[1];
            let (rows, layer) = (info.shape[0], info.name.split('.').nth(1).unwrap().parse::<u64>().unwrap());
            let mut s = 0x9e37_79b9_7f4a_7c15u64 ^ layer;
            let values: Vec<f32> = (0..rows * hidden)
                .map(|_| {
                    s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                    ((s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * 1.7 / (hidden as f32).sqrt()
                })
                .collect();
            extra.push((info.name.replace("attn_q_b", "attn_q"), vec![rows, hidden], values));
        }
        let keep_meta = |k: &str, v: &MetaValue| (!k.ends_with("attention.q_lora_rank")).then(|| v.clone());
        let drop_q = |i: &moe_lanes::gguf::GgufTensorInfo| match ["attn_q_a", "attn_q_b"]
            .iter()
            .any(|n| i.name.contains(n))
        {
            true => Rebuilt::Drop,
            false => Rebuilt::Keep,
        };
        rebuild_gguf(src, out, keep_meta, drop_q, extra);
    }

    /// The GPU engine on `gpu_file` against the oracle on `oracle_file` at `hot`: the prompt's
    /// rows (near ties left out) and 3 decode steps (up to a near tie); the largest error.
    pub fn compare(what: &str, gpu_file: &Path, oracle_file: &Path, hot: f64) -> f32 {
        let (gm, om) =
            (Arc::new(Model::open(gpu_file).unwrap()), Arc::new(Model::open(oracle_file).unwrap()));
        moe_lanes::gpu::GpuModel::supports(&gm).unwrap();
        let r = Reference::new(&om).unwrap();
        let prompt = prompt();
        let (mut rc, mut ties) = (r.new_cache(), common::NearTies::new(NEAR_TIE));
        let want = r.forward(&mut rc, &prompt, &mut ties).unwrap();
        let mut engine = fixture_checks::gpu_engine(&gm, hot);
        let mut cache = engine.new_cache(128).unwrap();
        let got = engine.forward(&prompt, Phase::Prefill, &mut cache).unwrap().rows();
        // a NaN row counts as the worst error (f32::max would drop it)
        let row_err = |a: &[f32], b: &[f32]| {
            let err = max_rel_err(&[a.to_vec()], &[b.to_vec()]);
            if err.is_nan() {
                f32::INFINITY
            } else {
                err
            }
        };
        let errs: Vec<f32> = got.iter().zip(&want).map(|(g, w)| row_err(g, w)).collect();
        let kept = |rows: std::ops::Range<usize>| -> Vec<f32> {
            rows.filter(|i| !ties.positions.contains(i)).map(|i| errs[i]).collect()
        };
        let max = |v: &[f32]| v.iter().fold(0f32, |m, &e| m.max(e));
        let mut sorted = kept(0..errs.len());
        sorted.sort_by(f32::total_cmp);
        let (first, rest) = (kept(0..MLA_ROWS.min(errs.len())), kept(MLA_ROWS.min(errs.len())..errs.len()));
        let mut worst = max(&sorted);
        println!(
            "{what} hot {hot}: prefill {worst:.2e} (rows 0..{MLA_ROWS} {:.2e}, the rest {:.2e}, median {:.2e}; {:.2e} with the near-tie rows {:?})",
            max(&first),
            max(&rest),
            sorted.get(sorted.len() / 2).copied().unwrap_or(0.0),
            max(&errs),
            ties.positions
        );
        let mut next = moe_lanes::reference::argmax(want.last().unwrap());
        for step in 0..3 {
            let want = r.forward(&mut rc, &[next], &mut ties).unwrap();
            let got = engine.forward(&[next], Phase::Decode, &mut cache).unwrap().rows();
            if ties.positions.contains(&(prompt.len() + step)) {
                println!("{what} hot {hot}: decode step {step} routes a near tie: compared up to there");
                break;
            }
            let err = row_err(&got[0], &want[0]);
            println!("{what} hot {hot}: decode {step} {err:.2e}");
            worst = worst.max(err);
            next = moe_lanes::reference::argmax(&want[0]);
        }
        worst
    }
}

/// `synth --arch deepseek_v3` (tiny: a dense first layer, 4 groups of 2 experts): both formats
/// open with the same plan and give the same logits, and the pipeline matches the oracle on
/// each (the GGUF file stores `attn_kv_b`, split at open as transformers' `kv_b_proj` is).
#[test]
fn synthetic_deepseek_in_both_formats_gives_the_same_logits() {
    use moe_lanes::synth::SynthFormat;
    let dir = tempfile::tempdir().unwrap();
    let prompt: Vec<u32> = (0..12).map(|i| (i * 37 + 5) % 500).collect();
    let mut per_format = Vec::new();
    for format in [SynthFormat::Safetensors, SynthFormat::Gguf] {
        let mut opts = synth_options("deepseek_v3", format, dir.path().join(format!("m-{format:?}")), 42);
        opts.dims.n_layers = Some(3);
        if format == SynthFormat::Gguf {
            opts.out.set_extension("gguf");
        }
        moe_lanes::synth::write_synthetic(&opts, &mut |_, _| {}).unwrap();
        let model = Arc::new(Model::open(&opts.out).unwrap());
        assert_eq!(model.plan().expert_layers(), vec![false, true, true], "{format:?}");
        let r = Reference::new(&model).unwrap();
        let want = r.forward(&mut r.new_cache(), &prompt, &mut NoObserver).unwrap();
        let mut p = pipeline(&model, 0.5, 512);
        let got = p.forward(&mut p.new_cache(), &prompt, Phase::Prefill).unwrap();
        let err = max_rel_err(&got, &want);
        assert!(err < TOLERANCE, "{format:?}: pipeline vs oracle {err}");
        per_format.push(want);
    }
    let err = max_rel_err(&per_format[1], &per_format[0]);
    println!("synthetic deepseek_v3: gguf vs safetensors {err:.2e}");
    assert!(err < 1e-5, "the formats differ by {err}");
}

/// The presets: DeepSeek-V3's and Kimi K2's shapes, shrunk with `--layers`.
#[test]
fn deepseek_presets_have_their_shapes() {
    use moe_lanes::synth::{synth_config, DimOverrides, Preset};
    let a = adapter("deepseek_v3");
    let dims = DimOverrides { n_layers: Some(4), ..Default::default() };
    let ds = synth_config(a, "deepseek-v3".parse::<Preset>().unwrap(), &dims).unwrap();
    let m = ds.mla.unwrap();
    assert_eq!((m.kv_lora_rank, m.qk_rope_head_dim, m.q_lora_rank), (512, 64, Some(1536)));
    assert_eq!(ds.dense_layers.unwrap().count, 3);
    assert_eq!((ds.n_experts, ds.sigmoid_routing.unwrap().n_group), (256, 8));
    let kimi = synth_config(a, "kimi-k2".parse::<Preset>().unwrap(), &dims).unwrap();
    assert_eq!((kimi.n_experts, kimi.n_heads, kimi.dense_layers.unwrap().count), (384, 64, 1));
    assert!(synth_config(adapter("qwen3_moe"), "deepseek-v3".parse().unwrap(), &dims).is_err());
}

/// The fixture rewritten in llama.cpp's layout by our own writer (`common::llama_layout`): split
/// `attn_k_b` / `attn_v_b` as llama.cpp's converter writes them today, and the older fused
/// `attn_kv_b` without `key_length_mla` that its loader still reads. gguf-py reads both and finds
/// the tensors llama.cpp's loader asks for; the oracle and the pipeline on each give the
/// fixture's transformers logits.
#[test]
fn the_fixture_in_llama_cpp_layout_gives_its_logits() {
    use common::llama_layout::{gguf_py_layout_check, write_llama_layout, KvB};
    let (hf, g) = open();
    let dir = tempfile::tempdir().unwrap();
    for kv_b in [KvB::Split, KvB::Legacy] {
        let path = dir.path().join(format!("{kv_b:?}.gguf"));
        write_llama_layout(&hf, &path, kv_b);
        if let Some((ok, text)) = gguf_py_layout_check(&path) {
            assert!(ok, "{kv_b:?}: {text}");
        }
        let file = moe_lanes::gguf::GgufFile::open(&path).unwrap();
        let split = file.tensor("blk.0.attn_k_b.weight").is_some();
        assert_eq!(
            (split, file.tensor("blk.0.attn_kv_b.weight").is_some()),
            (kv_b == KvB::Split, kv_b == KvB::Legacy)
        );
        let model = Arc::new(Model::open(&path).unwrap());
        let (c, want) = (model.config(), hf.config());
        assert_eq!(
            (c.mla, c.dense_layers, c.sigmoid_routing),
            (want.mla, want.dense_layers, want.sigmoid_routing)
        );
        assert_eq!(
            (c.yarn, c.norm_topk_prob, c.n_kv_heads),
            (want.yarn, want.norm_topk_prob, want.n_kv_heads)
        );
        fixture_checks::check_prompt_logits(&model, &g, &format!("{kv_b:?}: "));
    }
}

/// `synth --arch deepseek_v3` as GGUF is in llama.cpp's layout (gguf-py's check), in BF16 and as
/// `synth --quant q4_k_m` writes it (the preset's shapes, shrunk): `attn_k_b` of 128-wide rows
/// falls back to Q5_0 (as llama.cpp does) where Q4_K needs 256, `attn_v_b` is Q4_K, and the pipeline on
/// the quantized file follows the oracle on it.
#[test]
fn synthetic_deepseek_gguf_is_llama_cpp_layout_in_bf16_and_q4_k_m() {
    use moe_lanes::synth::{write_synthetic_quantized, Preset, SynthFormat};
    let dir = tempfile::tempdir().unwrap();
    let bf16 = synth_options("deepseek_v3", SynthFormat::Gguf, dir.path().join("bf16.gguf"), 3);
    moe_lanes::synth::write_synthetic(&bf16, &mut |_, _| {}).unwrap();
    let mut q = synth_options("deepseek_v3", SynthFormat::Gguf, dir.path().join("q4.gguf"), 3);
    q.preset = "deepseek-v3".parse::<Preset>().unwrap();
    q.dims = moe_lanes::synth::DimOverrides {
        n_layers: Some(4),
        hidden: Some(256),
        n_heads: Some(2),
        n_experts: Some(16),
        n_experts_used: Some(4),
        expert_ff: Some(256),
        shared_expert_ff: Some(256),
        vocab: Some(1024),
        ..Default::default()
    };
    let mix = moe_lanes::quantize::QuantMix::Q4_K_M;
    write_synthetic_quantized(&q, mix, &mut |_, _| {}).unwrap();
    for path in [&bf16.out, &q.out] {
        if let Some((ok, text)) = common::llama_layout::gguf_py_layout_check(path) {
            assert!(ok, "{text}");
        }
    }
    let file = moe_lanes::gguf::GgufFile::open(&q.out).unwrap();
    let dtype = |name: &str| file.tensor(name).unwrap().dtype;
    use moe_lanes::dtype::DType;
    // attn_k_b's rows are 128 wide (qk_nope_head_dim), not whole Q4_K super-blocks: Q5_0, as
    // llama.cpp's tensor_type_fallback picks.
    assert_eq!((dtype("blk.3.attn_k_b.weight"), dtype("blk.3.attn_v_b.weight")), (DType::Q5_0, DType::Q4_K));
    let model = Arc::new(Model::open(&q.out).unwrap());
    let prompt: Vec<u32> = (0..10).map(|i| (i * 53 + 7) % 1000).collect();
    let r = Reference::new(&model).unwrap();
    let want = r.forward(&mut r.new_cache(), &prompt, &mut NoObserver).unwrap();
    let mut p = pipeline(&model, 0.5, 512);
    let got = p.forward(&mut p.new_cache(), &prompt, Phase::Prefill).unwrap();
    let err = max_rel_err(&got, &want);
    // The pipeline's 8-bit activations against the oracle's f32 on quantized weights.
    assert!(err < 2e-2, "q4_k_m: pipeline vs oracle {err}");
}

/// The second fixture, `deepseek_v3_b`: YaRN as DeepSeek-V3 configures it with `mscale` (0.707)
/// unlike `mscale_all_dim` (1), so the cos/sin scale is their ratio and the softmax scale takes
/// `mscale_all_dim`'s square; no low-rank q (`attn_q`); one group, two shared experts.
mod rope_scaling {
    use super::*;

    const NAME_B: &str = "deepseek_v3_b";

    #[test]
    fn the_plan_reads_yarn_and_the_plain_q() {
        let (model, _) = fixture_checks::open(NAME_B);
        let c = model.config();
        let (m, y) = (c.mla.unwrap(), c.yarn.unwrap());
        assert_eq!((m.q_lora_rank, m.mscale_all_dim), (None, 1.0));
        assert_eq!((y.factor, y.original_context, y.beta_fast, y.beta_slow), (8.0, 16, 24.0, 2.0));
        let mscale = |v: f32| 0.1 * v * 8f32.ln() + 1.0;
        assert!((y.attention_factor - mscale(0.707) / mscale(1.0)).abs() < 1e-6, "{}", y.attention_factor);
        let Mixer::LatentAttention(a) = model.layer_spec(1).mixer else { panic!("MLA") };
        let want_scale = mscale(1.0) * mscale(1.0) / 24f32.sqrt();
        assert!((a.scale - want_scale).abs() < 1e-6, "{} vs {want_scale}", a.scale);
        assert!(model.layer(1, moe_lanes::naming::LayerRole::Q).is_some());
        assert_eq!(c.shared_expert_ff, 2 * c.expert_ff);
    }

    #[test]
    fn reference_matches_transformers_prefill_second_chunk_and_greedy() {
        fixture_checks::check_reference(NAME_B);
    }

    /// Kimi-style (no low-rank q: a plain `q`) on the GPU engine at every hot fraction.
    #[test]
    fn gpu_engine_matches_transformers() {
        moe_lanes::gpu::GpuModel::supports(&fixture_checks::open(NAME_B).0).unwrap();
        fixture_checks::check_gpu(NAME_B, &HOT_FRACTIONS);
    }

    #[test]
    fn pipeline_matches_transformers_at_every_hot_fraction() {
        fixture_checks::check_pipeline_prefill(NAME_B, &[8, 512]);
        fixture_checks::check_pipeline_decode(NAME_B, &HOT_FRACTIONS, usize::MAX);
        fixture_checks::check_pipeline_greedy(NAME_B, &HOT_FRACTIONS);
    }

    /// In llama.cpp's layout by our writer (`attn_q` without `q_lora_rank`, `rope.scaling.*` with
    /// `attn_factor` for the mscale ratio and `yarn_log_multiplier` for `mscale_all_dim`), the
    /// file gives the fixture's logits. gguf-py's check names the one thing llama.cpp's loader
    /// would refuse: no `q_lora_rank` outside its "lite" layer counts (26, 27).
    #[test]
    fn in_llama_cpp_layout_it_gives_its_logits() {
        use common::llama_layout::{gguf_py_layout_check, write_llama_layout, KvB};
        let (hf, g) = fixture_checks::open(NAME_B);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("b.gguf");
        write_llama_layout(&hf, &path, KvB::Split);
        if let Some((ok, text)) = gguf_py_layout_check(&path) {
            assert!(!ok && text.contains("no attention.q_lora_rank"), "{text}");
            assert_eq!(text.lines().count(), 2, "one problem and the summary: {text}");
        }
        let model = Arc::new(Model::open(&path).unwrap());
        let (c, want) = (model.config(), hf.config());
        assert_eq!((c.mla, c.yarn), (want.mla, want.yarn));
        fixture_checks::check_prompt_logits(&model, &g, "");
    }
}
