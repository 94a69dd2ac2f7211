//! `moe-lanes run`: text in, text streamed out as it is generated (whole UTF-8 characters only),
//! then a one-line summary on stderr (prompt t/s, generation t/s, hot-cache hit rate). With
//! `--chat` the prompt is one user turn through the chat template (`chat_cmd`: a GPT-OSS model's
//! answer is its final channel).

use crate::chat_cmd::{answer, generation, ChatOptions, ChatSetup};
use crate::{emit, engine_options, open_engine, open_model_ctx, write_perf, EngineArgs, SamplingArgs};
use anyhow::{Context, Result};
use clap::Args;
use moe_lanes::engine::{Engine, GeneratedToken, Generation, GenerationOptions, HotChoice, LiveCache};
use moe_lanes::model::Model;
use moe_lanes::perf::ModelFingerprint;
use moe_lanes::sample::SamplingParams;
use moe_lanes::text::{ChatMessage, Tokenizer};
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::Arc;

#[derive(Args)]
pub struct RunArgs {
    /// A GGUF file or a model directory (its tokenizer comes from the same place).
    #[arg(long)]
    model: PathBuf,
    /// The prompt (default: --prompt-file, else standard input).
    #[arg(long, conflicts_with = "prompt_file")]
    prompt: Option<String>,
    /// Read the prompt from this file (UTF-8).
    #[arg(long)]
    prompt_file: Option<PathBuf>,
    /// Most tokens to generate; the model's end-of-generation tokens end sooner.
    #[arg(short = 'n', long, default_value_t = 128, allow_negative_numbers = true, value_parser = crate::count(0))]
    max_new_tokens: usize,
    /// Print control tokens (<|im_end|>, ...) too.
    #[arg(long, conflicts_with = "chat")]
    show_special: bool,
    /// Send the prompt as a user turn through the model's chat template and print the answer
    /// (a GPT-OSS model's final channel; its reasoning with --show-reasoning).
    #[arg(long)]
    chat: bool,
    #[command(flatten)]
    chat_options: ChatOptions,
    #[command(flatten)]
    sampling: SamplingArgs,
    #[command(flatten)]
    engine: EngineArgs,
}

pub fn run(args: RunArgs) -> Result<()> {
    let sampling = args.sampling.params()?;
    let text = read_text(args.prompt.as_deref(), args.prompt_file.as_deref())?;
    let model = open_model_ctx(&args.model, &args.engine)?;
    if args.chat {
        return run_chat(&args, &text, &model, sampling);
    }
    check_no_chat_flags(&args.chat_options)?;
    let tok =
        Tokenizer::from_model(&model).with_context(|| format!("{}: tokenizer", args.model.display()))?;
    let prompt = tok.encode(&text, true, true)?;
    moe_lanes::reference::check_generation_fits(
        prompt.len(),
        args.max_new_tokens,
        model.config().max_positions,
    )?;
    let opts = engine_options(&model, &args.engine, prompt.len() + args.max_new_tokens, HotChoice::None)?;
    let policy = opts.update;
    let (mut engine, _) = open_engine(&model, opts, args.engine.trace.as_deref())?;
    // The hot-cache policy (or the planned policy's updater) runs between tokens and after.
    let mut live =
        LiveCache::new(engine.as_ref(), ModelFingerprint::of(&model), model.layer_expert_bytes(), policy);
    let gen_opts =
        GenerationOptions { max_tokens: args.max_new_tokens, stop_ids: tok.eog_ids().to_vec(), sampling };
    live.begin_request();
    let mut session = Generation::new(engine.as_mut(), &prompt, gen_opts)?;
    let mut decoder = tok.stream(!args.show_special);
    let mut tokens: Vec<GeneratedToken> = Vec::new();
    while let Some(t) = session.next_token()? {
        tokens.push(t.clone());
        decoder.push(t.id).map_err(anyhow::Error::from).and_then(|s| emit(&s))?;
        live.after_tokens(session.engine_mut(), 1)?;
    }
    live.end_request(session.engine_mut())?;
    drop(session);
    emit(&format!("{}\n", decoder.finish()))?;
    eprintln!("{}", summary(prompt.len(), &tokens, engine.as_ref()));
    write_perf(engine.as_ref(), &args.engine.perf_json)
}

/// `run --chat`: the prompt as one user turn, the answer shown as `chat` shows it.
fn run_chat(args: &RunArgs, text: &str, model: &Arc<Model>, sampling: SamplingParams) -> Result<()> {
    let setup = ChatSetup::new(model, &args.model, &args.chat_options)?;
    let prompt = setup.prompt(&[ChatMessage::user(text)])?;
    let positions = model.config().max_positions;
    moe_lanes::reference::check_generation_fits(prompt.len(), args.max_new_tokens, positions)?;
    let opts = engine_options(model, &args.engine, prompt.len() + args.max_new_tokens, HotChoice::None)?;
    let policy = opts.update;
    let (mut engine, _) = open_engine(model, opts, args.engine.trace.as_deref())?;
    let mut live =
        LiveCache::new(engine.as_ref(), ModelFingerprint::of(model), model.layer_expert_bytes(), policy);
    let gen = generation(&setup.tokenizer, args.max_new_tokens, sampling);
    let (_, tokens) = answer(&setup, engine.as_mut(), &mut live, &prompt, gen)?;
    eprintln!("{}", summary(prompt.len(), &tokens, engine.as_ref()));
    write_perf(engine.as_ref(), &args.engine.perf_json)
}

/// The chat flags mean nothing without `--chat`: refused, naming the first given.
fn check_no_chat_flags(c: &ChatOptions) -> Result<()> {
    let given = [
        ("--chat-template", c.chat_template.is_some()),
        ("--system", c.system.is_some()),
        ("--reasoning-effort", c.reasoning_effort.is_some()),
        ("--show-reasoning", c.show_reasoning),
    ];
    match given.iter().find(|(_, on)| *on) {
        Some((flag, _)) => anyhow::bail!("{flag} needs --chat (the prompt sent as a chat turn)"),
        None => Ok(()),
    }
}

/// `prompt 12 tokens, 340.1 t/s | generated 64 tokens, 45.2 t/s | hit rate 71.3%`.
fn summary(n_prompt: usize, tokens: &[GeneratedToken], engine: &dyn Engine) -> String {
    let per_s = |n: usize, us: u64| if us == 0 { 0.0 } else { n as f64 * 1e6 / us as f64 };
    let ttft_us = tokens.first().map_or(0, |t| t.at_us);
    let decode_us = tokens.last().map_or(0, |t| t.at_us) - ttft_us;
    let n_decode = tokens.len().saturating_sub(1);
    let hit = engine.perf().map(|p| p.report()).map(|r| {
        let (hot, all) =
            r.layers.iter().fold((0, 0), |(h, a), l| (h + l.hot_slots_total, a + l.expert_hits_total));
        if all == 0 {
            "hit rate n/a".to_string()
        } else {
            format!("hit rate {:.1}%", 100.0 * hot as f64 / all as f64)
        }
    });
    format!(
        "prompt {n_prompt} tokens, {:.1} t/s | generated {} tokens, {:.1} t/s | {} | {}",
        per_s(n_prompt, ttft_us),
        tokens.len(),
        per_s(n_decode, decode_us),
        hit.unwrap_or_else(|| "hit rate n/a (no hot cache)".into()),
        engine.kind(),
    )
}

/// The prompt: given, from a file, or from standard input.
fn read_text(text: Option<&str>, file: Option<&Path>) -> Result<String> {
    match (text, file) {
        (Some(t), _) => Ok(t.to_string()),
        (None, Some(path)) => std::fs::read_to_string(path)
            .with_context(|| format!("cannot read {} as UTF-8 text", path.display())),
        (None, None) => {
            let mut t = String::new();
            std::io::stdin().read_to_string(&mut t).context("cannot read standard input as UTF-8 text")?;
            Ok(t)
        }
    }
}
