//! Stop strings on a streamed text: [`StopStrings`] passes text through until one of its
//! strings appears, holding back text that might be the start of one.

/// Longest stop string accepted, in bytes (each push scans the held text for every string).
pub const MAX_STOP_STRING_BYTES: usize = 1024;
/// Most stop strings (OpenAI allows 4; llama.cpp's server any number).
pub const MAX_STOP_STRINGS: usize = 16;

/// A bad stop-string list.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StopStringError {
    #[error("stop string {index} is empty")]
    Empty { index: usize },
    #[error("stop string {index} is {bytes} bytes long; the limit is {MAX_STOP_STRING_BYTES}")]
    TooLong { index: usize, bytes: usize },
    #[error("{count} stop strings; the limit is {MAX_STOP_STRINGS}")]
    TooMany { count: usize },
}

/// What one [`StopStrings::push`] gives back.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct StopPush {
    /// Text safe to show now: never a stop string, nor the start of one that may yet complete.
    pub text: String,
    /// Index of the stop string found; the text after it is dropped and later pushes give nothing.
    pub stopped: Option<usize>,
}

/// Matches stop strings in text arriving piece by piece (a stop string may span pieces).
#[derive(Debug, Clone, Default)]
pub struct StopStrings {
    stops: Vec<String>,
    /// Text not yet handed out: a suffix that is a prefix of some stop string.
    held: String,
    stopped: Option<usize>,
}

impl StopStrings {
    pub fn new(stops: Vec<String>) -> Result<StopStrings, StopStringError> {
        if stops.len() > MAX_STOP_STRINGS {
            return Err(StopStringError::TooMany { count: stops.len() });
        }
        for (index, s) in stops.iter().enumerate() {
            if s.is_empty() {
                return Err(StopStringError::Empty { index });
            }
            if s.len() > MAX_STOP_STRING_BYTES {
                return Err(StopStringError::TooLong { index, bytes: s.len() });
            }
        }
        Ok(StopStrings { stops, held: String::new(), stopped: None })
    }

    /// Add text; returns what can be shown and whether a stop string ended it.
    pub fn push(&mut self, text: &str) -> StopPush {
        if self.stopped.is_some() {
            return StopPush { text: String::new(), stopped: self.stopped };
        }
        self.held.push_str(text);
        // The earliest match (of any string) wins; at one position, the first string listed.
        let found = self
            .stops
            .iter()
            .enumerate()
            .filter_map(|(i, s)| self.held.find(s.as_str()).map(|at| (at, i)))
            .min();
        if let Some((at, index)) = found {
            self.held.truncate(at);
            self.stopped = Some(index);
            return StopPush { text: std::mem::take(&mut self.held), stopped: Some(index) };
        }
        let keep = self.partial_suffix_len();
        let text = self.held[..self.held.len() - keep].to_string();
        self.held.drain(..self.held.len() - keep);
        StopPush { text, stopped: None }
    }

    /// The text held back (the generation ended without completing a stop string).
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }

    /// Which stop string ended the text, if one did.
    pub fn stopped(&self) -> Option<usize> {
        self.stopped
    }

    pub fn is_empty(&self) -> bool {
        self.stops.is_empty()
    }

    /// Length of the longest suffix of `held` that is a proper prefix of a stop string.
    fn partial_suffix_len(&self) -> usize {
        let held = self.held.as_str();
        let longest = self.stops.iter().map(|s| s.len() - 1).max().unwrap_or(0).min(held.len());
        (1..=longest)
            .rev()
            .find(|&n| {
                let start = held.len() - n;
                held.is_char_boundary(start) && self.stops.iter().any(|s| s.starts_with(&held[start..]))
            })
            .unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn stops(list: &[&str]) -> StopStrings {
        StopStrings::new(list.iter().map(|s| s.to_string()).collect()).unwrap()
    }

    /// Push the pieces; returns (all shown text, the stop index).
    fn feed(s: &mut StopStrings, pieces: &[&str]) -> (String, Option<usize>) {
        let mut out = String::new();
        for p in pieces {
            let push = s.push(p);
            out.push_str(&push.text);
            if push.stopped.is_some() {
                return (out, push.stopped);
            }
        }
        out.push_str(&s.finish());
        (out, None)
    }

    #[test]
    fn text_before_the_stop_string_is_returned_without_it() {
        let mut s = stops(&["</s>", "User:"]);
        assert_eq!(feed(&mut s, &["Hello wor", "ld</s> and more"]), ("Hello world".into(), Some(0)));
        assert!(s.push("later").text.is_empty(), "nothing after a stop");
    }

    #[test]
    fn a_stop_string_spanning_pieces_is_found_and_held_back_meanwhile() {
        let mut s = stops(&["User:"]);
        assert_eq!(s.push("Sure. Us").text, "Sure. ", "'Us' may start 'User:'");
        assert_eq!(s.push("e").text, "");
        let last = s.push("r: next");
        assert_eq!(last, StopPush { text: String::new(), stopped: Some(0) });
    }

    #[test]
    fn held_text_that_does_not_complete_is_released() {
        let mut s = stops(&["User:"]);
        assert_eq!(s.push("Use").text, "");
        assert_eq!(s.push("ful").text, "Useful");
        assert_eq!(s.push(" Us").text, " ");
        assert_eq!(s.finish(), "Us", "the end of the generation releases what is held");
    }

    #[test]
    fn the_earliest_match_wins_and_multibyte_text_is_split_on_char_boundaries() {
        let mut s = stops(&["b", "ab"]);
        assert_eq!(feed(&mut s, &["xab"]), ("x".into(), Some(1)));
        let mut s = stops(&["🦀!"]);
        assert_eq!(s.push("é🦀").text, "é");
        assert_eq!(s.push("?").text, "🦀?");
    }

    #[test]
    fn bad_lists_are_errors() {
        assert_eq!(
            StopStrings::new(vec!["a".into(), String::new()]).unwrap_err(),
            StopStringError::Empty { index: 1 }
        );
        let long = "x".repeat(MAX_STOP_STRING_BYTES + 1);
        assert!(matches!(StopStrings::new(vec![long]), Err(StopStringError::TooLong { index: 0, .. })));
        assert!(matches!(
            StopStrings::new(vec!["a".into(); MAX_STOP_STRINGS + 1]),
            Err(StopStringError::TooMany { .. })
        ));
        assert_eq!(feed(&mut stops(&[]), &["any", "thing"]), ("anything".into(), None));
    }

    proptest! {
        /// However the text is cut into pieces, the output is the text up to the first stop
        /// string (or all of it), and no stop string is ever shown.
        #[test]
        fn output_is_the_prefix_before_the_first_stop(
            text in "[ab🦀c]{0,40}",
            cuts in proptest::collection::vec(0usize..40, 0..8),
            stop in "[ab🦀]{1,3}",
        ) {
            let chars: Vec<char> = text.chars().collect();
            let mut cuts: Vec<usize> = cuts.into_iter().map(|c| c.min(chars.len())).collect();
            cuts.sort_unstable();
            let mut pieces = Vec::new();
            let mut last = 0;
            for c in cuts.into_iter().chain([chars.len()]) {
                pieces.push(chars[last..c].iter().collect::<String>());
                last = c;
            }
            let refs: Vec<&str> = pieces.iter().map(String::as_str).collect();
            let (out, stopped) = feed(&mut stops(&[&stop]), &refs);
            match text.find(&stop) {
                Some(at) => {
                    prop_assert_eq!(&out, &text[..at]);
                    prop_assert_eq!(stopped, Some(0));
                }
                None => {
                    prop_assert_eq!(&out, &text);
                    prop_assert_eq!(stopped, None);
                }
            }
        }
    }
}
