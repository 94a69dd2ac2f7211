//! Hugging Face `tokenizer.json` through the `tokenizers` crate, behind the same API as the
//! GGUF tokenizer. Encoding is the crate's; decoding is token by token to raw bytes (so the
//! stream decoder can hold back split characters), spelled by the kind of vocabulary the file
//! describes: byte-level BPE (`ByteLevel` pre-tokenizer or decoder) or SentencePiece-like
//! (`▁` for spaces, `<0xNN>` byte fallback). BOS/EOS and the chat template come from
//! `tokenizer_config.json` beside it, when present.

use super::bpe::ByteLevel;
use super::spm;
use super::TokenizerError;
use crate::format::gguf::TokenType;
use serde_json::Value;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

pub struct HfTokenizer {
    /// Matches special (added) tokens in text.
    parse_special: tokenizers::Tokenizer,
    /// Encodes special tokens' texts as plain text.
    plain: tokenizers::Tokenizer,
    tokens: Vec<String>,
    types: Vec<Option<TokenType>>,
    ids: HashMap<String, u32>,
    byte_level: Option<ByteLevel>,
    metaspace: bool,
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    pub eog: Vec<u32>,
    pub add_bos: bool,
    pub chat_template: Option<String>,
}

impl HfTokenizer {
    pub fn open(dir: &Path) -> Result<HfTokenizer, TokenizerError> {
        let path = dir.join("tokenizer.json");
        let text = read(&path)?;
        let json: Value = serde_json::from_str(&text)
            .map_err(|e| TokenizerError::HfJson { path: path.clone(), message: e.to_string() })?;
        let parse_special = tokenizers::Tokenizer::from_bytes(text.as_bytes())
            .map_err(|e| TokenizerError::HfJson { path: path.clone(), message: e.to_string() })?;
        let mut plain = parse_special.clone();
        plain.set_encode_special_tokens(true);
        let ids = parse_special.get_vocab(true);
        let n = ids.values().map(|&id| id as usize + 1).max().unwrap_or(0);
        let mut tokens = vec![String::new(); n];
        let mut types = vec![None; n];
        for (t, &id) in &ids {
            tokens[id as usize] = t.clone();
            types[id as usize] = Some(TokenType::Normal);
        }
        for (id, added) in parse_special.get_added_tokens_decoder() {
            let special = if added.special { TokenType::Control } else { TokenType::UserDefined };
            if let Some(slot) = types.get_mut(id as usize) {
                *slot = Some(special);
            }
        }
        let is_byte_level = mentions_type(&json["pre_tokenizer"], "ByteLevel")
            || mentions_type(&json["decoder"], "ByteLevel");
        let metaspace = !is_byte_level
            && (mentions_type(&json["pre_tokenizer"], "Metaspace")
                || mentions_type(&json["decoder"], "Metaspace")
                || mentions_type(&json["decoder"], "Strip"));
        let mut tok = HfTokenizer {
            parse_special,
            plain,
            byte_level: is_byte_level.then(|| ByteLevel::new(&ids)),
            tokens,
            types,
            ids,
            metaspace,
            bos: None,
            eos: None,
            eog: Vec::new(),
            add_bos: false,
            chat_template: None,
        };
        tok.read_config(dir)?;
        Ok(tok)
    }

    /// BOS/EOS, `add_bos_token` and `chat_template` from `tokenizer_config.json`; extra EOS ids
    /// from `generation_config.json`.
    fn read_config(&mut self, dir: &Path) -> Result<(), TokenizerError> {
        let path = dir.join("tokenizer_config.json");
        let config = read_json_if_present(&path)?.unwrap_or(Value::Null);
        self.bos = self.special_id(&path, &config, "bos_token")?;
        self.eos = self.special_id(&path, &config, "eos_token")?;
        self.add_bos = config["add_bos_token"].as_bool().unwrap_or(false);
        self.chat_template = match &config["chat_template"] {
            Value::String(s) => Some(s.clone()),
            _ => std::fs::read_to_string(dir.join("chat_template.jinja")).ok(),
        };
        let mut eog: Vec<u32> = self.eos.into_iter().collect();
        let generation = read_json_if_present(&dir.join("generation_config.json"))?.unwrap_or(Value::Null);
        match &generation["eos_token_id"] {
            Value::Number(n) => eog.extend(n.as_u64().map(|id| id as u32)),
            Value::Array(ids) => eog.extend(ids.iter().filter_map(|v| v.as_u64()).map(|id| id as u32)),
            _ => {}
        }
        // llama.cpp's end-of-generation token texts, as for GGUF.
        eog.extend(super::vocab::EOG_TEXTS.iter().filter_map(|t| self.ids.get(*t)));
        eog.retain(|&id| (id as usize) < self.tokens.len());
        eog.sort_unstable();
        eog.dedup();
        super::vocab::drop_harmony_end(&mut eog, |id| self.tokens.get(id as usize).map(String::as_str));
        self.eog = eog;
        Ok(())
    }

    /// A `*_token` field: a string or `{"content": ..}`; must name a token of the vocabulary.
    fn special_id(&self, path: &Path, config: &Value, field: &str) -> Result<Option<u32>, TokenizerError> {
        let text = match &config[field] {
            Value::String(s) => s.as_str(),
            Value::Object(o) => match o.get("content").and_then(Value::as_str) {
                Some(s) => s,
                None => return Ok(None),
            },
            _ => return Ok(None),
        };
        match self.ids.get(text) {
            Some(&id) => Ok(Some(id)),
            None => Err(TokenizerError::HfConfig {
                path: path.into(),
                field: field.into(),
                problem: "names a token that is not in tokenizer.json",
            }),
        }
    }

    pub fn encode(
        &self,
        text: &str,
        add_special: bool,
        parse_special: bool,
    ) -> Result<Vec<u32>, TokenizerError> {
        let tok = if parse_special { &self.parse_special } else { &self.plain };
        let encoding =
            tok.encode(text, add_special).map_err(|e| TokenizerError::HfEncode { message: e.to_string() })?;
        Ok(encoding.get_ids().to_vec())
    }

    pub fn token_bytes(&self, id: u32, out: &mut Vec<u8>) {
        let text = self.tokens[id as usize].as_str();
        match self.types[id as usize] {
            None => {}
            Some(TokenType::Normal) => match &self.byte_level {
                Some(bl) => bl.decode_text(text, out),
                None if self.metaspace => match spm::parse_byte_token(text) {
                    Some(b) => out.push(b),
                    None => out.extend_from_slice(text.replace(spm::SPACE, " ").as_bytes()),
                },
                None => out.extend_from_slice(text.as_bytes()),
            },
            Some(_) => out.extend_from_slice(text.as_bytes()),
        }
    }

    pub fn n_vocab(&self) -> usize {
        self.tokens.len()
    }

    pub fn is_special(&self, id: u32) -> bool {
        self.types.get(id as usize) == Some(&Some(TokenType::Control))
    }

    pub fn token_type(&self, id: u32) -> Option<TokenType> {
        self.types.get(id as usize).map(|t| t.unwrap_or(TokenType::Unused))
    }

    pub fn token_text(&self, id: u32) -> Option<&str> {
        self.tokens.get(id as usize).map(String::as_str)
    }

    pub fn token_id(&self, text: &str) -> Option<u32> {
        self.ids.get(text).copied()
    }

    pub fn strips_leading_space(&self) -> bool {
        self.metaspace
    }
}

/// Whether a pre-tokenizer or decoder (possibly a `Sequence`) has a part of type `ty`.
fn mentions_type(v: &Value, ty: &str) -> bool {
    match v {
        Value::Object(o) => {
            o.get("type").and_then(Value::as_str) == Some(ty) || o.values().any(|x| mentions_type(x, ty))
        }
        Value::Array(items) => items.iter().any(|x| mentions_type(x, ty)),
        _ => false,
    }
}

fn read(path: &Path) -> Result<String, TokenizerError> {
    std::fs::read_to_string(path).map_err(|source| TokenizerError::Io { path: PathBuf::from(path), source })
}

fn read_json_if_present(path: &Path) -> Result<Option<Value>, TokenizerError> {
    if !path.is_file() {
        return Ok(None);
    }
    let text = read(path)?;
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|e| TokenizerError::HfJson { path: path.into(), message: e.to_string() })
}
