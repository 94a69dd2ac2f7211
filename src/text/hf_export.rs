//! A GGUF byte-level BPE tokenizer written as Hugging Face files (`tokenizer.json`,
//! `tokenizer_config.json`), so a safetensors model can carry the same tokenizer
//! (`synth --vocab-from ... --format safetensors`). The pre-tokenizer becomes llama.cpp's regexes
//! as isolating `Split`s before a regex-free `ByteLevel`; no normalizer (llama.cpp has none);
//! BOS/EOS as a `TemplateProcessing` post-processor when the metadata adds them.

use super::vocab::{GgufVocab, VocabKind};
use crate::format::gguf::TokenType;
use serde_json::{json, Map, Value};

/// The two files' contents.
#[derive(Debug, Clone)]
pub struct HfTokenizerFiles {
    pub tokenizer_json: String,
    pub tokenizer_config_json: String,
}

/// `None` for a SentencePiece vocabulary (Hugging Face needs merges it does not have).
pub fn export(v: &GgufVocab) -> Option<HfTokenizerFiles> {
    let VocabKind::Bpe(pre) = v.kind else { return None };
    let mut vocab = Map::new();
    let mut added = Vec::new();
    for (id, (text, ty)) in v.tokens.iter().zip(&v.types).enumerate() {
        match ty {
            TokenType::Control | TokenType::Unknown | TokenType::UserDefined => added.push(json!({
                "id": id, "content": text, "single_word": false, "lstrip": false, "rstrip": false,
                "normalized": false, "special": ty.is_special(),
            })),
            _ => {
                vocab.entry(text.clone()).or_insert(json!(id));
            }
        }
    }
    let mut merges: Vec<(u32, u32, u32)> =
        v.merges.iter().map(|(&(l, r), &(rank, _))| (rank, l, r)).collect();
    merges.sort_unstable();
    let merges: Vec<Value> =
        merges.iter().map(|&(_, l, r)| json!([v.tokens[l as usize], v.tokens[r as usize]])).collect();
    let splits: Vec<Value> = pre
        .regexes()
        .iter()
        .map(|re| json!({"type": "Split", "pattern": {"Regex": re}, "behavior": "Isolated", "invert": false}))
        .collect();
    let byte_level =
        json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false});
    let pre_tokenizers: Vec<Value> = splits.into_iter().chain([byte_level.clone()]).collect();
    let tokenizer = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": pre_tokenizers},
        "post_processor": post_processor(v),
        "decoder": byte_level,
        "model": {
            "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
            "ignore_merges": pre.ignores_merges(), "vocab": vocab, "merges": merges,
        },
    });
    let text = |id: Option<u32>| id.map(|id| v.tokens[id as usize].clone());
    let config = json!({
        "bos_token": text(v.bos),
        "eos_token": text(v.eos),
        "add_bos_token": v.add_bos,
        "add_eos_token": v.add_eos,
        "chat_template": v.chat_template,
        "tokenizer_class": "PreTrainedTokenizerFast",
    });
    Some(HfTokenizerFiles {
        tokenizer_json: serde_json::to_string(&tokenizer).expect("JSON values serialize"),
        tokenizer_config_json: serde_json::to_string_pretty(&config).expect("JSON values serialize"),
    })
}

/// BOS/EOS around the sequence, as `add_bos_token`/`add_eos_token` say (`null`: none).
fn post_processor(v: &GgufVocab) -> Value {
    let bos = v.bos.filter(|_| v.add_bos);
    let eos = v.eos.filter(|_| v.add_eos);
    if bos.is_none() && eos.is_none() {
        return Value::Null;
    }
    let special = |id: u32| json!({"SpecialToken": {"id": v.tokens[id as usize], "type_id": 0}});
    let seq = |name: &str| json!({"Sequence": {"id": name, "type_id": 0}});
    let mut single: Vec<Value> = bos.map(special).into_iter().collect();
    single.push(seq("A"));
    single.extend(eos.map(special));
    let mut pair = single.clone();
    pair.extend(bos.map(special));
    pair.push(seq("B"));
    pair.extend(eos.map(special));
    let mut specials = Map::new();
    for id in bos.into_iter().chain(eos) {
        let t = &v.tokens[id as usize];
        specials.insert(t.clone(), json!({"id": t, "ids": [id], "tokens": [t]}));
    }
    json!({"type": "TemplateProcessing", "single": single, "pair": pair, "special_tokens": specials})
}
