//! synth -> open round trips for every adapter in both formats, and the same seed giving the same
//! weights (and logits) in GGUF and safetensors.

mod common;

use common::*;
use moe_lanes::arch::{Arch, RopeStyle};
use moe_lanes::model::Model;
use moe_lanes::naming::{GlobalRole, LayerRole};
use moe_lanes::reference::{NoObserver, Reference};
use moe_lanes::synth::{synth_config, DimOverrides, Preset, SynthFormat};

#[test]
fn synth_then_open_round_trips_for_every_adapter_in_both_formats() {
    let dir = tempfile::tempdir().unwrap();
    for arch in ARCHS {
        let expected = synth_config(adapter(arch), Preset::Tiny, &DimOverrides::default()).unwrap();
        for format in [SynthFormat::Gguf, SynthFormat::Safetensors] {
            let path = synth_tiny(dir.path(), arch, format, 1);
            let model = Model::open(&path).unwrap_or_else(|e| panic!("{arch} {format:?}: {e}"));
            let mut config = model.config().clone();
            if format == SynthFormat::Gguf && model.adapter().arch == Arch::Mixtral {
                assert_eq!(
                    config.rope_style,
                    RopeStyle::Interleaved,
                    "GGUF llama uses GGML's interleaved RoPE"
                );
                config.rope_style = expected.rope_style;
            }
            assert_eq!(config, expected, "{arch} {format:?}");
            assert_eq!(model.adapter().hf_model_type, arch);
        }
    }
}

fn values(t: moe_lanes::tensor::TensorRef<'_>) -> Vec<f32> {
    t.to_f32_vec().unwrap()
}

#[test]
fn same_seed_loads_to_identical_tensors_in_both_formats() {
    let dir = tempfile::tempdir().unwrap();
    for arch in ARCHS {
        let gguf = Model::open(&synth_tiny(dir.path(), arch, SynthFormat::Gguf, 7)).unwrap();
        let st = Model::open(&synth_tiny(dir.path(), arch, SynthFormat::Safetensors, 7)).unwrap();
        for role in [GlobalRole::TokenEmbedding, GlobalRole::OutputNorm, GlobalRole::Output] {
            assert_eq!(
                values(gguf.global(role).unwrap()),
                values(st.global(role).unwrap()),
                "{arch} {role:?}"
            );
        }
        let c = gguf.config().clone();
        for layer_idx in 0..c.n_layers {
            for role in gguf.required_layer_roles(layer_idx) {
                let (a, b) = (values(gguf.required(layer_idx, role)), values(st.required(layer_idx, role)));
                let permuted = arch == "mixtral" && matches!(role, LayerRole::Q | LayerRole::K);
                if permuted {
                    // GGUF rows are in llama.cpp's interleaved-RoPE order: row 2i of a head holds
                    // canonical row i, row 2i+1 holds canonical row d/2 + i.
                    let (hd, cols) = (c.head_dim, c.hidden);
                    for disk_row in 0..a.len() / cols {
                        let (head, local) = (disk_row / hd, disk_row % hd);
                        let canon = head * hd + if local % 2 == 0 { local / 2 } else { hd / 2 + local / 2 };
                        assert_eq!(
                            &a[disk_row * cols..][..cols],
                            &b[canon * cols..][..cols],
                            "{arch} {role:?}"
                        );
                    }
                } else {
                    assert_eq!(a, b, "{arch} layer {layer_idx} {role:?}");
                }
            }
            for expert_idx in 0..c.n_experts {
                let (x, y) = (gguf.expert(layer_idx, expert_idx), st.expert(layer_idx, expert_idx));
                assert_eq!(values(x.gate), values(y.gate));
                assert_eq!(values(x.up), values(y.up));
                assert_eq!(values(x.down), values(y.down));
            }
        }
    }
}

#[test]
fn gguf_and_safetensors_copies_give_the_same_logits() {
    let dir = tempfile::tempdir().unwrap();
    let tokens = [3u32, 400, 17, 0, 511, 42];
    for arch in ARCHS {
        let mut logits = Vec::new();
        for format in [SynthFormat::Gguf, SynthFormat::Safetensors] {
            let model = Model::open(&synth_tiny(dir.path(), arch, format, 11)).unwrap();
            let reference = Reference::new(&model).unwrap();
            let mut cache = reference.new_cache();
            logits.push(reference.forward(&mut cache, &tokens, &mut NoObserver).unwrap());
        }
        let err = max_rel_err(&logits[0], &logits[1]);
        assert!(err < 1e-5, "{arch}: GGUF vs safetensors logits differ by {err}");
    }
}

#[test]
fn synth_is_deterministic_and_seed_dependent() {
    let dir = tempfile::tempdir().unwrap();
    let a = std::fs::read(synth_tiny(dir.path(), "qwen3_moe", SynthFormat::Gguf, 5)).unwrap();
    let path_b = dir.path().join("again.gguf");
    let opts = synth_options("qwen3_moe", SynthFormat::Gguf, path_b.clone(), 5);
    moe_lanes::synth::write_synthetic(&opts, &mut |_, _| {}).unwrap();
    assert_eq!(a, std::fs::read(&path_b).unwrap(), "same seed, same bytes");
    let c = std::fs::read(synth_tiny(dir.path(), "qwen3_moe", SynthFormat::Gguf, 6)).unwrap();
    assert_ne!(a, c, "another seed, other weights");
}

#[test]
fn gguf_carries_a_tokenizer_llama_cpp_can_load() {
    let dir = tempfile::tempdir().unwrap();
    let path = synth_tiny(dir.path(), "qwen3_moe", SynthFormat::Gguf, 1);
    let file = moe_lanes::gguf::GgufFile::open(&path).unwrap();
    let tokens = file.get("tokenizer.ggml.tokens").unwrap().as_array().unwrap();
    assert_eq!(tokens.values.len(), 512, "one token per vocabulary entry");
    assert_eq!(file.get("tokenizer.ggml.token_type").unwrap().as_array().unwrap().values.len(), 512);
    assert!(!file.get("tokenizer.ggml.merges").unwrap().as_array().unwrap().values.is_empty());
    assert_eq!(file.get("tokenizer.ggml.model").unwrap().as_str(), Some("gpt2"));
    for key in [
        "qwen3moe.expert_count",
        "qwen3moe.expert_used_count",
        "qwen3moe.attention.layer_norm_rms_epsilon",
        "qwen3moe.expert_feed_forward_length",
        "qwen3moe.attention.key_length",
        "general.architecture",
    ] {
        assert!(file.get(key).is_some(), "{key}");
    }
}

#[test]
fn impossible_dimensions_are_refused_before_writing() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("bad.gguf");
    let mut opts = synth_options("qwen3_moe", SynthFormat::Gguf, out.clone(), 1);
    opts.dims.n_experts_used = Some(9);
    let err = moe_lanes::synth::write_synthetic(&opts, &mut |_, _| {}).unwrap_err().to_string();
    assert!(err.contains("num_experts_per_tok"), "{err}");
    opts.dims.n_experts_used = None;
    opts.dims.vocab = Some(100);
    let err = moe_lanes::synth::write_synthetic(&opts, &mut |_, _| {}).unwrap_err().to_string();
    assert!(err.contains("vocab"), "{err}");
    assert!(!out.exists());
}

/// `synth --quant` stores every tensor as `quantize` stores the float checkpoint's, without
/// writing the float file: the same types and the same bytes, hybrids (with an MTP layer)
/// included.
#[test]
fn synth_quant_writes_what_quantize_writes_from_the_float_file() {
    use moe_lanes::gguf::GgufFile;
    use moe_lanes::quantize::{quantize_gguf, QuantMix};
    use moe_lanes::synth::{write_synthetic, write_synthetic_quantized};
    let dir = tempfile::tempdir().unwrap();
    for (arch, mtp) in [("qwen3_moe", None), ("qwen3_5_moe", Some(1))] {
        let mut opts = synth_options(arch, SynthFormat::Gguf, dir.path().join(format!("{arch}.gguf")), 3);
        opts.dims = DimOverrides { hidden: Some(256), expert_ff: Some(256), mtp_layers: mtp, ..opts.dims };
        write_synthetic(&opts, &mut |_, _| {}).unwrap();
        let via_float = dir.path().join(format!("{arch}-q.gguf"));
        quantize_gguf(&opts.out, &via_float, QuantMix::Q4_K_M, &mut |_, _| {}).unwrap();
        let mut direct = opts.clone();
        direct.out = dir.path().join(format!("{arch}-direct.gguf"));
        write_synthetic_quantized(&direct, QuantMix::Q4_K_M, &mut |_, _| {}).unwrap();
        let (a, b) = (GgufFile::open(&via_float).unwrap(), GgufFile::open(&direct.out).unwrap());
        assert_eq!(a.tensor_infos().len(), b.tensor_infos().len(), "{arch}");
        let mut quantized = 0;
        for info in a.tensor_infos() {
            let (x, y) = (a.tensor(&info.name).unwrap(), b.tensor(&info.name).unwrap());
            assert_eq!((x.dtype, x.shape), (y.dtype, y.shape), "{arch} {}", info.name);
            assert!(x.data == y.data, "{arch} {}: different bytes", info.name);
            quantized += usize::from(!x.dtype.is_float());
        }
        assert!(quantized > 10, "{arch}: {quantized} quantized tensors");
        assert_eq!(a.get("general.file_type"), b.get("general.file_type"));
    }
}

/// `synth --quant --expert-row-pool N` writes the file `synth --quant` writes (the same tensors,
/// types, shapes and metadata; every tensor but the experts byte for byte), and each expert
/// tensor's rows are its first N rows as `--quant` writes them followed by copies of those rows
/// only.
#[test]
fn pooled_experts_copy_their_first_rows_and_nothing_else_changes() {
    use moe_lanes::gguf::GgufFile;
    use moe_lanes::quantize::QuantMix;
    use moe_lanes::synth::{write_synthetic_quantized, write_synthetic_quantized_pooled};
    const POOL: usize = 40;
    let dir = tempfile::tempdir().unwrap();
    let opts = synth_options("qwen3_moe", SynthFormat::Gguf, dir.path().join("full.gguf"), 3);
    write_synthetic_quantized(&opts, QuantMix::Q8_0, &mut |_, _| {}).unwrap();
    let pooled = moe_lanes::synth::SynthOptions { out: dir.path().join("pooled.gguf"), ..opts.clone() };
    let pool = std::num::NonZeroUsize::new(POOL).unwrap();
    write_synthetic_quantized_pooled(&pooled, QuantMix::Q8_0, pool, &mut |_, _| {}).unwrap();
    let (a, b) = (GgufFile::open(&opts.out).unwrap(), GgufFile::open(&pooled.out).unwrap());
    assert_eq!(a.metadata().len(), b.metadata().len());
    let mut pooled_tensors = 0;
    for info in a.tensor_infos() {
        let (x, y) = (a.tensor(&info.name).unwrap(), b.tensor(&info.name).unwrap());
        assert_eq!((x.dtype, &x.shape), (y.dtype, &y.shape), "{}", info.name);
        if !info.name.contains("_exps") {
            assert!(x.data == y.data, "{}: different bytes", info.name);
            continue;
        }
        let row_bytes = x.dtype.bytes_for(*x.shape.last().unwrap()).unwrap();
        let (xs, ys): (Vec<&[u8]>, Vec<&[u8]>) =
            (x.data.chunks(row_bytes).collect(), y.data.chunks(row_bytes).collect());
        assert!(xs.len() > 2 * POOL, "{}: {} rows", info.name, xs.len());
        assert_eq!(xs[..POOL], ys[..POOL], "{}: the pool is the first rows", info.name);
        assert!(
            ys[POOL..].iter().all(|r| ys[..POOL].contains(r)),
            "{}: a row from outside the pool",
            info.name
        );
        assert!(xs[POOL..] != ys[POOL..], "{}: nothing was copied", info.name);
        pooled_tensors += 1;
    }
    assert_eq!(pooled_tensors, 3 * 2, "gate, up and down of the tiny preset's two layers");
}

/// `synth --yarn F`: both formats carry YaRN over the preset's context, which becomes F times
/// longer; they give the same logits, other than the unscaled file's; an architecture with its
/// own scaling and a factor below 1 are refused by name.
#[test]
fn yarn_override_reaches_both_formats_and_changes_the_logits() {
    let dir = tempfile::tempdir().unwrap();
    let tokens = [3u32, 400, 17, 0, 511, 42];
    let logits = |model: &Model| {
        let reference = Reference::new(model).unwrap();
        reference.forward(&mut reference.new_cache(), &tokens, &mut NoObserver).unwrap()
    };
    let plain = Model::open(&synth_tiny(dir.path(), "qwen3_moe", SynthFormat::Gguf, 11)).unwrap();
    let mut scaled = Vec::new();
    for (format, name) in [(SynthFormat::Gguf, "yarn.gguf"), (SynthFormat::Safetensors, "yarn-hf")] {
        let mut opts = synth_options("qwen3_moe", format, dir.path().join(name), 11);
        opts.dims.yarn_factor = Some(4.0);
        moe_lanes::synth::write_synthetic(&opts, &mut |_, _| {}).unwrap();
        let model = Model::open(&opts.out).unwrap();
        let (c, base) = (model.config(), plain.config());
        let y = c.yarn.unwrap_or_else(|| panic!("{name}: no YaRN"));
        assert_eq!((y.factor, y.original_context), (4.0, base.max_positions), "{name}");
        assert_eq!(c.max_positions, 4 * base.max_positions, "{name}");
        scaled.push(logits(&model));
    }
    assert!(max_rel_err(&scaled[0], &scaled[1]) < 1e-5, "GGUF and safetensors agree");
    assert!(max_rel_err(&scaled[0], &logits(&plain)) > 1e-3, "YaRN changes the logits");
    for (arch, factor, want) in [("gpt_oss", 4.0, "its own RoPE scaling"), ("qwen3_moe", 0.5, ">= 1")] {
        let mut opts = synth_options(arch, SynthFormat::Gguf, dir.path().join("refused.gguf"), 11);
        opts.dims.yarn_factor = Some(factor);
        let err = moe_lanes::synth::write_synthetic(&opts, &mut |_, _| {}).unwrap_err().to_string();
        assert!(err.contains("yarn") && err.contains(want), "{arch} x{factor}: {err}");
        assert!(!opts.out.exists(), "{arch} x{factor}: nothing written");
    }
}
