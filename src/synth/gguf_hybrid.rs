//! A hybrid model's Gated DeltaNet tensors in llama.cpp's GGUF layout, drawn from the canonical
//! (Hugging Face) tensors, so a GGUF file and a safetensors directory of one seed hold the same
//! model. llama.cpp's converter (`conversion/qwen.py`) splits Qwen3-Next's fused `qkvz` into
//! `attn_qkv` and `attn_gate`, keeps its `ba` fused per key head, reorders Qwen3.5's value heads
//! from grouped to tiled order, and stores `-exp(A_log)` as `ssm_a`. Also the NextN/MTP layers
//! its converter appends (Qwen3.5's and GLM-4.5's, `mtp_tensors`).

use super::{
    canonical_2d, expert_part, layer_init, Canonical, Init, Layout, PlannedTensor, RowMap, SynthOptions,
    ValueMap,
};
use crate::format::dtype::DType;
use crate::model::arch::{Adapter, DeltaNetProjections, DeltaNetSpec, Mixer, VHeadOrder};
use crate::model::config::ModelConfig;
use crate::model::naming::{self, ExpertProj, LayerRole};
use crate::model::{expected_layer_shape, required_layer_roles};
use std::sync::Arc;

/// Where one value of a DeltaNet projection lives in the canonical checkpoint.
struct CanonicalLayout {
    d: DeltaNetSpec,
}

impl CanonicalLayout {
    /// Value heads per key head.
    fn r(&self) -> usize {
        self.d.n_v_heads / self.d.n_k_heads
    }

    /// Rows of one key head's group in a fused `qkvz`.
    fn group(&self) -> usize {
        2 * self.d.k_head_dim + 2 * self.r() * self.d.v_head_dim
    }

    fn grouped(&self) -> bool {
        self.d.projections == DeltaNetProjections::Grouped
    }

    /// Row `i` of key head `h`'s query (`k`: of its key).
    fn qk_row(&self, key: bool, h: usize, i: usize) -> (LayerRole, usize) {
        let dk = self.d.k_head_dim;
        if self.grouped() {
            (LayerRole::DeltaQkvz, h * self.group() + usize::from(key) * dk + i)
        } else {
            (LayerRole::DeltaQkv, usize::from(key) * self.d.key_dim() + h * dk + i)
        }
    }

    /// Row `i` of canonical value head `j`'s value (`gate`: of its output gate z).
    fn vz_row(&self, gate: bool, j: usize, i: usize) -> (LayerRole, usize) {
        let (dk, dv, r) = (self.d.k_head_dim, self.d.v_head_dim, self.r());
        match (self.grouped(), gate) {
            (true, _) => {
                let at = 2 * dk + usize::from(gate) * r * dv;
                (LayerRole::DeltaQkvz, (j / r) * self.group() + at + (j % r) * dv + i)
            }
            (false, false) => (LayerRole::DeltaQkv, 2 * self.d.key_dim() + j * dv + i),
            (false, true) => (LayerRole::DeltaZ, j * dv + i),
        }
    }

    /// Canonical value head `j`'s beta logit (`alpha`: its decay input a).
    fn ba_row(&self, alpha: bool, j: usize) -> (LayerRole, usize) {
        let r = self.r();
        match (self.grouped(), alpha) {
            (true, _) => (LayerRole::DeltaBa, (j / r) * 2 * r + usize::from(alpha) * r + j % r),
            (false, false) => (LayerRole::DeltaB, j),
            (false, true) => (LayerRole::DeltaA, j),
        }
    }
}

/// The canonical value head that value head `disk` of a file in `order` holds.
fn canonical_v_head(d: &DeltaNetSpec, order: VHeadOrder, disk: usize) -> usize {
    match order {
        VHeadOrder::Grouped => disk,
        VHeadOrder::Tiled => (disk % d.n_k_heads) * (d.n_v_heads / d.n_k_heads) + disk / d.n_k_heads,
    }
}

/// The canonical rows of each row of GGUF tensor `role` (layout `g`), in disk order.
fn disk_rows(canon: &CanonicalLayout, g: &DeltaNetSpec, role: LayerRole) -> Vec<(LayerRole, usize)> {
    let d = &canon.d;
    let (nk, nv, dk, dv) = (d.n_k_heads, d.n_v_heads, d.k_head_dim, d.v_head_dim);
    let vh = |jd: usize| canonical_v_head(d, g.v_heads, jd);
    let heads = |per: usize| (0..nv).flat_map(move |jd| (0..per).map(move |i| (jd, i)));
    let mut rows = Vec::new();
    match role {
        LayerRole::DeltaQkv => {
            for key in [false, true] {
                rows.extend(
                    (0..nk).flat_map(|h| (0..dk).map(move |i| (h, i))).map(|(h, i)| canon.qk_row(key, h, i)),
                );
            }
            rows.extend(heads(dv).map(|(jd, i)| canon.vz_row(false, vh(jd), i)));
        }
        LayerRole::DeltaZ => rows.extend(heads(dv).map(|(jd, i)| canon.vz_row(true, vh(jd), i))),
        LayerRole::DeltaB | LayerRole::DeltaA => {
            rows.extend((0..nv).map(|jd| canon.ba_row(role == LayerRole::DeltaA, vh(jd))))
        }
        LayerRole::DeltaBa => {
            let r = nv / nk;
            for h in 0..nk {
                for alpha in [false, true] {
                    rows.extend((0..r).map(|v| canon.ba_row(alpha, vh(h * r + v))));
                }
            }
        }
        _ => unreachable!("{role:?} is not a DeltaNet input projection"),
    }
    rows
}

/// The DeltaNet tensors of layer `layer_idx` as a GGUF file of `a` stores them, each as parts of
/// canonical tensors. `c` is the canonical (Hugging Face) config; `None` when the layer is not a
/// DeltaNet layer.
pub(super) fn delta_parts(
    c: &ModelConfig,
    a: &Adapter,
    layer_idx: usize,
) -> Option<Vec<(LayerRole, Vec<Canonical>)>> {
    let hf = (a.layer)(c, layer_idx);
    let Mixer::GatedDeltaNet(d) = hf.mixer else { return None };
    let (projections, v_heads) = a.hybrid.gguf_delta_net.expect("GGUF-capable hybrid");
    let g = DeltaNetSpec { projections, v_heads, ..d };
    let canon = CanonicalLayout { d };
    let part = |role: LayerRole| {
        let key = naming::hf_layer(a.hf_naming, layer_idx, role);
        canonical_2d(key, &expected_layer_shape(c, &hf, role), layer_init(c, role), layer_idx)
    };
    let v_channels: Arc<[usize]> = (0..d.n_v_heads)
        .flat_map(|jd| (0..d.v_head_dim).map(move |i| canonical_v_head(&d, v_heads, jd) * d.v_head_dim + i))
        .collect();
    let v_heads_pick: Arc<[usize]> = (0..d.n_v_heads).map(|jd| canonical_v_head(&d, v_heads, jd)).collect();
    let mut out = Vec::new();
    for &role in naming::delta_input_roles(projections) {
        out.push((role, picked_parts(&disk_rows(&canon, &g, role), &part)));
    }
    let mut conv = part(LayerRole::DeltaConv);
    let qk = 2 * d.key_dim();
    conv.rows = RowMap::Pick((0..qk).chain(v_channels.iter().map(|&ch| qk + ch)).collect());
    out.push((LayerRole::DeltaConv, vec![conv]));
    for role in [LayerRole::DeltaDtBias, LayerRole::DeltaALog] {
        let mut p = part(role);
        p.cols = Some(v_heads_pick.clone());
        if role == LayerRole::DeltaALog {
            p.value = ValueMap::NegExp;
        }
        out.push((role, vec![p]));
    }
    out.push((LayerRole::DeltaNorm, vec![part(LayerRole::DeltaNorm)]));
    let mut o = part(LayerRole::DeltaOut);
    o.cols = Some(v_channels);
    out.push((LayerRole::DeltaOut, vec![o]));
    Some(out)
}

/// Consecutive rows from one canonical tensor become one part picking them.
fn picked_parts(rows: &[(LayerRole, usize)], part: &dyn Fn(LayerRole) -> Canonical) -> Vec<Canonical> {
    let mut parts = Vec::new();
    let mut start = 0;
    for end in 1..=rows.len() {
        if end == rows.len() || rows[end].0 != rows[start].0 {
            let mut p = part(rows[start].0);
            p.rows = RowMap::Pick(rows[start..end].iter().map(|&(_, r)| r).collect());
            parts.push(p);
            start = end;
        }
    }
    parts
}

/// The multi-token-prediction layers llama.cpp's converter appends after the last layer
/// (`blk.{n_layers + m}`): a layer of the model's attention with its MoE (a hybrid's gated
/// attention, GLM-4.5's biased GQA with its sigmoid-routed experts and shared expert), plus the
/// NextN projection of `[embedding | hidden]` and its three norms. A forward pass loads and
/// skips them.
pub(super) fn mtp_tensors(c: &ModelConfig, opts: &SynthOptions) -> Vec<PlannedTensor> {
    let a = opts.adapter;
    // The layer the MTP block copies the kinds of: a hybrid's first full-attention layer, else
    // the last layer (a MoE layer: dense layers lead).
    let full = match &c.hybrid {
        Some(h) => h.full_attention_layers.first().copied(),
        None => c.n_layers.checked_sub(1),
    };
    let Some(full) = full.filter(|_| c.mtp_layers > 0) else {
        return Vec::new();
    };
    let spec = (a.layer)(c, full);
    let mut plan = Vec::new();
    let push = |plan: &mut Vec<PlannedTensor>, name: String, part: Canonical, dtype: DType| {
        let shape = if part.n_rows == 1 { vec![part.n_cols] } else { vec![part.n_rows, part.n_cols] };
        let dtype =
            if part.n_rows == 1 || name.ends_with("ffn_gate_inp.weight") { DType::F32 } else { dtype };
        plan.push(PlannedTensor { name, dtype, shape, parts: vec![part], layout: Layout::Rows });
    };
    for m in 0..c.mtp_layers {
        let l = c.n_layers + m;
        for role in required_layer_roles(&spec) {
            // Seeded by this layer's own names; the router draws its skew from layer `full`.
            let key = naming::hf_layer(a.hf_naming, l, role);
            let mut part =
                canonical_2d(key, &expected_layer_shape(c, &spec, role), layer_init(c, role), full);
            if c.zero_centred_norms && role.is_centred_norm() {
                part.value = ValueMap::PlusOne;
            }
            push(&mut plan, naming::gguf_layer(a, l, role), part, opts.dtype);
        }
        for proj in ExpertProj::ALL {
            let parts: Vec<Canonical> = (0..c.n_experts).map(|e| expert_part(c, a, l, e, proj)).collect();
            let shape = vec![c.n_experts, parts[0].n_rows, parts[0].n_cols];
            let name = naming::gguf_experts(l, proj);
            plan.push(PlannedTensor { name, dtype: opts.dtype, shape, parts, layout: Layout::Rows });
        }
        let nextn = |what: &str| format!("blk.{l}.nextn.{what}.weight");
        let eh = canonical_2d(nextn("eh_proj"), &[c.hidden, 2 * c.hidden], layer_init(c, LayerRole::Q), full);
        push(&mut plan, nextn("eh_proj"), eh, opts.dtype);
        for norm in ["enorm", "hnorm", "shared_head_norm"] {
            let part = canonical_2d(nextn(norm), &[c.hidden], Init::NormWeight, full);
            push(&mut plan, nextn(norm), part, DType::F32);
        }
    }
    plan
}
