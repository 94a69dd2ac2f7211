//! Post-Fetch in decode. A split layer's token (one token: decode, the device path) routes to a
//! few cold experts; at budget 0 all of them, and the CPU lane reads their weights out of host
//! DRAM while the GPU waits. Part of them can come over PCIe instead, at the same time: the cost
//! model of prefill ([`assign`]) weighs the CPU lane (bytes / CPU read rate) against the copy
//! lane (bytes / PCIe rate + [`DECODE_GPU_EXPERT_S`] a fetched expert), and the chosen experts'
//! copies are queued from the registered file (or staged) into the scratchpad as in prefill.
//! The compute stream waits for them and runs the decode GEMVs of the hot lane over the
//! scratchpad's slots (one slot per routed entry, -1 for the CPU's), accumulating into the
//! layer's MoE output, while the CPU lane computes the rest; its rows are added after them as
//! before. The copies are always waited for (a decode layer has nothing else to overlap them
//! with once its CPU lane is done).
//!
//! Every split decode layer starts from a clean Post-Fetch state: decode graphs replay the
//! routing without the host code that reset it, so a layer must not see the slots an earlier
//! call (a prefill) left behind.

use super::plan::{assign, ExpertLoad, PostFetchCosts, DECODE_GPU_EXPERT_S};
use super::Pending;
use crate::gpu::device::Device;
use crate::gpu::moe::MoeStage;
use crate::gpu::scratch::RouteView;
use crate::gpu::GpuError;

impl MoeStage {
    /// Decode, split layer `l`, `t` tokens, host worklist built, Post-Fetch state reset: with
    /// one token and decode fetching on, the layer's cold experts chosen for the GPU, their
    /// copies queued and their `pf_fetch` slots set (the CPU lane skips them).
    pub(crate) fn postfetch_issue_decode(
        &mut self,
        dev: &Device,
        l: usize,
        t: usize,
    ) -> Result<(), GpuError> {
        let fetching = |p: &&mut super::PostFetch| !p.paused && p.opts.decode && t == 1;
        let Some(pf) = self.postfetch.as_mut().filter(fetching) else { return Ok(()) };
        let hs = &mut self.host;
        let wl = &hs.worklist;
        hs.pf_loads.clear();
        let cold = wl.cold_id[..wl.cold_count].iter();
        hs.pf_loads.extend(cold.map(|&e| ExpertLoad { expert: e, tokens: 1 }));
        let slot_ready = &pf.slot_ready;
        pf.tracker.poll(|s| slot_ready[s].is_done());
        let limit = pf.slots.min(pf.tracker.room());
        let costs = PostFetchCosts { gpu_expert_s: DECODE_GPU_EXPERT_S, ..pf.costs };
        let n_chosen = assign(&mut hs.pf_loads, pf.expert_bytes(l), &costs, pf.opts.mode, (limit, 0));
        // waited for on the GPU, never by the host
        let waited = Pending { launched: false, host_wait_us: Some(0.0) };
        let issued = pf.start_layer(l, n_chosen, false, waited)?;
        for (i, x) in hs.pf_loads[..issued].iter().enumerate() {
            hs.pf_fetch[x.expert as usize] = i as i32;
        }
        if issued > 0 {
            self.postfetch_copies(dev, l, issued)?;
        }
        self.postfetch_debug(l, n_chosen, issued)
    }

    /// The fetched experts of [`MoeStage::postfetch_issue_decode`] on the compute stream: the
    /// entries' slots uploaded, a wait for the layer's copies, the decode GEMVs over the
    /// scratchpad into the MoE output, `free` recorded behind them (even when a launch fails).
    pub(crate) fn fetched_lane_gemv(&mut self, dev: &Device, t: usize) -> Result<(), GpuError> {
        let Some(cur) = self.postfetch.as_ref().and_then(|p| p.current) else { return Ok(()) };
        let k = dev.cfg.n_experts_used;
        let s = dev.s();
        let route = RouteView::of(self.pin.route.as_slice()?, s.cap, k, t, dev.cfg.hidden);
        let hs = &mut self.host;
        hs.pf_entry_slot.clear();
        hs.pf_entry_slot.extend(route.ids.iter().map(|&e| hs.pf_fetch[e as usize].max(-1)));
        let pf = self.postfetch.as_ref().expect("a current fetch implies post-fetch");
        let slots = pf.decode_slots.ptr().sub(0, t * k);
        dev.be.write(&self.host.pf_entry_slot, slots)?;
        let ev = &pf.events;
        dev.be.record(&ev.pre_wait)?;
        for end in &ev.copy_end {
            dev.be.wait_event(end)?;
        }
        dev.be.record(&ev.post_wait)?;
        let out = s.moe_out.ptr();
        let (views, epi) = (pf.views(cur.layer), pf.epilogue());
        let gemvs = crate::gpu::moe::expert_gemvs(dev, views, &epi, slots, cur.layer, t, out);
        dev.be.record(&ev.free)?;
        gemvs?;
        self.postfetch_launched();
        Ok(())
    }
}
