//! [`StreamDecoder`]: ids in, text out as soon as it is whole UTF-8.

use super::{Tokenizer, TokenizerError};

/// Decodes a stream of ids. [`push`](StreamDecoder::push) returns only complete UTF-8: a
/// character whose bytes are split over tokens (an emoji in byte-fallback tokens, a CJK char
/// in byte-level pieces) is held back until its last byte arrives; bytes that can never form a
/// character become U+FFFD. [`finish`](StreamDecoder::finish) flushes what is held (lossy).
/// The concatenated output equals [`Tokenizer::decode`] of the same ids.
#[derive(Debug)]
pub struct StreamDecoder<'t> {
    tokenizer: TokenizerRef<'t>,
    skip_special: bool,
    /// Bytes not yet emitted: the start of an incomplete UTF-8 sequence.
    pending: Vec<u8>,
    /// SentencePiece: the first non-special token still has its prefix space to drop.
    strip_space: bool,
}

/// The tokenizer a decoder reads: borrowed, or shared (a decoder that outlives any borrow: a
/// server's streams, one per running request, kept between batched steps).
#[derive(Debug, Clone)]
pub enum TokenizerRef<'t> {
    Borrowed(&'t Tokenizer),
    Shared(std::sync::Arc<Tokenizer>),
}

impl std::ops::Deref for TokenizerRef<'_> {
    type Target = Tokenizer;
    fn deref(&self) -> &Tokenizer {
        match self {
            TokenizerRef::Borrowed(t) => t,
            TokenizerRef::Shared(t) => t,
        }
    }
}

impl<'t> StreamDecoder<'t> {
    pub fn new(tokenizer: &'t Tokenizer, skip_special: bool) -> StreamDecoder<'t> {
        StreamDecoder::over(TokenizerRef::Borrowed(tokenizer), skip_special)
    }

    /// A decoder over a borrowed or shared tokenizer.
    pub fn over(tokenizer: TokenizerRef<'t>, skip_special: bool) -> StreamDecoder<'t> {
        let strip_space = tokenizer.strips_leading_space();
        StreamDecoder { tokenizer, skip_special, pending: Vec::new(), strip_space }
    }

    /// Add one id; returns the text that became complete (often empty).
    pub fn push(&mut self, id: u32) -> Result<String, TokenizerError> {
        self.tokenizer.check(id)?;
        let special = self.tokenizer.is_special(id);
        if self.skip_special && special {
            return Ok(String::new());
        }
        let start = self.pending.len();
        self.tokenizer.append_bytes(id, &mut self.pending);
        if self.strip_space && !special {
            if self.pending.get(start) == Some(&b' ') {
                self.pending.remove(start);
            }
            self.strip_space = false;
        }
        Ok(self.take_complete())
    }

    /// Whether bytes of an incomplete character are held back.
    pub fn has_pending(&self) -> bool {
        !self.pending.is_empty()
    }

    /// Flush what is held back (an incomplete sequence becomes U+FFFD).
    pub fn finish(mut self) -> String {
        let rest = std::mem::take(&mut self.pending);
        String::from_utf8_lossy(&rest).into_owned()
    }

    /// Emit the longest prefix of `pending` that is whole UTF-8 (invalid bytes become U+FFFD);
    /// keep an incomplete sequence at the end.
    fn take_complete(&mut self) -> String {
        let mut out = String::new();
        let mut rest: &[u8] = &self.pending;
        loop {
            match std::str::from_utf8(rest) {
                Ok(s) => {
                    out.push_str(s);
                    rest = &[];
                    break;
                }
                Err(e) => {
                    let (valid, after) = rest.split_at(e.valid_up_to());
                    out.push_str(std::str::from_utf8(valid).expect("checked valid"));
                    match e.error_len() {
                        // Invalid bytes that no later byte can fix.
                        Some(n) => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            rest = &after[n..];
                        }
                        // An incomplete sequence at the end: wait for more bytes.
                        None => {
                            rest = after;
                            break;
                        }
                    }
                }
            }
        }
        let keep = rest.len();
        self.pending.drain(..self.pending.len() - keep);
        out
    }
}
