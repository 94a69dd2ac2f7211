//! The GPU engine's build over several devices: which devices (`GpuOptions::devices`,
//! [`resolve_devices`]), which layers each runs (contiguous ranges balanced by bytes, or by
//! `GpuOptions::tensor_split`: [`crate::gpu::split`]), and the hot budget per device (a byte
//! budget split by the devices' expert bytes, each device's own free memory for the automatic
//! budget, the plan made per device over its own layers). On one device every function here
//! gives what the single-device build always did.

use super::build::{auto_budget_bytes, device_limit, BudgetError, EngineOptions, HotBudget, HotChoice, MIB};
use super::EngineError;
use crate::cache::observe::Observations;
use crate::cache::planner::plan_weighted;
use crate::cache::weighting::Weighting;
use crate::gpu::split::{assign_layers, device_shares, layer_bytes, resolve_devices};
use crate::gpu::{CudaBackend, GpuError};
use crate::model::Model;
use moe_lanes_kernels::cuda::CudaConfig;
use std::ops::Range;
use std::sync::Arc;

/// A device and the layers it runs.
pub(super) type DevicePart = (Arc<CudaBackend>, Range<usize>);

/// Every device the options name, opened: `GpuOptions::devices`, else the one
/// `CudaConfig::device_ordinal` names.
pub(super) fn open_devices(opts: &EngineOptions) -> Result<Vec<Arc<CudaBackend>>, GpuError> {
    let visible = moe_lanes_kernels::cuda::device_count()?;
    let ordinals = resolve_devices(&opts.gpu.devices, visible, opts.cuda.device_ordinal)?;
    ordinals
        .into_iter()
        .map(|device_ordinal| {
            let config = CudaConfig { device_ordinal, ..opts.cuda.clone() };
            Ok(Arc::new(CudaBackend::with_config(&config)?))
        })
        .collect()
}

/// How many entries of `ordinals` name the GPU entry `d` names (a GPU named twice shares its
/// memory between its entries).
fn sharing(ordinals: &[usize], d: usize) -> u64 {
    ordinals.iter().filter(|&&o| o == ordinals[d]).count() as u64
}

/// `amount * part / whole`, 0 when `whole` is.
fn share_of(amount: u64, part: u64, whole: u64) -> u64 {
    match whole {
        0 => 0,
        _ => (amount as u128 * part as u128 / whole as u128) as u64,
    }
}

/// Each device with the layers it runs: every layer on one device; over several, contiguous
/// ranges balanced by [`layer_bytes`] (dense weights, the KV cache of every session, the hot
/// cache the options ask for) in the shares of `GpuOptions::tensor_split`, else of each
/// device's free memory.
pub(super) fn device_parts(
    model: &Model,
    opts: &EngineOptions,
    n_positions: usize,
    bes: Vec<Arc<CudaBackend>>,
) -> Result<Vec<DevicePart>, EngineError> {
    let n_layers = model.config().n_layers;
    let ordinals: Vec<usize> = bes.iter().map(|be| be.info().ordinal).collect();
    let free: Vec<f64> = bes
        .iter()
        .enumerate()
        .map(|(d, be)| (be.mem_info().map_or(0, |(free, _)| free as u64) / sharing(&ordinals, d)) as f64)
        .collect();
    let shares = device_shares(&opts.gpu.tensor_split, &free).map_err(GpuError::from)?;
    if bes.len() == 1 {
        return Ok(bes.into_iter().map(|be| (be, 0..n_layers)).collect());
    }
    let hot = layer_hot_bytes(model, &opts.hot);
    let positions = n_positions * opts.sequences.max(1);
    let bytes = layer_bytes(model, opts.gpu_kv_type(), positions, &hot);
    let ranges = assign_layers(&bytes, &shares).map_err(GpuError::from)?;
    Ok(bes.into_iter().zip(ranges).collect())
}

/// Each layer's hot-cache bytes as the options ask for them: a set's or a fraction's experts, a
/// byte budget's share by the layer's expert bytes; none for the automatic budget (each
/// device's free memory sets its own).
fn layer_hot_bytes(model: &Model, hot: &HotChoice) -> Vec<u64> {
    let (per_expert, n_experts) = (model.layer_expert_bytes(), model.config().n_experts as u64);
    match hot {
        HotChoice::None | HotChoice::Budget(HotBudget::Auto) => vec![0; per_expert.len()],
        HotChoice::Set(set) => {
            set.layers.iter().zip(&per_expert).map(|(l, &b)| l.n_hot() as u64 * b).collect()
        }
        HotChoice::Budget(HotBudget::Fraction(f)) => {
            let n_hot = (f.clamp(0.0, 1.0) * n_experts as f64).round() as u64;
            per_expert.iter().map(|&b| n_hot * b).collect()
        }
        HotChoice::Budget(HotBudget::Bytes(budget)) => {
            let total: u64 = per_expert.iter().sum();
            per_expert.iter().map(|&b| share_of(*budget, b, total)).collect()
        }
    }
}

/// A byte budget split over the devices' layer `ranges` by their experts' bytes (one range:
/// the whole budget).
pub(super) fn split_budget(budget: u64, ranges: &[Range<usize>], per_expert: &[u64]) -> Vec<u64> {
    if ranges.len() <= 1 {
        return vec![budget; ranges.len().max(1)];
    }
    let total: u64 = per_expert.iter().sum();
    let mut budgets: Vec<u64> =
        ranges.iter().map(|r| share_of(budget, per_expert[r.clone()].iter().sum(), total)).collect();
    let given: u64 = budgets.iter().sum();
    if let Some(last) = budgets.last_mut() {
        *last += budget - given.min(budget); // the rounding's remainder
    }
    budgets
}

/// Each layer's hot experts: one plan over every layer on one device; on several, one plan per
/// device over its own layers within its budget.
pub(super) fn plan_per_device(
    model: &Model,
    obs: &Observations,
    weighting: &Weighting,
    ranges: &[Range<usize>],
    budgets: &[u64],
) -> Result<Vec<Vec<usize>>, EngineError> {
    let (c, per_expert) = (model.config(), model.layer_expert_bytes());
    let (n_layers, n_experts) = (c.n_layers, c.n_experts);
    if let ([_], [budget]) = (ranges, budgets) {
        return Ok(plan_weighted(obs, weighting, n_layers, n_experts, &per_expert, *budget)?.layers);
    }
    let mut lists = vec![Vec::new(); n_layers];
    for (range, &budget) in ranges.iter().zip(budgets) {
        // a layer of 0 bytes is never filled: only this device's layers are
        let own: Vec<u64> =
            per_expert.iter().enumerate().map(|(l, &b)| if range.contains(&l) { b } else { 0 }).collect();
        if own.iter().all(|&b| b == 0) {
            continue; // no experts on this device
        }
        let plan = plan_weighted(obs, weighting, n_layers, n_experts, &own, budget)?;
        for l in range.clone() {
            lists[l] = plan.layers[l].clone();
        }
    }
    Ok(lists)
}

/// Each device's automatic budget from its `(free, total)` memory (a GPU named twice: its
/// share), capped by the simulated `limit`, less its share (by layer count) of the `others`
/// sessions' KV caches.
pub(super) fn device_auto_budgets(
    mem: &[(usize, usize)],
    ordinals: &[usize],
    ranges: &[Range<usize>],
    limit: Option<u64>,
    others: u64,
) -> Vec<u64> {
    let n_layers: usize = ranges.iter().map(|r| r.len()).sum();
    (0..mem.len())
        .map(|d| {
            let n = sharing(ordinals, d);
            let (free, total) = (mem[d].0 as u64 / n, mem[d].1 as u64 / n);
            let kv = share_of(others, ranges[d].len() as u64, n_layers as u64);
            auto_budget_bytes(free, total, limit.map(|l| l / n)).saturating_sub(kv)
        })
        .collect()
}

/// Refuse a byte budget whose share on some device cannot fit beside that device's weights and
/// KV cache (the model split over several devices).
pub(super) fn check_split_budget(
    model: &Model,
    opts: &EngineOptions,
    n_positions: usize,
    parts: &[DevicePart],
    budget: u64,
) -> Result<(), BudgetError> {
    let kv_type = opts.gpu_kv_type();
    let weights = layer_bytes(model, kv_type, 0, &[]);
    let with_kv = layer_bytes(model, kv_type, n_positions * opts.sequences.max(1), &[]);
    let ranges: Vec<Range<usize>> = parts.iter().map(|(_, r)| r.clone()).collect();
    let budgets = split_budget(budget, &ranges, &model.layer_expert_bytes());
    let ordinals: Vec<usize> = parts.iter().map(|(be, _)| be.info().ordinal).collect();
    for (d, ((be, range), &share)) in parts.iter().zip(&budgets).enumerate() {
        let total = be.info().total_mem_bytes as u64 / sharing(&ordinals, d);
        let device_bytes = device_limit(total, opts.vram_limit_bytes.map(|l| l / sharing(&ordinals, d)));
        let w: u64 = weights[range.clone()].iter().sum();
        let kv = with_kv[range.clone()].iter().sum::<u64>() - w;
        let available = device_bytes.saturating_sub(w + kv);
        if share > available {
            return Err(BudgetError::TooLarge {
                budget_mib: share.div_ceil(MIB),
                available_mib: available / MIB,
                device_mib: device_bytes / MIB,
                weights_mib: w.div_ceil(MIB),
                kv_mib: kv.div_ceil(MIB),
            });
        }
    }
    Ok(())
}

#[cfg(test)]
#[allow(clippy::single_range_in_vec_init)] // one device's one layer range
mod tests {
    use super::*;

    #[test]
    fn a_budget_splits_by_expert_bytes() {
        assert_eq!(split_budget(100, &[0..4], &[1, 1, 1, 1]), vec![100]);
        assert_eq!(split_budget(100, &[0..2, 2..4], &[1, 1, 1, 1]), vec![50, 50]);
        assert_eq!(split_budget(100, &[0..1, 1..4], &[0, 1, 1, 1]), vec![0, 100]);
        // the rounding's remainder goes to the last device
        assert_eq!(split_budget(10, &[0..1, 1..2, 2..3], &[1, 1, 1]), vec![3, 3, 4]);
    }

    #[test]
    fn auto_budgets_share_a_gpu_named_twice() {
        let g = 1usize << 30;
        let one = device_auto_budgets(&[(10 * g, 80 * g)], &[0], &[0..4], None, 0);
        assert_eq!(one, vec![auto_budget_bytes(10 * g as u64, 80 * g as u64, None)]);
        let two = device_auto_budgets(&[(10 * g, 80 * g), (10 * g, 80 * g)], &[0, 0], &[0..2, 2..4], None, 0);
        assert_eq!(two, vec![auto_budget_bytes(5 * g as u64, 40 * g as u64, None); 2]);
        let apart =
            device_auto_budgets(&[(10 * g, 80 * g), (20 * g, 80 * g)], &[0, 1], &[0..2, 2..4], None, 0);
        assert_eq!(apart[1], auto_budget_bytes(20 * g as u64, 80 * g as u64, None));
    }
}
