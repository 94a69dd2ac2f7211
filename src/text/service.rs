//! [`TextGenerator`]: text generation for async (tokio) programs. One engine lives on its own
//! thread ([`crate::engine::worker`]); requests queue to it, run together (continuous batching,
//! [`crate::engine::batch`]) and their text comes back as a stream of pieces, so nothing blocks
//! the runtime. Dropping a [`TextEvents`] cancels its generation.
//!
//! The example is on [`TextGenerator`] (this module is private; its types are `text`'s).

use super::chat_template::{ChatMessage, ChatTemplate, RenderOptions};
use super::generate::{TextFinish, TextGenerationError, TextOptions, TextOutcome, TextStream};
use super::stream::TokenizerRef;
use super::{StopStrings, Tokenizer};
use crate::engine::worker::{spawn_engine_thread, EngineService};
use crate::engine::{
    BatchOptions, Batcher, BuildReport, Engine, EngineOptions, FinishReason, GeneratedToken,
    GenerationOptions, SeqEvent, SeqId,
};
use crate::model::Model;
use std::collections::HashMap;
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

/// A model's engine on a dedicated thread, running text requests together (one batched engine
/// call per step).
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
    /// blocking the runtime); requests run together as [`BatchOptions::default`] allows.
    pub async fn start(model: Arc<Model>, opts: EngineOptions) -> Result<TextGenerator, TextGenerationError> {
        Self::start_batched(model, opts, BatchOptions::default()).await
    }

    /// As [`TextGenerator::start`], with `batch` saying how many requests run at once and how
    /// many tokens one step takes (continuous batching: one engine call per step).
    pub async fn start_batched(
        model: Arc<Model>,
        opts: EngineOptions,
        batch: BatchOptions,
    ) -> Result<TextGenerator, TextGenerationError> {
        let tokenizer = Arc::new(Tokenizer::from_model(&model)?);
        let (jobs_tx, jobs_rx) = crossbeam_channel::unbounded::<Job>();
        let (built_tx, built_rx) = oneshot::channel();
        let tok = Arc::clone(&tokenizer);
        let make = move |_: &mut dyn Engine, _: &BuildReport| TextService {
            tokenizer: tok,
            batcher: Batcher::new(batch),
            running: HashMap::new(),
        };
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

    /// Answer a conversation: render it with `template`, generate the assistant's turn. A GPT-OSS
    /// model's answer is parsed as Harmony ([`TextOptions::harmony`] filled in when unset): the
    /// text is its final channel, [`TextOutcome::reasoning`] its analysis.
    pub fn chat(
        &self,
        template: &ChatTemplate,
        messages: &[ChatMessage],
        mut opts: TextOptions,
    ) -> TextEvents {
        opts.harmony = opts.harmony.or_else(|| self.harmony());
        let render = RenderOptions { add_generation_prompt: true, ..RenderOptions::default() };
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

    /// The model's chat template (`None` when it has none): its own, or a GPT-OSS model's
    /// built-in Harmony template ([`ChatTemplate::for_model`]).
    pub fn chat_template(&self) -> Option<Result<ChatTemplate, super::ChatTemplateError>> {
        let arch = self.model.config().arch;
        if self.tokenizer.chat_template().is_none() && arch != crate::model::arch::Arch::GptOss {
            return None;
        }
        Some(ChatTemplate::for_model(None, &self.tokenizer, self.model.path(), arch))
    }

    /// The Harmony tokens to parse this model's chats with (GPT-OSS), for
    /// [`TextOptions::harmony`].
    pub fn harmony(&self) -> Option<super::HarmonyTokens> {
        super::HarmonyTokens::for_arch(self.model.config().arch, &self.tokenizer)
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

/// The text requests' service on the engine thread: requests run together in a [`Batcher`]
/// (one batched engine call per step), each streaming its own text.
struct TextService {
    tokenizer: Arc<Tokenizer>,
    batcher: Batcher,
    running: HashMap<SeqId, TextRun>,
}

/// A running request: where its text goes and what its outcome collects.
struct TextRun {
    events: mpsc::Sender<TextEvent>,
    /// `None` once flushed at the end.
    stream: Option<TextStream<'static>>,
    text: String,
    reasoning: String,
    tokens: Vec<GeneratedToken>,
    prompt_tokens: usize,
}

impl EngineService for TextService {
    type Job = Job;
    type Output = ();

    fn serve(&mut self, engine: &mut dyn Engine, job: Job) {
        let events = job.events.clone();
        if let Err(e) = self.admit(engine, job) {
            let _ = events.blocking_send(TextEvent::Error(e));
        }
    }

    fn busy(&self) -> bool {
        !self.batcher.is_empty()
    }

    fn has_room(&self) -> bool {
        self.batcher.has_room()
    }

    /// One step: readers that went away cancel their requests first.
    fn work(&mut self, engine: &mut dyn Engine) {
        let gone: Vec<SeqId> =
            self.running.iter().filter(|(_, r)| r.events.is_closed()).map(|(id, _)| *id).collect();
        for id in gone {
            self.batcher.cancel(id);
            self.running.remove(&id);
        }
        for event in self.batcher.step(engine) {
            match event {
                SeqEvent::Token(id, t) => self.on_token(id, t),
                SeqEvent::Finished { id, finish, .. } => self.end(id, finish),
                SeqEvent::Failed(id, e) => {
                    if let Some(r) = self.running.remove(&id) {
                        let _ = r.events.blocking_send(TextEvent::Error(e.into()));
                    }
                }
            }
        }
    }

    fn finish(self, _: &mut dyn Engine) {}
}

impl TextService {
    /// A request joins the batch: its prompt encoded, its options checked.
    fn admit(&mut self, engine: &mut dyn Engine, job: Job) -> Result<(), TextGenerationError> {
        let ids = match job.prompt {
            Prompt::Ids(ids) => ids,
            Prompt::Text(text) => self.tokenizer.encode(&text, true, true)?,
        };
        let stops = StopStrings::new(job.opts.stop_strings)?;
        let stream = match job.opts.harmony {
            Some(tokens) => {
                TextStream::harmony(TokenizerRef::Shared(Arc::clone(&self.tokenizer)), tokens, stops)
            }
            None => TextStream::shared(Arc::clone(&self.tokenizer), !job.opts.show_special, stops),
        };
        let id = match self.batcher.add(&*engine, &ids, job.opts.generation) {
            Ok(added) => added?,
            Err(full) => return Err(crate::engine::EngineError::Step { message: full.to_string() }.into()),
        };
        let run = TextRun {
            events: job.events,
            stream: Some(stream),
            text: String::new(),
            reasoning: String::new(),
            tokens: Vec::new(),
            prompt_tokens: ids.len(),
        };
        self.running.insert(id, run);
        Ok(())
    }

    /// A token's text to its reader; a completed stop string ends the request.
    fn on_token(&mut self, id: SeqId, t: GeneratedToken) {
        let Some(r) = self.running.get_mut(&id) else { return };
        let push = match r.stream.as_mut().expect("flushed only at the end").push(t.id) {
            Ok(push) => push,
            Err(e) => {
                let r = self.running.remove(&id).expect("running");
                self.batcher.cancel(id);
                let _ = r.events.blocking_send(TextEvent::Error(e.into()));
                return;
            }
        };
        r.tokens.push(t);
        r.text.push_str(&push.text);
        r.reasoning.push_str(&push.reasoning);
        let sent = push.text.is_empty() || r.events.blocking_send(TextEvent::Text(push.text)).is_ok();
        if !sent {
            self.batcher.cancel(id);
            self.running.remove(&id);
        } else if let Some(index) = push.stopped {
            self.batcher.cancel(id);
            self.done(id, TextFinish::StopString { index });
        }
    }

    /// The generation ended (length or a stop id): the held-back text, then `Done`.
    fn end(&mut self, id: SeqId, finish: FinishReason) {
        let Some(r) = self.running.get_mut(&id) else { return };
        let push = r.stream.take().map(TextStream::finish).unwrap_or_default();
        r.reasoning.push_str(&push.reasoning);
        if !push.text.is_empty() {
            r.text.push_str(&push.text);
            let _ = r.events.blocking_send(TextEvent::Text(push.text));
        }
        let finish = match (push.stopped, finish) {
            (Some(index), _) => TextFinish::StopString { index },
            (None, FinishReason::Stop { token }) => TextFinish::StopId { token },
            (None, FinishReason::Cancelled) => TextFinish::Cancelled,
            (None, FinishReason::Length) => TextFinish::Length,
        };
        self.done(id, finish);
    }

    fn done(&mut self, id: SeqId, finish: TextFinish) {
        let Some(r) = self.running.remove(&id) else { return };
        let outcome = TextOutcome {
            text: r.text,
            reasoning: r.reasoning,
            finish,
            prompt_tokens: r.prompt_tokens,
            tokens: r.tokens,
        };
        let _ = r.events.blocking_send(TextEvent::Done(outcome));
    }
}
