//! The CPU pipeline's dense stage: the non-expert weights read in place from the mapped file
//! (F32/F16/BF16 or GGML quantised blocks, no f32 copy at load) and run by the SIMD kernels of `moe-lanes-kernels` on a
//! pool of pinned threads (row-split GEMV/GEMM, attention over heads).
//!
//! Matrices are resolved per layer and call from the model (a name lookup, no copy); only the
//! small vectors (norm weights, biases, the shared expert's sigmoid gate) are decoded to f32
//! once at load. Every matrix is checked at load, so a call cannot meet a bad one.

use crate::format::tensor::{TensorError, TensorRef};
use crate::model::arch::Mixer;
use crate::model::naming::{GlobalRole, LayerRole};
use crate::model::Model;
use crate::moe::expert_math::kernel_dtype;
use moe_lanes_kernels::attention_tiled::SPLIT_BELOW_TOKENS;
use moe_lanes_kernels::{
    attention, matmul, par_attention, par_matmul, AttentionInput, AttentionScratch, ColdPool,
    DecodeActivations, DenseMatrix, KernelError, MatmulPart, SimdLevel,
};

/// Small per-layer vectors, decoded to f32 once at load.
pub(crate) struct LayerVectors {
    pub attn_norm: Vec<f32>,
    pub q_bias: Option<Vec<f32>>,
    pub k_bias: Option<Vec<f32>>,
    pub v_bias: Option<Vec<f32>>,
    pub q_norm: Option<Vec<f32>>,
    pub k_norm: Option<Vec<f32>>,
    pub ffn_norm: Vec<f32>,
    pub o_bias: Option<Vec<f32>>,
    /// One attention sink logit per query head.
    pub sinks: Option<Vec<f32>>,
    pub router_bias: Option<Vec<f32>>,
    /// The selection bias of a sigmoid router (`[n_experts]`).
    pub selection_bias: Option<Vec<f32>>,
    /// A latent attention layer's norms: `q_a`'s (low-rank q) and the latent's.
    pub latent_norms: Option<(Option<Vec<f32>>, Vec<f32>)>,
    /// The shared expert's sigmoid gate `[1, hidden]`, when the model has a gated shared expert.
    pub shared_gate_logit: Option<Vec<f32>>,
    /// A Gated DeltaNet layer's small tensors.
    pub delta_net: Option<DeltaNetVectors>,
    /// The sandwich norms of the mixer's and the FFN's outputs (`LayerSpec::post_norms`).
    pub post_norms: Option<[Vec<f32>; 2]>,
    /// The layer's output scalar (`LayerSpec::output_scale`).
    pub output_scale: Option<f32>,
    /// The router's per-channel input scale, times `hidden^-0.5` (`RouterSpec::scaled_input`).
    pub router_input_scale: Option<Vec<f32>>,
    /// The router's per-expert scale (`RouterSpec::per_expert_scale`).
    pub router_expert_scale: Option<Vec<f32>>,
    /// `MoeSpec::branch_norms`: the shared branch's post norm, the experts' pre and post norms.
    pub branch_norms: Option<[Vec<f32>; 3]>,
}

/// A Gated DeltaNet layer's vectors, as f32.
pub(crate) struct DeltaNetVectors {
    /// `[conv_dim, kernel]`
    pub conv: Vec<f32>,
    /// The same, tap-major (`[kernel, conv_dim]`): the chunked prefill's conv runs along channels.
    pub conv_taps: Vec<f32>,
    pub dt_bias: Vec<f32>,
    /// `-exp(A_log)` per value head: the decay rate.
    pub neg_a: Vec<f32>,
    /// The gated RMSNorm of a value head, `[v_head_dim]`.
    pub norm: Vec<f32>,
}

/// `[channels, kernel]` to `[kernel, channels]`.
fn taps(conv: &[f32], kernel: usize) -> Vec<f32> {
    let channels = conv.len() / kernel;
    (0..kernel * channels).map(|i| conv[(i % channels) * kernel + i / channels]).collect()
}

impl LayerVectors {
    pub fn load(model: &Model, l: usize) -> Result<LayerVectors, TensorError> {
        let req = |role| model.required(l, role).to_f32_vec();
        let opt = |role| model.layer(l, role).map(|t| t.to_f32_vec()).transpose();
        let norm = |role| model.norm_weight(l, role);
        let delta_net = match model.layer_spec(l).mixer {
            Mixer::GatedDeltaNet(d) => Some(DeltaNetVectors {
                conv_taps: taps(&req(LayerRole::DeltaConv)?, d.conv_kernel),
                conv: req(LayerRole::DeltaConv)?,
                dt_bias: req(LayerRole::DeltaDtBias)?,
                neg_a: model.delta_a_log(l)?.iter().map(|a| -a.exp()).collect(),
                norm: req(LayerRole::DeltaNorm)?,
            }),
            Mixer::Attention(_) | Mixer::LatentAttention(_) => None,
        };
        let latent_norms = match model.layer_spec(l).mixer {
            Mixer::LatentAttention(_) => {
                Some((norm(LayerRole::MlaQANorm)?, norm(LayerRole::MlaKvANorm)?.expect("validated at open")))
            }
            _ => None,
        };
        let spec = model.layer_spec(l);
        let moe = spec.as_moe();
        let root = (model.config().hidden as f32).powf(-0.5);
        let post_norms = match spec.post_norms {
            true => Some([
                req_norm(model, l, LayerRole::PostAttnNorm)?,
                req_norm(model, l, LayerRole::PostFfnNorm)?,
            ]),
            false => None,
        };
        let branch_norms = match moe.is_some_and(|m| m.branch_norms) {
            true => Some([
                req_norm(model, l, LayerRole::SharedPostNorm)?,
                req_norm(model, l, LayerRole::ExpertsNorm)?,
                req_norm(model, l, LayerRole::ExpertsPostNorm)?,
            ]),
            false => None,
        };
        Ok(LayerVectors {
            post_norms,
            branch_norms,
            output_scale: if spec.output_scale { Some(req(LayerRole::LayerScalar)?[0]) } else { None },
            router_input_scale: match moe.is_some_and(|m| m.router.scaled_input) {
                true => Some(req(LayerRole::RouterInputScale)?.iter().map(|s| s * root).collect()),
                false => None,
            },
            router_expert_scale: match moe.is_some_and(|m| m.router.per_expert_scale) {
                true => Some(req(LayerRole::RouterExpertScale)?),
                false => None,
            },
            selection_bias: opt(LayerRole::RouterSelectionBias)?,
            latent_norms,
            attn_norm: norm(LayerRole::AttnNorm)?.expect("validated at open"),
            q_bias: opt(LayerRole::QBias)?,
            k_bias: opt(LayerRole::KBias)?,
            v_bias: opt(LayerRole::VBias)?,
            q_norm: norm(LayerRole::QNorm)?,
            k_norm: norm(LayerRole::KNorm)?,
            ffn_norm: norm(LayerRole::FfnNorm)?.expect("validated at open"),
            o_bias: opt(LayerRole::OBias)?,
            sinks: opt(LayerRole::Sinks)?,
            router_bias: opt(LayerRole::RouterBias)?,
            delta_net,
            shared_gate_logit: if model.layer_spec(l).shared_expert().is_some_and(|s| s.gated) {
                Some(req(LayerRole::SharedExpertGate)?)
            } else {
                None
            },
        })
    }

    /// Bytes of f32 this layer holds (what the engine copies out of the file).
    pub fn f32_bytes(&self) -> usize {
        let opt = |v: &Option<Vec<f32>>| v.as_ref().map_or(0, Vec::len);
        let delta = self
            .delta_net
            .as_ref()
            .map_or(0, |d| 2 * d.conv.len() + d.dt_bias.len() + d.neg_a.len() + d.norm.len());
        4 * (delta
            + self.attn_norm.len()
            + self.ffn_norm.len()
            + opt(&self.q_bias)
            + opt(&self.k_bias)
            + opt(&self.v_bias)
            + opt(&self.q_norm)
            + opt(&self.k_norm)
            + opt(&self.o_bias)
            + opt(&self.sinks)
            + opt(&self.router_bias)
            + opt(&self.selection_bias)
            + self.latent_norms.as_ref().map_or(0, |(q, kv)| opt(q) + kv.len())
            + opt(&self.shared_gate_logit)
            + self.post_norms.as_ref().map_or(0, |n| n.iter().map(Vec::len).sum())
            + self.branch_norms.as_ref().map_or(0, |n| n.iter().map(Vec::len).sum())
            + opt(&self.router_input_scale)
            + opt(&self.router_expert_scale))
    }
}

/// A norm weight the layer's spec requires (checked at open).
fn req_norm(model: &Model, l: usize, role: LayerRole) -> Result<Vec<f32>, TensorError> {
    Ok(model.norm_weight(l, role)?.expect("validated at open"))
}

/// The matrices of one layer, in place in the mapped file.
pub(crate) struct LayerMatrices<'m> {
    pub mixer: MixerMatrices<'m>,
    /// A MoE layer's router (`None` for a dense FFN layer).
    pub router: Option<DenseMatrix<'m>>,
    /// Shared expert gate, up (`[ff, hidden]`) and down (`[hidden, ff]`).
    pub shared: Option<[DenseMatrix<'m>; 3]>,
    /// A dense FFN layer's gate, up and down.
    pub dense_ffn: Option<[DenseMatrix<'m>; 3]>,
}

impl<'m> LayerMatrices<'m> {
    pub fn resolve(model: &'m Model, l: usize) -> Result<LayerMatrices<'m>, TensorError> {
        let m = |role| in_place(model.required(l, role));
        let spec = model.layer_spec(l);
        let shared = if spec.shared_expert().is_some() {
            Some([m(LayerRole::SharedGate)?, m(LayerRole::SharedUp)?, m(LayerRole::SharedDown)?])
        } else {
            None
        };
        let dense_ffn = if spec.has_experts() {
            None
        } else {
            Some([m(LayerRole::DenseGate)?, m(LayerRole::DenseUp)?, m(LayerRole::DenseDown)?])
        };
        let router = if spec.has_experts() { Some(m(LayerRole::Router)?) } else { None };
        let mixer = match model.layer_spec(l).mixer {
            Mixer::Attention(a) => MixerMatrices::Attention {
                q: m(LayerRole::Q)?,
                k: m(LayerRole::K)?,
                v: if a.values_from_keys { None } else { Some(m(LayerRole::V)?) },
                o: m(LayerRole::O)?,
            },
            Mixer::GatedDeltaNet(d) => {
                use LayerRole::*;
                let roles = crate::model::naming::delta_input_roles(d.projections);
                let inputs = roles.iter().map(|&r| m(r)).collect::<Result<_, _>>()?;
                MixerMatrices::DeltaNet { inputs, out: m(DeltaOut)? }
            }
            Mixer::LatentAttention(a) => {
                use LayerRole::*;
                let (k_b, v_b) = model.mla_kv_b(l);
                MixerMatrices::Latent {
                    q_a: a.q_lora_rank.map(|_| m(MlaQA)).transpose()?,
                    q: m(if a.q_lora_rank.is_some() { MlaQB } else { Q })?,
                    kv_a: m(MlaKvA)?,
                    k_b: stacked(k_b, a.n_heads * a.kv_lora_rank, a.nope_dim)?,
                    v_b: stacked(v_b, a.n_heads * a.v_dim, a.kv_lora_rank)?,
                    o: m(O)?,
                }
            }
        };
        Ok(LayerMatrices { mixer, router, shared, dense_ffn })
    }
}

/// The token mixer's matrices.
pub(crate) enum MixerMatrices<'m> {
    Attention {
        q: DenseMatrix<'m>,
        k: DenseMatrix<'m>,
        /// `None`: the values are the keys' projection (`AttentionSpec::values_from_keys`).
        v: Option<DenseMatrix<'m>>,
        o: DenseMatrix<'m>,
    },
    /// The input projections as stored (grouped: `qkvz`, `ba`; split: `qkv`, `z`, `b`, `a`) and
    /// the output projection.
    DeltaNet { inputs: Vec<DenseMatrix<'m>>, out: DenseMatrix<'m> },
    /// Latent attention: `q_a` (low-rank q), `q_b` or `q`, `kv_a`, the per-head `k_b`
    /// (`heads * kv_lora_rank` rows of `nope`) and `v_b` (`heads * v` rows of `kv_lora_rank`),
    /// `o`.
    Latent {
        q_a: Option<DenseMatrix<'m>>,
        q: DenseMatrix<'m>,
        kv_a: DenseMatrix<'m>,
        k_b: DenseMatrix<'m>,
        v_b: DenseMatrix<'m>,
        o: DenseMatrix<'m>,
    },
}

/// A 3-D tensor of stacked per-head matrices as one kernel matrix of `rows x cols`.
fn stacked(t: TensorRef<'_>, rows: usize, cols: usize) -> Result<DenseMatrix<'_>, TensorError> {
    DenseMatrix::new(t.data, kernel_dtype(t.dtype), rows, cols).map_err(|_| TensorError::SizeMismatch {
        name: t.name.to_string(),
        dtype: t.dtype,
        shape: t.shape.to_vec(),
        n_bytes: t.data.len(),
    })
}

/// The token embedding and the lm_head (the embedding again when tied), in place.
pub(crate) fn global_matrices(model: &Model) -> Result<(DenseMatrix<'_>, DenseMatrix<'_>), TensorError> {
    let embedding = in_place(model.global(GlobalRole::TokenEmbedding).expect("validated at open"))?;
    Ok((embedding, in_place(model.lm_head())?))
}

/// Checks every dense matrix of the model once (dtype, 2-D shape, byte length).
pub(crate) fn check_matrices(model: &Model) -> Result<(), TensorError> {
    global_matrices(model)?;
    for l in 0..model.config().n_layers {
        LayerMatrices::resolve(model, l)?;
    }
    Ok(())
}

/// A 2-D tensor (float or quantised blocks) as a kernel matrix over its bytes.
fn in_place(t: TensorRef<'_>) -> Result<DenseMatrix<'_>, TensorError> {
    let dtype = kernel_dtype(t.dtype);
    let size_mismatch = || TensorError::SizeMismatch {
        name: t.name.to_string(),
        dtype: t.dtype,
        shape: t.shape.to_vec(),
        n_bytes: t.data.len(),
    };
    let (rows, cols) = match *t.shape {
        [rows, cols] => (rows, cols),
        [cols] => (1, cols),
        _ => return Err(size_mismatch()),
    };
    DenseMatrix::new(t.data, dtype, rows, cols).map_err(|_| size_mismatch())
}

/// Decodes row `r` of `m` into `out` (`m.cols` values): embedding lookups.
pub(crate) fn decode_row(m: &DenseMatrix<'_>, r: usize, out: &mut [f32]) {
    m.dtype.decode_row(m.row(r), out);
}

/// Smallest dense call (multiply-adds) worth waking the pool for: 2^18 is about 15-30 us of one
/// core's SIMD work, several times a pool dispatch and wake-up (a few us on idle cores, far more
/// on a loaded machine). Smaller calls (a tiny model's projections, attention over a short
/// context) run on the driver alone. It changes no bit: the kernels give the same result on
/// any number of threads.
pub const PAR_MIN_MACS: usize = 1 << 18;

/// Visible positions from which a decode call's attention (fewer than `SPLIT_BELOW_TOKENS`
/// tokens) runs split over the pool (flash-decoding: each thread a partial softmax over its key
/// ranges, one combine) instead of on the driver alone. `cargo bench --bench kernels --
/// attention_decode` (32 query / 4 KV heads of 128) on the shared 2-core development machine
/// (load 4-8) found no crossover: the 2-thread pool was 1.1x to 4x slower than one thread at
/// every length up to 8192 (its second pinned thread competes with other processes; numbers in
/// benches/RESULTS.md). 256 positions is about 100 us of one thread's work at f32, tens of an
/// idle pool's wake-up; re-measure on an idle many-core host.
pub const ATTENTION_PAR_MIN_POSITIONS: usize = 256;

/// The pool, kernel level and activations of the dense stage, and its reused attention scratch.
pub(crate) struct DenseStage {
    pool: ColdPool,
    level: SimdLevel,
    /// Of its quantised matrices: the cold lane's setting, so one engine rounds one way.
    activations: DecodeActivations,
    scratch: AttentionScratch,
}

impl DenseStage {
    pub fn new(n_threads: usize, level: SimdLevel) -> DenseStage {
        let (pool, scratch) = (ColdPool::new(n_threads.max(1)), AttentionScratch::default());
        DenseStage { pool, level, activations: DecodeActivations::F32, scratch }
    }

    /// The activations its quantised matrices take (8-bit ones where the level has VNNI).
    pub fn set_activations(&mut self, activations: DecodeActivations) {
        self.activations = activations.at(self.level);
    }

    pub fn n_threads(&self) -> usize {
        self.pool.n_threads()
    }

    /// `part.y = x · part.wᵀ` for every part, row-split over the pool.
    pub fn matmul(&mut self, x: &[f32], parts: &mut [MatmulPart<'_, '_>]) -> Result<(), KernelError> {
        let macs =
            parts.iter().map(|p| p.w.rows * p.w.cols).sum::<usize>() * x.len() / parts[0].w.cols.max(1);
        let kernels = (self.level, self.activations);
        if self.pool.n_threads() == 1 || macs < PAR_MIN_MACS {
            matmul(kernels, x, parts)
        } else {
            par_matmul(&mut self.pool, kernels, x, parts)
        }
    }

    /// Causal attention of one layer over the pool (units of token x head; a decode token's keys
    /// split into ranges over the threads from [`ATTENTION_PAR_MIN_POSITIONS`] visible positions).
    pub fn attention(&mut self, input: &AttentionInput<'_>, out: &mut [f32]) -> Result<(), KernelError> {
        let s = input.shape;
        let n_tokens = input.q.len() / (s.n_heads * s.head_dim).max(1);
        let positions = input.first_pos + n_tokens;
        // Scores and the weighted sum: 2 * head_dim multiply-adds per (token, head, position).
        let macs = input.q.len() * positions * 2;
        let small = match n_tokens < SPLIT_BELOW_TOKENS {
            true => input.window.map_or(positions, |w| w.min(positions)) < ATTENTION_PAR_MIN_POSITIONS,
            false => macs < PAR_MIN_MACS,
        };
        if self.pool.n_threads() == 1 || small {
            attention(self.level, input, &mut self.scratch, out)
        } else {
            par_attention(&mut self.pool, self.level, input, &mut self.scratch, out)
        }
    }

    /// The pool, for the cold lane that shares it ([`crate::moe::pool_lane`]).
    pub fn pool_mut(&mut self) -> &mut ColdPool {
        &mut self.pool
    }

    /// The lanes take the cores now: the pool's idle workers sleep instead of spinning.
    pub fn park(&self) {
        self.pool.park_workers();
    }
}
