//! The online policy's steps, off the decode thread or inline.
//!
//! A step of every layer's [`LayerPolicy`] costs the host 25-40 us a token for 8 layers of 128
//! experts (the reuse and adaptive policies; measured on the build machine, benches/RESULTS.md,
//! session 43), on the thread that launches the next call. With `PolicyConfig::lag_steps` 1
//! [`LiveCache`](super::live::LiveCache) hands each step to this worker's thread and takes its
//! exchanges at the next step: the policy runs while the engine computes the next token. The
//! hand-off is deterministic: a step's exchanges are always applied at the step after it,
//! whatever the threads' timing (the taker waits for them; by then a token's time has passed,
//! so it does not wait in practice), so the decisions land one call later than inline, which
//! moves an admission by one token of its residence. Where no thread can be started the steps
//! run inline with the same one-step lag.
//!
//! With `lag_steps` 0 (the default) the live cache steps the policies inline (no thread), takes a
//! step's exchanges right after it and applies them before the next call: the step's time on
//! the decode thread, each admission serving one call sooner (replayed: +0.3-1.8 points of
//! Belady's share; on the H200 tg at or above the lagged step's, benches/RESULTS.md session
//! 48). The step runs only where the cache can exchange (not with every expert hot).

use crate::actors::Exchange;
use crate::cache::policy::LayerPolicy;
use crossbeam_channel::{bounded, Receiver, Sender};
use std::thread::JoinHandle;

/// One layer's step: the distinct experts it routed since the last step (none: the layer is not
/// stepped), and which experts the engine's cache holds now (the policy's residency is set to
/// it first).
#[derive(Debug, Clone)]
pub(super) struct LayerStep {
    pub layer_idx: usize,
    pub experts: Vec<usize>,
    pub resident: Vec<bool>,
}

/// Steps every layer of `step` on `layers`; the exchanges they decide, layer by layer.
fn run_step(layers: &mut [LayerPolicy], step: &[LayerStep]) -> Vec<Exchange> {
    let mut out = Vec::new();
    for s in step.iter().filter(|s| !s.experts.is_empty()) {
        let policy = &mut layers[s.layer_idx];
        policy.sync_resident(&s.resident);
        let decided = policy.step(&s.experts).exchanges;
        out.extend(decided.into_iter().map(|(evict, add)| Exchange { layer_idx: s.layer_idx, evict, add }));
    }
    out
}

/// The layers' policies on their own thread (or inline), one step in flight at most. A step's
/// buffers come back with its exchanges, so steady-state steps allocate nothing.
#[derive(Debug)]
pub(super) struct PolicyWorker {
    mode: Mode,
    /// Whether a submitted step's exchanges have not been taken yet.
    in_flight: bool,
    /// The last step's buffers, back from the worker ([`PolicyWorker::buffer`]).
    spare: Vec<LayerStep>,
}

#[derive(Debug)]
enum Mode {
    Thread {
        steps: Option<Sender<Vec<LayerStep>>>,
        decided: Receiver<(Vec<Exchange>, Vec<LayerStep>)>,
        thread: Option<JoinHandle<()>>,
    },
    Inline {
        layers: Vec<LayerPolicy>,
        decided: Vec<Exchange>,
    },
}

impl PolicyWorker {
    /// The policies stepped on a thread of their own; inline where the thread cannot start.
    pub fn spawn(layers: Vec<LayerPolicy>) -> PolicyWorker {
        let (steps_tx, steps_rx) = bounded::<Vec<LayerStep>>(1);
        let (decided_tx, decided_rx) = bounded::<(Vec<Exchange>, Vec<LayerStep>)>(1);
        // a failed spawn drops the closure and the layers in it: keep a copy (a few KB a layer)
        let kept = layers.clone();
        let mut layers = layers;
        let spawned = std::thread::Builder::new().name("moe-lanes-policy".into()).spawn(move || {
            for step in steps_rx {
                if decided_tx.send((run_step(&mut layers, &step), step)).is_err() {
                    break;
                }
            }
        });
        match spawned {
            Ok(thread) => PolicyWorker {
                mode: Mode::Thread { steps: Some(steps_tx), decided: decided_rx, thread: Some(thread) },
                in_flight: false,
                spare: Vec::new(),
            },
            Err(_) => PolicyWorker::inline(kept),
        }
    }

    /// The policies stepped on the caller's thread, with the same one-step lag.
    pub fn inline(layers: Vec<LayerPolicy>) -> PolicyWorker {
        PolicyWorker {
            mode: Mode::Inline { layers, decided: Vec::new() },
            in_flight: false,
            spare: Vec::new(),
        }
    }

    /// The buffers of the last step taken back (empty at first), to fill for the next; give
    /// them back with [`PolicyWorker::submit`] or [`PolicyWorker::give_back`].
    pub fn buffer(&mut self) -> Vec<LayerStep> {
        std::mem::take(&mut self.spare)
    }

    /// Keep `step`'s buffers for the next step without running it.
    pub fn give_back(&mut self, step: Vec<LayerStep>) {
        self.spare = step;
    }

    /// Start a step; its exchanges come from the next [`PolicyWorker::take`]. A step submitted
    /// while another is in flight waits for that one's exchanges, which are dropped.
    pub fn submit(&mut self, step: Vec<LayerStep>) {
        if self.in_flight {
            drop(self.take());
        }
        let sent = match &mut self.mode {
            Mode::Thread { steps, .. } => steps.as_ref().is_some_and(|s| s.send(step).is_ok()),
            Mode::Inline { layers, decided } => {
                *decided = run_step(layers, &step);
                self.spare = step;
                true
            }
        };
        self.in_flight = sent;
    }

    /// The exchanges of the step in flight (waiting for them); none when no step is in flight.
    /// A panic of the policy on its thread is raised here, on the caller's, as an inline step's
    /// would be.
    pub fn take(&mut self) -> Vec<Exchange> {
        if !std::mem::take(&mut self.in_flight) {
            return Vec::new();
        }
        match &mut self.mode {
            Mode::Thread { decided, thread, .. } => match decided.recv() {
                Ok((exchanges, step)) => {
                    self.spare = step;
                    exchanges
                }
                Err(_) => match thread.take().map(JoinHandle::join) {
                    Some(Err(panic)) => std::panic::resume_unwind(panic),
                    _ => Vec::new(),
                },
            },
            Mode::Inline { decided, .. } => std::mem::take(decided),
        }
    }
}

impl Drop for PolicyWorker {
    fn drop(&mut self) {
        if let Mode::Thread { steps, thread, .. } = &mut self.mode {
            // closing the step channel ends the thread's loop (after a step in flight)
            drop(steps.take());
            if let Some(t) = thread.take() {
                let _ = t.join();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::policy::{PolicyConfig, PolicyKind};

    fn layers() -> Vec<LayerPolicy> {
        (0..2).map(|_| LayerPolicy::new(PolicyConfig::of(PolicyKind::Lru), 8, &[0, 1], &[0, 1])).collect()
    }

    fn steps(i: usize) -> Vec<LayerStep> {
        let mask = |hot: [usize; 2]| (0..8).map(|e| hot.contains(&e)).collect();
        vec![
            LayerStep { layer_idx: 0, experts: vec![2 + i % 6], resident: mask([0, 1]) },
            LayerStep { layer_idx: 1, experts: vec![0, 7 - i % 6], resident: mask([0, 1]) },
        ]
    }

    #[test]
    fn the_thread_decides_what_the_inline_steps_decide_one_step_later() {
        let (mut thread, mut inline) = (PolicyWorker::spawn(layers()), PolicyWorker::inline(layers()));
        assert!(matches!(thread.mode, Mode::Thread { .. }));
        let mut direct = layers();
        assert!(thread.take().is_empty() && inline.take().is_empty(), "nothing before a step");
        let mut expected = Vec::new();
        for i in 0..20 {
            let (a, b) = (thread.take(), inline.take());
            assert_eq!(a, expected, "step {i}: the previous step's exchanges");
            assert_eq!(b, expected);
            thread.submit(steps(i));
            inline.submit(steps(i));
            expected = run_step(&mut direct, &steps(i));
            assert!(!expected.is_empty(), "LRU admits every miss");
        }
        assert_eq!(thread.take(), expected);
        assert!(thread.take().is_empty(), "taken once");
    }

    #[test]
    fn a_step_submitted_over_one_in_flight_drops_its_exchanges() {
        let mut w = PolicyWorker::spawn(layers());
        w.submit(steps(0));
        w.submit(steps(1));
        let mut direct = layers();
        drop(run_step(&mut direct, &steps(0)));
        assert_eq!(w.take(), run_step(&mut direct, &steps(1)));
        drop(w); // joins the thread
    }
}
