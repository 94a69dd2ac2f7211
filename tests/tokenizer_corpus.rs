//! The tokenizer against Hugging Face `transformers` on a corpus (tests/fixtures/tokenizer,
//! made by make_tokenizer_fixtures.py from the same vocabulary GGUFs), decode round trips, and
//! streaming decode that never emits a broken character.

mod common;

use moe_lanes::text::{StreamDecoder, Tokenizer};
use serde_json::Value;

const VOCABS: [&str; 2] = ["ggml-vocab-qwen2", "ggml-vocab-llama-spm"];

fn tokenizer(name: &str) -> Tokenizer {
    Tokenizer::from_gguf_path(&common::tokenizers().join(format!("{name}.gguf"))).unwrap()
}

/// (text, transformers' ids, the text after transformers' normalizer where that changed it).
fn corpus_cases(name: &str) -> Vec<(String, Vec<u32>, Option<String>)> {
    let path = common::repo_root().join(format!("tests/fixtures/tokenizer/{name}.json"));
    let json: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let cases = json["cases"].as_array().unwrap();
    assert!(cases.len() >= 30, "{}: expected the committed corpus", path.display());
    let ids = |v: &Value| v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect();
    let text = |v: &Value| v.as_str().map(str::to_owned);
    cases.iter().map(|c| (text(&c["text"]).unwrap(), ids(&c["ids"]), text(&c["hf_normalized"]))).collect()
}

/// (text, transformers' ids) of the committed fixture.
fn corpus(name: &str) -> Vec<(String, Vec<u32>)> {
    corpus_cases(name).into_iter().map(|(text, ids, _)| (text, ids)).collect()
}

#[test]
fn ids_equal_transformers_on_the_corpus() {
    for name in VOCABS {
        let tok = tokenizer(name);
        let mut failures = Vec::new();
        let mut normalized = 0;
        for (text, expected, hf_normalized) in corpus_cases(name) {
            // transformers normalizes Qwen2 text to NFC first; llama.cpp (and so moe-lanes) does
            // not, so such a case is checked on the normalized text, and must differ unnormalized.
            let text = match hf_normalized {
                Some(nfc) => {
                    assert_ne!(tok.encode(&text, false, true).unwrap(), expected, "{text:?}");
                    normalized += 1;
                    nfc
                }
                None => text,
            };
            // Hugging Face always matches special tokens written in the text.
            let ids = tok.encode(&text, false, true).unwrap();
            if ids != expected {
                failures.push(format!("{text:?}\n  ours:         {ids:?}\n  transformers: {expected:?}"));
            }
        }
        assert!(failures.is_empty(), "{name}: {} cases differ:\n{}", failures.len(), failures.join("\n"));
        assert!(normalized <= 1, "{name}: only the decomposed-accents case is NFC-sensitive");
    }
}

#[test]
fn decode_inverts_encode_on_the_corpus() {
    for name in VOCABS {
        let tok = tokenizer(name);
        for (text, _) in corpus(name) {
            // (add_special, parse_special): the added BOS/EOS are skipped as control tokens; with
            // parse_special off, special-token texts in the input are plain text and survive.
            for (add_special, parse_special) in [(false, false), (false, true), (true, false)] {
                let ids = tok.encode(&text, add_special, parse_special).unwrap();
                let skip = add_special;
                assert_eq!(tok.decode(&ids, skip).unwrap(), text, "{name} {add_special} {parse_special}");
            }
        }
    }
}

#[test]
fn streaming_decode_emits_only_whole_chars_and_equals_decode() {
    for name in VOCABS {
        let tok = tokenizer(name);
        for (text, _) in corpus(name) {
            let ids = tok.encode(&text, false, true).unwrap();
            let mut stream = StreamDecoder::new(&tok, false);
            let mut out = String::new();
            for &id in &ids {
                let piece = stream.push(id).unwrap();
                assert!(!piece.contains('\u{FFFD}'), "{name}: {text:?}: broken char in {piece:?}");
                out.push_str(&piece);
            }
            assert!(!stream.has_pending(), "{name}: {text:?}: bytes left over");
            out.push_str(&stream.finish());
            assert_eq!(out, text, "{name}");
        }
    }
}

#[test]
fn an_emoji_in_byte_fallback_tokens_waits_for_its_last_byte() {
    let tok = tokenizer("ggml-vocab-llama-spm");
    // 🦀 has no token of its own in Llama's vocabulary: four <0xNN> tokens.
    let ids = tok.encode("🦀", false, false).unwrap();
    let crab = &ids[ids.len() - 4..];
    assert!(crab.iter().all(|&id| tok.token_text(id).unwrap().starts_with("<0x")), "{ids:?}");
    let mut stream = tok.stream(false);
    let outputs: Vec<String> = ids.iter().map(|&id| stream.push(id).unwrap()).collect();
    assert_eq!(outputs.concat(), "🦀");
    assert_eq!(outputs.last().unwrap(), "🦀", "the char comes out whole with its last byte");
    assert!(outputs[..outputs.len() - 1].iter().all(|s| s.is_empty() || !s.contains('\u{FFFD}')));
    // Cut short, the held bytes become one replacement char only at finish.
    let mut cut = tok.stream(false);
    for &id in &ids[..ids.len() - 1] {
        assert!(!cut.push(id).unwrap().contains('\u{FFFD}'));
    }
    assert_eq!(cut.finish(), "\u{FFFD}");
}

#[test]
fn ids_out_of_range_are_typed_errors() {
    let tok = tokenizer("ggml-vocab-qwen2");
    let n = tok.n_vocab() as u32;
    for result in [tok.decode(&[1, n], false).map(|_| ()), tok.token_bytes(n).map(|_| ())] {
        let err = result.unwrap_err().to_string();
        assert_eq!(err, format!("token id {n} is out of range: the vocabulary has {n} tokens"));
    }
    assert!(tok.stream(false).push(n + 5).is_err());
    assert_eq!(tok.token_text(n), None);
}

#[test]
fn special_tokens_bos_eos_and_end_of_generation() {
    let qwen = tokenizer("ggml-vocab-qwen2");
    let im_end = qwen.token_id("<|im_end|>").unwrap();
    assert!(qwen.is_eog(im_end) && qwen.is_eog(qwen.token_id("<|endoftext|>").unwrap()));
    assert!(!qwen.is_eog(qwen.token_id("<|im_start|>").unwrap()));
    assert!(qwen.chat_template().unwrap().contains("<|im_start|>"));
    // Control tokens are text unless asked for.
    assert_eq!(qwen.encode("<|im_end|>", false, true).unwrap(), [im_end]);
    assert!(qwen.encode("<|im_end|>", false, false).unwrap().len() > 1);
    assert_eq!(qwen.decode(&[im_end], true).unwrap(), "");
    assert_eq!(qwen.decode(&[im_end], false).unwrap(), "<|im_end|>");

    let llama = tokenizer("ggml-vocab-llama-spm");
    assert_eq!((llama.bos(), llama.eos()), (Some(1), Some(2)));
    assert_eq!(llama.token_text(1), Some("<s>"));
    let ids = llama.encode("Hello", true, false).unwrap();
    assert_eq!(ids[0], 1, "SentencePiece vocabularies add BOS");
    assert_eq!(llama.decode(&ids, true).unwrap(), "Hello");
    assert!(llama.is_eog(2) && !llama.is_eog(1));
}

#[test]
fn pre_tokenizers_split_like_the_regexes_they_implement() {
    use moe_lanes::text::PreTokenizer;
    // Made by make_tokenizer_fixtures.py: llama.cpp's regexes run by Hugging Face `tokenizers`.
    let path = common::repo_root().join("tests/fixtures/tokenizer/pretokenize.json");
    let json: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let cases = json["cases"].as_array().unwrap();
    assert!(cases.len() >= 36);
    let mut failures = Vec::new();
    for case in cases {
        let text = case["text"].as_str().unwrap();
        for (name, words) in case["words"].as_object().unwrap() {
            let pre = PreTokenizer::from_name(name).unwrap();
            let expected: Vec<&str> = words.as_array().unwrap().iter().map(|w| w.as_str().unwrap()).collect();
            let ours: Vec<&str> = pre.split(text).into_iter().map(|r| &text[r]).collect();
            if ours != expected {
                failures.push(format!("{name} {text:?}\n  ours:  {ours:?}\n  regex: {expected:?}"));
            }
        }
    }
    assert!(failures.is_empty(), "{} splits differ:\n{}", failures.len(), failures.join("\n"));
}

#[test]
fn long_inputs_encode_and_round_trip() {
    // 100 KB in one call: a long word without spaces, long whitespace runs, long digit runs.
    let text = format!(
        "{}{}{}{}",
        "abc".repeat(10_000),
        " ".repeat(20_000),
        "9".repeat(20_000),
        "é🦀".repeat(5_000)
    );
    for name in VOCABS {
        let tok = tokenizer(name);
        let ids = tok.encode(&text, false, false).unwrap();
        assert_eq!(tok.decode(&ids, false).unwrap(), text, "{name}");
    }
}

#[test]
fn one_tokenizer_serves_several_threads() {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<Tokenizer>();
    let tok = std::sync::Arc::new(tokenizer("ggml-vocab-qwen2"));
    let texts: Vec<String> = corpus("ggml-vocab-qwen2").into_iter().map(|(t, _)| t).collect();
    let expected: Vec<Vec<u32>> = texts.iter().map(|t| tok.encode(t, false, true).unwrap()).collect();
    let handles: Vec<_> = (0..4)
        .map(|_| {
            let (tok, texts) = (tok.clone(), texts.clone());
            std::thread::spawn(move || {
                texts.iter().map(|t| tok.encode(t, false, true).unwrap()).collect::<Vec<_>>()
            })
        })
        .collect();
    for h in handles {
        assert_eq!(h.join().unwrap(), expected);
    }
}
