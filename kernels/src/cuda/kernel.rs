//! The kernels by typed id, their op-family source files, and the constants shared by the
//! Rust launchers and the CUDA code (passed to NVRTC as `-D` defines, defined only here).

use super::ops::{ATTENTION_MAX_HEAD_DIM, ATTENTION_SPLIT_CHUNK};

/// Warps per block in the warp-per-row kernels (a block is `32 * ROWS_PER_BLOCK` threads).
pub const ROWS_PER_BLOCK: u32 = 8;

/// Shared device helpers (types, warp and block reductions), prepended to the families.
pub const COMMON_CUH: &str = include_str!("../../cuda/common.cuh");

/// The op-family sources, in compile order.
pub const FAMILY_SOURCES: [(&str, &str); 7] = [
    ("gemv.cu", include_str!("../../cuda/gemv.cu")),
    ("norm_rope.cu", include_str!("../../cuda/norm_rope.cu")),
    ("elementwise.cu", include_str!("../../cuda/elementwise.cu")),
    ("attention.cu", include_str!("../../cuda/attention.cu")),
    ("argmax.cu", include_str!("../../cuda/argmax.cu")),
    ("route.cu", include_str!("../../cuda/route.cu")),
    ("moe.cu", include_str!("../../cuda/moe.cu")),
];

/// The whole program NVRTC compiles: the shared header, then every family.
pub fn kernel_source() -> String {
    let mut src = String::from(COMMON_CUH);
    for (name, text) in FAMILY_SOURCES {
        src.push_str(&format!("\n// ---- {name} ----\n"));
        src.push_str(text);
    }
    src
}

/// `-D` options for the constants the launchers and the kernels share.
pub fn shared_defines() -> Vec<String> {
    vec![
        format!("-DROWS_PER_BLOCK={ROWS_PER_BLOCK}"),
        format!("-DATT_CHUNK={ATTENTION_SPLIT_CHUNK}"),
        format!("-DATT_MAXC={}", ATTENTION_MAX_HEAD_DIM / 32),
    ]
}

/// Every kernel entry point, looked up once at start-up into a table indexed by this id.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kernel {
    GemvBf16,
    Gemv3Bf16,
    RmsnormF32,
    AddBiasRows,
    ClampF32,
    AddF32,
    SiluMulF32,
    RopeF32,
    QkNormRopeF32,
    AttentionF32,
    AttentionSplitF32,
    AttentionCombineF32,
    ArgmaxF32,
    ArgmaxPartialF32,
    ArgmaxFinalF32,
    EmbedBf16,
    GatherSplitBf16,
    GatherRowsF32,
    ScatterAddRowsF32,
    AddSigmoidScaledRows,
    RouteTopk,
    MoeGateUpGemv,
    MoeDownAccum,
    MoeScatterAccum,
    HotWorklistTokens,
}

impl Kernel {
    pub const ALL: [Kernel; 25] = [
        Kernel::GemvBf16,
        Kernel::Gemv3Bf16,
        Kernel::RmsnormF32,
        Kernel::AddBiasRows,
        Kernel::ClampF32,
        Kernel::AddF32,
        Kernel::SiluMulF32,
        Kernel::RopeF32,
        Kernel::QkNormRopeF32,
        Kernel::AttentionF32,
        Kernel::AttentionSplitF32,
        Kernel::AttentionCombineF32,
        Kernel::ArgmaxF32,
        Kernel::ArgmaxPartialF32,
        Kernel::ArgmaxFinalF32,
        Kernel::EmbedBf16,
        Kernel::GatherSplitBf16,
        Kernel::GatherRowsF32,
        Kernel::ScatterAddRowsF32,
        Kernel::AddSigmoidScaledRows,
        Kernel::RouteTopk,
        Kernel::MoeGateUpGemv,
        Kernel::MoeDownAccum,
        Kernel::MoeScatterAccum,
        Kernel::HotWorklistTokens,
    ];

    /// The `extern "C"` symbol.
    pub fn symbol(self) -> &'static str {
        match self {
            Kernel::GemvBf16 => "gemv_bf16",
            Kernel::Gemv3Bf16 => "gemv3_bf16",
            Kernel::RmsnormF32 => "rmsnorm_f32",
            Kernel::AddBiasRows => "add_bias_rows",
            Kernel::ClampF32 => "clamp_f32",
            Kernel::AddF32 => "add_f32",
            Kernel::SiluMulF32 => "silu_mul_f32",
            Kernel::RopeF32 => "rope_f32",
            Kernel::QkNormRopeF32 => "qk_norm_rope_f32",
            Kernel::AttentionF32 => "attention_f32",
            Kernel::AttentionSplitF32 => "attention_split_f32",
            Kernel::AttentionCombineF32 => "attention_combine_f32",
            Kernel::ArgmaxF32 => "argmax_f32",
            Kernel::ArgmaxPartialF32 => "argmax_partial_f32",
            Kernel::ArgmaxFinalF32 => "argmax_final_f32",
            Kernel::EmbedBf16 => "embed_bf16",
            Kernel::GatherSplitBf16 => "gather_split_bf16",
            Kernel::GatherRowsF32 => "gather_rows_f32",
            Kernel::ScatterAddRowsF32 => "scatter_add_rows_f32",
            Kernel::AddSigmoidScaledRows => "add_sigmoid_scaled_rows",
            Kernel::RouteTopk => "route_topk",
            Kernel::MoeGateUpGemv => "moe_gate_up_gemv",
            Kernel::MoeDownAccum => "moe_down_accum",
            Kernel::MoeScatterAccum => "moe_scatter_accum",
            Kernel::HotWorklistTokens => "hot_worklist_tokens",
        }
    }

    /// The op-family file that defines it.
    pub fn family(self) -> &'static str {
        match self {
            Kernel::GemvBf16 => "gemv.cu",
            Kernel::Gemv3Bf16 => "gemv.cu",
            Kernel::RmsnormF32 => "norm_rope.cu",
            Kernel::AddBiasRows => "elementwise.cu",
            Kernel::ClampF32 => "elementwise.cu",
            Kernel::AddF32 => "elementwise.cu",
            Kernel::SiluMulF32 => "elementwise.cu",
            Kernel::RopeF32 => "norm_rope.cu",
            Kernel::QkNormRopeF32 => "norm_rope.cu",
            Kernel::AttentionF32 => "attention.cu",
            Kernel::AttentionSplitF32 => "attention.cu",
            Kernel::AttentionCombineF32 => "attention.cu",
            Kernel::ArgmaxF32 => "argmax.cu",
            Kernel::ArgmaxPartialF32 => "argmax.cu",
            Kernel::ArgmaxFinalF32 => "argmax.cu",
            Kernel::EmbedBf16 => "elementwise.cu",
            Kernel::GatherSplitBf16 => "elementwise.cu",
            Kernel::GatherRowsF32 => "elementwise.cu",
            Kernel::ScatterAddRowsF32 => "elementwise.cu",
            Kernel::AddSigmoidScaledRows => "elementwise.cu",
            Kernel::RouteTopk => "route.cu",
            Kernel::MoeGateUpGemv => "moe.cu",
            Kernel::MoeDownAccum => "moe.cu",
            Kernel::MoeScatterAccum => "moe.cu",
            Kernel::HotWorklistTokens => "moe.cu",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kernel_is_defined_once_in_its_family_and_ids_index_the_table() {
        for (i, k) in Kernel::ALL.iter().enumerate() {
            assert_eq!(*k as usize, i, "Kernel::ALL is in declaration order");
            let (_, text) = FAMILY_SOURCES.iter().find(|(f, _)| *f == k.family()).expect("family file");
            assert_eq!(text.matches(&format!("void {}(", k.symbol())).count(), 1, "{k:?}");
        }
        let all = kernel_source();
        assert_eq!(all.matches("__global__").count(), Kernel::ALL.len(), "no kernel without an id");
    }

    #[test]
    fn shared_constants_are_defines_not_literals() {
        for (name, text) in FAMILY_SOURCES.iter().chain([("common.cuh", COMMON_CUH)].iter()) {
            for c in ["#define ROWS_PER_BLOCK", "#define ATT_CHUNK", "#define ATT_MAXC"] {
                assert!(!text.contains(c), "{name} defines {c} itself; it comes from shared_defines()");
            }
        }
    }
}
