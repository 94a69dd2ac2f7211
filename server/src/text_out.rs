//! Generated ids to text for the OpenAI API: whole UTF-8 only (the library's `StreamDecoder`),
//! and stop strings matched on the text. While streaming, text that could be the start of a
//! stop string is held back until it either completes the stop (then it and everything after
//! it is dropped, and the generation ends) or cannot any more (then it is released).

use moe_lanes::text::{StreamDecoder, Tokenizer, TokenizerError};
use std::sync::Arc;

/// Most stop strings one request may give (OpenAI's limit).
pub const MAX_STOP_STRINGS: usize = 4;

/// What a text request needs on the engine thread: the tokenizer and its stop strings.
#[derive(Clone)]
pub struct TextOut {
    pub tokenizer: Arc<Tokenizer>,
    pub stops: Vec<String>,
}

/// Decodes one generation, piece by piece.
pub struct TextStream<'t> {
    decoder: StreamDecoder<'t>,
    stops: &'t [String],
    /// Decoded text not yet released: a suffix that may start a stop string.
    held: String,
}

/// What one token released.
#[derive(Debug, PartialEq)]
pub struct Piece {
    pub text: String,
    /// A stop string was completed: `text` ends just before it, and the generation ends.
    pub stopped: bool,
}

impl<'t> TextStream<'t> {
    /// Control tokens (`<|im_end|>`, ...) are not printed, as `run` does by default.
    pub fn new(out: &'t TextOut) -> TextStream<'t> {
        TextStream { decoder: out.tokenizer.stream(true), stops: &out.stops, held: String::new() }
    }

    pub fn push(&mut self, id: u32) -> Result<Piece, TokenizerError> {
        let piece = self.decoder.push(id)?;
        self.held.push_str(&piece);
        Ok(self.release())
    }

    /// The end: what is still held (an incomplete character becomes U+FFFD), cut at a stop
    /// string if the last bytes completed one.
    pub fn finish(self) -> Piece {
        let TextStream { decoder, stops, mut held } = self;
        held.push_str(&decoder.finish());
        match stops.iter().filter_map(|s| held.find(s.as_str())).min() {
            Some(at) => Piece { text: held[..at].to_string(), stopped: true },
            None => Piece { text: held, stopped: false },
        }
    }

    fn release(&mut self) -> Piece {
        if let Some(at) = self.first_stop() {
            let text = self.held[..at].to_string();
            self.held.clear();
            return Piece { text, stopped: true };
        }
        let keep = self.held.len() - self.stop_prefix_start();
        let text = self.held[..self.held.len() - keep].to_string();
        self.held.drain(..self.held.len() - keep);
        Piece { text, stopped: false }
    }

    /// Where the earliest stop string starts in `held`.
    fn first_stop(&self) -> Option<usize> {
        self.stops.iter().filter_map(|s| self.held.find(s.as_str())).min()
    }

    /// The start of the longest suffix of `held` that is a proper prefix of a stop string
    /// (`held.len()` when none): the text to hold back.
    fn stop_prefix_start(&self) -> usize {
        let h = &self.held;
        (0..h.len())
            .filter(|&i| h.is_char_boundary(i))
            .find(|&i| self.stops.iter().any(|s| s.len() > h.len() - i && s.starts_with(&h[i..])))
            .unwrap_or(h.len())
    }
}
