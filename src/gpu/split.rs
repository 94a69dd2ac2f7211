//! Which layers each device runs when the model is split over several GPUs (llama.cpp's
//! `-sm layer`): contiguous ranges in layer order, the first device's starting at layer 0 (it
//! also runs the embedding), the last device's ending at the last layer (it also runs the head).
//!
//! A layer costs the bytes it puts on its device: its dense weights (as the device holds them:
//! float matrices as bf16, quantized ones as stored), its KV cache at the session's context (or
//! recurrent state), and its share of the hot cache; the embedding counts on the first layer, the
//! lm_head on the last. [`assign_layers`] cuts the layers where the running sum of those bytes
//! comes closest to each device's share of the total: shares by `--tensor-split` when given, else
//! by each device's free memory. The pure parts (`assign_layers`, `device_shares`,
//! `resolve_devices`) run without a GPU and are unit-tested here.

use crate::format::tensor::TensorRef;
use crate::model::arch::Mixer;
use crate::model::context::KvType;
use crate::model::naming::GlobalRole;
use crate::model::Model;
use std::ops::Range;

/// A device list or a layer split that cannot be used, refused by name before anything is
/// allocated.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SplitError {
    #[error("no devices to run the layers on")]
    NoDevices,
    #[error("--devices names device {ordinal}, but the driver reports {visible} CUDA device(s) (ordinals 0..{visible})")]
    NotVisible { ordinal: usize, visible: usize },
    #[error("--tensor-split gives {given} share(s) for {devices} device(s): give one share per device")]
    SplitLength { given: usize, devices: usize },
    #[error("--tensor-split share {index} is {value}: each share is a positive finite number")]
    BadShare { index: usize, value: f64 },
    #[error("{layers} layer(s) cannot be split over {devices} devices: each device runs at least one layer")]
    TooFewLayers { layers: usize, devices: usize },
}

/// The devices the engine runs on: `asked` (each ordinal visible; repeats allowed), else
/// `configured` alone (device 0, or the one `MOE_LANES_CUDA_DEVICE` names). A split is asked for
/// by name: the two-device path has run on one GPU twice (`tests/multi_gpu.rs`), not yet on
/// two GPUs, so a many-GPU machine keeps the one-device engine unless `--devices` says so.
pub fn resolve_devices(asked: &[usize], visible: usize, configured: usize) -> Result<Vec<usize>, SplitError> {
    let list: Vec<usize> = if asked.is_empty() { vec![configured] } else { asked.to_vec() };
    if visible == 0 {
        return Err(SplitError::NoDevices);
    }
    if list.is_empty() {
        return Err(SplitError::NoDevices);
    }
    match list.iter().find(|&&o| o >= visible) {
        Some(&ordinal) => Err(SplitError::NotVisible { ordinal, visible }),
        None => Ok(list),
    }
}

/// Each device's share: the `tensor_split` when given (one positive finite number per device),
/// else `fallback` (each device's free memory; a non-positive entry counts as the smallest
/// positive one).
pub fn device_shares(tensor_split: &[f64], fallback: &[f64]) -> Result<Vec<f64>, SplitError> {
    let devices = fallback.len();
    if devices == 0 {
        return Err(SplitError::NoDevices);
    }
    if tensor_split.is_empty() {
        let least =
            fallback.iter().copied().filter(|v| *v > 0.0 && v.is_finite()).fold(f64::INFINITY, f64::min);
        let least = if least.is_finite() { least } else { 1.0 };
        return Ok(fallback.iter().map(|&v| if v > 0.0 && v.is_finite() { v } else { least }).collect());
    }
    if tensor_split.len() != devices {
        return Err(SplitError::SplitLength { given: tensor_split.len(), devices });
    }
    check_shares(tensor_split)?;
    Ok(tensor_split.to_vec())
}

/// Every share a positive finite number.
fn check_shares(shares: &[f64]) -> Result<(), SplitError> {
    match shares.iter().position(|v| !(v.is_finite() && *v > 0.0)) {
        Some(index) => Err(SplitError::BadShare { index, value: shares[index] }),
        None => Ok(()),
    }
}

/// Contiguous layer ranges, one per device in order, covering every layer: the cut after device
/// `d` falls where the running sum of `layer_bytes` comes closest to the total times the shares
/// of devices `0..=d` over all shares, each device keeping at least one layer. Layers of zero
/// bytes all around count one byte each (an even split by count).
pub fn assign_layers(layer_bytes: &[u64], shares: &[f64]) -> Result<Vec<Range<usize>>, SplitError> {
    let (layers, devices) = (layer_bytes.len(), shares.len());
    if devices == 0 {
        return Err(SplitError::NoDevices);
    }
    check_shares(shares)?;
    if layers < devices {
        return Err(SplitError::TooFewLayers { layers, devices });
    }
    let even = layer_bytes.iter().all(|&b| b == 0);
    let mut cum = Vec::with_capacity(layers + 1);
    cum.push(0u128);
    for &b in layer_bytes {
        let b = if even { 1 } else { b as u128 };
        cum.push(cum.last().copied().unwrap_or(0) + b);
    }
    let (total, all_shares) = (cum[layers] as f64, shares.iter().sum::<f64>());
    let (mut ranges, mut start, mut share_sum) = (Vec::with_capacity(devices), 0, 0.0);
    for (d, share) in shares.iter().enumerate().take(devices - 1) {
        share_sum += share;
        let target = total * share_sum / all_shares;
        // leave at least one layer for each device after this one
        let last_end = layers - (devices - 1 - d);
        let off = |e: usize| (cum[e] as f64 - target).abs();
        let end =
            (start + 1..=last_end).min_by(|&a, &b| off(a).total_cmp(&off(b))).expect("a non-empty range");
        ranges.push(start..end);
        start = end;
    }
    ranges.push(start..layers);
    Ok(ranges)
}

/// Bytes of a tensor as the device holds it: a float matrix as bf16, a quantized one as stored.
fn device_bytes(t: TensorRef<'_>) -> u64 {
    if t.dtype.is_float() {
        2 * t.shape.iter().product::<usize>() as u64
    } else {
        t.data.len() as u64
    }
}

/// Each layer's bytes on its device ([`assign_layers`]'s input): dense weights, the KV cache of
/// `n_positions` in `kv_type` (a DeltaNet layer's f32 state), and `hot_bytes[l]` of hot cache; the
/// embedding on layer 0 and the lm_head (or, tied, the embedding again) on the last.
pub fn layer_bytes(model: &Model, kv_type: KvType, n_positions: usize, hot_bytes: &[u64]) -> Vec<u64> {
    let n_layers = model.config().n_layers;
    let positions = n_positions as u64;
    let mut bytes: Vec<u64> = (0..n_layers)
        .map(|l| {
            let roles = model.required_layer_roles(l);
            let dense: u64 = roles.into_iter().filter_map(|r| model.layer(l, r)).map(device_bytes).sum();
            let kv = match &model.layer_spec(l).mixer {
                Mixer::Attention(a) => {
                    let rows = moe_lanes_kernels::kv::kv_ring_rows(a.window.unwrap_or(0), n_positions) as u64;
                    kv_type.bytes_of(2 * rows * a.kv_dim() as u64)
                }
                Mixer::LatentAttention(m) => {
                    let (k_b, v_b) = model.mla_kv_b(l);
                    device_bytes(k_b)
                        + device_bytes(v_b)
                        + kv_type.bytes_of(positions * m.cache_width() as u64)
                }
                Mixer::GatedDeltaNet(d) => 4 * (d.conv_state_len() + d.matrix_state_len()) as u64,
            };
            dense + kv + hot_bytes.get(l).copied().unwrap_or(0)
        })
        .collect();
    if let (Some(first), Some(embed)) = (bytes.first_mut(), model.global(GlobalRole::TokenEmbedding)) {
        *first += device_bytes(embed);
    }
    if let Some(last) = bytes.last_mut() {
        *last += device_bytes(model.lm_head());
    }
    bytes
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equal_layers_split_evenly() {
        assert_eq!(assign_layers(&[10; 8], &[1.0, 1.0]).unwrap(), vec![0..4, 4..8]);
        assert_eq!(assign_layers(&[10; 9], &[1.0, 1.0, 1.0]).unwrap(), vec![0..3, 3..6, 6..9]);
        assert_eq!(assign_layers(&[7; 5], &[1.0]).unwrap(), vec![0..5]);
    }

    #[test]
    fn heavy_layers_balance_by_bytes() {
        // layer 0 carries the embedding: the first device takes fewer layers
        let bytes = [50, 10, 10, 10, 10, 10];
        assert_eq!(assign_layers(&bytes, &[1.0, 1.0]).unwrap(), vec![0..1, 1..6]);
        let bytes = [30, 10, 10, 10, 10, 10, 10, 30];
        assert_eq!(assign_layers(&bytes, &[1.0, 1.0]).unwrap(), vec![0..4, 4..8]);
        let bytes = [10, 10, 10, 10, 10, 10, 10, 40];
        assert_eq!(assign_layers(&bytes, &[1.0, 1.0]).unwrap(), vec![0..5, 5..8]);
    }

    #[test]
    fn tensor_split_sets_the_shares() {
        assert_eq!(assign_layers(&[10; 8], &[3.0, 1.0]).unwrap(), vec![0..6, 6..8]);
        assert_eq!(assign_layers(&[10; 8], &[1.0, 3.0]).unwrap(), vec![0..2, 2..8]);
        assert_eq!(assign_layers(&[10; 12], &[1.0, 2.0, 3.0]).unwrap(), vec![0..2, 2..6, 6..12]);
        // every device keeps a layer however small its share
        assert_eq!(assign_layers(&[10; 4], &[100.0, 1.0]).unwrap(), vec![0..3, 3..4]);
        assert_eq!(assign_layers(&[10; 3], &[1.0, 100.0, 1.0]).unwrap(), vec![0..1, 1..2, 2..3]);
    }

    #[test]
    fn ranges_cover_every_layer_in_order() {
        let bytes: Vec<u64> = (0..23).map(|i| (i * 37 % 11) as u64 + 1).collect();
        for shares in [vec![1.0], vec![1.0, 2.0], vec![5.0, 1.0, 1.0, 2.0], vec![1.0; 23]] {
            let r = assign_layers(&bytes, &shares).unwrap();
            assert_eq!(r.len(), shares.len());
            assert_eq!(r[0].start, 0);
            assert_eq!(r.last().unwrap().end, bytes.len());
            assert!(r.windows(2).all(|w| w[0].end == w[1].start), "{r:?}");
            assert!(r.iter().all(|x| !x.is_empty()), "{r:?}");
        }
        // all-zero bytes: an even split by count
        assert_eq!(assign_layers(&[0; 6], &[1.0, 1.0]).unwrap(), vec![0..3, 3..6]);
    }

    #[test]
    fn bad_input_is_refused_by_name() {
        assert_eq!(assign_layers(&[1, 2], &[]), Err(SplitError::NoDevices));
        assert_eq!(
            assign_layers(&[1, 2], &[1.0, 1.0, 1.0]),
            Err(SplitError::TooFewLayers { layers: 2, devices: 3 })
        );
        assert_eq!(assign_layers(&[1, 2], &[1.0, 0.0]), Err(SplitError::BadShare { index: 1, value: 0.0 }));
        assert!(matches!(
            assign_layers(&[1, 2], &[f64::NAN, 1.0]),
            Err(SplitError::BadShare { index: 0, .. })
        ));
        assert_eq!(device_shares(&[3.0], &[1.0, 1.0]), Err(SplitError::SplitLength { given: 1, devices: 2 }));
        assert_eq!(
            device_shares(&[3.0, -1.0], &[1.0, 1.0]),
            Err(SplitError::BadShare { index: 1, value: -1.0 })
        );
        assert_eq!(device_shares(&[], &[]), Err(SplitError::NoDevices));
        let e = SplitError::BadShare { index: 1, value: 0.0 }.to_string();
        assert!(e.contains("--tensor-split share 1 is 0"), "{e}");
        let e = SplitError::NotVisible { ordinal: 2, visible: 1 }.to_string();
        assert!(e.contains("device 2") && e.contains("1 CUDA device"), "{e}");
    }

    #[test]
    fn shares_default_to_free_memory() {
        assert_eq!(device_shares(&[], &[40.0, 80.0]).unwrap(), vec![40.0, 80.0]);
        assert_eq!(device_shares(&[3.0, 1.0], &[40.0, 80.0]).unwrap(), vec![3.0, 1.0]);
        // an unknown (zero) free memory counts as the smallest known one
        assert_eq!(device_shares(&[], &[0.0, 8.0]).unwrap(), vec![8.0, 8.0]);
        assert_eq!(device_shares(&[], &[0.0, 0.0]).unwrap(), vec![1.0, 1.0]);
    }

    #[test]
    fn devices_resolve_from_the_list_or_what_is_visible() {
        assert_eq!(resolve_devices(&[], 2, 0).unwrap(), vec![0]);
        assert_eq!(resolve_devices(&[], 1, 0).unwrap(), vec![0]);
        assert_eq!(resolve_devices(&[0, 0], 1, 0).unwrap(), vec![0, 0]);
        assert_eq!(resolve_devices(&[1, 0], 2, 0).unwrap(), vec![1, 0]);
        assert_eq!(resolve_devices(&[], 4, 2).unwrap(), vec![2]);
        assert_eq!(resolve_devices(&[0, 1], 1, 0), Err(SplitError::NotVisible { ordinal: 1, visible: 1 }));
        assert_eq!(resolve_devices(&[], 1, 3), Err(SplitError::NotVisible { ordinal: 3, visible: 1 }));
        assert_eq!(resolve_devices(&[], 0, 0), Err(SplitError::NoDevices));
    }
}
