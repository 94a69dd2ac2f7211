//! Text generation on one engine: ids from a [`Generation`], text out through a [`TextStream`]
//! (whole UTF-8 characters, stop strings cut off), until max tokens, an end-of-generation id,
//! a stop string, or the caller stops it.

use super::harmony::{HarmonyStream, HarmonyTokens};
use super::stop::{StopStringError, StopStrings};
use super::stream::TokenizerRef;
use super::{StreamDecoder, Tokenizer, TokenizerError};
use crate::engine::{Engine, FinishReason, GeneratedToken, Generation, GenerationError, GenerationOptions};
use std::ops::ControlFlow;

/// Ids in, text out: a [`StreamDecoder`] (or, for a Harmony model, a [`HarmonyStream`] that
/// splits reasoning from content) followed by [`StopStrings`] over the content.
#[derive(Debug)]
pub struct TextStream<'t> {
    decoder: Decoder<'t>,
    stops: StopStrings,
}

#[derive(Debug)]
enum Decoder<'t> {
    Plain(StreamDecoder<'t>),
    Harmony(HarmonyStream<'t>),
}

/// What one [`TextStream::push`] (or `finish`) gives back.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct TextPiece {
    /// Content that can be shown now (a Harmony model's final channel).
    pub text: String,
    /// A Harmony model's reasoning (its analysis channel) released now; empty otherwise.
    pub reasoning: String,
    /// The stop string that ended the content, if one did.
    pub stopped: Option<usize>,
}

impl TextPiece {
    fn from_stop(push: super::StopPush, reasoning: String) -> TextPiece {
        TextPiece { text: push.text, reasoning, stopped: push.stopped }
    }
}

impl<'t> TextStream<'t> {
    pub fn new(tokenizer: &'t Tokenizer, skip_special: bool, stops: StopStrings) -> TextStream<'t> {
        TextStream { decoder: Decoder::Plain(tokenizer.stream(skip_special)), stops }
    }

    /// A stream over a shared tokenizer, owing no borrow (kept across a batcher's steps).
    pub fn shared(
        tokenizer: std::sync::Arc<Tokenizer>,
        skip_special: bool,
        stops: StopStrings,
    ) -> TextStream<'static> {
        let decoder = StreamDecoder::over(TokenizerRef::Shared(tokenizer), skip_special);
        TextStream { decoder: Decoder::Plain(decoder), stops }
    }

    /// A stream that parses Harmony (GPT-OSS): reasoning and content apart, stop strings over the
    /// content only.
    pub fn harmony(tokenizer: TokenizerRef<'t>, tokens: HarmonyTokens, stops: StopStrings) -> TextStream<'t> {
        TextStream { decoder: Decoder::Harmony(HarmonyStream::new(tokenizer, tokens)), stops }
    }

    /// Add one id: the text that can be shown now, and the stop string that ended it, if any.
    pub fn push(&mut self, id: u32) -> Result<TextPiece, TokenizerError> {
        if self.stops.stopped().is_some() {
            return Ok(TextPiece { stopped: self.stops.stopped(), ..TextPiece::default() });
        }
        match &mut self.decoder {
            Decoder::Plain(d) => Ok(TextPiece::from_stop(self.stops.push(&d.push(id)?), String::new())),
            Decoder::Harmony(h) => {
                let delta = h.push(id)?;
                Ok(TextPiece::from_stop(self.stops.push(&delta.content), delta.reasoning))
            }
        }
    }

    /// The end of the ids: what was held back (an incomplete character becomes U+FFFD; a stop
    /// string completed by it still cuts). Returns the text and the stop index.
    pub fn finish(mut self) -> TextPiece {
        if let Some(index) = self.stops.stopped() {
            return TextPiece { stopped: Some(index), ..TextPiece::default() };
        }
        let (content, reasoning) = match self.decoder {
            Decoder::Plain(d) => (d.finish(), String::new()),
            Decoder::Harmony(h) => {
                let delta = h.finish();
                (delta.content, delta.reasoning)
            }
        };
        let mut push = self.stops.push(&content);
        if push.stopped.is_none() {
            push.text.push_str(&self.stops.finish());
        }
        TextPiece::from_stop(push, reasoning)
    }
}

/// What to generate, as text.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct TextOptions {
    /// Max tokens, stop ids (usually [`Tokenizer::eog_ids`]) and sampling.
    pub generation: GenerationOptions,
    /// Strings that end the text; the text before one is returned, never the string itself.
    pub stop_strings: Vec<String>,
    /// Print control tokens too (`<|im_end|>`); off drops them from the text.
    pub show_special: bool,
    /// Parse the output as Harmony (GPT-OSS; [`HarmonyTokens::of`] the tokenizer): the text is
    /// the final channel, [`TextOutcome::reasoning`] the analysis. `show_special` is then unused.
    pub harmony: Option<HarmonyTokens>,
}

/// Why a text generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case", tag = "reason")]
pub enum TextFinish {
    /// `max_tokens` were generated.
    Length,
    /// An end-of-generation (stop) id was chosen.
    StopId { token: u32 },
    /// Stop string `index` of [`TextOptions::stop_strings`] appeared.
    StopString { index: usize },
    /// The caller stopped it.
    Cancelled,
}

impl TextFinish {
    /// OpenAI's `finish_reason`.
    pub fn openai(self) -> &'static str {
        match self {
            TextFinish::Length => "length",
            TextFinish::StopId { .. } | TextFinish::StopString { .. } | TextFinish::Cancelled => "stop",
        }
    }
}

/// The whole of a text generation.
#[derive(Debug, Clone, PartialEq)]
pub struct TextOutcome {
    /// Everything shown, stop string excluded.
    pub text: String,
    /// A Harmony model's reasoning (analysis channel); empty otherwise.
    pub reasoning: String,
    pub finish: TextFinish,
    pub prompt_tokens: usize,
    /// Every generated token with its timing (those after a stop string's start included).
    pub tokens: Vec<GeneratedToken>,
}

/// Anything that ends a text generation early.
#[derive(Debug, thiserror::Error)]
pub enum TextGenerationError {
    #[error(transparent)]
    Generation(#[from] GenerationError),
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
    #[error(transparent)]
    StopString(#[from] StopStringError),
    #[error(transparent)]
    ChatTemplate(#[from] super::ChatTemplateError),
    #[error(transparent)]
    Engine(#[from] crate::engine::EngineError),
    /// The generator's worker thread is gone (it panicked, or the generator was dropped).
    #[error("the text generator's engine thread has stopped")]
    WorkerGone,
}

/// Generate from `prompt` ids, handing each non-empty piece of text to `on_text` as it becomes
/// showable; `Break` from it cancels. Options are checked before any work.
pub fn generate_text<E: Engine + ?Sized>(
    engine: &mut E,
    tokenizer: &Tokenizer,
    prompt: &[u32],
    opts: TextOptions,
    mut on_text: impl FnMut(&str) -> ControlFlow<()>,
) -> Result<TextOutcome, TextGenerationError> {
    let stops = StopStrings::new(opts.stop_strings)?;
    let mut stream = match opts.harmony {
        Some(tokens) => TextStream::harmony(TokenizerRef::Borrowed(tokenizer), tokens, stops),
        None => TextStream::new(tokenizer, !opts.show_special, stops),
    };
    let mut reasoning = String::new();
    let mut session = Generation::new(engine, prompt, opts.generation)?;
    let mut text = String::new();
    let mut tokens = Vec::new();
    let mut stopped = None;
    let mut show = |piece: &str, text: &mut String| {
        text.push_str(piece);
        if piece.is_empty() {
            ControlFlow::Continue(())
        } else {
            on_text(piece)
        }
    };
    while let Some(t) = session.next_token()? {
        let push = stream.push(t.id)?;
        reasoning.push_str(&push.reasoning);
        tokens.push(t);
        let flow = show(&push.text, &mut text);
        if push.stopped.is_some() || flow.is_break() {
            stopped = push.stopped;
            session.cancel();
        }
    }
    let finish = match (stopped, session.finish_reason()) {
        (Some(index), _) => TextFinish::StopString { index },
        (None, Some(FinishReason::Cancelled)) => TextFinish::Cancelled,
        (None, reason) => {
            let push = stream.finish();
            reasoning.push_str(&push.reasoning);
            // Ignore a Break here: there is nothing left to cancel.
            let _ = show(&push.text, &mut text);
            match (push.stopped, reason) {
                (Some(index), _) => TextFinish::StopString { index },
                (None, Some(FinishReason::Stop { token })) => TextFinish::StopId { token },
                _ => TextFinish::Length,
            }
        }
    };
    Ok(TextOutcome { text, reasoning, finish, prompt_tokens: prompt.len(), tokens })
}
