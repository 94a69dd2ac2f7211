//! The one engine worker thread of the library and the server: it owns the engine (engines are
//! `&mut` and need not be `Send`), builds it on itself, reports the build, then takes jobs from a
//! queue until the queue closes: one at a time, or (a batching service: the server's) admitted
//! while earlier ones run, one engine step per turn of the loop. What a job is, and what happens between jobs, is
//! the [`EngineService`] of the caller: [`crate::text::TextGenerator`]'s text requests, the
//! server's completions with live hot-cache updates.

use super::{build_engine, BuildReport, Engine, EngineError, EngineOptions};
use crate::model::Model;
use crossbeam_channel::{Receiver, RecvTimeoutError};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

/// What an engine thread does with its engine.
pub trait EngineService {
    type Job: Send + 'static;
    /// What the thread returns when its queue closes.
    type Output: Send + 'static;

    /// How often to call [`EngineService::between_jobs`] while no job comes (`None`: only
    /// before each wait).
    fn idle_poll(&self) -> Option<Duration> {
        None
    }

    /// Before each wait for a job, and every [`EngineService::idle_poll`] while none comes.
    fn between_jobs(&mut self, _engine: &mut dyn Engine) {}

    /// Take a job: run it to its end, or (a batching service) admit it and return.
    fn serve(&mut self, engine: &mut dyn Engine, job: Self::Job);

    /// Whether admitted jobs are in progress: the thread then takes new jobs without waiting
    /// (while [`EngineService::has_room`]) and calls [`EngineService::work`] in a loop.
    fn busy(&self) -> bool {
        false
    }

    /// Whether another job may be admitted now (a batching service's free sequences).
    fn has_room(&self) -> bool {
        true
    }

    /// One step of the jobs in progress (a batching service's engine call).
    fn work(&mut self, _engine: &mut dyn Engine) {}

    /// The queue closed: the thread's result.
    fn finish(self, engine: &mut dyn Engine) -> Self::Output;
}

/// What the starter hears once the engine is built: its report and device, or why it failed.
pub type Built = Result<(BuildReport, String), EngineError>;

/// Spawn thread `name`: build the engine for `model` with `opts` there, make its service with
/// `make` (before the build is reported, so the service is ready when the starter hears it),
/// report the build through `built`, then serve `jobs` until the queue closes. The thread returns
/// the service's output (`None` when the build failed).
pub fn spawn_engine_thread<S, M>(
    name: &str,
    model: Arc<Model>,
    opts: EngineOptions,
    jobs: Receiver<S::Job>,
    make: M,
    built: impl FnOnce(Built) + Send + 'static,
) -> std::io::Result<JoinHandle<Option<S::Output>>>
where
    S: EngineService,
    M: FnOnce(&mut dyn Engine, &BuildReport) -> S + Send + 'static,
{
    std::thread::Builder::new().name(name.into()).spawn(move || {
        let (mut engine, report) = match build_engine(&model, opts) {
            Ok(v) => v,
            Err(e) => {
                built(Err(e));
                return None;
            }
        };
        let mut service = make(engine.as_mut(), &report);
        built(Ok((report, engine.device())));
        serve_jobs(engine.as_mut(), &mut service, &jobs);
        Some(service.finish(engine.as_mut()))
    })
}

fn serve_jobs<S: EngineService>(engine: &mut dyn Engine, service: &mut S, jobs: &Receiver<S::Job>) {
    let mut closed = false;
    loop {
        service.between_jobs(engine);
        if service.busy() {
            while !closed && service.has_room() {
                match jobs.try_recv() {
                    Ok(job) => service.serve(engine, job),
                    Err(crossbeam_channel::TryRecvError::Empty) => break,
                    Err(crossbeam_channel::TryRecvError::Disconnected) => closed = true,
                }
            }
            service.work(engine);
            continue;
        }
        if closed {
            return;
        }
        let job = match service.idle_poll() {
            None => jobs.recv().ok(),
            Some(poll) => match jobs.recv_timeout(poll) {
                Ok(job) => Some(job),
                Err(RecvTimeoutError::Timeout) => continue,
                Err(RecvTimeoutError::Disconnected) => None,
            },
        };
        match job {
            Some(job) => service.serve(engine, job),
            None => return,
        }
    }
}
