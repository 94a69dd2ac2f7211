//! The CPU pipeline's per-stage profile (`MOE_LANES_CPU_PROFILE=1`, printed by `bench`): host
//! wall time between marks the driver sets as it goes through a forward call, summed per phase.
//! Off, it is `None` in the pipeline and costs one branch per mark.

use std::time::Instant;

/// Stages of one layer, in the order the driver runs them. A Gated DeltaNet layer marks the same
/// ones: its norm and input projections as the q/k/v GEMV, its conv, delta rule and gated norm as
/// attention (the stage between them empty), its output projection as the o proj.
pub const CPU_LAYER_STAGES: [&str; 9] = [
    "attn norm + q/k/v GEMV",
    "q/k norm, RoPE, KV append",
    "attention",
    "o proj + residual",
    "ffn norm + router GEMV + top-k",
    "worklist",
    "shared expert",
    "moe: cold lane + join + merge",
    "shared gate + residual add",
];
/// Stages outside the layers.
pub const CPU_TAIL_STAGES: [&str; 3] = ["embed", "final norm + lm_head", "logits rows + argmax"];

/// Summed stage times (microseconds) of one phase.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CpuStageTimes {
    pub calls: usize,
    pub tokens: usize,
    pub layer_calls: usize,
    pub layer_us: [f64; CPU_LAYER_STAGES.len()],
    pub tail_us: [f64; CPU_TAIL_STAGES.len()],
    /// Wall time of the calls (the stages plus whatever falls between marks).
    pub total_us: f64,
}

impl CpuStageTimes {
    /// A table: per stage, microseconds per layer call (layer stages) and per forward call.
    pub fn report(&self, name: &str) -> String {
        if self.calls == 0 {
            return String::new();
        }
        let per_call = |v: f64| v / self.calls as f64;
        let per_layer = |v: f64| v / self.layer_calls.max(1) as f64;
        let mut out = format!(
            "{name}: {} calls, {:.1} tokens/call, wall {:.1} us/call\n",
            self.calls,
            self.tokens as f64 / self.calls as f64,
            per_call(self.total_us)
        );
        for (stage, &us) in CPU_LAYER_STAGES.iter().zip(&self.layer_us) {
            out += &format!(
                "  layer  {stage:34} {:10.1} us/layer {:10.1} us/call\n",
                per_layer(us),
                per_call(us)
            );
        }
        for (stage, &us) in CPU_TAIL_STAGES.iter().zip(&self.tail_us) {
            out += &format!("  tail   {stage:34} {:>10} {:10.1} us/call\n", "", per_call(us));
        }
        let staged: f64 = self.layer_us.iter().chain(&self.tail_us).sum();
        out += &format!("  sum of stages {:.1} us/call\n", per_call(staged));
        out
    }
}

/// The profiler: both phases' sums and the running mark.
#[derive(Debug, Clone)]
pub struct CpuProfiler {
    pub decode: CpuStageTimes,
    pub prefill: CpuStageTimes,
    /// The phase of the call being recorded.
    decode_call: bool,
    last: Instant,
}

impl Default for CpuProfiler {
    fn default() -> Self {
        CpuProfiler {
            decode: CpuStageTimes::default(),
            prefill: CpuStageTimes::default(),
            decode_call: false,
            last: Instant::now(),
        }
    }
}

impl CpuProfiler {
    fn times(&mut self) -> &mut CpuStageTimes {
        if self.decode_call {
            &mut self.decode
        } else {
            &mut self.prefill
        }
    }

    /// A (sub-batch) call of `n_tokens` starts; `decode` picks the phase's sums.
    pub fn begin(&mut self, decode: bool, n_tokens: usize) {
        self.decode_call = decode;
        let t = self.times();
        t.calls += 1;
        t.tokens += n_tokens;
        self.last = Instant::now();
    }

    fn lap_us(&mut self) -> f64 {
        let now = Instant::now();
        let us = (now - self.last).as_secs_f64() * 1e6;
        self.last = now;
        us
    }

    /// Layer stage `stage` ([`CPU_LAYER_STAGES`]) ends now.
    pub fn layer(&mut self, stage: usize) {
        let us = self.lap_us();
        let t = self.times();
        t.layer_us[stage] += us;
        if stage + 1 == CPU_LAYER_STAGES.len() {
            t.layer_calls += 1;
        }
    }

    /// Tail stage `stage` ([`CPU_TAIL_STAGES`]) ends now.
    pub fn tail(&mut self, stage: usize) {
        let us = self.lap_us();
        self.times().tail_us[stage] += us;
    }

    /// Adds `us` to tail stage `stage` and to the call's wall time (work timed by the caller).
    pub fn add_tail_us(&mut self, stage: usize, us: f64) {
        let t = self.times();
        t.tail_us[stage] += us;
        t.total_us += us;
    }

    /// The call's wall time.
    pub fn add_total_us(&mut self, us: f64) {
        self.times().total_us += us;
    }

    pub fn report(&self) -> String {
        self.prefill.report("prefill") + &self.decode.report("decode")
    }
}

/// Sets a mark when profiling: `mark(&mut self.profile, |p| p.layer(2))`.
pub fn mark(profile: &mut Option<CpuProfiler>, f: impl FnOnce(&mut CpuProfiler)) {
    if let Some(p) = profile {
        f(p);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn report_of_fixed_times() {
        let decode = CpuStageTimes {
            calls: 4,
            tokens: 4,
            layer_calls: 8,
            layer_us: [80.0, 8.0, 16.0, 64.0, 24.0, 4.0, 0.0, 400.0, 8.0],
            tail_us: [2.0, 200.0, 40.0],
            total_us: 900.0,
        };
        let p = CpuProfiler { decode, ..CpuProfiler::default() };
        insta::assert_snapshot!("cpu_profile_report", p.report());
    }

    #[test]
    fn marks_land_in_the_call_phase() {
        let mut p = CpuProfiler::default();
        p.begin(true, 1);
        for stage in 0..CPU_LAYER_STAGES.len() {
            p.layer(stage);
        }
        p.tail(1);
        p.begin(false, 7);
        p.tail(0);
        assert_eq!((p.decode.calls, p.decode.tokens, p.decode.layer_calls), (1, 1, 1));
        assert_eq!((p.prefill.calls, p.prefill.tokens, p.prefill.layer_calls), (1, 7, 0));
        assert!(p.report().starts_with("prefill: 1 calls, 7.0 tokens/call"));
    }
}
