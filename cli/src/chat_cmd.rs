//! `moe-lanes chat` (a conversation over standard input, one user turn a line) and
//! `run --chat` (the prompt as one user turn): messages rendered through the model's chat
//! template (its own, `--chat-template FILE`, or GPT-OSS's built-in Harmony template), the answer
//! streamed to stdout. A GPT-OSS model's output is parsed as Harmony: stdout gets the final
//! channel only; `--show-reasoning` writes the analysis channel to stderr (dimmed on a terminal).

use crate::{emit, engine_options, open_engine, open_model_ctx, write_perf, EngineArgs, SamplingArgs};
use anyhow::{Context, Result};
use clap::Args;
use moe_lanes::engine::{Engine, GeneratedToken, Generation, GenerationOptions, HotChoice, LiveCache};
use moe_lanes::model::Model;
use moe_lanes::perf::ModelFingerprint;
use moe_lanes::sample::SamplingParams;
use moe_lanes::text::{
    ChatMessage, ChatTemplate, HarmonyTokens, ReasoningEffort, RenderOptions, StopStrings, TextPiece,
    TextStream, Tokenizer, TokenizerRef,
};
use std::io::{BufRead, IsTerminal, Write};
use std::path::{Path, PathBuf};

/// How a chat is rendered and shown (`run --chat` and `chat`).
#[derive(Args, Clone)]
pub struct ChatOptions {
    /// Jinja chat template (default: the model's own, tokenizer.chat_template; a GPT-OSS model
    /// without one gets the built-in Harmony template).
    #[arg(long)]
    pub chat_template: Option<PathBuf>,
    /// A system message opening the conversation.
    #[arg(long)]
    pub system: Option<String>,
    /// GPT-OSS's reasoning effort (the template's reasoning_effort; its default is medium).
    #[arg(long, value_parser = parse_effort)]
    pub reasoning_effort: Option<ReasoningEffort>,
    /// Write a GPT-OSS model's reasoning (its analysis channel) to stderr, dimmed on a terminal;
    /// stdout has the final answer only.
    #[arg(long)]
    pub show_reasoning: bool,
}

fn parse_effort(s: &str) -> Result<ReasoningEffort, String> {
    s.parse().map_err(|e: moe_lanes::text::ReasoningEffortError| e.to_string())
}

#[derive(Args)]
pub struct ChatArgs {
    /// A GGUF file or a model directory (its tokenizer comes from the same place).
    #[arg(long)]
    model: PathBuf,
    /// Most tokens per answer; the model's end-of-generation tokens end sooner.
    #[arg(short = 'n', long, default_value_t = 256, allow_negative_numbers = true, value_parser = crate::count(1))]
    max_new_tokens: usize,
    #[command(flatten)]
    chat: ChatOptions,
    #[command(flatten)]
    sampling: SamplingArgs,
    #[command(flatten)]
    engine: EngineArgs,
}

/// A model's chat: its tokenizer, template and (GPT-OSS) Harmony tokens.
pub struct ChatSetup {
    pub tokenizer: Tokenizer,
    pub template: ChatTemplate,
    pub harmony: Option<HarmonyTokens>,
    pub opts: ChatOptions,
}

impl ChatSetup {
    pub fn new(model: &Model, path: &Path, opts: &ChatOptions) -> Result<ChatSetup> {
        let tokenizer =
            Tokenizer::from_model(model).with_context(|| format!("{}: tokenizer", path.display()))?;
        let arch = model.config().arch;
        let template = ChatTemplate::for_model(opts.chat_template.as_deref(), &tokenizer, path, arch)?;
        let harmony = HarmonyTokens::for_arch(arch, &tokenizer);
        Ok(ChatSetup { tokenizer, template, harmony, opts: opts.clone() })
    }

    /// The conversation so far (the system message first) as prompt ids.
    pub fn prompt(&self, turns: &[ChatMessage]) -> Result<Vec<u32>> {
        let mut messages: Vec<ChatMessage> = self.opts.system.iter().map(ChatMessage::system).collect();
        messages.extend_from_slice(turns);
        let render = RenderOptions {
            add_generation_prompt: true,
            reasoning_effort: self.opts.reasoning_effort,
            ..RenderOptions::default()
        };
        Ok(self.template.encode(&self.tokenizer, &messages, render)?)
    }

    /// The text stream of an answer: Harmony-parsed for GPT-OSS, plain (no control tokens) else.
    pub fn stream(&self) -> TextStream<'_> {
        let none = StopStrings::default();
        match self.harmony {
            Some(tokens) => TextStream::harmony(TokenizerRef::Borrowed(&self.tokenizer), tokens, none),
            None => TextStream::new(&self.tokenizer, true, none),
        }
    }

    /// Show a piece: content on stdout, reasoning on stderr when asked for.
    pub fn show(&self, piece: &TextPiece) -> Result<()> {
        if self.opts.show_reasoning && !piece.reasoning.is_empty() {
            let mut err = std::io::stderr().lock();
            if err.is_terminal() {
                write!(err, "\x1b[2m{}\x1b[0m", piece.reasoning)?;
            } else {
                write!(err, "{}", piece.reasoning)?;
            }
            err.flush()?;
        }
        if !piece.text.is_empty() {
            emit(&piece.text)?;
        }
        Ok(())
    }
}

/// One answer: generate from `prompt`, showing it as it comes; returns its content and tokens.
pub fn answer(
    setup: &ChatSetup,
    engine: &mut dyn Engine,
    live: &mut LiveCache,
    prompt: &[u32],
    opts: GenerationOptions,
) -> Result<(String, Vec<GeneratedToken>)> {
    live.begin_request();
    let mut session = Generation::new(engine, prompt, opts)?;
    let mut stream = setup.stream();
    let (mut content, mut tokens) = (String::new(), Vec::new());
    while let Some(t) = session.next_token()? {
        let piece = stream.push(t.id)?;
        tokens.push(t);
        setup.show(&piece)?;
        content.push_str(&piece.text);
        live.after_tokens(session.engine_mut(), 1)?;
    }
    live.end_request(session.engine_mut())?;
    let piece = stream.finish();
    setup.show(&piece)?;
    content.push_str(&piece.text);
    emit("\n")?;
    Ok((content, tokens))
}

/// Generation options of a chat answer: `max_tokens`, the model's end-of-generation ids.
pub fn generation(tok: &Tokenizer, max_tokens: usize, sampling: SamplingParams) -> GenerationOptions {
    GenerationOptions { max_tokens, stop_ids: tok.eog_ids().to_vec(), sampling }
}

pub fn chat(args: ChatArgs) -> Result<()> {
    let sampling = args.sampling.params()?;
    let model = open_model_ctx(&args.model, &args.engine)?;
    let setup = ChatSetup::new(&model, &args.model, &args.chat)?;
    let positions = model.config().max_positions;
    let opts = engine_options(&model, &args.engine, positions, HotChoice::None)?;
    let policy = opts.update;
    let (mut engine, _) = open_engine(&model, opts, args.engine.trace.as_deref())?;
    let mut live =
        LiveCache::new(engine.as_ref(), ModelFingerprint::of(&model), model.layer_expert_bytes(), policy);
    let mut turns: Vec<ChatMessage> = Vec::new();
    for line in std::io::stdin().lock().lines() {
        let line = line.context("cannot read standard input as UTF-8 text")?;
        if line.trim().is_empty() {
            continue;
        }
        turns.push(ChatMessage::user(line));
        let prompt = setup.prompt(&turns)?;
        moe_lanes::reference::check_generation_fits(prompt.len(), args.max_new_tokens, positions)?;
        let gen = generation(&setup.tokenizer, args.max_new_tokens, sampling.clone());
        let (content, _) = answer(&setup, engine.as_mut(), &mut live, &prompt, gen)?;
        // Earlier turns' reasoning is not shown to the model again (Harmony drops it).
        turns.push(ChatMessage::assistant(content));
    }
    write_perf(engine.as_ref(), &args.engine.perf_json)
}
