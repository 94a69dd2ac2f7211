//! The reference forward pass: plain CPU arithmetic in f32, written to be obviously right rather
//! than fast. It is the oracle every faster path is tested against, so it shares the model view
//! with them but none of their arithmetic: its own matrix-vector products, norms, RoPE, attention
//! and routing.
//!
//! Tokens are processed one at a time, each appended to the KV cache and attending to every cached
//! position up to its own, which is causal attention by construction. A prefill of n tokens is n
//! such steps; decode continues from the same cache.

use crate::format::tensor::{TensorError, TensorRef};
use crate::model::arch::{
    AttentionSpec, DeltaNetProjections, DeltaNetSpec, Ffn, FfnActivation, LatentAttentionSpec, Mixer,
    MoeSpec, QkNorm, RopeSpec, RopeStyle, RouterSpec, RoutingVariant,
};
use crate::model::config::ModelConfig;
use crate::model::context::StateCheckpoints;
use crate::model::naming::{GlobalRole, LayerRole};
use crate::model::Model;

/// Why a forward call was refused or failed.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum ForwardError {
    #[error("token id {token} at position {position} is out of range: the vocabulary has {vocab} tokens")]
    TokenOutOfRange { token: u32, position: usize, vocab: usize },
    #[error("context is full: {max_positions} positions")]
    ContextFull { max_positions: usize },
    #[error("{prompt_tokens} prompt tokens + {new_tokens} new tokens exceed the context of {max_positions} positions (ask for at most {} new tokens)", max_positions.saturating_sub(*prompt_tokens))]
    TooLong { prompt_tokens: usize, new_tokens: usize, max_positions: usize },
    #[error("the prompt's {prompt_tokens} tokens leave no room for a new token in the context of {max_positions} positions: the prompt may be at most {} tokens", max_positions.saturating_sub(1))]
    PromptTooLong { prompt_tokens: usize, max_positions: usize },
    #[error("no tokens given")]
    EmptyInput,
    #[error(transparent)]
    Tensor(#[from] TensorError),
}

/// Refuse a generation that cannot fit before any work: `prompt + n_new` positions (the last
/// new token is not fed back, but a caller continuing the session needs its position).
pub fn check_generation_fits(
    prompt_tokens: usize,
    new_tokens: usize,
    max_positions: usize,
) -> Result<(), ForwardError> {
    if prompt_tokens == 0 {
        return Err(ForwardError::EmptyInput);
    }
    match prompt_tokens.checked_add(new_tokens) {
        Some(n) if n <= max_positions => Ok(()),
        // Asking for fewer new tokens would not help: say how long the prompt may be.
        _ if prompt_tokens >= max_positions => {
            Err(ForwardError::PromptTooLong { prompt_tokens, max_positions })
        }
        _ => Err(ForwardError::TooLong { prompt_tokens, new_tokens, max_positions }),
    }
}

/// Receives every routing decision the forward pass makes (for learn passes and tests).
pub trait RoutingObserver {
    fn on_route(&mut self, layer_idx: usize, position: usize, experts: &[(usize, f32)]);
    /// The routing's margin: how far the last chosen expert's score is above the best one left
    /// out, and the largest score's magnitude ([`choice_margin`]). A margin within an engine's
    /// rounding lets that engine choose the other expert, so tests skip such tokens.
    fn on_margin(&mut self, _layer_idx: usize, _position: usize, _margin: f32, _scale: f32) {}
}

/// The margin of a top-k choice over `scores` (the k-th largest minus the (k+1)-th) and the
/// largest `|score|`. For sigmoid routing the scores are the sigmoids plus the selection bias;
/// with a group limit (`topk_group` of `n_group` groups kept, as [`route_sigmoid`]) the margin is
/// the smaller of the kept groups' score over the best group left out (a near tie there swaps
/// whole groups of candidates) and the top-k margin among the kept groups' experts.
pub fn choice_margin(logits: &[f32], selection_bias: Option<&[f32]>, r: &RouterSpec) -> (f32, f32) {
    let v: Vec<f32> = match r.variant {
        RoutingVariant::Sigmoid => logits
            .iter()
            .enumerate()
            .map(|(e, &l)| sigmoid(l) + selection_bias.map_or(0.0, |b| b[e]))
            .collect(),
        _ => logits.to_vec(),
    };
    let scale = v.iter().fold(0f32, |m, x| m.max(x.abs()));
    let grouped = r.variant == RoutingVariant::Sigmoid && r.n_group > 1 && r.topk_group < r.n_group;
    let (kept, group_margin) = match grouped {
        true => kept_groups(&v, r),
        false => (v, f32::INFINITY),
    };
    (top_k_margin(kept, r.n_experts_used).min(group_margin), scale)
}

/// The k-th largest of `v` minus the (k+1)-th (infinite when all are chosen).
fn top_k_margin(mut v: Vec<f32>, k: usize) -> f32 {
    v.sort_by(|a, b| b.total_cmp(a));
    if k < v.len() {
        v[k - 1] - v[k]
    } else {
        f32::INFINITY
    }
}

/// The choice scores of the experts in the `topk_group` best groups (a group's score: the sum
/// of its two best, as [`route_sigmoid`]) and the last kept group's score over the next one's.
fn kept_groups(choice: &[f32], r: &RouterSpec) -> (Vec<f32>, f32) {
    let per = choice.len() / r.n_group;
    let mut groups: Vec<(f32, usize)> = (0..r.n_group)
        .map(|g| {
            let mut v = choice[g * per..(g + 1) * per].to_vec();
            v.sort_by(|a, b| b.total_cmp(a));
            (v[0] + v.get(1).copied().unwrap_or(0.0), g)
        })
        .collect();
    groups.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
    let margin = groups[r.topk_group - 1].0 - groups[r.topk_group].0;
    let kept =
        groups[..r.topk_group].iter().flat_map(|&(_, g)| choice[g * per..(g + 1) * per].to_vec()).collect();
    (kept, margin)
}

/// An observer that ignores everything.
pub struct NoObserver;

impl RoutingObserver for NoObserver {
    fn on_route(&mut self, _: usize, _: usize, _: &[(usize, f32)]) {}
}

/// Per-layer expert usage counts, `[layer][expert]`.
#[derive(Debug, Clone, PartialEq)]
pub struct ExpertCounts(pub Vec<Vec<u64>>);

impl RoutingObserver for ExpertCounts {
    fn on_route(&mut self, layer_idx: usize, _: usize, experts: &[(usize, f32)]) {
        for &(expert_idx, _) in experts {
            self.0[layer_idx][expert_idx] += 1;
        }
    }
}

impl ExpertCounts {
    pub fn new(n_layers: usize, n_experts: usize) -> ExpertCounts {
        ExpertCounts(vec![vec![0; n_experts]; n_layers])
    }

    /// Mean over layers of the share of routed slots that went to the most-used half of experts.
    pub fn top_half_coverage(&self) -> f64 {
        let per_layer: Vec<f64> = self
            .0
            .iter()
            .map(|counts| {
                let mut sorted = counts.clone();
                sorted.sort_unstable_by(|a, b| b.cmp(a));
                let total: u64 = sorted.iter().sum();
                let top: u64 = sorted[..sorted.len().div_ceil(2)].iter().sum();
                if total == 0 {
                    0.0
                } else {
                    top as f64 / total as f64
                }
            })
            .collect();
        per_layer.iter().sum::<f64>() / per_layer.len().max(1) as f64
    }
}

/// A session's state: per layer, what its mixer carries from one position to the next.
pub struct KvCache {
    layers: Vec<LayerState>,
    n_positions: usize,
    /// The DeltaNet layers' `(conv, matrix)` states at earlier positions, in layer order.
    checkpoints: StateCheckpoints<Vec<(Vec<f32>, Vec<f32>)>>,
}

/// One layer's part of a session.
enum LayerState {
    /// Keys and values of every position so far (`kv_dim` floats each).
    Attention { keys: Vec<f32>, values: Vec<f32> },
    /// A Gated DeltaNet layer's fixed-size state: the conv's last `kernel - 1` inputs (oldest
    /// first, `conv_dim` each) and the `[v_heads, k_head_dim, v_head_dim]` matrix state.
    DeltaNet { conv: Vec<f32>, matrix: Vec<f32> },
    /// A latent attention layer: per position its normalised latent and rotated key part
    /// (`kv_lora_rank + rope_dim` floats).
    Latent { latents: Vec<f32> },
}

impl KvCache {
    pub fn n_positions(&self) -> usize {
        self.n_positions
    }

    /// Whether a layer holds recurrent (DeltaNet) state.
    pub fn has_recurrent(&self) -> bool {
        self.layers.iter().any(|l| matches!(l, LayerState::DeltaNet { .. }))
    }

    /// Keep the recurrent layers' state at the current position, for a later [`Self::truncate`]
    /// back to it; false (nothing kept) without recurrent layers or with one there already.
    pub fn checkpoint(&mut self) -> bool {
        if !self.has_recurrent() || self.checkpoints.has(self.n_positions) {
            return false;
        }
        let state = self.layers.iter().filter_map(|l| match l {
            LayerState::DeltaNet { conv, matrix } => Some((conv.clone(), matrix.clone())),
            _ => None,
        });
        self.checkpoints.push(self.n_positions, state.collect());
        true
    }

    /// The most positions up to `n` that [`Self::truncate`] can keep: `n`, or with recurrent
    /// layers the latest checkpoint at or before it (all it holds from `n` up).
    pub fn rewind_point(&self, n: usize) -> Option<usize> {
        self.checkpoints.reach(n, self.n_positions, self.has_recurrent())
    }

    /// Keep the first `n` positions (a cached prefix reused), a recurrent layer's state from its
    /// checkpoint at `n`; false, changing nothing, where `n` is more than it holds or a recurrent
    /// state has no checkpoint there.
    pub fn truncate(&mut self, n: usize) -> bool {
        let recurrent = self.has_recurrent();
        if n > self.n_positions || (recurrent && n != self.n_positions && !self.checkpoints.has(n)) {
            return false;
        }
        if recurrent && n != self.n_positions {
            let state = self.checkpoints.rewind(n).expect("checked above");
            let delta = self.layers.iter_mut().filter_map(|l| match l {
                LayerState::DeltaNet { conv, matrix } => Some((conv, matrix)),
                _ => None,
            });
            for ((conv, matrix), (c, m)) in delta.zip(state) {
                conv.copy_from_slice(c);
                matrix.copy_from_slice(m);
            }
        }
        let old = self.n_positions;
        for layer in &mut self.layers {
            match layer {
                LayerState::Attention { keys, values } => {
                    let width = keys.len() / old.max(1);
                    keys.truncate(n * width);
                    values.truncate(n * width);
                }
                LayerState::Latent { latents } => {
                    let width = latents.len() / old.max(1);
                    latents.truncate(n * width);
                }
                LayerState::DeltaNet { .. } => {}
            }
        }
        self.n_positions = n;
        true
    }
}

/// Non-expert weights of one layer, decoded to f32 once.
struct LayerWeights {
    /// What the layer is (from the model's plan).
    mixer: Mixer,
    ffn: Ffn,
    attn_norm: Vec<f32>,
    mixer_weights: MixerWeights,
    ffn_norm: Vec<f32>,
    /// Empty for a dense FFN layer.
    router: Vec<f32>,
    router_bias: Option<Vec<f32>>,
    selection_bias: Option<Vec<f32>>,
    shared: Option<SharedExpert>,
    /// A dense FFN layer's gate, up and down.
    dense: Option<[Vec<f32>; 3]>,
    /// The sandwich norms of the mixer's and the FFN's outputs (`LayerSpec::post_norms`).
    post_norms: Option<[Vec<f32>; 2]>,
    /// The layer's output scalar (`LayerSpec::output_scale`).
    output_scale: Option<f32>,
    /// The router's input scale and per-expert scale, when it has them.
    router_input_scale: Option<Vec<f32>>,
    router_expert_scale: Option<Vec<f32>>,
    /// `MoeSpec::branch_norms`: the shared branch's post norm, the experts' pre and post norms.
    branch_norms: Option<[Vec<f32>; 3]>,
}

enum MixerWeights {
    Attention(AttentionWeights),
    DeltaNet(DeltaNetWeights),
    Latent(LatentWeights),
}

/// A latent attention layer's weights.
struct LatentWeights {
    /// `q_a` and its norm, when q is low-rank.
    q_a: Option<(Vec<f32>, Vec<f32>)>,
    /// `q_b` (low rank) or `q`.
    q: Vec<f32>,
    kv_a: Vec<f32>,
    kv_a_norm: Vec<f32>,
    /// `[heads, kv_lora_rank, nope]`
    k_b: Vec<f32>,
    /// `[heads, v, kv_lora_rank]`
    v_b: Vec<f32>,
    o: Vec<f32>,
}

struct AttentionWeights {
    q: Vec<f32>,
    k: Vec<f32>,
    /// `None`: the values are the k projection's output (`AttentionSpec::values_from_keys`).
    v: Option<Vec<f32>>,
    o: Vec<f32>,
    q_bias: Option<Vec<f32>>,
    k_bias: Option<Vec<f32>>,
    v_bias: Option<Vec<f32>>,
    q_norm: Option<Vec<f32>>,
    k_norm: Option<Vec<f32>>,
    o_bias: Option<Vec<f32>>,
    /// One sink logit per query head.
    sinks: Option<Vec<f32>>,
}

/// A DeltaNet layer's weights; the input projections as stored (see [`DeltaNetProjections`]).
struct DeltaNetWeights {
    /// Grouped: `qkvz` and `ba`; split: `qkv`, `z`, `b`, `a`.
    inputs: Vec<Vec<f32>>,
    /// `[conv_dim, kernel]`
    conv: Vec<f32>,
    dt_bias: Vec<f32>,
    a_log: Vec<f32>,
    norm: Vec<f32>,
    out: Vec<f32>,
}

struct SharedExpert {
    ff: usize,
    gate: Vec<f32>,
    up: Vec<f32>,
    down: Vec<f32>,
    /// `None`: ungated (DeepSeek-V3).
    gate_logit: Option<Vec<f32>>,
}

/// The reference engine over an opened model.
pub struct Reference<'m> {
    model: &'m Model,
    config: ModelConfig,
    embedding: Vec<f32>,
    final_norm: Vec<f32>,
    /// `None` when embeddings are tied (the embedding matrix is the lm_head).
    lm_head: Option<Vec<f32>>,
    layers: Vec<LayerWeights>,
}

fn decode(t: TensorRef<'_>) -> Result<Vec<f32>, TensorError> {
    t.to_f32_vec()
}

impl<'m> Reference<'m> {
    pub fn new(model: &'m Model) -> Result<Reference<'m>, ForwardError> {
        let config = model.config().clone();
        let embedding = decode(model.global(GlobalRole::TokenEmbedding).expect("validated"))?;
        let final_norm = model.output_norm_weight()?;
        let lm_head = model.global(GlobalRole::Output).map(decode).transpose()?;
        let layers = (0..config.n_layers).map(|l| load_layer(model, l)).collect::<Result<Vec<_>, _>>()?;
        Ok(Reference { model, config, embedding, final_norm, lm_head, layers })
    }

    pub fn new_cache(&self) -> KvCache {
        let layers = self
            .layers
            .iter()
            .map(|l| match &l.mixer {
                Mixer::Attention(_) => LayerState::Attention { keys: Vec::new(), values: Vec::new() },
                Mixer::GatedDeltaNet(d) => LayerState::DeltaNet {
                    conv: vec![0.0; d.conv_state_len()],
                    matrix: vec![0.0; d.matrix_state_len()],
                },
                Mixer::LatentAttention(_) => LayerState::Latent { latents: Vec::new() },
            })
            .collect();
        KvCache { layers, n_positions: 0, checkpoints: StateCheckpoints::default() }
    }

    /// Run `tokens` through the model after whatever `cache` holds; returns one logits row per token.
    /// Checks every token id before touching the cache, so a bad id changes nothing.
    pub fn forward(
        &self,
        cache: &mut KvCache,
        tokens: &[u32],
        observer: &mut dyn RoutingObserver,
    ) -> Result<Vec<Vec<f32>>, ForwardError> {
        self.check_tokens(cache, tokens)?;
        let mut all_logits = Vec::with_capacity(tokens.len());
        for &token in tokens {
            let hidden = self.forward_hidden(cache, token, observer)?;
            all_logits.push(self.logits(&hidden));
        }
        Ok(all_logits)
    }

    /// Like [`Reference::forward`] but without the lm_head (for routing measurements).
    pub fn forward_no_logits(
        &self,
        cache: &mut KvCache,
        tokens: &[u32],
        observer: &mut dyn RoutingObserver,
    ) -> Result<(), ForwardError> {
        self.check_tokens(cache, tokens)?;
        for &token in tokens {
            self.forward_hidden(cache, token, observer)?;
        }
        Ok(())
    }

    /// Greedy generation: prefill `prompt`, then decode `n_new` tokens one by one.
    pub fn generate(&self, prompt: &[u32], n_new: usize) -> Result<Vec<u32>, ForwardError> {
        check_generation_fits(prompt.len(), n_new, self.config.max_positions)?;
        let mut cache = self.new_cache();
        let logits = self.forward(&mut cache, prompt, &mut NoObserver)?;
        let mut next = argmax(logits.last().expect("prompt is not empty"));
        let mut generated = Vec::with_capacity(n_new);
        for i in 0..n_new {
            generated.push(next);
            if i + 1 < n_new {
                let logits = self.forward(&mut cache, &[next], &mut NoObserver)?;
                next = argmax(&logits[0]);
            }
        }
        Ok(generated)
    }

    fn check_tokens(&self, cache: &KvCache, tokens: &[u32]) -> Result<(), ForwardError> {
        if tokens.is_empty() {
            return Err(ForwardError::EmptyInput);
        }
        for (i, &token) in tokens.iter().enumerate() {
            if token as usize >= self.config.vocab {
                return Err(ForwardError::TokenOutOfRange {
                    token,
                    position: cache.n_positions + i,
                    vocab: self.config.vocab,
                });
            }
        }
        if cache.n_positions + tokens.len() > self.config.max_positions {
            return Err(ForwardError::ContextFull { max_positions: self.config.max_positions });
        }
        Ok(())
    }

    fn forward_hidden(
        &self,
        cache: &mut KvCache,
        token: u32,
        observer: &mut dyn RoutingObserver,
    ) -> Result<Vec<f32>, ForwardError> {
        let c = &self.config;
        let position = cache.n_positions;
        let row = token as usize * c.hidden;
        let mut hidden = self.embedding[row..row + c.hidden].to_vec();
        if let Some(scale) = c.embedding_scale {
            hidden.iter_mut().for_each(|x| *x *= scale);
        }
        for (layer_idx, layer) in self.layers.iter().enumerate() {
            let normed = rms_norm(&hidden, &layer.attn_norm, c.rms_eps);
            let state = &mut cache.layers[layer_idx];
            let mixed = match (&layer.mixer, &layer.mixer_weights, state) {
                (
                    Mixer::Attention(spec),
                    MixerWeights::Attention(w),
                    LayerState::Attention { keys, values },
                ) => self.attention(spec, w, keys, values, &normed, position),
                (
                    Mixer::GatedDeltaNet(spec),
                    MixerWeights::DeltaNet(w),
                    LayerState::DeltaNet { conv, matrix },
                ) => delta_net(spec, w, conv, matrix, &normed, c.rms_eps),
                (Mixer::LatentAttention(spec), MixerWeights::Latent(w), LayerState::Latent { latents }) => {
                    latent_attention(spec, w, latents, &normed, position, c.rms_eps)
                }
                _ => unreachable!("weights and state are built from the same plan"),
            };
            let post = |x: Vec<f32>, i: usize| match &layer.post_norms {
                Some(norms) => rms_norm(&x, &norms[i], c.rms_eps),
                None => x,
            };
            add_into(&mut hidden, &post(mixed, 0));
            let normed = rms_norm(&hidden, &layer.ffn_norm, c.rms_eps);
            let ffn = match (&layer.ffn, &layer.dense) {
                (Ffn::Moe(spec), _) => {
                    self.moe(spec, layer, layer_idx, &hidden, &normed, position, observer)?
                }
                (Ffn::Dense(d), Some([gate, up, down])) => ffn(gate, up, down, &normed, d.ff, d.activation),
                (Ffn::Dense(_), None) => unreachable!("dense weights are loaded for dense layers"),
            };
            add_into(&mut hidden, &post(ffn, 1));
            if let Some(scale) = layer.output_scale {
                hidden.iter_mut().for_each(|x| *x *= scale);
            }
        }
        cache.n_positions += 1;
        Ok(hidden)
    }

    fn logits(&self, hidden: &[f32]) -> Vec<f32> {
        let normed = rms_norm(hidden, &self.final_norm, self.config.rms_eps);
        let head = self.lm_head.as_deref().unwrap_or(&self.embedding);
        let mut logits = matvec(head, &normed, self.config.vocab);
        if let Some(cap) = self.config.final_logit_softcap {
            logits.iter_mut().for_each(|x| *x = cap * (*x / cap).tanh());
        }
        logits
    }

    fn attention(
        &self,
        spec: &AttentionSpec,
        w: &AttentionWeights,
        keys: &mut Vec<f32>,
        values: &mut Vec<f32>,
        x: &[f32],
        position: usize,
    ) -> Vec<f32> {
        let c = &self.config;
        let (hd, n_heads, n_kv) = (spec.head_dim, c.n_heads, spec.n_kv_heads);
        let (q_dim, kv_dim) = (spec.q_dim(n_heads), spec.kv_dim());
        let q_rows = if spec.output_gate { 2 * q_dim } else { q_dim };
        let mut q = matvec(&w.q, x, q_rows);
        let mut k = matvec(&w.k, x, kv_dim);
        let mut v = match &w.v {
            Some(wv) => matvec(wv, x, kv_dim),
            None => k.clone(),
        };
        if spec.v_norm {
            let ones = vec![1.0; hd];
            for head in v.chunks_mut(hd) {
                let normed = rms_norm(head, &ones, c.rms_eps);
                head.copy_from_slice(&normed);
            }
        }
        for (proj, bias) in [(&mut q, &w.q_bias), (&mut k, &w.k_bias), (&mut v, &w.v_bias)] {
            if let Some(b) = bias {
                add_into(proj, b);
            }
        }
        // A gated q projection holds `[query | gate]` for each head.
        let gate: Option<Vec<f32>> = spec.output_gate.then(|| {
            let (query, gate): (Vec<&[f32]>, Vec<&[f32]>) = q.chunks(2 * hd).map(|h| h.split_at(hd)).unzip();
            let gate = gate.concat();
            q = query.concat();
            gate
        });
        match spec.qk_norm {
            QkNorm::None => {}
            QkNorm::WholeProjection => {
                q = rms_norm(&q, w.q_norm.as_ref().expect("validated"), c.rms_eps);
                k = rms_norm(&k, w.k_norm.as_ref().expect("validated"), c.rms_eps);
            }
            QkNorm::PerHead => {
                for head in q.chunks_mut(hd) {
                    let normed = rms_norm(head, w.q_norm.as_ref().expect("validated"), c.rms_eps);
                    head.copy_from_slice(&normed);
                }
                for head in k.chunks_mut(hd) {
                    let normed = rms_norm(head, w.k_norm.as_ref().expect("validated"), c.rms_eps);
                    head.copy_from_slice(&normed);
                }
            }
        }
        if let Some(clip) = spec.clip_qkv {
            for x in q.iter_mut().chain(k.iter_mut()).chain(v.iter_mut()) {
                *x = x.clamp(-clip, clip);
            }
        }
        for head in q.chunks_mut(hd).chain(k.chunks_mut(hd)) {
            apply_rope(&mut head[..spec.rope.dims], position, &spec.rope);
        }
        keys.extend_from_slice(&k);
        values.extend_from_slice(&v);
        let first_visible = match spec.window {
            Some(window) => (position + 1).saturating_sub(window),
            None => 0,
        };
        let scale = spec.softmax_scale();
        let group = n_heads / n_kv;
        let mut out = vec![0.0; q_dim];
        for head in 0..n_heads {
            let kv_head = head / group;
            let qh = &q[head * hd..(head + 1) * hd];
            let mut scores: Vec<f32> = (first_visible..=position)
                .map(|p| dot(qh, &keys[p * kv_dim + kv_head * hd..][..hd]) * scale)
                .collect();
            // A sink logit joins the softmax and is dropped: it takes probability, attends nothing.
            if let Some(sinks) = &w.sinks {
                scores.push(sinks[head]);
            }
            let probs = softmax(&scores);
            let oh = &mut out[head * hd..(head + 1) * hd];
            for (p, prob) in (first_visible..=position).zip(probs) {
                let vh = &values[p * kv_dim + kv_head * hd..][..hd];
                for (o, val) in oh.iter_mut().zip(vh) {
                    *o += prob * val;
                }
            }
        }
        if let Some(gate) = gate {
            for (o, g) in out.iter_mut().zip(&gate) {
                *o *= sigmoid(*g);
            }
        }
        let mut y = matvec(&w.o, &out, c.hidden);
        if let Some(b) = &w.o_bias {
            add_into(&mut y, b);
        }
        y
    }

    /// The MoE block over `normed` (the FFN norm's output of `residual`, the layer's input).
    #[allow(clippy::too_many_arguments)]
    fn moe(
        &self,
        spec: &MoeSpec,
        w: &LayerWeights,
        layer_idx: usize,
        residual: &[f32],
        normed: &[f32],
        position: usize,
        observer: &mut dyn RoutingObserver,
    ) -> Result<Vec<f32>, ForwardError> {
        let c = &self.config;
        let r = &spec.router;
        // The router's input: the FFN norm's output, or (Gemma 4) the residual through a
        // weightless RMSNorm times the learned scale and `hidden^-0.5`.
        let router_in = match &w.router_input_scale {
            Some(scale) => {
                let root = (c.hidden as f32).powf(-0.5);
                let ones = vec![1.0; c.hidden];
                let n = rms_norm(residual, &ones, c.rms_eps);
                n.iter().zip(scale).map(|(v, s)| v * s * root).collect()
            }
            None => normed.to_vec(),
        };
        // The experts' input: their own norm of the residual (branch norms) or the FFN norm's.
        let x = match &w.branch_norms {
            Some([_, pre, _]) => rms_norm(residual, pre, c.rms_eps),
            None => normed.to_vec(),
        };
        let x = x.as_slice();
        let mut logits = matvec(&w.router, &router_in, r.n_experts);
        if let Some(b) = &w.router_bias {
            add_into(&mut logits, b);
        }
        let (margin, scale) = choice_margin(&logits, w.selection_bias.as_deref(), r);
        observer.on_margin(layer_idx, position, margin, scale);
        let chosen = match r.variant {
            RoutingVariant::Sigmoid => route_sigmoid(&logits, w.selection_bias.as_deref(), r),
            _ => route(&logits, r.n_experts_used, r.variant, r.norm_topk_prob),
        };
        let chosen: Vec<(usize, f32)> = match &w.router_expert_scale {
            Some(s) => chosen.iter().map(|&(e, wt)| (e, wt * s[e])).collect(),
            None => chosen,
        };
        observer.on_route(layer_idx, position, &chosen);
        let mut out = vec![0.0; c.hidden];
        for &(expert_idx, weight) in &chosen {
            let e = self.model.expert(layer_idx, expert_idx);
            let (gate, up, down) = (decode(e.gate)?, decode(e.up)?, decode(e.down)?);
            let y = match self.model.expert_bias(layer_idx, expert_idx) {
                None => ffn(&gate, &up, &down, x, spec.expert_ff, spec.activation),
                Some(b) => biased_ffn([&gate, &up, &down], [b.gate, b.up, b.down], x, spec.activation),
            };
            for (o, v) in out.iter_mut().zip(&y) {
                *o += weight * v;
            }
        }
        if let Some([shared_post, _, experts_post]) = &w.branch_norms {
            // Each branch normalised, then added: the shared (dense) one reads the FFN norm's output.
            let shared = w.shared.as_ref().expect("branch norms come with the dense branch");
            let y = ffn(&shared.gate, &shared.up, &shared.down, normed, shared.ff, spec.activation);
            let mut out = rms_norm(&out, experts_post, c.rms_eps);
            add_into(&mut out, &rms_norm(&y, shared_post, c.rms_eps));
            return Ok(out);
        }
        if let Some(shared) = &w.shared {
            let y = ffn(&shared.gate, &shared.up, &shared.down, x, shared.ff, spec.activation);
            let gate = shared.gate_logit.as_ref().map_or(1.0, |g| sigmoid(dot(g, x)));
            for (o, v) in out.iter_mut().zip(&y) {
                *o += gate * v;
            }
        }
        Ok(out)
    }
}

fn load_layer(model: &Model, layer_idx: usize) -> Result<LayerWeights, TensorError> {
    let req = |role| decode(model.required(layer_idx, role));
    let norm = |role| model.norm_weight(layer_idx, role);
    let spec = *model.layer_spec(layer_idx);
    let shared = match spec.ffn {
        Ffn::Moe(MoeSpec { shared: Some(s), .. }) => Some(SharedExpert {
            ff: s.ff,
            gate: req(LayerRole::SharedGate)?,
            up: req(LayerRole::SharedUp)?,
            down: req(LayerRole::SharedDown)?,
            gate_logit: if s.gated { Some(req(LayerRole::SharedExpertGate)?) } else { None },
        }),
        Ffn::Moe(_) | Ffn::Dense(_) => None,
    };
    let dense = match spec.ffn {
        Ffn::Dense(_) => {
            Some([req(LayerRole::DenseGate)?, req(LayerRole::DenseUp)?, req(LayerRole::DenseDown)?])
        }
        Ffn::Moe(_) => None,
    };
    let mixer_weights = match &spec.mixer {
        Mixer::Attention(_) => {
            let get = |role| model.layer(layer_idx, role).map(decode).transpose();
            MixerWeights::Attention(AttentionWeights {
                q: req(LayerRole::Q)?,
                k: req(LayerRole::K)?,
                v: get(LayerRole::V)?,
                o: req(LayerRole::O)?,
                q_bias: get(LayerRole::QBias)?,
                k_bias: get(LayerRole::KBias)?,
                v_bias: get(LayerRole::VBias)?,
                q_norm: norm(LayerRole::QNorm)?,
                k_norm: norm(LayerRole::KNorm)?,
                o_bias: get(LayerRole::OBias)?,
                sinks: get(LayerRole::Sinks)?,
            })
        }
        Mixer::GatedDeltaNet(d) => {
            use LayerRole::*;
            let inputs = crate::model::naming::delta_input_roles(d.projections);
            MixerWeights::DeltaNet(DeltaNetWeights {
                inputs: inputs.iter().map(|&r| req(r)).collect::<Result<_, _>>()?,
                conv: req(DeltaConv)?,
                dt_bias: req(DeltaDtBias)?,
                a_log: model.delta_a_log(layer_idx)?,
                norm: req(DeltaNorm)?,
                out: req(DeltaOut)?,
            })
        }
        Mixer::LatentAttention(m) => {
            use LayerRole::*;
            let q_a = match m.q_lora_rank {
                Some(_) => Some((req(MlaQA)?, norm(MlaQANorm)?.expect("validated"))),
                None => None,
            };
            let (k_b, v_b) = model.mla_kv_b(layer_idx);
            MixerWeights::Latent(LatentWeights {
                q: req(if q_a.is_some() { MlaQB } else { Q })?,
                q_a,
                kv_a: req(MlaKvA)?,
                kv_a_norm: norm(MlaKvANorm)?.expect("validated"),
                k_b: decode(k_b)?,
                v_b: decode(v_b)?,
                o: req(O)?,
            })
        }
    };
    Ok(LayerWeights {
        mixer: spec.mixer,
        ffn: spec.ffn,
        attn_norm: norm(LayerRole::AttnNorm)?.expect("validated"),
        mixer_weights,
        ffn_norm: norm(LayerRole::FfnNorm)?.expect("validated"),
        router: if spec.has_experts() { req(LayerRole::Router)? } else { Vec::new() },
        router_bias: model.layer(layer_idx, LayerRole::RouterBias).map(decode).transpose()?,
        selection_bias: match spec.as_moe() {
            Some(m) if m.router.selection_bias => Some(req(LayerRole::RouterSelectionBias)?),
            _ => None,
        },
        shared,
        dense,
        post_norms: match spec.post_norms {
            true => Some([
                norm(LayerRole::PostAttnNorm)?.expect("validated"),
                norm(LayerRole::PostFfnNorm)?.expect("validated"),
            ]),
            false => None,
        },
        output_scale: match spec.output_scale {
            true => Some(req(LayerRole::LayerScalar)?[0]),
            false => None,
        },
        router_input_scale: match spec.as_moe() {
            Some(m) if m.router.scaled_input => Some(req(LayerRole::RouterInputScale)?),
            _ => None,
        },
        router_expert_scale: match spec.as_moe() {
            Some(m) if m.router.per_expert_scale => Some(req(LayerRole::RouterExpertScale)?),
            _ => None,
        },
        branch_norms: match spec.as_moe() {
            Some(m) if m.branch_norms => Some([
                norm(LayerRole::SharedPostNorm)?.expect("validated"),
                norm(LayerRole::ExpertsNorm)?.expect("validated"),
                norm(LayerRole::ExpertsPostNorm)?.expect("validated"),
            ]),
            _ => None,
        },
    })
}

/// One token through a latent attention layer, the plain (unabsorbed) form: every cached
/// latent is expanded into each head's key and value, as transformers computes them.
fn latent_attention(
    m: &LatentAttentionSpec,
    w: &LatentWeights,
    latents: &mut Vec<f32>,
    x: &[f32],
    position: usize,
    eps: f32,
) -> Vec<f32> {
    let (rank, nope, rope, vd) = (m.kv_lora_rank, m.nope_dim, m.rope_dim, m.v_dim);
    let q_in = match &w.q_a {
        Some((q_a, norm)) => rms_norm(&matvec(q_a, x, norm.len()), norm, eps),
        None => x.to_vec(),
    };
    let mut q = matvec(&w.q, &q_in, m.q_dim());
    let kv = matvec(&w.kv_a, x, rank + rope);
    let mut entry = rms_norm(&kv[..rank], &w.kv_a_norm, eps);
    let mut k_rope = kv[rank..].to_vec();
    apply_rope(&mut k_rope, position, &m.rope);
    entry.extend_from_slice(&k_rope);
    latents.extend_from_slice(&entry);
    let width = rank + rope;
    let n_pos = latents.len() / width;
    let mut out = vec![0.0; m.n_heads * vd];
    for h in 0..m.n_heads {
        let qh = &mut q[h * (nope + rope)..(h + 1) * (nope + rope)];
        apply_rope(&mut qh[nope..], position, &m.rope);
        let k_b = &w.k_b[h * rank * nope..(h + 1) * rank * nope];
        let v_b = &w.v_b[h * vd * rank..(h + 1) * vd * rank];
        let mut scores = Vec::with_capacity(n_pos);
        let mut values = Vec::with_capacity(n_pos);
        for p in 0..n_pos {
            let (latent, kr) = latents[p * width..(p + 1) * width].split_at(rank);
            // k_nope[i] = sum_c k_b[c][i] * latent[c]
            let mut k_nope = vec![0.0f32; nope];
            for (c, l) in latent.iter().enumerate() {
                for (k, b) in k_nope.iter_mut().zip(&k_b[c * nope..(c + 1) * nope]) {
                    *k += b * l;
                }
            }
            scores.push((dot(&qh[..nope], &k_nope) + dot(&qh[nope..], kr)) * m.scale);
            values.push(matvec(v_b, latent, vd));
        }
        let probs = softmax(&scores);
        let oh = &mut out[h * vd..(h + 1) * vd];
        for (prob, v) in probs.iter().zip(&values) {
            for (o, val) in oh.iter_mut().zip(v) {
                *o += prob * val;
            }
        }
    }
    matvec(&w.o, &out, x.len())
}

/// DeepSeek-V3's router: sigmoid scores; the choice adds the selection bias and keeps the best
/// `topk_group` groups (a group's score: the sum of its two best); the weights are the chosen
/// scores (renormalised, plus 1e-20 as transformers) times the scale. Ties go to the lower id.
pub fn route_sigmoid(logits: &[f32], selection_bias: Option<&[f32]>, r: &RouterSpec) -> Vec<(usize, f32)> {
    let scores: Vec<f32> = logits.iter().map(|&l| sigmoid(l)).collect();
    let choice: Vec<f32> =
        scores.iter().enumerate().map(|(e, s)| s + selection_bias.map_or(0.0, |b| b[e])).collect();
    let per = logits.len() / r.n_group;
    let group_score = |g: usize| {
        let mut v: Vec<f32> = choice[g * per..(g + 1) * per].to_vec();
        v.sort_by(|a, b| b.total_cmp(a));
        v[0] + v.get(1).copied().unwrap_or(0.0)
    };
    let mut groups: Vec<usize> = (0..r.n_group).collect();
    let gs: Vec<f32> = groups.iter().map(|&g| group_score(g)).collect();
    groups.sort_by(|&a, &b| gs[b].total_cmp(&gs[a]).then(a.cmp(&b)));
    let kept = &groups[..r.topk_group];
    let mut order: Vec<usize> = (0..logits.len()).filter(|e| kept.contains(&(e / per))).collect();
    order.sort_by(|&a, &b| choice[b].total_cmp(&choice[a]).then(a.cmp(&b)));
    let mut chosen: Vec<(usize, f32)> = order[..r.n_experts_used].iter().map(|&e| (e, scores[e])).collect();
    if r.norm_topk_prob {
        let sum: f32 = chosen.iter().map(|(_, w)| w).sum::<f32>() + 1e-20;
        chosen.iter_mut().for_each(|(_, w)| *w /= sum);
    }
    chosen.iter_mut().for_each(|(_, w)| *w *= r.scale);
    chosen
}

/// One token through a Gated DeltaNet layer, the recurrent form: the conv over the last
/// `kernel` inputs, then per value head `S <- S * exp(g); S += k (x) beta (v - S^T k); o = S^T q`.
fn delta_net(
    d: &DeltaNetSpec,
    w: &DeltaNetWeights,
    conv_state: &mut [f32],
    matrix: &mut [f32],
    x: &[f32],
    eps: f32,
) -> Vec<f32> {
    let (qkv, z, b, a) = delta_net_inputs(d, w, x);
    let mixed = causal_conv_step(&qkv, conv_state, &w.conv, d.conv_kernel);
    let (kd, dk, dv) = (d.key_dim(), d.k_head_dim, d.v_head_dim);
    let (q, rest) = mixed.split_at(kd);
    let (k, v) = rest.split_at(kd);
    let mut out = vec![0.0; d.value_dim()];
    for j in 0..d.n_v_heads {
        let kh = d.k_head_of(j);
        let mut qh = l2_normalized(&q[kh * dk..][..dk]);
        qh.iter_mut().for_each(|x| *x /= (dk as f32).sqrt());
        let kh = l2_normalized(&k[kh * dk..][..dk]);
        let vh = &v[j * dv..][..dv];
        let beta = sigmoid(b[j]);
        let g = -(w.a_log[j] as f64).exp() * softplus(a[j] as f64 + w.dt_bias[j] as f64);
        let s = &mut matrix[j * dk * dv..][..dk * dv];
        let decay = g.exp() as f32;
        s.iter_mut().for_each(|x| *x *= decay);
        // kv_mem = S^T k, then delta = beta (v - kv_mem)
        let mut delta: Vec<f32> = vh.to_vec();
        for (i, row) in s.chunks(dv).enumerate() {
            for (dl, r) in delta.iter_mut().zip(row) {
                *dl -= kh[i] * r;
            }
        }
        delta.iter_mut().for_each(|x| *x *= beta);
        for (i, row) in s.chunks_mut(dv).enumerate() {
            for (r, dl) in row.iter_mut().zip(&delta) {
                *r += kh[i] * dl;
            }
        }
        let oh = &mut out[j * dv..][..dv];
        for (i, row) in s.chunks(dv).enumerate() {
            for (o, r) in oh.iter_mut().zip(row) {
                *o += qh[i] * r;
            }
        }
        let normed = rms_norm(oh, &w.norm, eps);
        for ((o, n), zv) in oh.iter_mut().zip(normed).zip(&z[j * dv..][..dv]) {
            *o = n * activate(FfnActivation::Silu, *zv);
        }
    }
    matvec(&w.out, &out, x.len())
}

/// The layer's input projections as `(qkv, z, b, a)`: q of every key head, then k, then v of
/// every value head; a grouped projection (per key head: `q, k, v.., z..` and `b.., a..`) is
/// regrouped into that order.
fn delta_net_inputs(
    d: &DeltaNetSpec,
    w: &DeltaNetWeights,
    x: &[f32],
) -> (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>) {
    let (vd, nv) = (d.value_dim(), d.n_v_heads);
    let r = nv / d.n_k_heads;
    let (qkv, z) = match d.projections {
        DeltaNetProjections::Split | DeltaNetProjections::SplitGroupedBa => {
            (matvec(&w.inputs[0], x, d.conv_dim()), matvec(&w.inputs[1], x, vd))
        }
        DeltaNetProjections::Grouped => {
            let qkvz = matvec(&w.inputs[0], x, d.conv_dim() + vd);
            let (dk, vw) = (d.k_head_dim, r * d.v_head_dim);
            let (mut q, mut k, mut v, mut z) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
            for group in qkvz.chunks(2 * dk + 2 * vw) {
                q.extend_from_slice(&group[..dk]);
                k.extend_from_slice(&group[dk..2 * dk]);
                v.extend_from_slice(&group[2 * dk..2 * dk + vw]);
                z.extend_from_slice(&group[2 * dk + vw..]);
            }
            q.extend(k);
            q.extend(v);
            (q, z)
        }
    };
    let (b, a) = match d.projections {
        DeltaNetProjections::Split => (matvec(&w.inputs[2], x, nv), matvec(&w.inputs[3], x, nv)),
        DeltaNetProjections::Grouped | DeltaNetProjections::SplitGroupedBa => {
            let ba = matvec(w.inputs.last().expect("a ba projection"), x, 2 * nv);
            let (mut b, mut a) = (Vec::new(), Vec::new());
            for group in ba.chunks(2 * r) {
                b.extend_from_slice(&group[..r]);
                a.extend_from_slice(&group[r..]);
            }
            (b, a)
        }
    };
    (qkv, z, b, a)
}

/// The depthwise causal conv for one new input, then SiLU: channel `c` is
/// `sum_j weight[c][j] * input[t - (kernel - 1) + j]`; `state` holds the `kernel - 1` inputs
/// before this one, oldest first, and moves on by one.
fn causal_conv_step(input: &[f32], state: &mut [f32], weight: &[f32], kernel: usize) -> Vec<f32> {
    let channels = input.len();
    let out = (0..channels)
        .map(|ch| {
            let w = &weight[ch * kernel..][..kernel];
            let past: f32 = (0..kernel - 1).map(|j| w[j] * state[j * channels + ch]).sum();
            activate(FfnActivation::Silu, past + w[kernel - 1] * input[ch])
        })
        .collect();
    state.copy_within(channels.., 0);
    let last = state.len() - channels;
    state[last..].copy_from_slice(input);
    out
}

fn l2_normalized(x: &[f32]) -> Vec<f32> {
    let inv = 1.0 / (x.iter().map(|v| v * v).sum::<f32>() + 1e-6).sqrt();
    x.iter().map(|v| v * inv).collect()
}

/// `ln(1 + e^x)`, linear above 20 as torch's.
fn softplus(x: f64) -> f64 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

/// The router: expert ids and weights for one token. Ties go to the lower expert id.
pub fn route(logits: &[f32], k: usize, variant: RoutingVariant, norm_topk_prob: bool) -> Vec<(usize, f32)> {
    let mut order: Vec<usize> = (0..logits.len()).collect();
    // Softmax is monotonic, so ranking by logits equals ranking by probabilities.
    order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
    let top = &order[..k];
    match variant {
        RoutingVariant::SoftmaxThenTopK => {
            let probs = softmax(logits);
            let mut chosen: Vec<(usize, f32)> = top.iter().map(|&e| (e, probs[e])).collect();
            if norm_topk_prob {
                let sum: f32 = chosen.iter().map(|(_, w)| w).sum();
                chosen.iter_mut().for_each(|(_, w)| *w /= sum);
            }
            chosen
        }
        RoutingVariant::TopKThenSoftmax => {
            let top_logits: Vec<f32> = top.iter().map(|&e| logits[e]).collect();
            top.iter().copied().zip(softmax(&top_logits)).collect()
        }
        // Sigmoid routing needs its spec (groups, scale, selection bias): `route_sigmoid`.
        RoutingVariant::Sigmoid => {
            let spec = RouterSpec {
                variant,
                norm_topk_prob,
                n_experts: logits.len(),
                n_experts_used: k,
                bias: false,
                selection_bias: false,
                n_group: 1,
                topk_group: 1,
                scale: 1.0,
                scaled_input: false,
                per_expert_scale: false,
            };
            route_sigmoid(logits, None, &spec)
        }
    }
}

/// `down · (act(gate · x) * (up · x))`
fn ffn(gate: &[f32], up: &[f32], down: &[f32], x: &[f32], ff: usize, act: FfnActivation) -> Vec<f32> {
    let g = matvec(gate, x, ff);
    let u = matvec(up, x, ff);
    let h: Vec<f32> = g.iter().zip(&u).map(|(g, u)| glu(act, *g, *u)).collect();
    matvec(down, &h, x.len())
}

/// `down · glu(gate · x + b_gate, up · x + b_up) + b_down` for an expert with biases.
fn biased_ffn(w: [&[f32]; 3], b: [&[f32]; 3], x: &[f32], act: FfnActivation) -> Vec<f32> {
    let ff = b[0].len();
    let mut g = matvec(w[0], x, ff);
    let mut u = matvec(w[1], x, ff);
    add_into(&mut g, b[0]);
    add_into(&mut u, b[1]);
    let h: Vec<f32> = g.iter().zip(&u).map(|(g, u)| glu(act, *g, *u)).collect();
    let mut y = matvec(w[2], &h, x.len());
    add_into(&mut y, b[2]);
    y
}

/// The gated product of one intermediate value: `act(gate) * up`, or GPT-OSS's clamped form.
fn glu(act: FfnActivation, gate: f32, up: f32) -> f32 {
    match act {
        FfnActivation::SwigluOai => {
            let (alpha, limit) = (1.702f32, 7.0f32);
            let g = gate.min(limit);
            let u = up.clamp(-limit, limit);
            (u + 1.0) * (g * sigmoid(alpha * g))
        }
        _ => activate(act, gate) * up,
    }
}

/// The oracle's own activations (f64 inside, as `transformers` is exact to f32 here).
fn activate(act: FfnActivation, x: f32) -> f32 {
    let v = x as f64;
    let y = match act {
        FfnActivation::Silu => return x / (1.0 + (-x).exp()),
        FfnActivation::SwigluOai => unreachable!("the clamped SwiGLU takes gate and up (glu)"),
        FfnActivation::Gelu => 0.5 * v * (1.0 + erf(v / std::f64::consts::SQRT_2)),
        FfnActivation::GeluTanh => {
            0.5 * v * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (v + 0.044715 * v * v * v)).tanh())
        }
    };
    y as f32
}

/// erf by its Maclaurin series below 3 and the continued-fraction tail above (|error| < 1e-12).
fn erf(x: f64) -> f64 {
    let a = x.abs();
    let y = if a < 3.0 {
        let (mut sum, mut term) = (0.0, a);
        for n in 0..80 {
            sum += term / (2 * n + 1) as f64;
            term *= -a * a / (n + 1) as f64;
        }
        sum * 2.0 / std::f64::consts::PI.sqrt()
    } else {
        // erfc(a) = exp(-a^2)/sqrt(pi) * 1/(a + 1/2/(a + 1/(a + 3/2/(a + ...)))).
        let mut frac = a;
        for k in (1..60).rev() {
            frac = a + (k as f64 / 2.0) / frac;
        }
        1.0 - (-a * a).exp() / (std::f64::consts::PI.sqrt() * frac)
    };
    y.copysign(x)
}

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// `weight` is row-major `[n_rows, x.len()]`.
fn matvec(weight: &[f32], x: &[f32], n_rows: usize) -> Vec<f32> {
    assert_eq!(weight.len(), n_rows * x.len(), "matvec shape");
    weight.chunks_exact(x.len()).map(|row| dot(row, x)).collect()
}

fn dot(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

fn add_into(acc: &mut [f32], x: &[f32]) {
    for (a, v) in acc.iter_mut().zip(x) {
        *a += v;
    }
}

fn rms_norm(x: &[f32], weight: &[f32], eps: f32) -> Vec<f32> {
    let mean_square = x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32;
    let inv = 1.0 / (mean_square + eps).sqrt();
    x.iter().zip(weight).map(|(v, w)| v * inv * w).collect()
}

fn softmax(x: &[f32]) -> Vec<f32> {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let exps: Vec<f32> = x.iter().map(|v| (v - max).exp()).collect();
    let sum: f32 = exps.iter().sum();
    exps.iter().map(|e| e / sum).collect()
}

/// Rotate one head in place. Frequencies as Hugging Face computes them: `theta^(-2i/d)`, or
/// YaRN's blend with cos/sin scaled by its attention factor.
fn apply_rope(head: &mut [f32], position: usize, rope: &RopeSpec) {
    let d = head.len();
    let half = d / 2;
    // A proportional RoPE's pairs past its turning ones have frequency 0: they stay.
    for i in 0..rope.turning_pairs.map_or(half, |n| n.min(half)) {
        let (inv_freq, scale) = match &rope.yarn {
            None => {
                let plain = 1.0 / (rope.theta as f64).powf(2.0 * i as f64 / d as f64);
                (plain / rope.linear.map_or(1.0, f64::from), 1.0)
            }
            Some(y) => (y.inv_freq(i, d, rope.theta), y.attention_factor as f64),
        };
        let angle = position as f64 * inv_freq;
        let (sin, cos) = ((angle.sin() * scale) as f32, (angle.cos() * scale) as f32);
        let (a, b) = match rope.style {
            RopeStyle::HalfSplit => (i, i + half),
            RopeStyle::Interleaved => (2 * i, 2 * i + 1),
        };
        let (x0, x1) = (head[a], head[b]);
        head[a] = x0 * cos - x1 * sin;
        head[b] = x1 * cos + x0 * sin;
    }
}

/// Index of the largest value (first on ties).
pub fn argmax(values: &[f32]) -> u32 {
    let mut best = 0;
    for (i, v) in values.iter().enumerate() {
        if *v > values[best] {
            best = i;
        }
    }
    best as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_choice_margin_is_the_gap_after_the_last_chosen_score() {
        let mut spec = RouterSpec {
            variant: RoutingVariant::TopKThenSoftmax,
            norm_topk_prob: false,
            n_experts: 4,
            n_experts_used: 2,
            bias: false,
            selection_bias: false,
            n_group: 1,
            topk_group: 1,
            scale: 1.0,
            scaled_input: false,
            per_expert_scale: false,
        };
        assert_eq!(choice_margin(&[3.0, 1.0, -4.0, 2.5], None, &spec), (1.5, 4.0));
        // sigmoid routing: the margin of the biased scores the choice uses
        spec.variant = RoutingVariant::Sigmoid;
        let (m, s) = choice_margin(&[0.0, 0.0, 0.0, 0.0], Some(&[0.3, 0.1, 0.0, 0.2]), &spec);
        assert!((m - 0.1).abs() < 1e-6 && (s - 0.8).abs() < 1e-6, "{m} {s}");
        spec.n_experts_used = 4;
        assert_eq!(choice_margin(&[1.0, 2.0, 3.0, 4.0], None, &spec).0, f32::INFINITY);
    }

    /// With a group limit, a near tie between the last kept group and the best one left out is
    /// a near tie of the choice, however far apart the experts' own scores are.
    #[test]
    fn the_choice_margin_sees_a_near_tie_between_groups() {
        let spec = RouterSpec {
            variant: RoutingVariant::Sigmoid,
            norm_topk_prob: true,
            n_experts: 8,
            n_experts_used: 2,
            bias: false,
            selection_bias: true,
            n_group: 4,
            topk_group: 2,
            scale: 1.0,
            scaled_input: false,
            per_expert_scale: false,
        };
        // choice scores (logits 0: sigmoid 0.5, plus the bias): groups sum to 1.9, 1.5, 1.499, 1.0
        let bias = [0.45, 0.45, 0.25, 0.25, 0.2495, 0.2495, 0.0, 0.0];
        let (m, s) = choice_margin(&[0.0; 8], Some(&bias), &spec);
        assert!((m - 0.001).abs() < 1e-5 && (s - 0.95).abs() < 1e-6, "{m} {s}");
        // groups far apart: the experts' margin inside the kept groups (0.95 - 0.75, 0.9 - 0.75)
        let bias = [0.45, 0.45, 0.25, 0.25, 0.0, 0.0, -0.2, -0.2];
        let (m, _) = choice_margin(&[0.0; 8], Some(&bias), &spec);
        assert!((m - 0.2).abs() < 1e-6, "{m}");
        let bias = [0.45, 0.4, 0.25, 0.2, 0.0, 0.0, -0.2, -0.2];
        let (m, _) = choice_margin(&[0.0; 8], Some(&bias), &spec);
        assert!((m - 0.15).abs() < 1e-6, "{m}");
    }

    #[test]
    fn both_routing_variants_agree_when_renormalised() {
        let logits = [0.3, -1.0, 2.0, 0.9, 1.5];
        let a = route(&logits, 3, RoutingVariant::SoftmaxThenTopK, true);
        let b = route(&logits, 3, RoutingVariant::TopKThenSoftmax, false);
        for ((ea, wa), (eb, wb)) in a.iter().zip(&b) {
            assert_eq!(ea, eb);
            assert!((wa - wb).abs() < 1e-6);
        }
        assert_eq!(a.iter().map(|x| x.0).collect::<Vec<_>>(), vec![2, 4, 3]);
    }

    #[test]
    fn unnormalised_softmax_topk_keeps_full_softmax_weights() {
        let logits = [0.0, 0.0, 0.0, 0.0];
        let chosen = route(&logits, 2, RoutingVariant::SoftmaxThenTopK, false);
        assert_eq!(chosen, vec![(0, 0.25), (1, 0.25)]);
    }

    #[test]
    fn rope_styles_agree_on_permuted_input() {
        let canonical: Vec<f32> = (0..8).map(|i| i as f32 * 0.37 - 1.0).collect();
        let mut half = canonical.clone();
        let rope = |style| RopeSpec {
            style,
            theta: 10000.0,
            dims: 8,
            yarn: None,
            linear: None,
            turning_pairs: None,
        };
        apply_rope(&mut half, 5, &rope(RopeStyle::HalfSplit));
        let mut inter: Vec<f32> =
            (0..8).map(|r| canonical[if r % 2 == 0 { r / 2 } else { 4 + r / 2 }]).collect();
        apply_rope(&mut inter, 5, &rope(RopeStyle::Interleaved));
        for (r, value) in inter.iter().enumerate() {
            let c = if r % 2 == 0 { r / 2 } else { 4 + r / 2 };
            assert!((value - half[c]).abs() < 1e-6);
        }
    }
}
