//! KV cache element types, and one KV head's cached rows in one of them (the CPU attention reads
//! every type; [`crate::attention`](mod@crate::attention)).
//!
//! The types are llama.cpp's (`--cache-type-k/v`): f32, f16, bf16 (both rounded to nearest
//! even) and q8_0 (blocks of [`Q8_0_BLOCK`] values: one f16 scale `d = max|x| / 127` and 32
//! int8 `round(x / d)`, [`Q8_0_BLOCK_BYTES`] bytes; a row's length must be a multiple of 32).

use half::{bf16, f16};

use crate::error::KernelError;

/// Values per q8_0 block.
pub const Q8_0_BLOCK: usize = 32;
/// Bytes per q8_0 block: the f16 scale, then 32 int8.
pub const Q8_0_BLOCK_BYTES: usize = 34;

/// The most positions one call appends to a sequence of a model with sliding-window layers
/// (`-DKV_RING_CHUNK` for the CUDA kernels): a window layer keeps [`kv_ring_positions`] of them,
/// enough for the window and one call's new keys. 512 is llama.cpp's default micro-batch; a GPU
/// prompt longer runs as calls of this many tokens (each call reads the layer's weights once).
pub const KV_RING_CHUNK_POSITIONS: usize = 512;

/// The positions a sliding-window layer of `window` keeps: the window and one call's
/// [`KV_RING_CHUNK_POSITIONS`] (0 for a full layer, `window` 0).
///
/// On the GPU it is a mirrored ring: position p at row p % R and, from p >= R on, at row
/// p % R + R as well, so any R consecutive positions are contiguous rows and the attention
/// kernels read them as a full layer's cache moved back by a multiple of R rows
/// (`attention.cu`'s `kv_ring_base`).
pub const fn kv_ring_positions(window: usize) -> usize {
    if window == 0 {
        0
    } else {
        window + KV_RING_CHUNK_POSITIONS
    }
}

/// Rows a layer's GPU cache of `capacity` positions holds: all of them for a full layer
/// (`window` 0), at most twice [`kv_ring_positions`] (the ring and its mirror) for a window.
pub const fn kv_ring_rows(window: usize, capacity: usize) -> usize {
    let ring = kv_ring_positions(window);
    if ring == 0 || capacity < 2 * ring {
        capacity
    } else {
        2 * ring
    }
}

/// The element type of a KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum KvType {
    #[serde(rename = "f32")]
    F32,
    #[serde(rename = "f16")]
    F16,
    #[serde(rename = "bf16")]
    Bf16,
    #[serde(rename = "q8_0")]
    Q8_0,
}

/// A KV cache type name that is not one of [`KvType::ALL`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KvTypeError {
    #[error("KV cache type {0:?} is not supported: the supported types are f32, f16, bf16 and q8_0")]
    Unsupported(String),
}

impl KvType {
    pub const ALL: [KvType; 4] = [KvType::F32, KvType::F16, KvType::Bf16, KvType::Q8_0];

    /// Bytes of `n_values` cached values (q8_0: whole blocks, `n_values` rounded up to 32).
    pub fn bytes_of(self, n_values: u64) -> u64 {
        match self {
            KvType::F32 => 4 * n_values,
            KvType::F16 | KvType::Bf16 => 2 * n_values,
            KvType::Q8_0 => n_values.div_ceil(Q8_0_BLOCK as u64) * Q8_0_BLOCK_BYTES as u64,
        }
    }

    /// Values per block: a cached row's length must be a multiple of it (32 for q8_0, else 1).
    pub fn block_len(self) -> usize {
        match self {
            KvType::Q8_0 => Q8_0_BLOCK,
            _ => 1,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            KvType::F32 => "f32",
            KvType::F16 => "f16",
            KvType::Bf16 => "bf16",
            KvType::Q8_0 => "q8_0",
        }
    }
}

impl std::str::FromStr for KvType {
    type Err = KvTypeError;
    fn from_str(s: &str) -> Result<KvType, KvTypeError> {
        let lower = s.to_ascii_lowercase();
        KvType::ALL
            .into_iter()
            .find(|t| t.name() == lower)
            .ok_or_else(|| KvTypeError::Unsupported(s.to_string()))
    }
}

impl std::fmt::Display for KvType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// One q8_0 block of `x` (32 values) into `out` (34 bytes), as llama.cpp's
/// `quantize_row_q8_0_ref`: `d = max|x| / 127`, `q = round(x / d)` (half away from zero), `d`
/// stored as f16.
pub fn quantize_q8_0_block(x: &[f32], out: &mut [u8]) {
    let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let d = amax / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    out[..2].copy_from_slice(&f16::from_f32(d).to_bits().to_le_bytes());
    for (q, v) in out[2..Q8_0_BLOCK_BYTES].iter_mut().zip(x) {
        *q = (v * id).round() as i8 as u8;
    }
}

/// One q8_0 block (34 bytes) decoded into `out` (32 values): `d * q`.
pub fn dequantize_q8_0_block(block: &[u8], out: &mut [f32]) {
    let d = f16::from_bits(u16::from_le_bytes([block[0], block[1]])).to_f32();
    for (o, &q) in out.iter_mut().zip(&block[2..Q8_0_BLOCK_BYTES]) {
        *o = d * (q as i8) as f32;
    }
}

/// A KV head's cache: `positions x head_dim` values in one type, appended row by row.
#[derive(Debug, Clone, PartialEq)]
pub enum KvRows {
    F32(Vec<f32>),
    /// f16 bit patterns.
    F16(Vec<u16>),
    /// bf16 bit patterns.
    Bf16(Vec<u16>),
    /// q8_0 blocks of [`Q8_0_BLOCK_BYTES`].
    Q8_0(Vec<u8>),
}

impl KvRows {
    pub fn new(t: KvType) -> KvRows {
        match t {
            KvType::F32 => KvRows::F32(Vec::new()),
            KvType::F16 => KvRows::F16(Vec::new()),
            KvType::Bf16 => KvRows::Bf16(Vec::new()),
            KvType::Q8_0 => KvRows::Q8_0(Vec::new()),
        }
    }

    /// f32 values as they are (tests, and the kernels' own fixtures).
    pub fn from_f32(values: Vec<f32>) -> KvRows {
        KvRows::F32(values)
    }

    /// `values` converted to `t` (q8_0: a multiple of 32 values).
    pub fn converted(t: KvType, values: &[f32]) -> Result<KvRows, KernelError> {
        let mut rows = KvRows::new(t);
        rows.push(values)?;
        Ok(rows)
    }

    pub fn kv_type(&self) -> KvType {
        match self {
            KvRows::F32(_) => KvType::F32,
            KvRows::F16(_) => KvType::F16,
            KvRows::Bf16(_) => KvType::Bf16,
            KvRows::Q8_0(_) => KvType::Q8_0,
        }
    }

    /// Values held.
    pub fn n_values(&self) -> usize {
        match self {
            KvRows::F32(v) => v.len(),
            KvRows::F16(v) | KvRows::Bf16(v) => v.len(),
            KvRows::Q8_0(b) => b.len() / Q8_0_BLOCK_BYTES * Q8_0_BLOCK,
        }
    }

    /// Bytes held (not counting spare capacity).
    pub fn bytes(&self) -> usize {
        self.kv_type().bytes_of(self.n_values() as u64) as usize
    }

    /// Room for `n_values` more values without reallocating.
    pub fn reserve(&mut self, n_values: usize) {
        match self {
            KvRows::F32(v) => v.reserve(n_values),
            KvRows::F16(v) | KvRows::Bf16(v) => v.reserve(n_values),
            KvRows::Q8_0(b) => b.reserve(n_values.div_ceil(Q8_0_BLOCK) * Q8_0_BLOCK_BYTES),
        }
    }

    /// Appends `values` converted to the type (q8_0: a multiple of 32 values, else an error and
    /// nothing appended).
    pub fn push(&mut self, values: &[f32]) -> Result<(), KernelError> {
        match self {
            KvRows::F32(v) => v.extend_from_slice(values),
            KvRows::F16(v) => v.extend(values.iter().map(|&x| f16::from_f32(x).to_bits())),
            KvRows::Bf16(v) => v.extend(values.iter().map(|&x| bf16::from_f32(x).to_bits())),
            KvRows::Q8_0(b) => {
                if !values.len().is_multiple_of(Q8_0_BLOCK) {
                    let expected = values.len().div_ceil(Q8_0_BLOCK) * Q8_0_BLOCK;
                    let what = "q8_0 KV row (a multiple of 32 values)";
                    return Err(KernelError::ShapeMismatch { what, expected, actual: values.len() });
                }
                let at = b.len();
                b.resize(at + values.len() / Q8_0_BLOCK * Q8_0_BLOCK_BYTES, 0);
                for (x, out) in
                    values.chunks_exact(Q8_0_BLOCK).zip(b[at..].chunks_exact_mut(Q8_0_BLOCK_BYTES))
                {
                    quantize_q8_0_block(x, out);
                }
            }
        }
        Ok(())
    }

    /// Keep the first `n_values` values (whole rows; q8_0: whole blocks, rounded down).
    pub fn truncate(&mut self, n_values: usize) {
        match self {
            KvRows::F32(v) => v.truncate(n_values),
            KvRows::F16(v) | KvRows::Bf16(v) => v.truncate(n_values),
            KvRows::Q8_0(b) => b.truncate(n_values / Q8_0_BLOCK * Q8_0_BLOCK_BYTES),
        }
    }

    /// Forget the first `n_values` (whole rows: a multiple of the q8_0 block for q8_0), moving
    /// the rest to the front (a sliding-window layer dropping positions no query sees).
    pub fn drain_front(&mut self, n_values: usize) {
        match self {
            KvRows::F32(v) => drop(v.drain(..n_values)),
            KvRows::F16(v) | KvRows::Bf16(v) => drop(v.drain(..n_values)),
            KvRows::Q8_0(b) => drop(b.drain(..n_values / Q8_0_BLOCK * Q8_0_BLOCK_BYTES)),
        }
    }

    /// Forget every value (the memory stays allocated).
    pub fn clear(&mut self) {
        match self {
            KvRows::F32(v) => v.clear(),
            KvRows::F16(v) | KvRows::Bf16(v) => v.clear(),
            KvRows::Q8_0(b) => b.clear(),
        }
    }

    /// The f32 values in place, for an f32 cache.
    pub fn as_f32(&self) -> Option<&[f32]> {
        match self {
            KvRows::F32(v) => Some(v),
            _ => None,
        }
    }

    /// Values `start..start + out.len()` as f32 (q8_0: `start` and the length multiples of 32;
    /// the attention's rows always are, [`KvType::block_len`]). Panics past the end.
    pub fn decode(&self, start: usize, out: &mut [f32]) {
        let n = out.len();
        match self {
            KvRows::F32(v) => out.copy_from_slice(&v[start..start + n]),
            KvRows::F16(v) => f16_to_f32(&v[start..start + n], out),
            // The shift into the high half: a loop the compiler vectorises.
            KvRows::Bf16(v) => {
                for (o, &b) in out.iter_mut().zip(&v[start..start + n]) {
                    *o = f32::from_bits((b as u32) << 16);
                }
            }
            KvRows::Q8_0(b) => {
                assert!(
                    start.is_multiple_of(Q8_0_BLOCK) && n.is_multiple_of(Q8_0_BLOCK),
                    "q8_0 rows are read in whole blocks"
                );
                let blocks = &b[start / Q8_0_BLOCK * Q8_0_BLOCK_BYTES..][..n / Q8_0_BLOCK * Q8_0_BLOCK_BYTES];
                for (block, o) in blocks.chunks_exact(Q8_0_BLOCK_BYTES).zip(out.chunks_exact_mut(Q8_0_BLOCK))
                {
                    dequantize_q8_0_block(block, o);
                }
            }
        }
    }

    /// Every value as f32.
    pub fn to_f32_vec(&self) -> Vec<f32> {
        let mut out = vec![0.0; self.n_values()];
        self.decode(0, &mut out);
        out
    }
}

/// f16 bit patterns to f32: eight at a time by F16C's `vcvtph2ps` where the CPU has it (exact,
/// as every f16 is an f32), else `half`'s conversion.
fn f16_to_f32(bits: &[u16], out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("f16c") && std::arch::is_x86_feature_detected!("avx") {
        // SAFETY: the CPU has F16C and AVX (checked above).
        return unsafe { f16_to_f32_f16c(bits, out) };
    }
    half::slice::HalfFloatSliceExt::convert_to_f32_slice(bytemuck::cast_slice::<u16, f16>(bits), out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx,f16c")]
// SAFETY (callers): the CPU has AVX and F16C.
unsafe fn f16_to_f32_f16c(bits: &[u16], out: &mut [f32]) {
    use std::arch::x86_64::{__m128i, _mm256_cvtph_ps, _mm256_storeu_ps, _mm_loadu_si128};
    let n = bits.len().min(out.len());
    let whole = n / 8 * 8;
    for i in (0..whole).step_by(8) {
        // SAFETY: i + 8 <= n values of both slices; unaligned loads and stores.
        unsafe {
            let h = _mm_loadu_si128(bits.as_ptr().add(i) as *const __m128i);
            _mm256_storeu_ps(out.as_mut_ptr().add(i), _mm256_cvtph_ps(h));
        }
    }
    for i in whole..n {
        out[i] = f16::from_bits(bits[i]).to_f32();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn types_parse_and_count_their_bytes() {
        for t in KvType::ALL {
            assert_eq!(t.name().parse::<KvType>(), Ok(t));
            assert_eq!(serde_json::from_str::<KvType>(&format!("\"{t}\"")).unwrap(), t);
        }
        assert_eq!("Q8_0".parse::<KvType>(), Ok(KvType::Q8_0));
        let err = "q4_0".parse::<KvType>().unwrap_err().to_string();
        assert!(err.contains("\"q4_0\"") && err.contains("f32, f16, bf16 and q8_0"), "{err}");
        assert_eq!(KvType::F32.bytes_of(64), 256);
        assert_eq!(KvType::Bf16.bytes_of(64), 128);
        assert_eq!(KvType::Q8_0.bytes_of(64), 68);
    }

    #[test]
    fn rows_round_trip_within_their_rounding() {
        let values: Vec<f32> = (0..128).map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.0123).collect();
        let amax = values.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        for (t, bound) in [(KvType::F32, 0.0), (KvType::F16, 1.0 / 2048.0), (KvType::Bf16, 1.0 / 256.0)] {
            let rows = KvRows::converted(t, &values).unwrap();
            assert_eq!((rows.n_values(), rows.bytes()), (128, t.bytes_of(128) as usize));
            for (a, b) in rows.to_f32_vec().iter().zip(&values) {
                assert!((a - b).abs() <= bound * b.abs(), "{t}: {a} vs {b}");
            }
        }
        // q8_0: half a step of the block's scale (plus the scale's own f16 rounding).
        let rows = KvRows::converted(KvType::Q8_0, &values).unwrap();
        for (a, b) in rows.to_f32_vec().iter().zip(&values) {
            assert!((a - b).abs() <= amax / 127.0 * 0.51, "q8_0: {a} vs {b}");
        }
        let mut tail = vec![0.0; 32];
        rows.decode(64, &mut tail);
        assert_eq!(tail, rows.to_f32_vec()[64..96]);
    }

    /// The F16C path widens every f16 exactly as `half` does (NaNs stay NaNs).
    #[test]
    fn f16_decoding_is_exact_for_every_pattern() {
        let bits: Vec<u16> = (0..=u16::MAX).collect();
        let mut fast = vec![0.0f32; bits.len()];
        f16_to_f32(&bits, &mut fast);
        for (&b, &x) in bits.iter().zip(&fast) {
            let want = f16::from_bits(b).to_f32();
            assert!(x.to_bits() == want.to_bits() || (x.is_nan() && want.is_nan()), "{b:#x}: {x} vs {want}");
        }
    }

    #[test]
    fn q8_0_rows_must_be_whole_blocks() {
        let mut rows = KvRows::new(KvType::Q8_0);
        let err = rows.push(&[1.0; 20]).unwrap_err();
        assert!(matches!(err, KernelError::ShapeMismatch { expected: 32, actual: 20, .. }), "{err}");
        assert_eq!(rows.n_values(), 0);
        rows.push(&[0.0; 32]).unwrap();
        assert_eq!(rows.to_f32_vec(), vec![0.0; 32]);
    }

    /// The layout is llama.cpp's block_q8_0: the f16 scale first, then the int8 values.
    #[test]
    fn q8_0_block_layout_is_llama_cpp_s() {
        let mut x = [0.0f32; 32];
        x[0] = 1.27;
        x[1] = -0.64;
        let rows = KvRows::converted(KvType::Q8_0, &x).unwrap();
        let KvRows::Q8_0(b) = &rows else { unreachable!() };
        assert_eq!(u16::from_le_bytes([b[0], b[1]]), f16::from_f32(0.01).to_bits());
        assert_eq!((b[2] as i8, b[3] as i8, b[4]), (127, -64, 0));
    }
}
