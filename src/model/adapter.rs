//! Architecture adapters: the allow-list of model architectures moe-lanes runs.
//!
//! An adapter declares everything that differs between architectures and is not a number in the
//! model's config: how the router turns logits into expert weights, the FFN activation, where q/k
//! norms sit, the RoPE style, whether there is a shared expert, the tensor-name family, and the
//! *profile* of pipeline switches (DESIGN.md "Phases and policies"). Numbers (sizes, theta,
//! `norm_topk_prob`, tied embeddings) live in [`crate::model::config::ModelConfig`].

use serde::Serialize;

/// The architectures moe-lanes supports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Arch {
    Qwen3Moe,
    Mixtral,
    Olmoe,
    Qwen2Moe,
}

/// How router logits become the top-k expert ids and weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum RoutingVariant {
    /// softmax over all experts, then take the k largest (optionally renormalised to sum to 1).
    SoftmaxThenTopK,
    /// take the k largest logits, then softmax over those k (always sums to 1).
    TopKThenSoftmax,
}

/// FFN activation applied to the gate projection before multiplying by the up projection.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FfnActivation {
    Silu,
    Gelu,
}

/// Where q/k RMSNorms sit, if the architecture has them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum QkNorm {
    None,
    /// One norm of `head_dim` applied to every head (Qwen3-MoE).
    PerHead,
    /// One norm over the whole q (or k) projection, before splitting heads (OLMoE).
    WholeProjection,
}

/// How RoPE pairs up the values of a head.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum RopeStyle {
    /// Pairs `(i, i + d/2)`: Hugging Face `rotate_half`, GGML "NEOX".
    HalfSplit,
    /// Pairs `(2i, 2i + 1)`: GGML "NORM". llama.cpp's converter permutes the q/k rows of
    /// llama-family checkpoints so that this equals `HalfSplit` on the original weights.
    Interleaved,
}

/// The tensor-name family on disk for the Hugging Face layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum HfNaming {
    /// `mlp.gate`, `mlp.experts.E.{gate,up,down}_proj`
    Mlp,
    /// `block_sparse_moe.gate`, `block_sparse_moe.experts.E.{w1,w3,w2}`
    BlockSparseMoe,
}

/// Pipeline switches an architecture opts into (DESIGN.md "Phases and policies").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Profile {
    /// Route tiny decode batches on the CPU instead of launching router work on the GPU.
    pub cpu_decode_routing: bool,
    /// Largest batch (tokens) that `cpu_decode_routing` applies to.
    pub cpu_decode_routing_max_tokens: usize,
    /// One-token decode merges hot and cold rows directly, without a reduce pass.
    pub decode_direct_merge: bool,
    /// Merge by summing rows of the lane outputs.
    pub merge_sum_rows: bool,
    /// Cold lane reduces its slots into a prefix of token rows.
    pub cold_prefix_sum: bool,
    /// Like `cold_prefix_sum` but applies routing weights during the reduce.
    pub cold_prefix_weighted_sum: bool,
    /// Lanes reduce their own slots before the final merge.
    pub branch_reduce_merge: bool,
    /// Prompt processing may run dense (all experts for all tokens) when cheaper.
    pub pp_dense: bool,
    /// Prompt processing reduces branch outputs before the merge.
    pub pp_reduce_merge: bool,
    /// The cold lane accumulates weighted expert outputs straight into token rows.
    pub compact_cold_reduce: bool,
    /// Upper bound on prefix-reduce tasks in flight per layer.
    pub prefix_reduce_tasks_max: usize,
}

/// The profile every current adapter starts from: proven shortcuts on, dense PP off.
pub const DEFAULT_PROFILE: Profile = Profile {
    cpu_decode_routing: true,
    cpu_decode_routing_max_tokens: 1,
    decode_direct_merge: true,
    merge_sum_rows: true,
    cold_prefix_sum: true,
    cold_prefix_weighted_sum: true,
    branch_reduce_merge: false,
    pp_dense: false,
    pp_reduce_merge: true,
    compact_cold_reduce: true,
    prefix_reduce_tasks_max: 4,
};

/// The allow-list entry for one architecture.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Adapter {
    pub arch: Arch,
    /// `model_type` in a Hugging Face `config.json`.
    pub hf_model_type: &'static str,
    /// `general.architecture` in GGUF (Mixtral is llama.cpp's `llama` with experts).
    pub gguf_arch: &'static str,
    /// The graph the pipeline builds for it; one kind today.
    pub graph_kind: &'static str,
    pub activation: FfnActivation,
    pub routing: RoutingVariant,
    pub qk_norm: QkNorm,
    /// RoPE style of the Hugging Face weights (GGUF llama-family files use `Interleaved`).
    pub rope_style: RopeStyle,
    pub qkv_bias: bool,
    pub shared_expert: bool,
    pub hf_naming: HfNaming,
    pub default_rope_theta: f32,
    pub profile: Profile,
}

/// Every supported architecture.
pub const ADAPTERS: [Adapter; 4] = [
    Adapter {
        arch: Arch::Qwen3Moe,
        hf_model_type: "qwen3_moe",
        gguf_arch: "qwen3moe",
        graph_kind: "moe_lanes",
        activation: FfnActivation::Silu,
        routing: RoutingVariant::SoftmaxThenTopK,
        qk_norm: QkNorm::PerHead,
        rope_style: RopeStyle::HalfSplit,
        qkv_bias: false,
        shared_expert: false,
        hf_naming: HfNaming::Mlp,
        default_rope_theta: 1_000_000.0,
        profile: DEFAULT_PROFILE,
    },
    Adapter {
        arch: Arch::Mixtral,
        hf_model_type: "mixtral",
        gguf_arch: "llama",
        graph_kind: "moe_lanes",
        activation: FfnActivation::Silu,
        routing: RoutingVariant::TopKThenSoftmax,
        qk_norm: QkNorm::None,
        rope_style: RopeStyle::HalfSplit,
        qkv_bias: false,
        shared_expert: false,
        hf_naming: HfNaming::BlockSparseMoe,
        default_rope_theta: 1_000_000.0,
        profile: DEFAULT_PROFILE,
    },
    Adapter {
        arch: Arch::Olmoe,
        hf_model_type: "olmoe",
        gguf_arch: "olmoe",
        graph_kind: "moe_lanes",
        activation: FfnActivation::Silu,
        routing: RoutingVariant::SoftmaxThenTopK,
        qk_norm: QkNorm::WholeProjection,
        rope_style: RopeStyle::HalfSplit,
        qkv_bias: false,
        shared_expert: false,
        hf_naming: HfNaming::Mlp,
        default_rope_theta: 10_000.0,
        profile: DEFAULT_PROFILE,
    },
    Adapter {
        arch: Arch::Qwen2Moe,
        hf_model_type: "qwen2_moe",
        gguf_arch: "qwen2moe",
        graph_kind: "moe_lanes",
        activation: FfnActivation::Silu,
        routing: RoutingVariant::SoftmaxThenTopK,
        qk_norm: QkNorm::None,
        rope_style: RopeStyle::HalfSplit,
        qkv_bias: true,
        shared_expert: true,
        hf_naming: HfNaming::Mlp,
        default_rope_theta: 1_000_000.0,
        profile: DEFAULT_PROFILE,
    },
];

/// An architecture outside the allow-list.
#[derive(Debug, thiserror::Error, PartialEq)]
#[error("unsupported architecture '{found}' (from {source_kind}); supported: {supported}")]
pub struct UnsupportedArch {
    pub found: String,
    pub source_kind: &'static str,
    pub supported: String,
}

fn supported_list(names: impl Iterator<Item = &'static str>) -> String {
    names.collect::<Vec<_>>().join(", ")
}

/// Look up an adapter by Hugging Face `model_type`.
pub fn for_hf_model_type(model_type: &str) -> Result<&'static Adapter, UnsupportedArch> {
    ADAPTERS.iter().find(|a| a.hf_model_type == model_type).ok_or_else(|| UnsupportedArch {
        found: model_type.to_string(),
        source_kind: "config.json model_type",
        supported: supported_list(ADAPTERS.iter().map(|a| a.hf_model_type)),
    })
}

/// Look up an adapter by GGUF `general.architecture`. `llama` is accepted only with experts
/// (that is Mixtral); a dense llama is refused.
pub fn for_gguf_arch(gguf_arch: &str, n_experts: usize) -> Result<&'static Adapter, UnsupportedArch> {
    let found = ADAPTERS.iter().find(|a| a.gguf_arch == gguf_arch);
    match found {
        Some(adapter) if gguf_arch != "llama" || n_experts > 0 => Ok(adapter),
        _ => Err(UnsupportedArch {
            found: if gguf_arch == "llama" {
                "llama (without experts)".to_string()
            } else {
                gguf_arch.to_string()
            },
            source_kind: "GGUF general.architecture",
            supported: supported_list(ADAPTERS.iter().map(|a| a.gguf_arch))
                + " (llama with experts = mixtral)",
        }),
    }
}

/// Look up an adapter by its user-facing name (`qwen3_moe`, `mixtral`, `olmoe`, `qwen2_moe`;
/// GGUF names are accepted too).
pub fn by_name(name: &str) -> Result<&'static Adapter, UnsupportedArch> {
    let normalized = name.to_ascii_lowercase().replace('-', "_");
    ADAPTERS
        .iter()
        .find(|a| a.hf_model_type == normalized || (a.gguf_arch == normalized && a.gguf_arch != "llama"))
        .ok_or_else(|| UnsupportedArch {
            found: name.to_string(),
            source_kind: "--arch",
            supported: supported_list(ADAPTERS.iter().map(|a| a.hf_model_type)),
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_adapter_is_found_by_both_names() {
        for a in &ADAPTERS {
            assert_eq!(for_hf_model_type(a.hf_model_type).unwrap().arch, a.arch);
            assert_eq!(for_gguf_arch(a.gguf_arch, 8).unwrap().arch, a.arch);
            assert_eq!(by_name(a.hf_model_type).unwrap().arch, a.arch);
        }
    }

    #[test]
    fn unsupported_arch_lists_the_supported_ones() {
        let err = for_hf_model_type("deepseek_v3").unwrap_err().to_string();
        assert!(err.contains("deepseek_v3"), "{err}");
        for name in ["qwen3_moe", "mixtral", "olmoe", "qwen2_moe"] {
            assert!(err.contains(name), "{err}");
        }
        let err = for_gguf_arch("llama", 0).unwrap_err().to_string();
        assert!(err.contains("without experts"), "{err}");
    }

    #[test]
    fn profiles_are_declared_per_adapter() {
        for a in &ADAPTERS {
            assert!(a.profile.cpu_decode_routing_max_tokens >= 1);
            assert!(a.profile.prefix_reduce_tasks_max >= 1);
        }
    }
}
