//! Model-level bad input: tensors missing or disagreeing with the config (shape, dtype), missing or
//! mistyped metadata, unsupported architectures. Format-level corruption (truncation, magic,
//! versions, offsets, alignment, shards, malformed JSON) is covered in gguf_errors.rs and
//! safetensors_errors.rs. Every error must name the file and the tensor or key.

mod common;

use common::*;
use moe_lanes::dtype::DType;
use moe_lanes::gguf::MetaValue;
use moe_lanes::model::Model;
use moe_lanes::synth::SynthFormat;

fn open_err(path: &std::path::Path) -> String {
    match Model::open(path) {
        Ok(_) => panic!("{} opened but should not", path.display()),
        Err(e) => e.to_string(),
    }
}

fn base() -> (tempfile::TempDir, std::path::PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let path = synth_tiny(dir.path(), "qwen3_moe", SynthFormat::Gguf, 1);
    (dir, path)
}

#[test]
fn missing_tensor_names_file_and_tensor() {
    let (dir, src) = base();
    let dst = dir.path().join("missing.gguf");
    rewrite_gguf(
        &src,
        &dst,
        |_, v| Some(v.clone()),
        |name| {
            if name == "blk.1.attn_k.weight" {
                TensorEdit::Drop
            } else {
                TensorEdit::Keep
            }
        },
    );
    let err = open_err(&dst);
    assert!(err.contains("missing.gguf") && err.contains("blk.1.attn_k.weight"), "{err}");
}

#[test]
fn missing_expert_tensor_is_reported() {
    let (dir, src) = base();
    let dst = dir.path().join("noexp.gguf");
    rewrite_gguf(
        &src,
        &dst,
        |_, v| Some(v.clone()),
        |name| {
            if name == "blk.0.ffn_down_exps.weight" {
                TensorEdit::Drop
            } else {
                TensorEdit::Keep
            }
        },
    );
    let err = open_err(&dst);
    assert!(err.contains("blk.0.ffn_down_exps.weight") && err.contains("missing"), "{err}");
}

#[test]
fn shape_that_disagrees_with_the_config_is_reported_with_both_shapes() {
    let (dir, src) = base();
    let dst = dir.path().join("shape.gguf");
    rewrite_gguf(
        &src,
        &dst,
        |_, v| Some(v.clone()),
        |name| {
            if name == "blk.0.attn_q.weight" {
                TensorEdit::Replace { dtype: DType::BF16, shape: vec![48, 64] }
            } else {
                TensorEdit::Keep
            }
        },
    );
    let err = open_err(&dst);
    assert!(
        err.contains("shape.gguf")
            && err.contains("blk.0.attn_q.weight")
            && err.contains("[48, 64]")
            && err.contains("[64, 64]"),
        "{err}"
    );
}

#[test]
fn config_that_disagrees_with_the_tensors_is_reported() {
    let (dir, src) = base();
    let dst = dir.path().join("cfg.gguf");
    rewrite_gguf(
        &src,
        &dst,
        |k, v| Some(if k == "qwen3moe.expert_count" { MetaValue::U32(6) } else { v.clone() }),
        |_| TensorEdit::Keep,
    );
    let err = open_err(&dst);
    assert!(err.contains("cfg.gguf") && err.contains("ffn_gate_inp") && err.contains("[6, 64]"), "{err}");
}

#[test]
fn a_quantized_vector_is_reported() {
    // Matrices may be quantized; norms and biases are read as floats.
    let (dir, src) = base();
    let dst = dir.path().join("dtype.gguf");
    rewrite_gguf(
        &src,
        &dst,
        |_, v| Some(v.clone()),
        |name| {
            if name == "blk.0.attn_norm.weight" {
                TensorEdit::Replace { dtype: DType::Q8_0, shape: vec![64] }
            } else {
                TensorEdit::Keep
            }
        },
    );
    let err = open_err(&dst);
    assert!(
        err.contains("blk.0.attn_norm.weight") && err.contains("Q8_0") && err.contains("F32, F16 or BF16"),
        "{err}"
    );
}

#[test]
fn missing_metadata_key_is_named() {
    let (dir, src) = base();
    let dst = dir.path().join("meta.gguf");
    rewrite_gguf(&src, &dst, |k, v| (k != "qwen3moe.block_count").then(|| v.clone()), |_| TensorEdit::Keep);
    let err = open_err(&dst);
    assert!(err.contains("meta.gguf") && err.contains("qwen3moe.block_count"), "{err}");
}

#[test]
fn mistyped_metadata_value_is_named() {
    let (dir, src) = base();
    let dst = dir.path().join("mistyped.gguf");
    rewrite_gguf(
        &src,
        &dst,
        |k, v| {
            Some(if k == "qwen3moe.expert_used_count" {
                MetaValue::String("eight".into())
            } else {
                v.clone()
            })
        },
        |_| TensorEdit::Keep,
    );
    let err = open_err(&dst);
    assert!(err.contains("qwen3moe.expert_used_count") && err.contains("integer"), "{err}");
}

#[test]
fn unsupported_architecture_lists_the_supported_ones() {
    let (dir, src) = base();
    let dst = dir.path().join("arch.gguf");
    rewrite_gguf(
        &src,
        &dst,
        |k, v| Some(if k == "general.architecture" { MetaValue::String("gemma3".into()) } else { v.clone() }),
        |_| TensorEdit::Keep,
    );
    let err = open_err(&dst);
    assert!(
        err.contains("gemma3")
            && err.contains("qwen3moe")
            && err.contains("olmoe")
            && err.contains("qwen2moe"),
        "{err}"
    );
}

#[test]
fn truncated_gguf_names_the_file() {
    let (dir, src) = base();
    let bytes = std::fs::read(&src).unwrap();
    let dst = dir.path().join("cut.gguf");
    std::fs::write(&dst, &bytes[..bytes.len() / 2]).unwrap();
    let err = open_err(&dst);
    assert!(err.contains("cut.gguf"), "{err}");
}

#[test]
fn safetensors_config_that_disagrees_with_tensors_names_the_shard_and_tensor() {
    let dir = tempfile::tempdir().unwrap();
    let model_dir = synth_tiny(dir.path(), "olmoe", SynthFormat::Safetensors, 1);
    let config_path = model_dir.join("config.json");
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&config_path).unwrap()).unwrap();
    config["intermediate_size"] = serde_json::json!(40);
    std::fs::write(&config_path, config.to_string()).unwrap();
    let err = open_err(&model_dir);
    assert!(
        err.contains("model.safetensors")
            && err.contains("experts.0.gate_proj.weight")
            && err.contains("[40, 64]"),
        "{err}"
    );
}

#[test]
fn malformed_config_json_names_file_and_position() {
    let dir = tempfile::tempdir().unwrap();
    let model_dir = synth_tiny(dir.path(), "mixtral", SynthFormat::Safetensors, 1);
    std::fs::write(model_dir.join("config.json"), "{\"model_type\": \"mixtral\",\n \"hidden_size\": }")
        .unwrap();
    let err = open_err(&model_dir);
    assert!(err.contains("config.json") && err.contains("line 2"), "{err}");
}

#[test]
fn nonexistent_path_is_named() {
    let err = open_err(std::path::Path::new("/nonexistent/model.gguf"));
    assert!(err.contains("/nonexistent/model.gguf"), "{err}");
}
