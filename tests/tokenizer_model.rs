//! The tokenizer of models: synthetic models' own vocabulary, `synth --vocab-from`, and typed
//! errors naming the metadata key (and index) for malformed tokenizer tables.

mod common;

use common::{rewrite_gguf, synth_options, TensorEdit};
use moe_lanes::gguf::MetaValue;
use moe_lanes::model::Model;
use moe_lanes::synth::{write_synthetic, SynthFormat};
use moe_lanes::text::{Tokenizer, TokenizerError};
use std::path::{Path, PathBuf};

fn synth_gguf(dir: &Path, vocab_from: Option<PathBuf>) -> PathBuf {
    let mut opts = synth_options("qwen3_moe", SynthFormat::Gguf, dir.join("m.gguf"), 3);
    opts.vocab_from = vocab_from;
    write_synthetic(&opts, &mut |_, _| {}).unwrap();
    opts.out
}

#[test]
fn synthetic_models_tokenize_with_their_own_vocabulary() {
    let dir = tempfile::tempdir().unwrap();
    let model = Model::open(&synth_gguf(dir.path(), None)).unwrap();
    let tok = Tokenizer::from_model(&model).unwrap();
    assert_eq!(tok.n_vocab(), model.config().vocab);
    let text = "hello world, 123 <|im_start|>héllo\n";
    let ids = tok.encode(text, false, true).unwrap();
    assert!(ids.len() < text.len(), "merges apply: {ids:?}");
    assert!(ids.contains(&tok.token_id("<|im_start|>").unwrap()));
    assert_eq!(tok.decode(&ids, false).unwrap(), text);
    assert!(tok.is_eog(tok.token_id("<|im_end|>").unwrap()));
    assert_eq!(tok.eos(), tok.token_id("<|endoftext|>"));
}

#[test]
fn vocab_from_copies_the_tokenizer_and_the_vocabulary_size() {
    let dir = tempfile::tempdir().unwrap();
    let vocab = common::tokenizers().join("ggml-vocab-qwen2.gguf");
    let model = Model::open(&synth_gguf(dir.path(), Some(vocab.clone()))).unwrap();
    let real = Tokenizer::from_gguf_path(&vocab).unwrap();
    let copied = Tokenizer::from_model(&model).unwrap();
    assert_eq!(model.config().vocab, real.n_vocab());
    assert_eq!(copied.n_vocab(), 151_936);
    assert_eq!(copied.chat_template(), real.chat_template());
    assert!(copied.chat_template().is_some());
    for (text, _) in common::vocab_test_vectors("ggml-vocab-qwen2") {
        assert_eq!(copied.encode(&text, false, true).unwrap(), real.encode(&text, false, true).unwrap());
    }
    // Every tokenizer.* key is copied, values equal.
    let (src, dst) = (moe_lanes::gguf::GgufFile::open(&vocab).unwrap(), model.gguf().unwrap());
    for (key, value) in src.metadata().iter().filter(|(k, _)| k.starts_with("tokenizer.")) {
        assert_eq!(dst.get(key), Some(value), "{key}");
    }
}

#[test]
fn vocab_from_into_safetensors_writes_a_tokenizer_json_that_tokenizes_the_same() {
    let dir = tempfile::tempdir().unwrap();
    let vocab = common::tokenizers().join("ggml-vocab-qwen2.gguf");
    let mut opts = synth_options("olmoe", SynthFormat::Safetensors, dir.path().join("st"), 1);
    opts.vocab_from = Some(vocab.clone());
    write_synthetic(&opts, &mut |_, _| {}).unwrap();
    let model = Model::open(&opts.out).unwrap();
    assert_eq!(model.config().vocab, 151_936);
    let hf = Tokenizer::from_model(&model).unwrap(); // tokenizer.json, through the tokenizers crate
    let gguf = Tokenizer::from_gguf_path(&vocab).unwrap();
    assert_eq!((hf.n_vocab(), hf.bos(), hf.eos()), (gguf.n_vocab(), gguf.bos(), gguf.eos()));
    assert_eq!(hf.chat_template(), gguf.chat_template());
    assert_eq!(hf.eog_ids(), gguf.eog_ids());
    let mut texts: Vec<String> =
        common::vocab_test_vectors("ggml-vocab-qwen2").into_iter().map(|(t, _)| t).collect();
    texts.push("<|im_start|>user\nHi 🦀<|im_end|>\n  x".into());
    for text in &texts {
        for parse_special in [false, true] {
            let ids = hf.encode(text, false, parse_special).unwrap();
            assert_eq!(ids, gguf.encode(text, false, parse_special).unwrap(), "{text:?} {parse_special}");
            assert_eq!(hf.decode(&ids, false).unwrap(), *text);
        }
    }
    let im_end = hf.token_id("<|im_end|>").unwrap();
    assert!(hf.is_special(im_end) && hf.decode(&[im_end], true).unwrap().is_empty());
}

/// Chat out of the box: the synthetic vocabulary (ChatML's markers) carries the ChatML template,
/// and so does a copied vocabulary with the markers but no template, in GGUF metadata and in
/// safetensors' `tokenizer_config.json`; a copied template is kept, and a vocabulary without the
/// markers gets none.
#[test]
fn chatml_vocabularies_get_the_chatml_template() {
    use moe_lanes::text::CHATML_TEMPLATE;
    let dir = tempfile::tempdir().unwrap();
    let own = Tokenizer::from_model(&Model::open(&synth_gguf(dir.path(), None)).unwrap()).unwrap();
    assert_eq!(own.chat_template(), Some(CHATML_TEMPLATE));
    let qwen2 = common::tokenizers().join("ggml-vocab-qwen2.gguf");
    let bare = dir.path().join("qwen2-no-template.gguf");
    rewrite_gguf(
        &qwen2,
        &bare,
        |k, v| (k != "tokenizer.chat_template").then(|| v.clone()),
        |_| TensorEdit::Keep,
    );
    assert_eq!(Tokenizer::from_gguf_path(&bare).unwrap().chat_template(), None);
    for (format, out) in [(SynthFormat::Gguf, "c.gguf"), (SynthFormat::Safetensors, "c-st")] {
        let mut opts = synth_options("qwen3_moe", format, dir.path().join(out), 1);
        opts.vocab_from = Some(bare.clone());
        write_synthetic(&opts, &mut |_, _| {}).unwrap();
        let tok = Tokenizer::from_model(&Model::open(&opts.out).unwrap()).unwrap();
        assert_eq!(tok.chat_template(), Some(CHATML_TEMPLATE), "{format:?}");
    }
    let sub = tempfile::tempdir().unwrap();
    let kept = Tokenizer::from_model(&Model::open(&synth_gguf(sub.path(), Some(qwen2))).unwrap()).unwrap();
    assert_ne!(kept.chat_template(), Some(CHATML_TEMPLATE));
    let mut opts = synth_options("mixtral", SynthFormat::Gguf, dir.path().join("spm.gguf"), 1);
    opts.vocab_from = Some(common::tokenizers().join("ggml-vocab-llama-spm.gguf"));
    write_synthetic(&opts, &mut |_, _| {}).unwrap();
    assert_eq!(Tokenizer::from_model(&Model::open(&opts.out).unwrap()).unwrap().chat_template(), None);
}

#[test]
fn vocab_from_refuses_what_it_cannot_copy() {
    let dir = tempfile::tempdir().unwrap();
    let spm = common::tokenizers().join("ggml-vocab-llama-spm.gguf");
    let mut opts = synth_options("mixtral", SynthFormat::Safetensors, dir.path().join("st"), 1);
    opts.vocab_from = Some(spm);
    let err = write_synthetic(&opts, &mut |_, _| {}).unwrap_err().to_string();
    assert!(err.contains("cannot write a SentencePiece (llama) tokenizer as tokenizer.json"), "{err}");
    assert!(!opts.out.exists(), "nothing written");
    let mut opts = synth_options("olmoe", SynthFormat::Gguf, dir.path().join("v.gguf"), 1);
    opts.vocab_from = Some(common::tokenizers().join("ggml-vocab-qwen2.gguf"));
    opts.dims.vocab = Some(1000);
    let err = write_synthetic(&opts, &mut |_, _| {}).unwrap_err().to_string();
    assert!(err.contains("vocab: 1000 conflicts with the 151936 tokens"), "{err}");
    opts.vocab_from = Some(dir.path().join("missing.gguf"));
    opts.dims.vocab = None;
    let err = write_synthetic(&opts, &mut |_, _| {}).unwrap_err().to_string();
    assert!(err.contains("missing.gguf"), "{err}");
}

/// The synthetic model with one tokenizer key edited (`None`: removed).
fn edited(dir: &Path, key: &'static str, value: Option<MetaValue>) -> Result<Tokenizer, TokenizerError> {
    let src = synth_gguf(dir, None);
    let dst = dir.join(format!("edited-{}.gguf", key.replace('.', "_")));
    rewrite_gguf(
        &src,
        &dst,
        |k, v| if k == key { value.clone() } else { Some(v.clone()) },
        |_| TensorEdit::Keep,
    );
    Tokenizer::from_gguf_path(&dst)
}

#[test]
fn malformed_tokenizer_metadata_is_a_typed_error_naming_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let s = |v: &str| Some(MetaValue::String(v.into()));
    let cases: Vec<(&str, Option<MetaValue>, &str)> = vec![
        ("tokenizer.ggml.pre", s("klingon"), "pre-tokenizer 'klingon' (metadata key 'tokenizer.ggml.pre') is not supported"),
        ("tokenizer.ggml.model", s("t5"), "tokenizer model 't5' (metadata key 'tokenizer.ggml.model') is not supported"),
        ("tokenizer.ggml.model", None, "missing metadata key 'tokenizer.ggml.model'"),
        ("tokenizer.ggml.tokens", None, "missing metadata key 'tokenizer.ggml.tokens'"),
        ("tokenizer.ggml.merges", Some(MetaValue::U32(3)), "metadata key 'tokenizer.ggml.merges' must be an array of strings"),
        (
            "tokenizer.ggml.merges",
            Some(MetaValue::string_array(vec!["a b".into(), "ab".into()])),
            "metadata key 'tokenizer.ggml.merges', entry 1: must be two tokens joined by a space",
        ),
        (
            "tokenizer.ggml.token_type",
            Some(MetaValue::i32_array(vec![1, 1, 1])),
            "metadata key 'tokenizer.ggml.token_type' has 3 entries, but 'tokenizer.ggml.tokens' has",
        ),
        (
            "tokenizer.ggml.eos_token_id",
            Some(MetaValue::U32(999_999)),
            "metadata key 'tokenizer.ggml.eos_token_id' is token id 999999, but the vocabulary has 512 tokens",
        ),
        ("tokenizer.ggml.add_bos_token", s("yes"), "metadata key 'tokenizer.ggml.add_bos_token' must be a bool"),
    ];
    for (key, value, expected) in cases {
        let err = edited(dir.path(), key, value).unwrap_err().to_string();
        assert!(err.contains(expected), "{key}: {err}");
        assert!(err.contains("edited-"), "names the file: {err}");
    }
    // A bad entry names its index.
    let mut types = vec![1i32; 512];
    types[7] = 42;
    let err = edited(dir.path(), "tokenizer.ggml.token_type", Some(MetaValue::i32_array(types))).unwrap_err();
    assert!(matches!(err, TokenizerError::BadEntry { index: 7, .. }), "{err}");
}

/// A tiny SentencePiece-style `tokenizer.json` (Metaspace spelling, byte fallback), as Llama and
/// Mistral repositories ship, with BOS added by the post-processor.
fn write_spm_tokenizer_json(dir: &Path) {
    let special = |id: u32, content: &str| {
        serde_json::json!({"id": id, "content": content, "single_word": false, "lstrip": false,
            "rstrip": false, "normalized": false, "special": true})
    };
    let mut vocab = serde_json::Map::new();
    for (i, t) in ["<unk>", "<s>", "</s>"].iter().enumerate() {
        vocab.insert(t.to_string(), i.into());
    }
    for b in 0..256u32 {
        vocab.insert(format!("<0x{b:02X}>"), (3 + b).into());
    }
    for (i, t) in ["▁", "a", "b", "▁a", "ab", "▁ab"].iter().enumerate() {
        vocab.insert(t.to_string(), (259 + i).into());
    }
    let json = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": [special(0, "<unk>"), special(1, "<s>"), special(2, "</s>")],
        "normalizer": {"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": "▁"},
            {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]},
        "pre_tokenizer": null,
        "post_processor": {"type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}},
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
            {"type": "ByteFallback"}, {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
        "model": {"type": "BPE", "dropout": null, "unk_token": "<unk>", "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": true, "byte_fallback": true, "ignore_merges": false,
            "vocab": vocab, "merges": ["▁ a", "a b", "▁a b"]},
    });
    std::fs::write(dir.join("tokenizer.json"), json.to_string()).unwrap();
    let config = serde_json::json!({"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": true,
        "chat_template": "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"});
    std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).unwrap();
}

#[test]
fn sentencepiece_style_tokenizer_json_decodes_spaces_and_byte_fallback() {
    let dir = tempfile::tempdir().unwrap();
    write_spm_tokenizer_json(dir.path());
    let tok = Tokenizer::from_hf_dir(dir.path()).unwrap();
    assert_eq!((tok.n_vocab(), tok.bos(), tok.eos()), (265, Some(1), Some(2)));
    assert!(tok.add_bos() && tok.is_eog(2) && tok.chat_template().unwrap().contains("bos_token"));
    assert_eq!(tok.encode("ab a", false, true).unwrap(), [264, 262]);
    assert_eq!(tok.encode("ab a", true, true).unwrap(), [1, 264, 262]);
    assert_eq!(tok.decode(&[1, 264, 262], true).unwrap(), "ab a", "the prefix space is dropped");
    assert_eq!(tok.decode(&[1, 264, 262], false).unwrap(), "<s>ab a");
    // 🦀 = F0 9F A6 80: four byte-fallback tokens, held back until whole.
    let ids = tok.encode("a🦀", false, true).unwrap();
    assert_eq!(ids, [262, 3 + 0xF0, 3 + 0x9F, 3 + 0xA6, 3 + 0x80]);
    assert_eq!(tok.token_bytes(3 + 0xF0).unwrap(), [0xF0]);
    let mut stream = tok.stream(true);
    let pieces: Vec<String> = ids.iter().map(|&id| stream.push(id).unwrap()).collect();
    assert_eq!(pieces, ["a", "", "", "", "🦀"]);
    assert_eq!(tok.decode(&ids, false).unwrap(), "a🦀");
    assert!(tok.decode(&[265], false).is_err());
}

#[test]
fn a_broken_tokenizer_json_is_an_error_naming_the_file() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("tokenizer.json"), "{\"version\": ").unwrap();
    let err = Tokenizer::from_hf_dir(dir.path()).unwrap_err().to_string();
    assert!(err.contains("tokenizer.json"), "{err}");
    write_spm_tokenizer_json(dir.path());
    std::fs::write(dir.path().join("tokenizer_config.json"), r#"{"bos_token": "<nope>"}"#).unwrap();
    let err = Tokenizer::from_hf_dir(dir.path()).unwrap_err().to_string();
    assert!(
        err.contains("tokenizer_config.json: field 'bos_token' names a token that is not in tokenizer.json"),
        "{err}"
    );
}

/// `synth --arch gpt_oss` writes Harmony's special tokens (BOS `<|startoftext|>`, EOS
/// `<|return|>`) and no template: chats take the built-in Harmony template, and `<|end|>` is not
/// end-of-generation (it ends a message, as in llama.cpp).
#[test]
fn gpt_oss_synthetic_vocabularies_speak_harmony() {
    use moe_lanes::model::arch::Arch;
    use moe_lanes::text::{ChatMessage, ChatTemplate, HarmonyTokens, RenderOptions};
    let dir = tempfile::tempdir().unwrap();
    let path = common::synth_tiny(dir.path(), "gpt_oss", SynthFormat::Gguf, 2);
    let model = Model::open(&path).unwrap();
    let tok = Tokenizer::from_model(&model).unwrap();
    assert_eq!(tok.n_vocab(), model.config().vocab);
    assert_eq!(tok.chat_template(), None);
    assert_eq!(tok.bos(), tok.token_id("<|startoftext|>"));
    assert_eq!(tok.eos(), tok.token_id("<|return|>"));
    let id = |t: &str| tok.token_id(t).unwrap();
    assert!(tok.is_eog(id("<|return|>")) && tok.is_eog(id("<|call|>")) && !tok.is_eog(id("<|end|>")));
    assert!(HarmonyTokens::for_arch(Arch::GptOss, &tok).is_some());
    assert!(HarmonyTokens::for_arch(Arch::Qwen3Moe, &tok).is_none(), "only GPT-OSS output is parsed");
    let t = ChatTemplate::for_model(None, &tok, &path, model.config().arch).unwrap();
    assert_eq!(t.origin(), "built-in Harmony template");
    let opts = RenderOptions { add_generation_prompt: true, ..RenderOptions::default() };
    let ids = t.encode(&tok, &[ChatMessage::user("Hi")], opts).unwrap();
    assert_eq!(ids.iter().filter(|&&i| i == id("<|start|>")).count(), 3, "system, user, assistant");
    assert_eq!(ids.last(), tok.encode("assistant", false, true).unwrap().last());
    // Too small for the byte tokens and Harmony's nine specials.
    let mut opts = synth_options("gpt_oss", SynthFormat::Gguf, dir.path().join("small.gguf"), 1);
    opts.dims.vocab = Some(260);
    let err = write_synthetic(&opts, &mut |_, _| {}).unwrap_err();
    assert!(err.to_string().contains("260 is below 265"), "{err}");
}
