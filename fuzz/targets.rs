//! The fuzz targets: each takes arbitrary bytes to one parser and checks what a parser must
//! never do: panic, hang, or allocate past the limit (the fuzzer's memory limit catches that), and
//! that whatever it accepts is consistent (an accepted file's tensors lie inside it; an accepted
//! JSON document survives a write/re-read). Shared by the AFL++ binaries in `fuzz/src/bin/` and by
//! `server/tests/fuzz_regressions.rs`, which replays the seed corpora and every crash found.

use moe_lanes::cache::hot_set::HotSet;
use moe_lanes::cache::perf::PerfReport;
use moe_lanes::format::gguf::GgufFile;
use moe_lanes::format::safetensors::{parse_index, SafetensorsFile};
use std::path::Path;

/// A fuzz target: one input, any bytes.
pub type Target = fn(&[u8]);

/// Every target, by the name of its corpus folder.
pub const TARGETS: [(&str, Target); 6] = [
    ("gguf", gguf),
    ("safetensors_header", safetensors_header),
    ("safetensors_index", safetensors_index),
    ("perf_json", perf_json),
    ("hot_experts_json", hot_experts_json),
    ("completion_request", completion_request),
];

const NAME: &str = "fuzz-input";

/// The GGUF reader: header, metadata, tensor infos, tensor extents.
pub fn gguf(data: &[u8]) {
    if let Ok(tensors) = GgufFile::check_bytes(Path::new(NAME), data) {
        for t in &tensors {
            let end = t.offset.checked_add(t.n_bytes as u64).expect("accepted extents do not overflow");
            assert!(end <= data.len() as u64, "{}: accepted past the end", t.name);
        }
    }
}

/// The safetensors header (length prefix, JSON header, dtypes, shapes, extents).
pub fn safetensors_header(data: &[u8]) {
    if let Ok(tensors) = SafetensorsFile::check_bytes(Path::new(NAME), data) {
        for t in &tensors {
            assert!(t.begin <= t.end && t.end <= data.len(), "{}: accepted past the end", t.name);
        }
    }
}

/// `model.safetensors.index.json`.
pub fn safetensors_index(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else { return };
    if let Ok(map) = parse_index(Path::new(NAME), text) {
        assert!(map.values().all(|shard| !shard.contains('/') && !shard.is_empty()), "{map:?}");
    }
}

/// Learn files and perf snapshots: what is accepted is written back and read again unchanged.
pub fn perf_json(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else { return };
    if let Ok(report) = PerfReport::parse(Path::new(NAME), text, None) {
        let again =
            PerfReport::parse(Path::new(NAME), &report.to_json(), None).expect("written perf JSON re-reads");
        assert_eq!(again.to_json(), report.to_json());
    }
}

/// `--hot-experts` files against a 4-layer, 16-expert model.
pub fn hot_experts_json(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else { return };
    if let Ok(set) = HotSet::from_experts_json(Path::new(NAME), text, 4, 16, 1) {
        let json = set.to_experts_json().to_string();
        let again =
            HotSet::from_experts_json(Path::new(NAME), &json, 4, 16, 1).expect("written hot set re-reads");
        assert_eq!(again.to_experts_json(), set.to_experts_json());
    }
}

/// `POST /v1/completions` bodies (the server's parser) against a 512-token vocabulary without a
/// tokenizer (text prompts and stop strings are refused): whatever
/// is accepted has a non-empty prompt of in-range ids, at least one token to generate, sampling
/// parameters in range and stop ids in range.
pub fn completion_request(data: &[u8]) {
    use moe_lanes_server::api;
    let Ok(body) = api::object(Ok(data.to_vec().into())) else { return };
    if let Ok(req) = api::completion(&body, 512, None) {
        let g = &req.generation;
        assert!(!req.prompt.is_empty() && req.prompt.iter().all(|&t| t < 512) && g.max_tokens >= 1);
        assert!(g.sampling.validate().is_ok() && g.stop_ids.iter().all(|&t| t < 512));
    }
}
