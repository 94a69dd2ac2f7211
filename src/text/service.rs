//! [`TextGenerator`]: text generation for async (tokio) programs. One engine lives on its own
//! thread ([`crate::engine::worker`]); requests queue to it and their text comes back as a stream of pieces, so nothing
//! blocks the runtime. Dropping a [`TextEvents`] cancels its generation.
//!
//! The example is on [`TextGenerator`] (this module is private; its types are `text`'s).

use super::chat_template::{ChatMessage, ChatTemplate, RenderOptions};
use super::generate::{generate_text, TextGenerationError, TextOptions, TextOutcome};
use super::Tokenizer;
use crate::engine::worker::{spawn_engine_thread, EngineService};
use crate::engine::{BuildReport, Engine, EngineOptions, GenerationOptions};
use crate::model::Model;
use std::ops::ControlFlow;
use std::sync::Arc;
use tokio::sync::{mpsc, oneshot};

/// Text pieces a request may have in flight before the engine thread waits for the reader.
pub const TEXT_EVENTS_BUFFER: usize = 64;

/// What a request streams back: text pieces, then one `Done` or `Error`.
#[derive(Debug)]
pub enum TextEvent {
    Text(String),
    Done(TextOutcome),
    Error(TextGenerationError),
}

/// The events of one request. Dropping it cancels the generation (at its next token).
#[derive(Debug)]
pub struct TextEvents {
    rx: mpsc::Receiver<TextEvent>,
}

impl TextEvents {
    /// The next event; `None` after `Done`/`Error`.
    pub async fn next(&mut self) -> Option<TextEvent> {
        self.rx.recv().await
    }

    /// Wait for the whole text.
    pub async fn collect(mut self) -> Result<TextOutcome, TextGenerationError> {
        while let Some(event) = self.next().await {
            match event {
                TextEvent::Text(_) => {}
                TextEvent::Done(outcome) => return Ok(outcome),
                TextEvent::Error(e) => return Err(e),
            }
        }
        Err(TextGenerationError::WorkerGone)
    }
}

enum Prompt {
    Text(String),
    Ids(Vec<u32>),
}

struct Job {
    prompt: Prompt,
    opts: TextOptions,
    events: mpsc::Sender<TextEvent>,
}

/// A model's engine on a dedicated thread, taking text requests one at a time.
///
/// ```no_run
/// use moe_lanes::engine::EngineOptions;
/// use moe_lanes::model::Model;
/// use moe_lanes::text::{TextEvent, TextGenerator, TextOptions};
/// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
/// let model = std::sync::Arc::new(Model::open("model.gguf".as_ref())?);
/// let generator = TextGenerator::start(model, EngineOptions::with_context(4096)).await?;
/// let mut events = generator.generate("Once upon a time", generator.options(64));
/// while let Some(event) = events.next().await {
///     match event {
///         TextEvent::Text(piece) => print!("{piece}"),
///         TextEvent::Done(outcome) => println!("\n[{}]", outcome.finish.openai()),
///         TextEvent::Error(e) => return Err(e.into()),
///     }
/// }
/// # Ok(()) }
/// ```
pub struct TextGenerator {
    jobs: Option<crossbeam_channel::Sender<Job>>,
    tokenizer: Arc<Tokenizer>,
    model: Arc<Model>,
    report: BuildReport,
    worker: Option<std::thread::JoinHandle<Option<()>>>,
}

impl TextGenerator {
    /// Load the model's tokenizer and build its engine (on the engine thread, awaited without
    /// blocking the runtime).
    pub async fn start(model: Arc<Model>, opts: EngineOptions) -> Result<TextGenerator, TextGenerationError> {
        let tokenizer = Arc::new(Tokenizer::from_model(&model)?);
        let (jobs_tx, jobs_rx) = crossbeam_channel::unbounded::<Job>();
        let (built_tx, built_rx) = oneshot::channel();
        let tok = Arc::clone(&tokenizer);
        let make = move |_: &mut dyn Engine, _: &BuildReport| TextService { tokenizer: tok };
        let built = move |b: crate::engine::worker::Built| {
            let _ = built_tx.send(b.map(|(report, _device)| report));
        };
        let worker = spawn_engine_thread("moe-lanes-text", Arc::clone(&model), opts, jobs_rx, make, built)
            .expect("spawn the engine thread");
        let report = built_rx.await.map_err(|_| TextGenerationError::WorkerGone)??;
        Ok(TextGenerator { jobs: Some(jobs_tx), tokenizer, model, report, worker: Some(worker) })
    }

    /// Generate from text (encoded with BOS as the tokenizer's metadata says).
    pub fn generate(&self, prompt: impl Into<String>, opts: TextOptions) -> TextEvents {
        self.submit(Prompt::Text(prompt.into()), opts)
    }

    /// Generate from token ids.
    pub fn generate_ids(&self, prompt: Vec<u32>, opts: TextOptions) -> TextEvents {
        self.submit(Prompt::Ids(prompt), opts)
    }

    /// Answer a conversation: render it with `template`, generate the assistant's turn.
    pub fn chat(&self, template: &ChatTemplate, messages: &[ChatMessage], opts: TextOptions) -> TextEvents {
        let render = RenderOptions { add_generation_prompt: true, enable_thinking: None };
        match template.encode(&self.tokenizer, messages, render) {
            Ok(ids) => self.generate_ids(ids, opts),
            Err(e) => failed(e.into()),
        }
    }

    /// Options for `max_tokens` greedy tokens that stop at the model's end-of-generation ids.
    pub fn options(&self, max_tokens: usize) -> TextOptions {
        TextOptions {
            generation: GenerationOptions {
                max_tokens,
                stop_ids: self.tokenizer.eog_ids().to_vec(),
                ..GenerationOptions::default()
            },
            ..TextOptions::default()
        }
    }

    /// The model's chat template (`None` when it has none).
    pub fn chat_template(&self) -> Option<Result<ChatTemplate, super::ChatTemplateError>> {
        self.tokenizer.chat_template()?;
        Some(ChatTemplate::from_tokenizer(&self.tokenizer, self.model.path()))
    }

    pub fn tokenizer(&self) -> &Arc<Tokenizer> {
        &self.tokenizer
    }

    /// Which engine runs, and with how many hot experts.
    pub fn report(&self) -> &BuildReport {
        &self.report
    }

    fn submit(&self, prompt: Prompt, opts: TextOptions) -> TextEvents {
        let (tx, rx) = mpsc::channel(TEXT_EVENTS_BUFFER);
        let job = Job { prompt, opts, events: tx };
        // the queue gives a refused job back in its error: nothing to do with it but report
        let sent = self.jobs.as_ref().is_some_and(|jobs| jobs.send(job).is_ok());
        if sent {
            TextEvents { rx }
        } else {
            failed(TextGenerationError::WorkerGone)
        }
    }
}

impl Drop for TextGenerator {
    /// Close the queue and let the engine thread finish the queued requests.
    fn drop(&mut self) {
        self.jobs.take();
        if let Some(worker) = self.worker.take() {
            // A tokio worker must not wait for generations; the thread ends on its own.
            if tokio::runtime::Handle::try_current().is_err() {
                let _ = worker.join();
            }
        }
    }
}

/// A stream holding only `error`.
fn failed(error: TextGenerationError) -> TextEvents {
    let (tx, rx) = mpsc::channel(1);
    tx.try_send(TextEvent::Error(error)).expect("room for one");
    TextEvents { rx }
}

/// The text requests' service on the engine thread.
struct TextService {
    tokenizer: Arc<Tokenizer>,
}

impl EngineService for TextService {
    type Job = Job;
    type Output = ();

    fn serve(&mut self, engine: &mut dyn Engine, job: Job) {
        run_job(engine, &self.tokenizer, job);
    }

    fn finish(self, _: &mut dyn Engine) {}
}

/// Run one request on the engine thread; a reader that went away cancels it.
fn run_job(engine: &mut dyn Engine, tokenizer: &Tokenizer, job: Job) {
    let events = job.events;
    let ids = match job.prompt {
        Prompt::Ids(ids) => Ok(ids),
        Prompt::Text(text) => tokenizer.encode(&text, true, true),
    };
    let result = ids.map_err(TextGenerationError::from).and_then(|ids| {
        generate_text(engine, tokenizer, &ids, job.opts, |piece| {
            match events.blocking_send(TextEvent::Text(piece.to_string())) {
                Ok(()) => ControlFlow::Continue(()),
                Err(_) => ControlFlow::Break(()),
            }
        })
    });
    let _ = events.blocking_send(match result {
        Ok(outcome) => TextEvent::Done(outcome),
        Err(e) => TextEvent::Error(e),
    });
}
