//! Element types of model tensors: the float types and the GGML quantised block types (with their
//! exact block sizes; their layouts and arithmetic are in [`crate::format::quant`]).

use serde::Serialize;

/// One tensor element type. Quantised types store `block_elems` values in `block_bytes` bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[allow(non_camel_case_types)]
pub enum DType {
    F32,
    F16,
    BF16,
    Q4_0,
    Q8_0,
    Q4_K,
    Q5_K,
    Q6_K,
    /// GGML's MXFP4: 32 E2M1 values (4 bits) under one E8M0 scale byte.
    MXFP4,
    /// GGML's Q5_0: 32 five-bit values minus 16 under one f16 scale.
    Q5_0,
    /// GGML's Q5_1: 32 five-bit values under an f16 scale and an f16 min.
    Q5_1,
    /// GGML's IQ4_NL: 32 nibbles indexing a fixed non-linear table under one f16 scale.
    IQ4_NL,
}

impl DType {
    /// Every type, in GGML id order; used by tests and by `inspect`.
    pub const ALL: [DType; 12] = [
        DType::F32,
        DType::F16,
        DType::Q4_0,
        DType::Q5_0,
        DType::Q5_1,
        DType::Q8_0,
        DType::Q4_K,
        DType::Q5_K,
        DType::Q6_K,
        DType::IQ4_NL,
        DType::BF16,
        DType::MXFP4,
    ];

    /// The `ggml_type` id used in GGUF tensor infos.
    pub fn ggml_type_id(self) -> u32 {
        match self {
            DType::F32 => 0,
            DType::F16 => 1,
            DType::Q4_0 => 2,
            DType::Q8_0 => 8,
            DType::Q4_K => 12,
            DType::Q5_K => 13,
            DType::Q6_K => 14,
            DType::BF16 => 30,
            DType::MXFP4 => 39,
            DType::Q5_0 => 6,
            DType::Q5_1 => 7,
            DType::IQ4_NL => 20,
        }
    }

    pub fn from_ggml_type_id(id: u32) -> Option<DType> {
        DType::ALL.into_iter().find(|t| t.ggml_type_id() == id)
    }

    /// The type's name as ggml spells it.
    pub fn ggml_name(self) -> &'static str {
        ggml_type_name(self.ggml_type_id()).expect("every DType is a ggml type")
    }

    /// Values per block (1 for plain float types).
    pub fn block_elems(self) -> usize {
        match self {
            DType::F32 | DType::F16 | DType::BF16 => 1,
            DType::Q4_0 | DType::Q8_0 | DType::MXFP4 | DType::Q5_0 | DType::Q5_1 | DType::IQ4_NL => 32,
            DType::Q4_K | DType::Q5_K | DType::Q6_K => 256,
        }
    }

    /// Bytes per block. Q4_0: f16 scale + 16 nibble bytes; Q8_0: f16 scale + 32 bytes;
    /// Q4_K: 2 f16 + 12 scale bytes + 128; Q5_K: 2 f16 + 12 + 32 high bits + 128;
    /// Q6_K: 128 low + 64 high + 16 scales + f16; MXFP4: E8M0 scale byte + 16 nibble bytes;
    /// Q5_0: f16 + 4 bytes of fifth bits + 16; Q5_1: 2 f16 + 4 + 16; IQ4_NL: f16 + 16.
    pub fn block_bytes(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::Q4_0 => 18,
            DType::Q8_0 => 34,
            DType::Q4_K => 144,
            DType::Q5_K => 176,
            DType::Q6_K => 210,
            DType::MXFP4 => 17,
            DType::Q5_0 => 22,
            DType::Q5_1 => 24,
            DType::IQ4_NL => 18,
        }
    }

    /// Bytes needed for `n_elems` values, or `None` when `n_elems` is not a whole number of blocks
    /// (or the size overflows).
    pub fn bytes_for(self, n_elems: usize) -> Option<usize> {
        if !n_elems.is_multiple_of(self.block_elems()) {
            return None;
        }
        (n_elems / self.block_elems()).checked_mul(self.block_bytes())
    }

    pub fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F16 | DType::BF16)
    }

    /// Name as safetensors and `inspect` write it.
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "F32",
            DType::F16 => "F16",
            DType::BF16 => "BF16",
            DType::Q4_0 => "Q4_0",
            DType::Q8_0 => "Q8_0",
            DType::Q4_K => "Q4_K",
            DType::Q5_K => "Q5_K",
            DType::Q6_K => "Q6_K",
            DType::MXFP4 => "MXFP4",
            DType::Q5_0 => "Q5_0",
            DType::Q5_1 => "Q5_1",
            DType::IQ4_NL => "IQ4_NL",
        }
    }

    /// Parse a safetensors dtype string; only the float types occur there.
    pub fn from_safetensors_name(name: &str) -> Option<DType> {
        match name {
            "F32" => Some(DType::F32),
            "F16" => Some(DType::F16),
            "BF16" => Some(DType::BF16),
            _ => None,
        }
    }

    /// Parse a user-facing name (`bf16`, `f16`, `f32`), case-insensitive.
    pub fn parse_float(name: &str) -> Option<DType> {
        match name.to_ascii_lowercase().as_str() {
            "f32" => Some(DType::F32),
            "f16" => Some(DType::F16),
            "bf16" => Some(DType::BF16),
            _ => None,
        }
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ggml_ids_round_trip() {
        for t in DType::ALL {
            assert_eq!(DType::from_ggml_type_id(t.ggml_type_id()), Some(t));
        }
        assert_eq!(DType::from_ggml_type_id(3), None);
    }

    #[test]
    fn quantised_sizes_follow_blocks() {
        assert_eq!(DType::Q8_0.bytes_for(64), Some(68));
        assert_eq!(DType::Q4_K.bytes_for(512), Some(288));
        assert_eq!(DType::Q6_K.bytes_for(256), Some(210));
        assert_eq!(DType::Q5_K.bytes_for(256), Some(176));
        assert_eq!(DType::Q4_0.bytes_for(31), None);
        assert_eq!(DType::MXFP4.bytes_for(64), Some(34));
        assert_eq!(DType::from_ggml_type_id(39), Some(DType::MXFP4));
        assert_eq!(
            (DType::Q5_0.bytes_for(64), DType::Q5_1.bytes_for(64), DType::IQ4_NL.bytes_for(64)),
            (Some(44), Some(48), Some(36))
        );
        assert_eq!(DType::from_ggml_type_id(6), Some(DType::Q5_0));
        assert_eq!(DType::from_ggml_type_id(7), Some(DType::Q5_1));
        assert_eq!(DType::from_ggml_type_id(20), Some(DType::IQ4_NL));
        assert_eq!(DType::BF16.bytes_for(3), Some(6));
    }
}

/// Names of ggml's tensor types by id (ggml.h's `ggml_type`), those moe-lanes reads and those it
/// does not, so a refusal names the type a file uses (Q4_1, Q2_K, Q3_K and the other IQ types
/// are refused by name).
pub fn ggml_type_name(id: u32) -> Option<&'static str> {
    const NAMES: [&str; 40] = [
        "F32", "F16", "Q4_0", "Q4_1", "", "", "Q5_0", "Q5_1", "Q8_0", "Q8_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
        "Q6_K", "Q8_K", "IQ2_XXS", "IQ2_XS", "IQ3_XXS", "IQ1_S", "IQ4_NL", "IQ3_S", "IQ2_S", "IQ4_XS", "I8",
        "I16", "I32", "I64", "F64", "IQ1_M", "BF16", "", "", "", "TQ1_0", "TQ2_0", "", "", "", "MXFP4",
    ];
    NAMES.get(id as usize).copied().filter(|n| !n.is_empty())
}

/// The ggml types moe-lanes reads, for messages: "F32, F16, ...".
pub fn readable_type_names() -> String {
    DType::ALL.iter().map(|t| t.ggml_name()).collect::<Vec<_>>().join(", ")
}

#[cfg(test)]
mod ggml_name_tests {
    use super::*;

    #[test]
    fn every_type_read_has_its_ggml_name_and_others_are_named_too() {
        for t in DType::ALL {
            assert_eq!(DType::from_ggml_type_id(t.ggml_type_id()), Some(t));
            assert!(!t.ggml_name().is_empty());
        }
        assert_eq!(ggml_type_name(6), Some("Q5_0"));
        assert_eq!(ggml_type_name(20), Some("IQ4_NL"));
        assert_eq!(ggml_type_name(3), Some("Q4_1"));
        assert!(!readable_type_names().contains("Q4_1") && readable_type_names().contains("Q5_1"));
        assert_eq!(ggml_type_name(39), Some("MXFP4"));
        assert_eq!((ggml_type_name(4), ggml_type_name(99)), (None, None));
        assert!(readable_type_names().contains("Q4_K") && readable_type_names().contains("MXFP4"));
    }
}
