//! A transformers checkpoint (a golden fixture) rewritten as a GGUF file in llama.cpp's layout by
//! our own writer (`GgufWriter` + `synth::gguf_metadata`), as llama.cpp's converter would: tensors
//! under llama.cpp's names, experts stacked per layer, a latent attention's `kv_b_proj` split into
//! `attn_k_b` (each head's key rows transposed) and `attn_v_b`, or kept fused as `attn_kv_b` with
//! the metadata of llama.cpp's older files (`Legacy`). For architectures whose RoPE pairing is the
//! same in both formats (DeepSeek-V3: interleaved; GLM-4.5: half-split), so no row is permuted.
//! And the gguf-py layout check (`scripts/gguf-layout-check.py`) run over a file.

use moe_lanes::arch::Mixer;
use moe_lanes::gguf::{GgufWriter, MetaValue};
use moe_lanes::model::naming::{self, ExpertProj, GlobalRole, LayerRole};
use moe_lanes::model::{mla, required_layer_roles, Model};
use std::path::Path;

/// How a latent attention's `kv_b` is written.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum KvB {
    /// `attn_k_b` / `attn_v_b` with `key_length_mla` / `value_length_mla` (llama.cpp's converter
    /// today).
    Split,
    /// One `attn_kv_b`, per-head `key_length` / `value_length`, `head_count_kv` = heads (llama.cpp's
    /// older files, which its loader still reads).
    Legacy,
}

/// Write `model` (opened from a transformers checkpoint) to `out` in llama.cpp's layout.
pub fn write_llama_layout(model: &Model, out: &Path, kv_b: KvB) {
    let adapter = model.adapter();
    assert_eq!(adapter.rope_style, adapter.gguf_rope_style, "no RoPE permutation here");
    // No MTP tensors in a transformers checkpoint (transformers drops them on save).
    let config = moe_lanes::model::config::ModelConfig { mtp_layers: 0, ..model.config().clone() };
    let mut w = GgufWriter::new();
    moe_lanes::synth::gguf_metadata(&mut w, &config, adapter, model.expert_dtype());
    if kv_b == KvB::Legacy {
        let m = config.mla.expect("a latent attention model");
        let arch = adapter.gguf_arch;
        let u32v = |v: usize| MetaValue::U32(v as u32);
        w.add_metadata(format!("{arch}.attention.key_length"), u32v(m.qk_nope_head_dim + m.qk_rope_head_dim));
        w.add_metadata(format!("{arch}.attention.value_length"), u32v(m.v_head_dim));
        w.add_metadata(format!("{arch}.attention.head_count_kv"), u32v(config.n_heads));
    }
    let mut blobs: Vec<Vec<u8>> = Vec::new();
    let add = |w: &mut GgufWriter, name: String, t: moe_lanes::tensor::TensorRef<'_>, shape: &[usize]| {
        w.add_tensor(name, t.dtype, shape);
        t.data.to_vec()
    };
    for role in [GlobalRole::TokenEmbedding, GlobalRole::OutputNorm, GlobalRole::Output] {
        if let Some(t) = model.global(role) {
            blobs.push(add(&mut w, naming::gguf_global(role).into(), t, t.shape));
        }
    }
    for l in 0..config.n_layers {
        let spec = model.layer_spec(l);
        for role in required_layer_roles(spec) {
            let t = model.required(l, role);
            blobs.push(add(&mut w, naming::gguf_layer(adapter, l, role), t, t.shape));
        }
        if let Mixer::LatentAttention(m) = spec.mixer {
            if kv_b == KvB::Legacy {
                let t = model.layer(l, LayerRole::MlaKvB).expect("transformers' fused kv_b_proj");
                blobs.push(add(&mut w, naming::gguf_layer(adapter, l, LayerRole::MlaKvB), t, t.shape));
            } else {
                let (k, v) = model.mla_kv_b(l);
                let (k_shape, v_shape) = mla::split_shapes(&m);
                blobs.push(add(&mut w, naming::gguf_layer(adapter, l, LayerRole::MlaKB), k, &k_shape));
                blobs.push(add(&mut w, naming::gguf_layer(adapter, l, LayerRole::MlaVB), v, &v_shape));
            }
        }
        if !spec.has_experts() {
            continue;
        }
        for proj in ExpertProj::ALL {
            let mut data = Vec::new();
            let mut shape = Vec::new();
            let mut dtype = None;
            for e in 0..config.n_experts {
                let x = model.expert(l, e);
                let t = match proj {
                    ExpertProj::Gate => x.gate,
                    ExpertProj::Up => x.up,
                    ExpertProj::Down => x.down,
                };
                data.extend_from_slice(t.data);
                shape = t.shape.to_vec();
                dtype = Some(t.dtype);
            }
            shape.insert(0, config.n_experts);
            w.add_tensor(naming::gguf_experts(l, proj), dtype.unwrap(), &shape);
            blobs.push(data);
        }
    }
    if kv_b == KvB::Split {
        w.write(out, &mut |idx, o| o.write_all(&blobs[idx]), &mut |_| {}).unwrap();
        return;
    }
    // The older files have no `*_mla` keys (llama.cpp's `is_mla()` is false without them).
    let tmp = out.with_extension("with-mla-keys.gguf");
    w.write(&tmp, &mut |idx, o| o.write_all(&blobs[idx]), &mut |_| {}).unwrap();
    let keep = |key: &str, v: &MetaValue| (!key.ends_with("_mla")).then(|| v.clone());
    super::rewrite_gguf(&tmp, out, keep, |_| super::TensorEdit::Keep);
    std::fs::remove_file(tmp).unwrap();
}

/// Run `scripts/gguf-layout-check.py` (llama.cpp's gguf-py) over `file`: `None` (and a SKIP
/// line) where python3 or gguf-py is missing, else whether it passed and what it printed.
pub fn gguf_py_layout_check(file: &Path) -> Option<(bool, String)> {
    let script = super::repo_root().join("scripts/gguf-layout-check.py");
    let probe = std::process::Command::new("python3").args(["-c", "import gguf"]).output();
    if !probe.is_ok_and(|o| o.status.success()) {
        println!("SKIP: python3 with gguf-py (pip install gguf) not found");
        return None;
    }
    let out = std::process::Command::new("python3").arg(script).arg(file).output().unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    Some((out.status.success(), text))
}
