//! Run-time SIMD level selection: CPU feature detection (once, cached) and a forced level
//! passed in by the caller (the CLI reads `MOE_LANES_SIMD`; kernels read no environment).

use std::sync::OnceLock;

use serde::{Deserialize, Serialize};

use crate::error::KernelError;

/// A CPU SIMD instruction-set level the kernels can run at. Ordered from weakest to strongest.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SimdLevel {
    /// Portable scalar Rust; also the reference the SIMD levels are tested against.
    Scalar,
    /// AVX2 + FMA + F16C (256-bit vectors).
    Avx2,
    /// AVX-512F (512-bit vectors; F16 weights also need F16C, BF16 is converted by shifting).
    Avx512,
    /// AVX-512F + AVX-512 BF16: BF16 weights use `vdpbf16ps`, which rounds the F32 activations
    /// to BF16 before multiplying (a looser tolerance than the other levels); F16/F32 weights
    /// run the plain AVX-512F kernels.
    Avx512Bf16,
    /// AVX-512 BF16 + AMX-BF16 tiles: BF16 expert weights of calls with many tokens (prefill)
    /// run on the tiles with the activations split into two BF16 parts (about f32 accuracy,
    /// `x86_amx`); everything else runs the AVX-512F kernels (f32 activations).
    Amx,
}

impl SimdLevel {
    /// All levels, weakest first.
    pub const ALL: [SimdLevel; 5] =
        [SimdLevel::Scalar, SimdLevel::Avx2, SimdLevel::Avx512, SimdLevel::Avx512Bf16, SimdLevel::Amx];

    /// The lower-case name used by `MOE_LANES_SIMD` and in reports.
    pub fn name(self) -> &'static str {
        match self {
            SimdLevel::Scalar => "scalar",
            SimdLevel::Avx2 => "avx2",
            SimdLevel::Avx512 => "avx512",
            SimdLevel::Avx512Bf16 => "avx512bf16",
            SimdLevel::Amx => "amx",
        }
    }

    /// Parses a level name (case-insensitive, surrounding whitespace ignored).
    pub fn parse(name: &str) -> Result<SimdLevel, KernelError> {
        let lowered = name.trim().to_ascii_lowercase();
        SimdLevel::ALL
            .into_iter()
            .find(|level| level.name() == lowered)
            .ok_or_else(|| KernelError::UnknownSimdLevel { name: name.to_string() })
    }

    /// The best level this CPU supports, detected once and cached.
    pub fn detect() -> SimdLevel {
        static DETECTED: OnceLock<SimdLevel> = OnceLock::new();
        *DETECTED.get_or_init(|| available().into_iter().max().unwrap_or(SimdLevel::Scalar))
    }

    /// Whether this CPU can run this level.
    pub fn is_supported(self) -> bool {
        supported_flags()[self as usize]
    }

    /// The forced level if one is given (an error if this CPU lacks it), else
    /// [`SimdLevel::detect`]. Callers read any override (e.g. `MOE_LANES_SIMD`) at their edge.
    pub fn resolve(forced: Option<SimdLevel>) -> Result<SimdLevel, KernelError> {
        match forced {
            Some(level) => {
                level.ensure_supported()?;
                Ok(level)
            }
            None => Ok(SimdLevel::detect()),
        }
    }

    /// Whether this level runs the VNNI 8-bit-activation tiles here (every quantised type, one
    /// token and many): an AVX-512 level on a CPU with AVX-512 VNNI (`vpdpbusd`), BW and VL
    /// ([`has_avx512_vnni`]).
    pub fn has_q8_dot(self) -> bool {
        self >= SimdLevel::Avx512 && self.is_supported() && has_avx512_vnni()
    }

    /// Whether this level has a one-token tile with 8-bit activations for `dtype`: every
    /// quantised type with VNNI ([`SimdLevel::has_q8_dot`]); Q4_0, Q4_K, Q5_K and Q6_K on AVX2 and on
    /// AVX-512 without VNNI (`vpmaddubsw`, `x86_quant_q8_avx2.rs`).
    pub fn has_q8_tile(self, dtype: crate::WeightDType) -> bool {
        if self.has_q8_dot() {
            return dtype.is_quantized();
        }
        #[cfg(target_arch = "x86_64")]
        return self >= SimdLevel::Avx2
            && self.is_supported()
            && crate::x86_quant_tile::avx2_q8::takes(dtype);
        #[cfg(not(target_arch = "x86_64"))]
        return false;
    }

    /// Whether this level has any 8-bit-activation tile ([`SimdLevel::has_q8_tile`]).
    pub fn has_q8_tiles(self) -> bool {
        self.has_q8_dot() || cfg!(target_arch = "x86_64") && self >= SimdLevel::Avx2 && self.is_supported()
    }

    /// Parses a forced level name and checks that this CPU supports it.
    pub fn from_forced_name(name: &str) -> Result<SimdLevel, KernelError> {
        let level = SimdLevel::parse(name)?;
        level.ensure_supported()?;
        Ok(level)
    }

    /// `Ok(())` if this CPU supports the level, else [`KernelError::UnsupportedSimdLevel`].
    pub fn ensure_supported(self) -> Result<(), KernelError> {
        if self.is_supported() {
            Ok(())
        } else {
            let names: Vec<&str> = available().iter().map(|level| level.name()).collect();
            Err(KernelError::UnsupportedSimdLevel { level: self.name(), available: names.join(",") })
        }
    }
}

impl std::fmt::Display for SimdLevel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for SimdLevel {
    type Err = KernelError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        SimdLevel::parse(s)
    }
}

/// The levels this CPU can run, weakest first (always starts with `Scalar`).
pub fn available() -> Vec<SimdLevel> {
    SimdLevel::ALL.into_iter().filter(|level| level.is_supported()).collect()
}

/// Whether this CPU has AVX-512 VNNI with the BW and VL subsets the integer decode tiles use
/// (with AVX-512F), detected once.
pub fn has_avx512_vnni() -> bool {
    static VNNI: OnceLock<bool> = OnceLock::new();
    *VNNI.get_or_init(detect_vnni)
}

#[cfg(target_arch = "x86_64")]
fn detect_vnni() -> bool {
    is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512vl")
        && is_x86_feature_detected!("avx512vnni")
}

#[cfg(not(target_arch = "x86_64"))]
fn detect_vnni() -> bool {
    false
}

/// Per-level support flags, indexed by `SimdLevel as usize`, detected once.
fn supported_flags() -> [bool; 5] {
    static FLAGS: OnceLock<[bool; 5]> = OnceLock::new();
    *FLAGS.get_or_init(detect_flags)
}

#[cfg(target_arch = "x86_64")]
fn detect_flags() -> [bool; 5] {
    let avx2 = is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c");
    // The AVX-512 kernels also use F16C (for F16 weights) and AVX2-era instructions for tails.
    let avx512 = avx2 && is_x86_feature_detected!("avx512f");
    let avx512_bf16 = avx512 && is_x86_feature_detected!("avx512bf16");
    // AMX last: detecting it asks Linux for the tile state (once per process).
    let amx = avx512_bf16 && crate::x86_amx::detect();
    [true, avx2, avx512, avx512_bf16, amx]
}

#[cfg(not(target_arch = "x86_64"))]
fn detect_flags() -> [bool; 5] {
    [true, false, false, false, false]
}
