//! Property test: the hand-written pre-tokenizer splitters (src/text/pretokenize.rs) give the
//! same words as llama.cpp's regexes run by a regex engine with lookahead (fancy-regex), on
//! random strings over letters, combining marks, digits, whitespace and punctuation.

use fancy_regex::Regex;
use moe_lanes::text::PreTokenizer;
use proptest::prelude::*;

const CONTRACTIONS: &str = "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])";
const GPT2: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)";

fn regexes(pre: PreTokenizer) -> Vec<String> {
    let tail = |word: &str, digits: &str, punct: &str| {
        format!(
            r"{CONTRACTIONS}|[^\r\n\p{{L}}\p{{N}}]?{word}+|\p{{N}}{digits}| ?[^\s{punct}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
        )
    };
    match pre {
        PreTokenizer::Gpt2 => vec![GPT2.into()],
        PreTokenizer::Llama3 => vec![tail(r"\p{L}", "{1,3}", r"\p{L}\p{N}")],
        PreTokenizer::Qwen2 => vec![tail(r"\p{L}", "", r"\p{L}\p{N}")],
        PreTokenizer::Qwen35 => vec![tail(r"[\p{L}\p{M}]", "", r"\p{L}\p{M}\p{N}")],
        PreTokenizer::Default => {
            vec![r"[\p{P}\$\+<=>\^~\|]+".into(), GPT2.into(), r"\p{N}+".into(), "[0-9][0-9][0-9]".into()]
        }
    }
}

/// Successive isolating splits: every match and every gap between matches is a word, each word
/// matched on its own by the next regex.
fn regex_split(regexes: &[Regex], text: &str) -> Vec<String> {
    let mut words = vec![text.to_string()];
    for re in regexes {
        let mut next = Vec::new();
        for word in &words {
            let mut last = 0;
            for m in re.find_iter(word) {
                let m = m.unwrap();
                if m.start() > last {
                    next.push(word[last..m.start()].to_string());
                }
                if m.end() > m.start() {
                    next.push(m.as_str().to_string());
                }
                last = m.end();
            }
            if last < word.len() {
                next.push(word[last..].to_string());
            }
        }
        words = next;
    }
    words
}

const ALPHABET: &[char] = &[
    'a', 'Z', 's', 't', 'r', 'e', 'v', 'm', 'l', 'd', 'S', 'L', 'é', '中', 'न', 'ж', '\u{301}', '्', 'ा', '1',
    '7', '٣', '½', ' ', ' ', ' ', '\t', '\n', '\r', '\u{a0}', '\u{3000}', '\'', '!', '-', '$', '+', '😀',
    '_', '.',
];

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]
    #[test]
    fn splitters_match_their_regexes(chars in prop::collection::vec(prop::sample::select(ALPHABET), 0..24)) {
        let text: String = chars.into_iter().collect();
        for pre in [PreTokenizer::Gpt2, PreTokenizer::Llama3, PreTokenizer::Qwen2, PreTokenizer::Qwen35, PreTokenizer::Default] {
            let res: Vec<Regex> = regexes(pre).iter().map(|r| Regex::new(r).unwrap()).collect();
            let expected = regex_split(&res, &text);
            let ours: Vec<String> = pre.split(&text).into_iter().map(|r| text[r].to_string()).collect();
            prop_assert_eq!(ours, expected, "{:?} on {:?}", pre, text);
        }
    }
}
