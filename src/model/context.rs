//! The context size of a session: how many positions (prompt + generated tokens) a KV cache may
//! hold. The default is the model's trained context (`context_length` in GGUF metadata,
//! `max_position_embeddings` in config.json), lowered to what fits in memory; an explicit size is
//! refused when it is past the trained context or does not fit.

use crate::model::config::ModelConfig;
use moe_lanes_kernels::kv::kv_ring_rows;

/// The element type of a KV cache (`--cache-type-k` / `--cache-type-v` at the CLI, as
/// llama.cpp): f32, f16, bf16 or q8_0 (blocks of 32 values, one f16 scale and 32 int8). The GPU
/// engine and the CPU pipeline read every type (computing in f32); the reference oracle keeps
/// f32. Defined with the kernels that read it ([`moe_lanes_kernels::kv`]).
pub use moe_lanes_kernels::kv::{KvType, KvTypeError};

/// Bytes of an f32 KV cache per position (the reference oracle's; [`kv_bytes_per_position_of`]
/// for the other types).
pub fn kv_bytes_per_position(c: &ModelConfig) -> u64 {
    kv_bytes_per_position_of(c, KvType::F32)
}

/// Bytes of KV cache per position in a cache of `kv`: K and V of every full attention layer (a
/// sliding-window layer keeps a bounded ring instead, [`window_kv_bytes`]; a hybrid's DeltaNet
/// layers a fixed-size state, [`recurrent_state_bytes`]).
pub fn kv_bytes_per_position_of(c: &ModelConfig, kv: KvType) -> u64 {
    // A latent attention layer keeps one latent and key part per position, no K and V.
    if let Some(m) = &c.mla {
        return c.n_layers as u64 * kv.bytes_of((m.kv_lora_rank + m.qk_rope_head_dim) as u64);
    }
    // Each attention layer at its own width (Gemma 4's global layers have their own KV heads and
    // head dim).
    let full = attention_layers(c).filter(|&l| c.window_of(l).is_none());
    2 * full.map(|l| kv.bytes_of(c.layer_kv_dim(l) as u64)).sum::<u64>()
}

/// The layers that keep K and V (every layer but a hybrid's DeltaNet layers; none with latent
/// attention, which keeps one latent row per position).
fn attention_layers(c: &ModelConfig) -> Box<dyn Iterator<Item = usize> + '_> {
    match (&c.mla, &c.hybrid) {
        (Some(_), _) => Box::new(std::iter::empty()),
        (None, Some(h)) => Box::new(h.full_attention_layers.iter().copied()),
        (None, None) => Box::new(0..c.n_layers),
    }
}

/// Bytes of the sliding-window layers' KV in a session of `n_positions` in a cache of `kv`:
/// each keeps at most its ring and the ring's mirror, [`kv_ring_rows`] rows of K and V,
/// whatever the context (what the GPU allocates; the CPU pipeline drops its rows past the same
/// bound after each call).
pub fn window_kv_bytes(c: &ModelConfig, kv: KvType, n_positions: usize) -> u64 {
    let rows = |l: usize| c.window_of(l).map_or(0, |w| kv_ring_rows(w, n_positions));
    2 * attention_layers(c).map(|l| rows(l) as u64 * kv.bytes_of(c.layer_kv_dim(l) as u64)).sum::<u64>()
}

/// Bytes of a session's fixed-size recurrent state (f32): per Gated DeltaNet layer the conv's
/// last inputs and the `[v_heads, k_head_dim, v_head_dim]` matrix; 0 without such layers.
pub fn recurrent_state_bytes(c: &ModelConfig) -> u64 {
    let Some(h) = &c.hybrid else { return 0 };
    let key_dim = h.n_k_heads * h.k_head_dim;
    let value_dim = h.n_v_heads * h.v_head_dim;
    let conv = (2 * key_dim + value_dim) * (h.conv_kernel - 1);
    let matrix = h.n_v_heads * h.k_head_dim * h.v_head_dim;
    let layers = c.n_layers - h.full_attention_layers.len();
    4 * (layers * (conv + matrix)) as u64
}

/// Bytes of one session of `n_positions` in a cache of `kv`: its KV (the full layers' per
/// position, the window layers' rings) and its recurrent state.
pub fn session_bytes(c: &ModelConfig, kv: KvType, n_positions: usize) -> u64 {
    kv_bytes_per_position_of(c, kv) * n_positions as u64
        + window_kv_bytes(c, kv, n_positions)
        + recurrent_state_bytes(c)
}

/// Bytes of a session's KV and state that do not grow with its context: the recurrent state and
/// the window layers' full rings.
fn fixed_bytes(c: &ModelConfig, kv: KvType) -> u64 {
    recurrent_state_bytes(c) + window_kv_bytes(c, kv, usize::MAX)
}

/// Why a context size cannot be used.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ContextError {
    #[error("context size 0: a context holds at least one position")]
    Zero,
    #[error(
        "context size {asked_positions} is past the model's trained context of {trained_positions} positions"
    )]
    PastTrained { asked_positions: usize, trained_positions: usize },
    #[error(
        "context size {asked_positions} needs {kv_bytes} bytes of KV cache, but {available_bytes} bytes of memory \
         are available (at most {fits_positions} positions fit)"
    )]
    NoMemory { asked_positions: usize, kv_bytes: u64, available_bytes: u64, fits_positions: usize },
}

/// The context a session gets: `asked` (or the trained context when `None`), checked against the
/// trained context and against `available_bytes` of memory for a KV cache of `kv` (`None`:
/// unknown, not checked). A default is lowered to what fits; an explicit size that does not fit
/// is an error.
pub fn resolve_context(
    c: &ModelConfig,
    asked: Option<usize>,
    available_bytes: Option<u64>,
    kv: KvType,
) -> Result<usize, ContextError> {
    let trained = c.max_positions;
    let per_position = kv_bytes_per_position_of(c, kv).max(1);
    let available_bytes = available_bytes.map(|b| b.saturating_sub(fixed_bytes(c, kv)));
    let fits = available_bytes.map(|b| usize::try_from(b / per_position).unwrap_or(usize::MAX));
    let Some(asked) = asked else {
        return Ok(fits.map_or(trained, |f| trained.min(f).max(1)));
    };
    if asked == 0 {
        return Err(ContextError::Zero);
    }
    if asked > trained {
        return Err(ContextError::PastTrained { asked_positions: asked, trained_positions: trained });
    }
    match (fits, available_bytes) {
        (Some(f), Some(available)) if asked > f => Err(ContextError::NoMemory {
            asked_positions: asked,
            kv_bytes: per_position.saturating_mul(asked as u64),
            available_bytes: available,
            fits_positions: f,
        }),
        _ => Ok(asked),
    }
}

/// `MemAvailable` of `/proc/meminfo` in bytes; `None` where the file or the line is missing.
pub fn available_memory_bytes() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    parse_mem_available(&text)
}

fn parse_mem_available(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// Most recurrent-state checkpoints one session cache keeps ([`StateCheckpoints`]). Cost: each
/// holds every DeltaNet layer's state once (a Qwen3.6-35B-A3B-shaped model: 30 layers, about 63
/// MiB; [`recurrent_state_bytes`]).
pub const MAX_STATE_CHECKPOINTS: usize = 4;

/// A session's recurrent (DeltaNet) state at earlier positions, so that a cache kept for prefix
/// reuse can go back to one of them (a recurrent state cannot be cut like an attention cache):
/// at most [`MAX_STATE_CHECKPOINTS`], in position order, the oldest dropped past the limit.
/// `S` is the engine's copy of the state.
#[derive(Debug, Clone)]
pub struct StateCheckpoints<S> {
    at: Vec<(usize, S)>,
}

impl<S> Default for StateCheckpoints<S> {
    fn default() -> Self {
        StateCheckpoints { at: Vec::new() }
    }
}

impl<S> StateCheckpoints<S> {
    /// Whether one was taken at `position` (so none is needed there).
    pub fn has(&self, position: usize) -> bool {
        self.at.iter().any(|(p, _)| *p == position)
    }

    /// Keep `state` as the state at `position`, past the later ones (a session only grows
    /// between its rewinds).
    pub fn push(&mut self, position: usize, state: S) {
        self.at.retain(|(p, _)| *p < position);
        self.at.push((position, state));
        if self.at.len() > MAX_STATE_CHECKPOINTS {
            self.at.remove(0);
        }
    }

    /// The latest position at or before `n` with a checkpoint.
    pub fn latest_at_most(&self, n: usize) -> Option<usize> {
        self.at.iter().rev().map(|(p, _)| *p).find(|&p| p <= n)
    }

    /// The most positions up to `n` that a session holding `held` can be cut back to: `n` (at
    /// most `held`) without recurrent state or from `held` up, else the latest checkpoint at or
    /// before `n`.
    pub fn reach(&self, n: usize, held: usize, recurrent: bool) -> Option<usize> {
        match n >= held || !recurrent {
            true => Some(n.min(held)),
            false => self.latest_at_most(n),
        }
    }

    /// The state at exactly `position`, the later checkpoints dropped (the session goes back
    /// there); `None`, changing nothing, without one.
    pub fn rewind(&mut self, position: usize) -> Option<&S> {
        let i = self.at.iter().position(|(p, _)| *p == position)?;
        self.at.truncate(i + 1);
        Some(&self.at[i].1)
    }

    pub fn len(&self) -> usize {
        self.at.len()
    }

    pub fn is_empty(&self) -> bool {
        self.at.is_empty()
    }

    /// Every kept state, oldest first (for their memory).
    pub fn states(&self) -> impl Iterator<Item = &S> {
        self.at.iter().map(|(_, s)| s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kv_types_parse_and_count_their_bytes() {
        assert_eq!("f16".parse::<KvType>(), Ok(KvType::F16));
        assert_eq!("F32".parse::<KvType>(), Ok(KvType::F32));
        assert_eq!("q8_0".parse::<KvType>(), Ok(KvType::Q8_0));
        let err = "q4_0".parse::<KvType>().unwrap_err().to_string();
        assert!(err.contains("f32, f16, bf16 and q8_0"), "{err}");
        let t: KvType = serde_json::from_str("\"bf16\"").unwrap();
        assert_eq!(t, KvType::Bf16);
        let c = config();
        let f32_bytes = kv_bytes_per_position(&c);
        assert_eq!(2 * kv_bytes_per_position_of(&c, KvType::F16), f32_bytes);
        assert_eq!(2 * kv_bytes_per_position_of(&c, KvType::Bf16), f32_bytes);
        // q8_0: 34 bytes per 32 values.
        assert_eq!(kv_bytes_per_position_of(&c, KvType::Q8_0) * 128, f32_bytes * 34);
        let room = 10 * kv_bytes_per_position_of(&c, KvType::Q8_0);
        assert_eq!(resolve_context(&c, None, Some(room), KvType::Q8_0), Ok(10));
        assert_eq!(resolve_context(&c, None, Some(room), KvType::F32), Ok(10 * 34 / 128));
    }

    fn config() -> ModelConfig {
        let adapter = crate::model::arch::by_name("qwen3_moe").unwrap();
        crate::synth::synth_config(adapter, crate::synth::Preset::Tiny, &Default::default()).unwrap()
    }

    #[test]
    fn default_is_trained_context_lowered_to_memory() {
        let c = config();
        assert_eq!(resolve_context(&c, None, None, KvType::F32), Ok(c.max_positions));
        let per = kv_bytes_per_position(&c);
        assert_eq!(resolve_context(&c, None, Some(per * 10 + 1), KvType::F32), Ok(10));
        assert_eq!(resolve_context(&c, None, Some(0), KvType::F32), Ok(1));
    }

    #[test]
    fn explicit_sizes_are_checked() {
        let c = config();
        let per = kv_bytes_per_position(&c);
        assert_eq!(resolve_context(&c, Some(0), None, KvType::F32), Err(ContextError::Zero));
        assert_eq!(resolve_context(&c, Some(64), None, KvType::F32), Ok(64));
        let past = c.max_positions + 1;
        assert_eq!(
            resolve_context(&c, Some(past), None, KvType::F32),
            Err(ContextError::PastTrained { asked_positions: past, trained_positions: c.max_positions })
        );
        let err = resolve_context(&c, Some(20), Some(per * 10), KvType::F32).unwrap_err();
        assert_eq!(
            err,
            ContextError::NoMemory {
                asked_positions: 20,
                kv_bytes: per * 20,
                available_bytes: per * 10,
                fits_positions: 10
            }
        );
    }

    /// A hybrid's context costs KV only for its full-attention layers (one in four for
    /// Qwen3-Next), plus a fixed recurrent state.
    #[test]
    fn a_hybrid_pays_kv_for_its_attention_layers_only() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/qwen3_next_a");
        let text = std::fs::read_to_string(dir.join("config.json")).unwrap();
        let (c, _) = ModelConfig::from_hf_json(&serde_json::from_str(&text).unwrap(), &dir).unwrap();
        assert_eq!(c.n_attention_layers(), 1);
        assert_eq!(kv_bytes_per_position(&c), 2 * c.kv_dim() as u64 * 4);
        // 3 DeltaNet layers: conv (2*32 + 48) x 3 and matrix 4 x 16 x 12, f32.
        assert_eq!(recurrent_state_bytes(&c), 4 * 3 * (112 * 3 + 4 * 16 * 12));
        assert_eq!(
            session_bytes(&c, KvType::F32, 10),
            10 * kv_bytes_per_position(&c) + recurrent_state_bytes(&c)
        );
        let room = recurrent_state_bytes(&c) + 5 * kv_bytes_per_position(&c);
        assert_eq!(resolve_context(&c, None, Some(room), KvType::F32), Ok(5));
    }

    /// Gemma 4's global layers pay their own width per position: the fixture's config with its
    /// global layers widened to 4 KV heads of 32 (the sliding ones keep 2 of 16), in f32 and
    /// q8_0's blocks; its sliding layers (0 and 2) pay their ring, the same at any longer context.
    #[test]
    fn layers_of_their_own_width_pay_their_own_bytes() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/gemma4_a");
        let text = std::fs::read_to_string(dir.join("config.json")).unwrap();
        let (mut c, _) = ModelConfig::from_hf_json(&serde_json::from_str(&text).unwrap(), &dir).unwrap();
        let g = c.global_attention.as_mut().expect("gemma4 has global layers");
        g.n_kv_heads = 4;
        assert_eq!((c.layer_kv_dim(0), c.layer_kv_dim(1), c.n_layers), (32, 128, 4));
        assert_eq!(kv_bytes_per_position(&c), 2 * 4 * (128 + 128));
        assert_eq!(kv_bytes_per_position_of(&c, KvType::Q8_0), 2 * 34 * (4 + 4));
        let window = c.sliding_window.expect("gemma4 slides");
        let ring = moe_lanes_kernels::kv::kv_ring_positions(window) as u64;
        assert_eq!(window_kv_bytes(&c, KvType::F32, 10), 2 * 2 * 10 * 4 * 32, "below the ring: every row");
        for n in [2 * ring as usize, 100_000] {
            assert_eq!(window_kv_bytes(&c, KvType::F32, n), 2 * 2 * (2 * ring) * 4 * 32, "the ring at {n}");
        }
        let long = session_bytes(&c, KvType::F32, 100_000);
        assert_eq!(long, 100_000 * 2 * 4 * 256 + 2 * 2 * (2 * ring) * 4 * 32);
        let room = fixed_bytes(&c, KvType::F32) + 7 * kv_bytes_per_position(&c);
        assert_eq!(resolve_context(&c, None, Some(room), KvType::F32), Ok(7.min(c.max_positions)));
    }

    #[test]
    fn meminfo_is_parsed() {
        let text = "MemTotal:       24000000 kB\nMemAvailable:   2048 kB\n";
        assert_eq!(parse_mem_available(text), Some(2048 * 1024));
        assert_eq!(parse_mem_available("MemTotal: 1 kB\n"), None);
    }

    #[test]
    fn checkpoints_keep_the_latest_and_rewind_drops_the_later_ones() {
        let mut c = StateCheckpoints::default();
        for p in 1..=MAX_STATE_CHECKPOINTS + 2 {
            c.push(8 * p, p);
        }
        assert_eq!(c.len(), MAX_STATE_CHECKPOINTS, "the oldest dropped past the limit");
        assert!(!c.has(8) && !c.has(16) && c.has(24));
        assert_eq!(c.latest_at_most(47), Some(40));
        assert_eq!(c.latest_at_most(23), None);
        assert_eq!(c.rewind(30), None, "no checkpoint at 30: nothing changes");
        assert_eq!(c.len(), MAX_STATE_CHECKPOINTS);
        assert_eq!(c.rewind(32), Some(&4));
        assert_eq!((c.len(), c.latest_at_most(usize::MAX)), (2, Some(32)));
        // a session grows again from 32: a checkpoint at 36 goes after it, one at 28 replaces
        // everything from 28 on
        c.push(36, 9);
        c.push(28, 7);
        assert_eq!(c.states().copied().collect::<Vec<_>>(), vec![3, 7]);
    }
}
