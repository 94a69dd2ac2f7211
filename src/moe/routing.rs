//! The pipeline's router: router logits of a batch of tokens -> top-k expert ids and weights per
//! token, written into reusable buffers (no allocation after construction).
//!
//! Both routing variants of [`RoutingVariant`] are implemented: softmax over all experts then the
//! k largest (optionally renormalised, `norm_topk_prob`), and top-k on the logits then a softmax
//! over those k; and DeepSeek-V3's sigmoid scores with a selection bias for the choice,
//! group-limited top-k, renormalisation and a weight scale. Ties go to the lower expert id.
//!
//! This is written independently of `reference::route` (the oracle); the tests compare them.

use crate::model::arch::RoutingVariant;
use crate::moe::math::{sigmoid, softmax_in_place};

/// Everything that decides how one layer's router logits become expert weights: the layer's
/// router spec from the model's plan.
pub use crate::model::arch::RouterSpec as RouterOptions;

/// Routing results of one batch: slot `t * k + j` is the j-th choice of token t.
#[derive(Debug, Clone, Default)]
pub struct Routes {
    pub n_tokens: usize,
    pub n_experts_used: usize,
    /// `[n_tokens * k]` expert ids, best first per token.
    pub expert_ids: Vec<u32>,
    /// `[n_tokens * k]` routing weights matching `expert_ids`.
    pub weights: Vec<f32>,
}

impl Routes {
    pub fn n_slots(&self) -> usize {
        self.n_tokens * self.n_experts_used
    }
}

/// The router with its reusable buffers, sized for `max_tokens` tokens per batch.
#[derive(Debug)]
pub struct Router {
    options: RouterOptions,
    max_tokens: usize,
    /// Softmax probabilities of one token (`n_experts`).
    probs: Vec<f32>,
    /// Chosen ids of one token (`k`), kept sorted best first during selection.
    chosen: Vec<u32>,
    /// The k logits of one token (TopKThenSoftmax).
    top_logits: Vec<f32>,
    /// Sigmoid routing: the selection bias (empty without), one token's choice scores, its
    /// group scores and the kept groups.
    selection_bias: Vec<f32>,
    choice: Vec<f32>,
    group_scores: Vec<f32>,
    kept_groups: Vec<u32>,
    /// Each chosen weight times its expert's scale (empty without: Gemma 4's per-expert scale).
    expert_scale: Vec<f32>,
    routes: Routes,
}

/// A batch larger than the router was sized for.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum RouterError {
    #[error("router sized for {max_tokens} tokens was given {n_tokens}")]
    TooManyTokens { n_tokens: usize, max_tokens: usize },
    #[error(
        "router logits hold {n_values} values, expected {expected} ({n_tokens} tokens x {n_experts} experts)"
    )]
    BadLogits { n_values: usize, expected: usize, n_tokens: usize, n_experts: usize },
}

impl Router {
    pub fn new(options: RouterOptions, max_tokens: usize) -> Router {
        assert!(options.n_experts_used >= 1 && options.n_experts_used <= options.n_experts, "bad k");
        let cap = max_tokens * options.n_experts_used;
        Router {
            options,
            max_tokens,
            probs: vec![0.0; options.n_experts],
            chosen: Vec::with_capacity(options.n_experts_used),
            top_logits: vec![0.0; options.n_experts_used],
            selection_bias: Vec::new(),
            choice: vec![0.0; options.n_experts],
            group_scores: vec![0.0; options.n_group.max(1)],
            kept_groups: Vec::with_capacity(options.n_group.max(1)),
            expert_scale: Vec::new(),
            routes: Routes {
                n_tokens: 0,
                n_experts_used: options.n_experts_used,
                expert_ids: Vec::with_capacity(cap),
                weights: Vec::with_capacity(cap),
            },
        }
    }

    /// The selection bias (`[n_experts]`) a sigmoid router adds to its scores for the choice.
    pub fn with_selection_bias(mut self, bias: Vec<f32>) -> Router {
        assert_eq!(bias.len(), self.options.n_experts, "one selection bias per expert");
        self.selection_bias = bias;
        self
    }

    /// A learned scale per expert (`[n_experts]`) each chosen weight is multiplied by, after
    /// renormalisation (`RouterSpec::per_expert_scale`).
    pub fn with_expert_scale(mut self, scale: Vec<f32>) -> Router {
        assert_eq!(scale.len(), self.options.n_experts, "one scale per expert");
        self.expert_scale = scale;
        self
    }

    pub fn options(&self) -> &RouterOptions {
        &self.options
    }

    /// The results of the last [`Router::route`] call.
    pub fn routes(&self) -> &Routes {
        &self.routes
    }

    /// Route `n_tokens` tokens whose router logits are `logits` (`[n_tokens, n_experts]`).
    pub fn route(&mut self, logits: &[f32], n_tokens: usize) -> Result<&Routes, RouterError> {
        let (n_experts, k) = (self.options.n_experts, self.options.n_experts_used);
        if n_tokens > self.max_tokens {
            return Err(RouterError::TooManyTokens { n_tokens, max_tokens: self.max_tokens });
        }
        if logits.len() != n_tokens * n_experts {
            return Err(RouterError::BadLogits {
                n_values: logits.len(),
                expected: n_tokens * n_experts,
                n_tokens,
                n_experts,
            });
        }
        self.routes.n_tokens = n_tokens;
        self.routes.expert_ids.clear();
        self.routes.weights.clear();
        for token_logits in logits.chunks_exact(n_experts) {
            if self.options.variant == RoutingVariant::Sigmoid {
                self.route_sigmoid(token_logits);
                continue;
            }
            select_top_k(token_logits, k, &mut self.chosen);
            match self.options.variant {
                RoutingVariant::SoftmaxThenTopK => {
                    softmax_into(token_logits, &mut self.probs);
                    let mut sum = 0.0f32;
                    for &e in &self.chosen {
                        sum += self.probs[e as usize];
                    }
                    for &e in &self.chosen {
                        let p = self.probs[e as usize];
                        self.routes.expert_ids.push(e);
                        self.routes.weights.push(if self.options.norm_topk_prob { p / sum } else { p });
                    }
                }
                RoutingVariant::TopKThenSoftmax => {
                    for (slot, &e) in self.top_logits.iter_mut().zip(&self.chosen) {
                        *slot = token_logits[e as usize];
                    }
                    softmax_in_place(&mut self.top_logits);
                    for (&e, &w) in self.chosen.iter().zip(&self.top_logits) {
                        self.routes.expert_ids.push(e);
                        self.routes.weights.push(w);
                    }
                }
                RoutingVariant::Sigmoid => unreachable!("routed above"),
            }
        }
        if !self.expert_scale.is_empty() {
            for (w, &e) in self.routes.weights.iter_mut().zip(&self.routes.expert_ids) {
                *w *= self.expert_scale[e as usize];
            }
        }
        Ok(&self.routes)
    }

    /// One token of sigmoid routing: scores in `probs`, the choice (score + selection bias) in
    /// `choice` with the experts of every group outside the best `topk_group` masked out.
    fn route_sigmoid(&mut self, logits: &[f32]) {
        let o = self.options;
        for (e, &l) in logits.iter().enumerate() {
            self.probs[e] = sigmoid(l);
            self.choice[e] = self.probs[e] + self.selection_bias.get(e).copied().unwrap_or(0.0);
        }
        if o.n_group > 1 {
            let per = o.n_experts / o.n_group;
            for (g, score) in self.group_scores.iter_mut().enumerate() {
                let (mut best, mut second) = (f32::NEG_INFINITY, f32::NEG_INFINITY);
                for &v in &self.choice[g * per..(g + 1) * per] {
                    if v > best {
                        (best, second) = (v, best);
                    } else if v > second {
                        second = v;
                    }
                }
                *score = best + second;
            }
            select_top_k(&self.group_scores, o.topk_group, &mut self.kept_groups);
            for g in 0..o.n_group {
                if !self.kept_groups.contains(&(g as u32)) {
                    self.choice[g * per..(g + 1) * per].fill(f32::NEG_INFINITY);
                }
            }
        }
        select_top_k(&self.choice, o.n_experts_used, &mut self.chosen);
        let sum: f32 = self.chosen.iter().map(|&e| self.probs[e as usize]).sum();
        let norm = if o.norm_topk_prob { 1.0 / (sum + 1e-20) } else { 1.0 };
        for &e in &self.chosen {
            self.routes.expert_ids.push(e);
            self.routes.weights.push(self.probs[e as usize] * norm * o.scale);
        }
    }
}

/// The k largest values' indices, best first; ties prefer the lower index. Insertion into a
/// sorted list of k: O(n * k), no allocation (k is small: 2..8 for every supported model).
fn select_top_k(values: &[f32], k: usize, chosen: &mut Vec<u32>) {
    chosen.clear();
    for (idx, &v) in values.iter().enumerate() {
        // `better(a, b)`: a ranks above b.
        let better = |a: f32, b: f32| a.total_cmp(&b).is_gt();
        if chosen.len() == k && !better(v, values[chosen[k - 1] as usize]) {
            continue;
        }
        if chosen.len() == k {
            chosen.pop();
        }
        let mut pos = chosen.len();
        while pos > 0 && better(v, values[chosen[pos - 1] as usize]) {
            pos -= 1;
        }
        chosen.insert(pos, idx as u32);
    }
}

fn softmax_into(x: &[f32], out: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0f32;
    for (o, &v) in out.iter_mut().zip(x) {
        *o = (v - max).exp();
        sum += *o;
    }
    for o in out.iter_mut() {
        *o /= sum;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reference;

    fn lcg_logits(seed: u64, n: usize) -> Vec<f32> {
        let mut s = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (0..n)
            .map(|_| {
                s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((s >> 33) as f32 / (1u64 << 31) as f32) * 4.0 - 2.0
            })
            .collect()
    }

    #[test]
    fn both_variants_match_the_oracle() {
        for variant in [RoutingVariant::SoftmaxThenTopK, RoutingVariant::TopKThenSoftmax] {
            for norm in [false, true] {
                for (n_experts, k) in [(8, 2), (6, 3), (16, 8), (4, 4)] {
                    let n_tokens = 5;
                    let logits = lcg_logits((n_experts * 31 + k) as u64, n_tokens * n_experts);
                    let opts = RouterOptions {
                        variant,
                        n_experts,
                        n_experts_used: k,
                        norm_topk_prob: norm,
                        bias: false,
                        selection_bias: false,
                        n_group: 1,
                        topk_group: 1,
                        scale: 1.0,
                        scaled_input: false,
                        per_expert_scale: false,
                    };
                    let mut router = Router::new(opts, 8);
                    let routes = router.route(&logits, n_tokens).unwrap().clone();
                    for t in 0..n_tokens {
                        let want = reference::route(&logits[t * n_experts..][..n_experts], k, variant, norm);
                        for (j, (e, w)) in want.iter().enumerate() {
                            assert_eq!(routes.expert_ids[t * k + j] as usize, *e);
                            assert!((routes.weights[t * k + j] - w).abs() < 1e-6);
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn ties_go_to_the_lower_id_and_buffers_are_reused() {
        let opts = RouterOptions {
            variant: RoutingVariant::TopKThenSoftmax,
            n_experts: 4,
            n_experts_used: 2,
            norm_topk_prob: false,
            bias: false,
            selection_bias: false,
            n_group: 1,
            topk_group: 1,
            scale: 1.0,
            scaled_input: false,
            per_expert_scale: false,
        };
        let mut router = Router::new(opts, 2);
        let ptr = router.routes().expert_ids.as_ptr();
        let routes = router.route(&[1.0, 3.0, 3.0, 3.0, 0.0, 0.0, 0.0, 0.0], 2).unwrap();
        assert_eq!(routes.expert_ids, vec![1, 2, 0, 1]);
        assert_eq!(router.routes().expert_ids.as_ptr(), ptr);
        assert!(matches!(router.route(&[0.0; 12], 3), Err(RouterError::TooManyTokens { .. })));
    }

    /// Sigmoid routing with a selection bias, groups and a scale against the oracle's.
    #[test]
    fn sigmoid_grouped_routing_matches_the_oracle() {
        for (n_experts, k, n_group, topk_group) in
            [(8, 3, 4, 2), (16, 4, 4, 1), (12, 2, 1, 1), (256, 8, 8, 4)]
        {
            for norm in [false, true] {
                let n_tokens = 6;
                let logits = lcg_logits((n_experts * 7 + k) as u64, n_tokens * n_experts);
                let bias: Vec<f32> = lcg_logits(99, n_experts).iter().map(|b| 0.05 * b).collect();
                let opts = RouterOptions {
                    variant: RoutingVariant::Sigmoid,
                    n_experts,
                    n_experts_used: k,
                    norm_topk_prob: norm,
                    bias: false,
                    selection_bias: true,
                    n_group,
                    topk_group,
                    scale: 2.5,
                    scaled_input: false,
                    per_expert_scale: false,
                };
                let mut router = Router::new(opts, 8).with_selection_bias(bias.clone());
                let routes = router.route(&logits, n_tokens).unwrap().clone();
                for t in 0..n_tokens {
                    let want =
                        reference::route_sigmoid(&logits[t * n_experts..][..n_experts], Some(&bias), &opts);
                    for (j, (e, w)) in want.iter().enumerate() {
                        assert_eq!(routes.expert_ids[t * k + j] as usize, *e, "token {t} slot {j}");
                        assert!((routes.weights[t * k + j] - w).abs() < 1e-5, "token {t} slot {j}");
                    }
                }
            }
        }
    }
}
