//! The Updater: a kameo actor that queues cache slot exchanges (evict expert a, add expert b in
//! one layer). Anyone holding an [`UpdaterHandle`] may request exchanges at any time; the engine
//! drains the queue between forward calls — never during one — applies each exchange to the hot
//! lane (new slot contents) and to the hot set (rewritten maps), and counts it.
//!
//! Which exchanges to make is planned in `cache::update` (scored live observations,
//! `update_rate`) and driven by `engine::live`. A request the queue cannot take is refused with an
//! [`UpdaterError`], which the engines return and `engine::live` counts (never dropped silently).

use crate::cache::perf::PerfState;
use kameo::message::{Context, Message};
use kameo::Actor;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// Most exchanges queued at once; a request beyond it is refused (the caller may retry after
/// the next forward call). Costs 24 bytes each.
pub const MAX_PENDING_EXCHANGES: usize = 4096;

/// Capacity of the Updater's kameo mailbox (control plane; requests are rare).
pub const UPDATER_MAILBOX_CAPACITY: usize = 64;

/// An exchange is hot-set vocabulary (planned in `cache::update`); the actor queues them.
pub use crate::cache::hot_set::Exchange;

/// Why an exchange was not queued.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum UpdaterError {
    #[error("the updater's queue is full ({capacity} exchanges wait for the next call); exchange refused")]
    Full { capacity: usize },
    #[error("the updater has stopped; exchange refused")]
    Gone,
}

/// The actor's state.
#[derive(Actor)]
pub struct Updater {
    pending: VecDeque<Exchange>,
    /// Shared with handles so the engine can skip the mailbox round trip when nothing waits.
    n_pending: Arc<AtomicUsize>,
}

/// Queue one exchange; replies false when the queue is full.
pub struct RequestExchange(pub Exchange);

/// Take every queued exchange (the engine, between calls).
pub struct TakePending;

impl Message<RequestExchange> for Updater {
    type Reply = bool;
    async fn handle(&mut self, msg: RequestExchange, _: &mut Context<Self, Self::Reply>) -> bool {
        if self.pending.len() >= MAX_PENDING_EXCHANGES {
            return false;
        }
        self.pending.push_back(msg.0);
        self.n_pending.store(self.pending.len(), Ordering::Release);
        true
    }
}

impl Message<TakePending> for Updater {
    type Reply = Vec<Exchange>;
    async fn handle(&mut self, _: TakePending, _: &mut Context<Self, Self::Reply>) -> Vec<Exchange> {
        self.n_pending.store(0, Ordering::Release);
        self.pending.drain(..).collect()
    }
}

/// A running Updater with the tokio runtime that hosts it (one worker thread).
pub struct UpdaterHandle {
    runtime: tokio::runtime::Runtime,
    actor: kameo::actor::ActorRef<Updater>,
    n_pending: Arc<AtomicUsize>,
}

impl std::fmt::Debug for UpdaterHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UpdaterHandle").field("n_pending", &self.n_pending()).finish()
    }
}

impl UpdaterHandle {
    pub fn start() -> std::io::Result<UpdaterHandle> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("moe-updater")
            .enable_all()
            .build()?;
        let n_pending = Arc::new(AtomicUsize::new(0));
        let actor = {
            let _guard = runtime.enter();
            Updater::spawn_with_mailbox(
                Updater { pending: VecDeque::new(), n_pending: n_pending.clone() },
                kameo::mailbox::bounded(UPDATER_MAILBOX_CAPACITY),
            )
        };
        Ok(UpdaterHandle { runtime, actor, n_pending })
    }

    /// Queue an exchange, or say why it was not queued.
    pub fn request(&self, exchange: Exchange) -> Result<(), UpdaterError> {
        match self.runtime.block_on(self.actor.ask(RequestExchange(exchange)).send()) {
            Ok(true) => Ok(()),
            Ok(false) => Err(UpdaterError::Full { capacity: MAX_PENDING_EXCHANGES }),
            Err(_) => Err(UpdaterError::Gone),
        }
    }

    pub fn n_pending(&self) -> usize {
        self.n_pending.load(Ordering::Acquire)
    }

    /// Drain the queue (empty without a mailbox round trip when nothing is pending).
    pub fn take_pending(&self) -> Vec<Exchange> {
        if self.n_pending() == 0 {
            return Vec::new();
        }
        self.runtime.block_on(self.actor.ask(TakePending).send()).unwrap_or_default()
    }
}

impl Drop for UpdaterHandle {
    fn drop(&mut self) {
        self.actor.kill();
    }
}

/// The one exchange-apply path of both engines, between calls: every queued exchange applied in
/// order by `apply` (which returns the bytes it copied, recorded in `perf` with the exchange). At
/// the first failure the exchanges not yet applied are queued again (each the queue refuses is
/// counted) and the error is returned. Returns how many were taken from the queue.
pub fn apply_exchanges<T, E>(
    target: &mut T,
    updater: fn(&T) -> &UpdaterHandle,
    perf: fn(&mut T) -> &mut PerfState,
    mut apply: impl FnMut(&mut T, Exchange) -> Result<u64, E>,
) -> Result<usize, E> {
    let pending = updater(target).take_pending();
    for (i, &exchange) in pending.iter().enumerate() {
        match apply(target, exchange) {
            Ok(bytes) => perf(target).record_exchange(exchange.layer_idx, bytes),
            Err(e) => {
                let rest = &pending[i + 1..];
                let refused = rest.iter().filter(|&&x| updater(target).request(x).is_err()).count();
                if refused > 0 {
                    perf(target).record_refused_exchanges(refused as u64);
                }
                return Err(e);
            }
        }
    }
    Ok(pending.len())
}
