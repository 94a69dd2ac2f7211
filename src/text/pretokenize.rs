//! Pre-tokenizers of byte-level BPE vocabularies: split text into words before BPE merges, as
//! llama.cpp does for each `tokenizer.ggml.pre` name.
//!
//! llama.cpp expresses each pre-tokenizer as one or more regexes over Unicode general
//! categories (`\p{L}`, `\p{N}`, `\p{M}`) with a negative lookahead (`\s+(?!\S)`). The `regex`
//! crate has no lookahead and `fancy-regex` backtracks (slow on long whitespace runs), so the
//! alternatives are matched here by hand, one small function per regex family, with the
//! categories from `unicode-general-category` (a table crate, no regex engine). Each function
//! documents the regex it implements; leftmost-first alternation and greedy quantifiers with
//! their backtracking are spelled out where they matter.

use unicode_general_category::{get_general_category, GeneralCategory as Gc};

/// The pre-tokenizer a BPE vocabulary names in `tokenizer.ggml.pre`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PreTokenizer {
    /// llama.cpp's `LLAMA_VOCAB_PRE_TYPE_DEFAULT` (`default`): four successive splits.
    Default,
    /// GPT-2's regex (`gpt-2`, `olmo`, `mpt`, `phi-2`, ...).
    Gpt2,
    /// Llama 3's regex (`llama-bpe`, `llama3`, `dbrx`, ...): digit runs of up to three.
    Llama3,
    /// Qwen 2's regex (`qwen2`, `stablelm2`, ...): one digit per word.
    Qwen2,
    /// Qwen 3.5's regex (`qwen35`): Qwen 2's with combining marks (`\p{M}`) joining letters.
    Qwen35,
}

impl PreTokenizer {
    /// The pre-tokenizer llama.cpp selects for a `tokenizer.ggml.pre` name, if supported.
    pub fn from_name(name: &str) -> Option<PreTokenizer> {
        Some(match name {
            "default" => PreTokenizer::Default,
            "gpt-2" | "gpt2" | "olmo" | "mpt" | "phi-2" | "jais" | "trillion" | "granite-docling"
            | "exaone4" | "roberta-bpe" | "jina-v1-en" | "jina-v2-code" | "mellum" | "modern-bert" => {
                PreTokenizer::Gpt2
            }
            "llama-bpe" | "llama3" | "llama-v3" | "falcon3" | "falcon-h1" | "pixtral" | "dbrx"
            | "smaug-bpe" | "midm-2.0" | "lfm2" => PreTokenizer::Llama3,
            "qwen2" | "deepseek-r1-qwen" | "stablelm2" | "megrez" | "hunyuan" | "grok-2" => {
                PreTokenizer::Qwen2
            }
            "qwen35" => PreTokenizer::Qwen35,
            _ => return None,
        })
    }

    /// llama.cpp's regexes for this pre-tokenizer, applied in order as isolating splits (what
    /// [`split`](Self::split) implements by hand; written into exported `tokenizer.json` files).
    pub fn regexes(self) -> &'static [&'static str] {
        const GPT2: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)";
        match self {
            PreTokenizer::Default => &[r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", "[0-9][0-9][0-9]"],
            PreTokenizer::Gpt2 => &[GPT2],
            PreTokenizer::Llama3 => &[
                r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
            ],
            PreTokenizer::Qwen2 => &[
                r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
            ],
            PreTokenizer::Qwen35 => &[
                r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
            ],
        }
    }

    /// Whether a word that is itself a vocabulary token is taken whole, skipping merges
    /// (llama.cpp's `ignore_merges`, set for the Llama 3 family).
    pub fn ignores_merges(self) -> bool {
        self == PreTokenizer::Llama3
    }

    /// Split `text` into words (byte ranges of `text`, in order, covering it).
    pub fn split(self, text: &str) -> Vec<std::ops::Range<usize>> {
        let chars: Vec<(usize, char)> = text.char_indices().collect();
        let whole = vec![0..chars.len()];
        let char_ranges = match self {
            PreTokenizer::Default => {
                let words = refine(&chars, whole, default_punct);
                let words = refine(&chars, words, gpt2_word);
                let words = refine(&chars, words, number_run);
                refine(&chars, words, ascii_digit_triple)
            }
            PreTokenizer::Gpt2 => refine(&chars, whole, gpt2_word),
            PreTokenizer::Llama3 => refine(&chars, whole, |c, p| llama3_word(c, p, Family::LLAMA3)),
            PreTokenizer::Qwen2 => refine(&chars, whole, |c, p| llama3_word(c, p, Family::QWEN2)),
            PreTokenizer::Qwen35 => refine(&chars, whole, |c, p| llama3_word(c, p, Family::QWEN35)),
        };
        let byte_at = |i: usize| chars.get(i).map_or(text.len(), |&(b, _)| b);
        char_ranges.into_iter().map(|r| byte_at(r.start)..byte_at(r.end)).collect()
    }
}

/// A matcher: the end (exclusive, in chars) of the match starting at `pos` of `seg`, if any.
type Matcher<'a> = dyn Fn(&[char], usize) -> Option<usize> + 'a;

/// Split each word further by a regex, as llama.cpp's successive regex splits do: matches and
/// the gaps between them both become words; each word is matched on its own (lookahead does
/// not see past it).
fn refine(
    chars: &[(usize, char)],
    words: Vec<std::ops::Range<usize>>,
    matcher: impl Fn(&[char], usize) -> Option<usize>,
) -> Vec<std::ops::Range<usize>> {
    let matcher: &Matcher<'_> = &matcher;
    let mut out = Vec::with_capacity(words.len());
    let mut seg: Vec<char> = Vec::new();
    for word in words {
        seg.clear();
        seg.extend(chars[word.clone()].iter().map(|&(_, c)| c));
        let mut gap_start = 0;
        let mut pos = 0;
        while pos < seg.len() {
            match matcher(&seg, pos).filter(|&end| end > pos) {
                Some(end) => {
                    if gap_start < pos {
                        out.push(word.start + gap_start..word.start + pos);
                    }
                    out.push(word.start + pos..word.start + end);
                    pos = end;
                    gap_start = end;
                }
                None => pos += 1,
            }
        }
        if gap_start < seg.len() {
            out.push(word.start + gap_start..word.end);
        }
    }
    out
}

fn is_letter(c: char) -> bool {
    if c.is_ascii() {
        return c.is_ascii_alphabetic();
    }
    matches!(
        get_general_category(c),
        Gc::UppercaseLetter
            | Gc::LowercaseLetter
            | Gc::TitlecaseLetter
            | Gc::ModifierLetter
            | Gc::OtherLetter
    )
}

fn is_number(c: char) -> bool {
    if c.is_ascii() {
        return c.is_ascii_digit();
    }
    matches!(get_general_category(c), Gc::DecimalNumber | Gc::LetterNumber | Gc::OtherNumber)
}

fn is_mark(c: char) -> bool {
    !c.is_ascii()
        && matches!(get_general_category(c), Gc::NonspacingMark | Gc::SpacingMark | Gc::EnclosingMark)
}

fn is_punctuation(c: char) -> bool {
    matches!(
        get_general_category(c),
        Gc::ConnectorPunctuation
            | Gc::DashPunctuation
            | Gc::OpenPunctuation
            | Gc::ClosePunctuation
            | Gc::InitialPunctuation
            | Gc::FinalPunctuation
            | Gc::OtherPunctuation
    )
}

/// `\s`: Unicode White_Space, the set llama.cpp's codepoint flags use.
fn is_space(c: char) -> bool {
    c.is_whitespace()
}

fn is_newline(c: char) -> bool {
    c == '\r' || c == '\n'
}

/// End of the run of chars from `pos` that satisfy `pred`.
fn run(seg: &[char], pos: usize, pred: impl Fn(char) -> bool) -> usize {
    seg[pos..].iter().position(|&c| !pred(c)).map_or(seg.len(), |n| pos + n)
}

/// `[\p{P}\$\+<=>\^~\|]+` (the first split of `default`).
fn default_punct(seg: &[char], pos: usize) -> Option<usize> {
    let end = run(seg, pos, |c| is_punctuation(c) || "$+<=>^~|".contains(c));
    (end > pos).then_some(end)
}

/// `\p{N}+`.
fn number_run(seg: &[char], pos: usize) -> Option<usize> {
    let end = run(seg, pos, is_number);
    (end > pos).then_some(end)
}

/// `[0-9][0-9][0-9]`.
fn ascii_digit_triple(seg: &[char], pos: usize) -> Option<usize> {
    (pos + 3 <= seg.len() && seg[pos..pos + 3].iter().all(char::is_ascii_digit)).then_some(pos + 3)
}

/// `'s|'t|'re|'ve|'m|'ll|'d` with the letters' case either exact (GPT-2) or free (Llama 3).
fn contraction(seg: &[char], pos: usize, any_case: bool) -> Option<usize> {
    if seg[pos] != '\'' {
        return None;
    }
    let at = |i: usize| -> Option<char> {
        let c = *seg.get(pos + i)?;
        Some(if any_case { c.to_ascii_lowercase() } else { c })
    };
    match (at(1)?, at(2)) {
        ('s' | 't' | 'm' | 'd', _) => Some(pos + 2),
        ('r', Some('e')) | ('v', Some('e')) | ('l', Some('l')) => Some(pos + 3),
        _ => None,
    }
}

/// `\s+(?!\S)`: a whitespace run that is not followed by a non-space; when it is, the run
/// gives back its last char (which then starts the next word), if it has more than one.
fn space_not_before_word(seg: &[char], pos: usize) -> Option<usize> {
    let end = run(seg, pos, is_space);
    if end == pos {
        return None;
    }
    if end == seg.len() {
        return Some(end);
    }
    (end - pos >= 2).then_some(end - 1)
}

/// GPT-2: `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`
/// (llama.cpp keeps what no alternative matches as words of their own, which is what the
/// final `\s+` gives).
fn gpt2_word(seg: &[char], pos: usize) -> Option<usize> {
    if let Some(end) = contraction(seg, pos, false) {
        return Some(end);
    }
    let body = if seg[pos] == ' ' && pos + 1 < seg.len() { pos + 1 } else { pos };
    let c = seg[body];
    let classes: [&dyn Fn(char) -> bool; 3] =
        [&is_letter, &is_number, &|c| !is_space(c) && !is_letter(c) && !is_number(c)];
    for class in classes {
        if class(c) {
            return Some(run(seg, body, class));
        }
    }
    space_not_before_word(seg, pos).or_else(|| Some(run(seg, pos, is_space)).filter(|&e| e > pos))
}

/// The knobs of the Llama 3 regex family.
#[derive(Clone, Copy)]
struct Family {
    /// `\p{N}{1,max_digits}`.
    max_digits: usize,
    /// Whether `\p{M}` joins `\p{L}` in words and leaves the punctuation class (Qwen 3.5).
    marks_are_letters: bool,
}

impl Family {
    const LLAMA3: Family = Family { max_digits: 3, marks_are_letters: false };
    const QWEN2: Family = Family { max_digits: 1, marks_are_letters: false };
    const QWEN35: Family = Family { max_digits: 1, marks_are_letters: true };

    fn is_word_char(self, c: char) -> bool {
        is_letter(c) || (self.marks_are_letters && is_mark(c))
    }

    fn is_punct(self, c: char) -> bool {
        !is_space(c) && !is_letter(c) && !is_number(c) && !(self.marks_are_letters && is_mark(c))
    }
}

/// Llama 3 / Qwen 2 / Qwen 3.5:
/// `(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?W+|\p{N}{1,K}| ?P+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`
/// with `W` = `\p{L}` (or `[\p{L}\p{M}]`), `P` = `[^\s\p{L}\p{N}]` (or without `\p{M}`), and
/// `K` = 3 (or 1).
fn llama3_word(seg: &[char], pos: usize, f: Family) -> Option<usize> {
    if let Some(end) = contraction(seg, pos, true) {
        return Some(end);
    }
    let c = seg[pos];
    let next = seg.get(pos + 1).copied();
    // [^\r\n\p{L}\p{N}]?W+ : with the optional prefix char, or without it.
    if !is_newline(c) && !is_letter(c) && !is_number(c) && next.is_some_and(|n| f.is_word_char(n)) {
        return Some(run(seg, pos + 1, |c| f.is_word_char(c)));
    }
    if f.is_word_char(c) {
        return Some(run(seg, pos, |c| f.is_word_char(c)));
    }
    if is_number(c) {
        let end = run(seg, pos, is_number);
        return Some(end.min(pos + f.max_digits));
    }
    //  ?P+[\r\n]*
    let body = if c == ' ' && next.is_some_and(|n| f.is_punct(n)) { pos + 1 } else { pos };
    if f.is_punct(seg[body]) {
        let end = run(seg, body, |c| f.is_punct(c));
        return Some(run(seg, end, is_newline));
    }
    // \s*[\r\n]+ : the whitespace run up to and including its last newline.
    let space_end = run(seg, pos, is_space);
    if let Some(last_nl) = seg[pos..space_end].iter().rposition(|&c| is_newline(c)) {
        return Some(pos + last_nl + 1);
    }
    space_not_before_word(seg, pos).or(Some(space_end).filter(|&e| e > pos))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(pre: PreTokenizer, text: &str) -> Vec<&str> {
        pre.split(text).into_iter().map(|r| &text[r]).collect()
    }

    #[test]
    fn gpt2_splits_words_numbers_punctuation_and_spaces() {
        assert_eq!(
            words(PreTokenizer::Gpt2, "Hello world's 123 !!  x\n"),
            ["Hello", " world", "'s", " 123", " !!", " ", " x", "\n"]
        );
    }

    #[test]
    fn llama3_groups_digits_by_three_and_keeps_newlines_with_spaces() {
        assert_eq!(
            words(PreTokenizer::Llama3, "12345 I'LL\n\n  go"),
            ["123", "45", " I", "'LL", "\n\n", " ", " go"]
        );
        assert_eq!(words(PreTokenizer::Qwen2, "2024"), ["2", "0", "2", "4"]);
    }

    #[test]
    fn qwen35_keeps_combining_marks_with_letters() {
        // "e" + COMBINING ACUTE ACCENT, then a Devanagari word with vowel signs.
        let text = "cafe\u{301} नमस्ते";
        assert_eq!(words(PreTokenizer::Qwen35, text), ["cafe\u{301}", " नमस्ते"]);
        assert_eq!(words(PreTokenizer::Qwen2, text), ["cafe", "\u{301}", " नमस", "्त", "े"]);
    }

    #[test]
    fn splits_cover_the_text() {
        let text = "  a\t\t b\r\n\r\n 1,000,000!?  ";
        for pre in [
            PreTokenizer::Default,
            PreTokenizer::Gpt2,
            PreTokenizer::Llama3,
            PreTokenizer::Qwen2,
            PreTokenizer::Qwen35,
        ] {
            assert_eq!(words(pre, text).concat(), text, "{pre:?}");
        }
    }
}
