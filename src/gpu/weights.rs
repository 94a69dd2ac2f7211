//! Non-expert weights on the device: embeddings, norms, attention, router, shared expert,
//! lm_head. Matrices of float files are stored as bf16 (bf16 copied bit-exactly, f16/f32 rounded
//! to nearest even); quantized matrices keep their GGUF blocks exactly as the file stores them (a
//! 4-bit matrix costs 4-bit VRAM; the decode GEMV and the embedding lookup dequantize in
//! registers, exactly as the CPU; prefill dequantizes row ranges to bf16 for cuBLAS). Norm
//! weights and biases stay f32.

use super::GpuError;
use crate::format::dtype::DType;
use crate::format::tensor::{TensorError, TensorRef};
use crate::model::arch::{
    AttentionSpec, DeltaNetProjections, DeltaNetSpec, Ffn, LatentAttentionSpec, Mixer, RopeSpec,
};
use crate::model::naming::{GlobalRole, LayerRole};
use crate::model::Model;
use crate::moe::expert_math::kernel_dtype;
use half::bf16;
use moe_lanes_kernels::cuda::{CudaBackend, DeviceBuffer, TypedWeights};
use moe_lanes_kernels::quant::widen_blocks;
use moe_lanes_kernels::WeightDType;
use std::borrow::Cow;

/// A weight matrix on the device in its stored type (bf16 or GGUF blocks).
pub(crate) struct DevMatrix {
    buf: DeviceBuffer<u8>,
    dtype: WeightDType,
}

impl DevMatrix {
    pub fn view(&self) -> TypedWeights {
        TypedWeights { bytes: self.buf.ptr(), dtype: self.dtype }
    }
}

/// A gated FFN: a MoE layer's shared expert (scaled by `sigmoid(gate_logit · x)` when it has
/// that gate, Qwen2-MoE; added as it is otherwise, DeepSeek-V3 / GLM-4.5), or a dense layer's FFN
/// (`gate_logit` none).
pub(crate) struct SharedWeights {
    pub gate: DevMatrix,
    pub up: DevMatrix,
    pub down: DevMatrix,
    pub gate_logit: Option<DevMatrix>,
}

pub(crate) struct LayerWeights {
    pub attn_norm: DeviceBuffer<f32>,
    pub mixer: MixerWeights,
    pub ffn_norm: DeviceBuffer<f32>,
    /// A MoE layer's router (none for a dense FFN layer).
    pub router: Option<DevMatrix>,
    /// Added to the router's logits before the top-k (GPT-OSS).
    pub router_bias: Option<DeviceBuffer<f32>>,
    /// Added to a sigmoid router's scores for the choice only (DeepSeek-V3, GLM-4.5).
    pub selection_bias: Option<DeviceBuffer<f32>>,
    pub shared: Option<SharedWeights>,
    /// A dense FFN layer's gate, up and down (DeepSeek-V3's and GLM-4.5's leading layers).
    pub dense: Option<SharedWeights>,
    /// Gemma 4's sandwich norms, output scalar and router extras (all none elsewhere).
    pub extras: LayerExtras,
}

/// A layer's vectors beside the usual norms (Gemma 4; see `src/model/arch/gemma4.rs`), f32.
#[derive(Default)]
pub(crate) struct LayerExtras {
    /// The post norms of the mixer's and the FFN's outputs (`LayerSpec::post_norms`).
    pub post_norms: Option<[DeviceBuffer<f32>; 2]>,
    /// The learned scalar on the layer's output (`LayerSpec::output_scale`).
    pub output_scale: Option<f32>,
    /// The router's input scale times `hidden^-0.5`, the weight of the weightless RMSNorm of the
    /// residual that the router reads (`RouterSpec::scaled_input`).
    pub router_input_scale: Option<DeviceBuffer<f32>>,
    /// The per-expert scale on the routing weights after the top-k
    /// (`RouterSpec::per_expert_scale`).
    pub router_expert_scale: Option<DeviceBuffer<f32>>,
    /// `MoeSpec::branch_norms`: the shared branch's post norm, the experts' pre and post norms.
    pub branch_norms: Option<[DeviceBuffer<f32>; 3]>,
}

impl LayerExtras {
    /// Something is applied to the layer's MoE output before or after it joins the residual
    /// stream (the hot lane cannot accumulate into the residual straight).
    pub fn around_output(&self) -> bool {
        self.post_norms.is_some() || self.output_scale.is_some() || self.branch_norms.is_some()
    }

    fn upload(model: &Model, l: usize, be: &CudaBackend) -> Result<LayerExtras, GpuError> {
        let spec = model.layer_spec(l);
        let moe = spec.as_moe();
        let wanted = spec.post_norms
            || spec.output_scale
            || moe.is_some_and(|m| m.router.scaled_input || m.router.per_expert_scale || m.branch_norms);
        if !wanted {
            return Ok(LayerExtras::default());
        }
        let v = crate::moe::dense::LayerVectors::load(model, l)?;
        let one = |x: &Vec<f32>| be.upload(x).map_err(GpuError::from);
        let three = |[a, b, c]: &[Vec<f32>; 3]| -> Result<_, GpuError> { Ok([one(a)?, one(b)?, one(c)?]) };
        Ok(LayerExtras {
            post_norms: v
                .post_norms
                .as_ref()
                .map(|[a, b]| Ok::<_, GpuError>([one(a)?, one(b)?]))
                .transpose()?,
            output_scale: v.output_scale,
            router_input_scale: v.router_input_scale.as_ref().map(one).transpose()?,
            router_expert_scale: v.router_expert_scale.as_ref().map(one).transpose()?,
            branch_norms: v.branch_norms.as_ref().map(three).transpose()?,
        })
    }
}

impl LayerWeights {
    /// A MoE layer's router (the caller walks the plan: this is a MoE layer).
    pub fn router(&self) -> TypedWeights {
        self.router.as_ref().expect("the plan says MoE").view()
    }
}

impl LayerWeights {
    /// An attention layer's weights (the caller walks the plan: this is an attention layer).
    pub fn attention(&self) -> &AttentionWeights {
        match &self.mixer {
            MixerWeights::Attention(a) => a,
            _ => unreachable!("the plan says attention"),
        }
    }

    /// A latent attention layer's weights (the caller walks the plan: this is one).
    pub fn latent(&self) -> &LatentWeights {
        match &self.mixer {
            MixerWeights::Latent(w) => w,
            _ => unreachable!("the plan says latent attention"),
        }
    }
}

pub(crate) enum MixerWeights {
    // Boxed: an attention layer's weights are several hundred bytes of handles, a DeltaNet
    // layer's fewer; one box per layer, read through a reference every call.
    Attention(Box<AttentionWeights>),
    DeltaNet(Box<DeltaNetWeights>),
    Latent(Box<LatentWeights>),
}

/// A latent attention layer (DeepSeek-V3, Kimi K2): q through `q_a`, its norm and `q_b`, or a
/// plain `q`; `kv_a` (`[kv_lora_rank + rope, hidden]`) and the latent's norm; each head's `k_b`
/// and `v_b` as bf16 (`[heads, rank, nope]`, `[heads, v, rank]`: the per-head kernels read bf16;
/// a quantized file's are dequantized at upload); `o`.
pub(crate) struct LatentWeights {
    pub q_a: Option<DevMatrix>,
    pub q_a_norm: Option<DeviceBuffer<f32>>,
    /// `q_b` after `q_a`, or the plain `q`.
    pub q: DevMatrix,
    pub kv_a: DevMatrix,
    pub kv_a_norm: DeviceBuffer<f32>,
    pub k_b: DeviceBuffer<u16>,
    pub v_b: DeviceBuffer<u16>,
    pub o: DevMatrix,
    /// YaRN's table and attention factor, as [`AttentionWeights::rope_freqs`].
    pub rope_freqs: Option<(DeviceBuffer<f64>, f32)>,
}

pub(crate) struct AttentionWeights {
    /// The query rows (a gated checkpoint's `[query | gate]` per head, split at upload).
    pub q: DevMatrix,
    /// The output gate's rows of a gated attention layer.
    pub q_gate: Option<DevMatrix>,
    pub k: DevMatrix,
    /// None: the values are the k projection's output (`AttentionSpec::values_from_keys`).
    pub v: Option<DevMatrix>,
    pub o: DevMatrix,
    pub q_bias: Option<DeviceBuffer<f32>>,
    pub k_bias: Option<DeviceBuffer<f32>>,
    pub v_bias: Option<DeviceBuffer<f32>>,
    /// The per-head q norm's weight; times `scale * sqrt(head_dim)` for a layer with its own
    /// score scale (`AttentionSpec::scale`, Gemma 4's 1.0), which the kernels' `1/sqrt(head_dim)`
    /// then gives back (RoPE is linear, so the scale passes through it).
    pub q_norm: Option<DeviceBuffer<f32>>,
    pub k_norm: Option<DeviceBuffer<f32>>,
    /// Ones of `head_dim`: the weight of the weightless RMSNorm of each value head
    /// (`AttentionSpec::v_norm`).
    pub v_norm: Option<DeviceBuffer<f32>>,
    /// Added to the o projection's output (GPT-OSS).
    pub o_bias: Option<DeviceBuffer<f32>>,
    /// One learned logit per query head joining each row's softmax (GPT-OSS).
    pub sinks: Option<DeviceBuffer<f32>>,
    /// YaRN's inverse frequency per rotated pair (f64, the reference's values) and its factor
    /// on sin and cos, or a proportional RoPE's (`RopeSpec::turning_pairs`: `theta^(-2i/rot)` for
    /// the turning pairs, 0 after them, factor 1); none for plain `theta^(-2i/rot)` RoPE.
    pub rope_freqs: Option<(DeviceBuffer<f64>, f32)>,
}

/// A Gated DeltaNet layer: its input projections put in the kernels' order at upload, whatever
/// the checkpoint's (grouped per key head, or split).
pub(crate) struct DeltaNetWeights {
    /// `[q | k | v | z]` rows: `[conv_dim + value_dim, hidden]`.
    pub qkvz: DevMatrix,
    /// `[b | a]` rows: `[2 v_heads, hidden]`.
    pub ba: DevMatrix,
    /// `[conv_dim, kernel]`
    pub conv: DeviceBuffer<f32>,
    pub dt_bias: DeviceBuffer<f32>,
    /// `-exp(A_log)`
    pub neg_a: DeviceBuffer<f32>,
    pub norm: DeviceBuffer<f32>,
    pub out: DevMatrix,
}

pub(crate) struct DenseWeights {
    /// The embedding table in its stored type (the lookup decodes quantized rows exactly): on
    /// the device that runs the embedding, and on the one that runs the head when the lm_head is
    /// tied to it.
    embed: Option<DevMatrix>,
    /// The final norm and the lm_head, on the device that runs the head.
    head: Option<HeadWeights>,
    /// Layers `first..first + layers.len()`: the device's own.
    layers: Vec<LayerWeights>,
    first: usize,
    /// Bytes of the matrices on the device.
    pub matrix_bytes: usize,
    /// Elements of the largest quantized matrix (0: none), for the prefill dequantization
    /// scratch.
    pub max_quantized_elems: usize,
}

/// bf16 bit patterns of a tensor (bf16 copied exactly; f16/f32 and dequantized blocks rounded to
/// nearest even).
pub(crate) fn bf16_bits(t: TensorRef<'_>) -> Result<Vec<u16>, GpuError> {
    match t.dtype {
        DType::BF16 => {
            let n = t.n_elems();
            if t.data.len() != 2 * n {
                return Err(TensorError::SizeMismatch {
                    name: t.name.into(),
                    dtype: t.dtype,
                    shape: t.shape.to_vec(),
                    n_bytes: t.data.len(),
                }
                .into());
            }
            Ok(t.data.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]])).collect())
        }
        DType::F16
        | DType::F32
        | DType::Q8_0
        | DType::Q4_0
        | DType::Q4_K
        | DType::Q5_K
        | DType::Q6_K
        | DType::MXFP4
        | DType::Q5_0
        | DType::Q5_1
        | DType::IQ4_NL => Ok(t.to_f32_vec()?.into_iter().map(|v| bf16::from_f32(v).to_bits()).collect()),
    }
}

/// The type a tensor is stored in on the device: its own when quantized, bf16 otherwise.
pub(crate) fn stored_dtype(dtype: DType) -> WeightDType {
    match dtype {
        DType::Q8_0
        | DType::Q4_0
        | DType::Q4_K
        | DType::Q5_K
        | DType::Q6_K
        | DType::MXFP4
        | DType::Q5_0
        | DType::Q5_1
        | DType::IQ4_NL => kernel_dtype(dtype),
        _ => WeightDType::BF16,
    }
}

/// A tensor's bytes as the device stores them ([`stored_dtype`]): quantized blocks borrowed
/// from the file (length checked), bf16 bit patterns otherwise.
pub(crate) fn stored_bytes<'t>(t: TensorRef<'t>) -> Result<std::borrow::Cow<'t, [u8]>, GpuError> {
    if stored_dtype(t.dtype) == WeightDType::BF16 {
        return Ok(std::borrow::Cow::Owned(bytemuck::cast_slice(&bf16_bits(t)?).to_vec()));
    }
    if t.dtype.bytes_for(t.n_elems()) != Some(t.data.len()) {
        return Err(TensorError::SizeMismatch {
            name: t.name.into(),
            dtype: t.dtype,
            shape: t.shape.to_vec(),
            n_bytes: t.data.len(),
        }
        .into());
    }
    Ok(std::borrow::Cow::Borrowed(t.data))
}

struct Uploader<'b> {
    be: &'b CudaBackend,
    matrix_bytes: usize,
    max_quantized_elems: usize,
}

impl Uploader<'_> {
    /// A matrix in its stored type.
    fn mat(&mut self, t: TensorRef<'_>) -> Result<DevMatrix, GpuError> {
        let dtype = stored_dtype(t.dtype);
        if dtype.is_quantized() {
            self.max_quantized_elems = self.max_quantized_elems.max(t.n_elems());
        }
        self.upload(&stored_bytes(t)?, dtype)
    }
    fn upload(&mut self, bytes: &[u8], dtype: WeightDType) -> Result<DevMatrix, GpuError> {
        let buf = self.be.upload(bytes)?;
        self.matrix_bytes += buf.bytes();
        Ok(DevMatrix { buf, dtype })
    }
    fn vec(&self, t: TensorRef<'_>) -> Result<DeviceBuffer<f32>, GpuError> {
        Ok(self.be.upload(&t.to_f32_vec()?)?)
    }

    /// Layer `l`'s RMSNorm weight `role` as the scale the kernels multiply by
    /// ([`Model::norm_weight`]); `None` for a role the layer lacks.
    fn norm(&self, model: &Model, l: usize, role: LayerRole) -> Result<Option<DeviceBuffer<f32>>, GpuError> {
        model.norm_weight(l, role)?.map(|w| Ok(self.be.upload(&w)?)).transpose()
    }

    /// One matrix of the given rows of `parts` in order (`(tensor, rows)`): in the tensors'
    /// stored type when they share it or the others widen into it exactly
    /// ([`widen_blocks`]: Q4_K_M's Q5_K `attn_qkv` beside its Q4_K `attn_gate`), else all as bf16.
    fn rows(&mut self, parts: &[(TensorRef<'_>, Vec<usize>)]) -> Result<DevMatrix, GpuError> {
        let (dtype, stored) = match common_blocks(parts)? {
            Some(found) => found,
            None => {
                let bf16 = |(t, _): &(TensorRef<'_>, _)| {
                    Ok(Cow::Owned(bytemuck::cast_slice(&bf16_bits(*t)?).to_vec()))
                };
                (WeightDType::BF16, parts.iter().map(bf16).collect::<Result<Vec<_>, GpuError>>()?)
            }
        };
        let mut bytes = Vec::new();
        for ((t, rows), stored) in parts.iter().zip(&stored) {
            let row_bytes = stored.len() / t.shape[0];
            for &r in rows {
                bytes.extend_from_slice(&stored[r * row_bytes..(r + 1) * row_bytes]);
            }
        }
        if dtype.is_quantized() {
            let elems = parts.iter().map(|(t, rows)| rows.len() * t.shape[1..].iter().product::<usize>());
            self.max_quantized_elems = self.max_quantized_elems.max(elems.sum());
        }
        self.upload(&bytes, dtype)
    }
}

/// One block type and every part's stored bytes in it.
type CommonBlocks<'t> = (WeightDType, Vec<Cow<'t, [u8]>>);

/// The stored bytes of every part in one quantized type that all of them take exactly (a part's
/// own type as it is, the others widened into it: [`widen_blocks`]), or None (bf16 then: a float
/// part, or types without an exact widening).
fn common_blocks<'t>(parts: &[(TensorRef<'t>, Vec<usize>)]) -> Result<Option<CommonBlocks<'t>>, GpuError> {
    let types: Vec<WeightDType> = parts.iter().map(|(t, _)| stored_dtype(t.dtype)).collect();
    if !types.iter().all(|t| t.is_quantized()) {
        return Ok(None);
    }
    'target: for &to in &types {
        let mut stored = Vec::with_capacity(parts.len());
        for ((t, _), &from) in parts.iter().zip(&types) {
            let bytes = stored_bytes(*t)?;
            if from == to {
                stored.push(bytes);
                continue;
            }
            let Some(wide) = widen_blocks(from, to, &bytes) else { continue 'target };
            stored.push(Cow::Owned(wide));
        }
        return Ok(Some((to, stored)));
    }
    Ok(None)
}

/// The head's weights: the final norm and the lm_head (`None`: tied, the embedding is the
/// lm_head).
pub(crate) struct HeadWeights {
    pub final_norm: DeviceBuffer<f32>,
    pub lm_head: Option<DevMatrix>,
}

/// Which ends of the model a device runs beside its layers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Ends {
    pub embed: bool,
    pub head: bool,
}

impl DenseWeights {
    /// The weights of `layers` and of the `ends` a device runs (one device: every layer, both
    /// ends).
    pub fn upload(
        model: &Model,
        be: &CudaBackend,
        layers: std::ops::Range<usize>,
        ends: Ends,
    ) -> Result<DenseWeights, GpuError> {
        let mut up = Uploader { be, matrix_bytes: 0, max_quantized_elems: 0 };
        let output = model.global(GlobalRole::Output);
        let embed = (ends.embed || (ends.head && output.is_none()))
            .then(|| up.mat(model.global(GlobalRole::TokenEmbedding).expect("validated at open")))
            .transpose()?;
        let head = match ends.head {
            true => Some(HeadWeights {
                final_norm: be.upload(&model.output_norm_weight()?)?,
                lm_head: output.map(|t| up.mat(t)).transpose()?,
            }),
            false => None,
        };
        let first = layers.start;
        let layers = layers.map(|l| upload_layer(model, l, &mut up)).collect::<Result<_, _>>()?;
        let (matrix_bytes, max_quantized_elems) = (up.matrix_bytes, up.max_quantized_elems);
        Ok(DenseWeights { embed, head, layers, first, matrix_bytes, max_quantized_elems })
    }

    /// Layer `l`'s weights (one of the device's layers).
    pub fn layer(&self, l: usize) -> &LayerWeights {
        &self.layers[l - self.first]
    }

    /// The embedding table (the device runs the embedding, or a head tied to it).
    pub fn embed(&self) -> TypedWeights {
        self.embed.as_ref().expect("the device that runs the embedding holds it").view()
    }

    /// The final norm and the lm_head (the device runs the head).
    pub fn head(&self) -> (&DeviceBuffer<f32>, TypedWeights) {
        let h = self.head.as_ref().expect("the device that runs the head holds it");
        (&h.final_norm, h.lm_head.as_ref().map_or_else(|| self.embed(), DevMatrix::view))
    }
}

fn upload_layer(model: &Model, l: usize, up: &mut Uploader<'_>) -> Result<LayerWeights, GpuError> {
    let req = |r| model.required(l, r);
    let spec = model.layer_spec(l);
    let shared = match spec.shared_expert() {
        Some(s) => Some(SharedWeights {
            gate: up.mat(req(LayerRole::SharedGate))?,
            up: up.mat(req(LayerRole::SharedUp))?,
            down: up.mat(req(LayerRole::SharedDown))?,
            gate_logit: if s.gated { Some(up.mat(req(LayerRole::SharedExpertGate))?) } else { None },
        }),
        None => None,
    };
    let dense = match spec.ffn {
        Ffn::Dense(_) => Some(SharedWeights {
            gate: up.mat(req(LayerRole::DenseGate))?,
            up: up.mat(req(LayerRole::DenseUp))?,
            down: up.mat(req(LayerRole::DenseDown))?,
            gate_logit: None,
        }),
        Ffn::Moe(_) => None,
    };
    let opt_vec = |up: &Uploader<'_>, r| model.layer(l, r).map(|t| up.vec(t)).transpose();
    let norm = |up: &Uploader<'_>, r| up.norm(model, l, r);
    let mixer = match model.layer_spec(l).mixer {
        Mixer::Attention(a) => MixerWeights::Attention(Box::new(upload_attention(model, l, &a, up)?)),
        Mixer::GatedDeltaNet(d) => MixerWeights::DeltaNet(Box::new(upload_delta_net(model, l, &d, up)?)),
        Mixer::LatentAttention(m) => MixerWeights::Latent(Box::new(upload_latent(model, l, &m, up)?)),
    };
    Ok(LayerWeights {
        attn_norm: norm(up, LayerRole::AttnNorm)?.expect("validated at open"),
        mixer,
        ffn_norm: norm(up, LayerRole::FfnNorm)?.expect("validated at open"),
        router: if dense.is_none() { Some(up.mat(req(LayerRole::Router))?) } else { None },
        router_bias: opt_vec(up, LayerRole::RouterBias)?,
        selection_bias: opt_vec(up, LayerRole::RouterSelectionBias)?,
        shared,
        dense,
        extras: LayerExtras::upload(model, l, up.be)?,
    })
}

fn upload_attention(
    model: &Model,
    l: usize,
    a: &AttentionSpec,
    up: &mut Uploader<'_>,
) -> Result<AttentionWeights, GpuError> {
    let req = |r| model.required(l, r);
    let opt_vec = |up: &Uploader<'_>, r| model.layer(l, r).map(|t| up.vec(t)).transpose();
    let norm = |up: &Uploader<'_>, r| up.norm(model, l, r);
    let (q, q_gate) = if a.output_gate {
        // `[query | gate]` per head: the query rows, then the gate rows, apart.
        let hd = a.head_dim;
        let heads = req(LayerRole::Q).shape[0] / (2 * hd);
        let rows = |off: usize| (0..heads).flat_map(|h| (0..hd).map(move |i| 2 * h * hd + off + i)).collect();
        (up.rows(&[(req(LayerRole::Q), rows(0))])?, Some(up.rows(&[(req(LayerRole::Q), rows(hd))])?))
    } else {
        (up.mat(req(LayerRole::Q))?, None)
    };
    Ok(AttentionWeights {
        q,
        q_gate,
        k: up.mat(req(LayerRole::K))?,
        v: if a.values_from_keys { None } else { Some(up.mat(req(LayerRole::V))?) },
        o: up.mat(req(LayerRole::O))?,
        q_bias: opt_vec(up, LayerRole::QBias)?,
        k_bias: opt_vec(up, LayerRole::KBias)?,
        v_bias: opt_vec(up, LayerRole::VBias)?,
        q_norm: match (a.scale, model.norm_weight(l, LayerRole::QNorm)?) {
            (Some(scale), Some(w)) => {
                let by = scale * (a.head_dim as f32).sqrt();
                Some(up.be.upload(&w.iter().map(|x| x * by).collect::<Vec<f32>>())?)
            }
            _ => norm(up, LayerRole::QNorm)?,
        },
        k_norm: norm(up, LayerRole::KNorm)?,
        v_norm: if a.v_norm { Some(up.be.upload(&vec![1f32; a.head_dim])?) } else { None },
        o_bias: opt_vec(up, LayerRole::OBias)?,
        sinks: opt_vec(up, LayerRole::Sinks)?,
        rope_freqs: a.rope.needs_table().then(|| rope_table(up.be, &a.rope)).transpose()?,
    })
}

fn upload_latent(
    model: &Model,
    l: usize,
    m: &LatentAttentionSpec,
    up: &mut Uploader<'_>,
) -> Result<LatentWeights, GpuError> {
    let req = |r| model.required(l, r);
    let (q_a, q_a_norm, q) = match m.q_lora_rank {
        Some(_) => (
            Some(up.mat(req(LayerRole::MlaQA))?),
            Some(up.norm(model, l, LayerRole::MlaQANorm)?.expect("validated at open")),
            up.mat(req(LayerRole::MlaQB))?,
        ),
        None => (None, None, up.mat(req(LayerRole::Q))?),
    };
    let (k_b, v_b) = model.mla_kv_b(l);
    let mut per_head = |t: TensorRef<'_>| -> Result<DeviceBuffer<u16>, GpuError> {
        let buf = up.be.upload(&bf16_bits(t)?)?;
        up.matrix_bytes += buf.bytes();
        Ok(buf)
    };
    let (k_b, v_b) = (per_head(k_b)?, per_head(v_b)?);
    Ok(LatentWeights {
        q_a,
        q_a_norm,
        q,
        kv_a: up.mat(req(LayerRole::MlaKvA))?,
        kv_a_norm: up.norm(model, l, LayerRole::MlaKvANorm)?.expect("validated at open"),
        k_b,
        v_b,
        o: up.mat(req(LayerRole::O))?,
        rope_freqs: m.rope.needs_table().then(|| rope_table(up.be, &m.rope)).transpose()?,
    })
}

/// A RoPE's inverse frequencies (the formula every engine reads, [`RopeSpec::inv_freq`]: YaRN's,
/// linear scaling's, a proportional RoPE's) on the device, with its attention factor.
fn rope_table(be: &CudaBackend, rope: &RopeSpec) -> Result<(DeviceBuffer<f64>, f32), GpuError> {
    Ok((be.upload(&rope_freqs(rope))?, rope.attention_factor() as f32))
}

/// [`rope_table`]'s values, a pair each.
fn rope_freqs(rope: &RopeSpec) -> Vec<f64> {
    (0..rope.dims / 2).map(|i| rope.inv_freq(i)).collect()
}

fn upload_delta_net(
    model: &Model,
    l: usize,
    d: &DeltaNetSpec,
    up: &mut Uploader<'_>,
) -> Result<DeltaNetWeights, GpuError> {
    let req = |r| model.required(l, r);
    let all = |n: usize| (0..n).collect::<Vec<_>>();
    // The kernels take `[q | k | v | z]` and `[b | a]` rows, each part over every head.
    let (dk, r) = (d.k_head_dim, d.n_v_heads / d.n_k_heads);
    let pick = |start: usize, width: usize, stride: usize| -> Vec<usize> {
        (0..d.n_k_heads).flat_map(|h| (0..width).map(move |i| h * stride + start + i)).collect()
    };
    let qkvz = match d.projections {
        DeltaNetProjections::Split | DeltaNetProjections::SplitGroupedBa => up.rows(&[
            (req(LayerRole::DeltaQkv), all(d.conv_dim())),
            (req(LayerRole::DeltaZ), all(d.value_dim())),
        ])?,
        DeltaNetProjections::Grouped => {
            // Per key head: q (dk), k (dk), v (r dv), z (r dv) rows.
            let vw = r * d.v_head_dim;
            let group = 2 * dk + 2 * vw;
            let order = [
                pick(0, dk, group),
                pick(dk, dk, group),
                pick(2 * dk, vw, group),
                pick(2 * dk + vw, vw, group),
            ];
            up.rows(&[(req(LayerRole::DeltaQkvz), order.concat())])?
        }
    };
    let ba = match d.projections {
        DeltaNetProjections::Split => up.rows(&[
            (req(LayerRole::DeltaB), all(d.n_v_heads)),
            (req(LayerRole::DeltaA), all(d.n_v_heads)),
        ])?,
        // Per key head: b (r), a (r) rows.
        DeltaNetProjections::Grouped | DeltaNetProjections::SplitGroupedBa => {
            up.rows(&[(req(LayerRole::DeltaBa), [pick(0, r, 2 * r), pick(r, r, 2 * r)].concat())])?
        }
    };
    let neg_a: Vec<f32> = model.delta_a_log(l)?.iter().map(|a| -a.exp()).collect();
    Ok(DeltaNetWeights {
        qkvz,
        ba,
        conv: up.vec(req(LayerRole::DeltaConv))?,
        dt_bias: up.vec(req(LayerRole::DeltaDtBias))?,
        neg_a: up.be.upload(&neg_a)?,
        norm: up.vec(req(LayerRole::DeltaNorm))?,
        out: up.mat(req(LayerRole::DeltaOut))?,
    })
}

#[cfg(test)]
mod tests {
    use super::{common_blocks, rope_freqs};
    use crate::format::dtype::DType;
    use crate::format::tensor::TensorRef;
    use crate::model::arch::{RopeSpec, RopeStyle};
    use moe_lanes_kernels::WeightDType;

    /// Parts of two quantized types take the one the other widens into exactly (whichever comes
    /// first), each part's bytes re-encoded in it; a pair without an exact widening, or a float
    /// part, gives None (the upload's bf16).
    #[test]
    fn parts_of_two_block_types_share_the_one_both_take_exactly() {
        // every part one row of 256 values
        let part = |dtype: DType, bytes: &'static [u8]| -> (TensorRef<'static>, Vec<usize>) {
            (TensorRef { name: "t", dtype, shape: &[1, 256], data: bytes }, vec![0])
        };
        let (q4k, q5k, q6k): (&[u8], &[u8], &[u8]) = (&[3; 144], &[5; 176], &[7; 210]);
        for parts in [
            [part(DType::Q4_K, q4k), part(DType::Q5_K, q5k)],
            [part(DType::Q5_K, q5k), part(DType::Q4_K, q4k)],
        ] {
            let (dtype, stored) = common_blocks(&parts).unwrap().expect("Q4_K widens into Q5_K");
            assert_eq!(dtype, WeightDType::Q5_K);
            let q4k_as_q5k =
                moe_lanes_kernels::quant::widen_blocks(WeightDType::Q4_K, WeightDType::Q5_K, q4k);
            for ((t, _), bytes) in parts.iter().zip(&stored) {
                let want = if t.dtype == DType::Q5_K { q5k.to_vec() } else { q4k_as_q5k.clone().unwrap() };
                assert_eq!(bytes.as_ref(), want.as_slice());
            }
        }
        assert!(common_blocks(&[part(DType::Q6_K, q6k), part(DType::Q5_K, q5k)]).unwrap().is_none());
        let f32_row: &'static [u8] = &[0; 1024];
        assert!(common_blocks(&[part(DType::Q4_K, q4k), part(DType::F32, f32_row)]).unwrap().is_none());
    }

    fn rope(turning_pairs: Option<usize>, linear: Option<f32>) -> RopeSpec {
        let style = RopeStyle::HalfSplit;
        RopeSpec { style, theta: 1e6, dims: 32, yarn: None, linear, turning_pairs }
    }

    /// Gemma 4's global layers: heads of 32 turning 4 pairs at `theta^(-2i/32)`, the other 12 at
    /// frequency 0 (they stay, as the reference's `apply_rope` leaves them).
    #[test]
    fn a_proportional_rope_turns_its_first_pairs_at_the_full_heads_frequencies() {
        let f = rope_freqs(&rope(Some(4), None));
        assert_eq!(f.len(), 16);
        assert_eq!(f[0], 1.0);
        assert!((f[3] - 1e6f64.powf(-6.0 / 32.0)).abs() < 1e-15, "{}", f[3]);
        assert!(f[4..].iter().all(|&x| x == 0.0));
    }

    /// Linear scaling: every pair a quarter as fast at factor 4.
    #[test]
    fn linear_scaling_divides_every_frequency() {
        let (plain, scaled) = (rope_freqs(&rope(None, None)), rope_freqs(&rope(None, Some(4.0))));
        assert!(plain.iter().zip(&scaled).all(|(p, s)| (p / 4.0 - s).abs() < 1e-18 && *s > 0.0));
    }
}
