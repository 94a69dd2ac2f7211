//! `moe-lanes serve` through the real binary: completions equal `generate`, streaming, every
//! endpoint's bad requests (4xx JSON naming the field, nothing changed), hot-cache apply between
//! requests, the bounded queue (429), metrics, the admin token, and graceful shutdown.

mod bin;

use bin::server::{json_request, metric_samples as samples, Server};
use bin::{ok_stdout, p};
use serde_json::{json, Value};

fn tiny(dir: &std::path::Path) -> String {
    let path = dir.join("t.gguf");
    ok_stdout(&["synth", "--out", p(&path)]);
    p(&path).to_string()
}

/// A hot-experts file with the lowest half of the tiny model's experts hot in both layers, a start
/// the hot-cache tests' exchanges are counted from (`--hot-fraction` ranks by a learn pass).
fn lowest_half(dir: &std::path::Path) -> String {
    let path = dir.join("lowest-half.json");
    std::fs::write(&path, r#"{"layers": {"0": [0, 1, 2, 3], "1": [0, 1, 2, 3]}}"#).unwrap();
    p(&path).to_string()
}

fn generate(model: &str, tokens: &str, n: usize, hot: &[&str]) -> Vec<u64> {
    let mut args = vec!["generate", "--model", model, "--tokens", tokens, "--engine", "pipeline"];
    let n = n.to_string();
    args.extend(["--max-new-tokens", &n]);
    args.extend(hot);
    let v: Value = serde_json::from_str(&ok_stdout(&args)).unwrap();
    v["tokens"].as_array().unwrap().iter().map(|t| t.as_u64().unwrap()).collect()
}

#[test]
fn completions_equal_generate_plain_and_streamed() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny(dir.path());
    let want = generate(&model, "1,2,3", 6, &["--hot-fraction", "0.5"]);
    let server = Server::start(&model, &["--hot-fraction", "0.5"]);
    let (status, v) = server.json(
        "POST",
        "/v1/completions",
        &json!({"prompt": [1, 2, 3], "max_tokens": 6, "model": "t", "temperature": 0}),
    );
    assert_eq!(status, 200, "{v}");
    let got: Vec<u64> =
        v["choices"][0]["token_ids"].as_array().unwrap().iter().map(|t| t.as_u64().unwrap()).collect();
    assert_eq!(got, want);
    assert_eq!(v["usage"], json!({"prompt_tokens": 3, "completion_tokens": 6, "total_tokens": 9}));
    let (status, text) = server.request(
        "POST",
        "/v1/completions",
        json!({"prompt": [[1, 2, 3]], "max_tokens": 6, "stream": true, "temperature": 0.0})
            .to_string()
            .as_bytes(),
        &[],
    );
    assert_eq!(status, 200);
    let data: Vec<&str> = text.lines().filter_map(|l| l.strip_prefix("data: ")).collect();
    assert_eq!(data.last(), Some(&"[DONE]"), "{text}");
    let streamed: Vec<u64> = data[..data.len() - 1]
        .iter()
        .flat_map(|d| {
            serde_json::from_str::<Value>(d).unwrap()["choices"][0]["token_ids"].as_array().unwrap().clone()
        })
        .map(|t| t.as_u64().unwrap())
        .collect();
    assert_eq!(streamed, want);
    let (_, models) = server.json("GET", "/v1/models", &json!({}));
    assert_eq!(models["data"][0]["id"], "t");
}

/// A second turn whose prompt continues the first request's prompt and answer reuses its KV
/// cache (the prefix-cache counters move) and answers what `generate` answers from scratch;
/// with `--prefix-cache 0` nothing is kept.
#[test]
fn a_follow_up_turn_reuses_the_first_turns_cache_and_answers_the_same() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny(dir.path());
    for (keep, hits) in [("4", 1.0), ("0", 0.0)] {
        let server = Server::start(&model, &["--hot-fraction", "0.5", "--prefix-cache", keep]);
        let ask = |prompt: &[u64], n: usize| -> Vec<u64> {
            let (status, v) = server.json(
                "POST",
                "/v1/completions",
                &json!({"prompt": prompt, "max_tokens": n, "temperature": 0}),
            );
            assert_eq!(status, 200, "{v}");
            v["choices"][0]["token_ids"].as_array().unwrap().iter().map(|t| t.as_u64().unwrap()).collect()
        };
        let first_prompt = [5u64, 17, 200, 9, 31];
        let first = ask(&first_prompt, 4);
        let follow: Vec<u64> = first_prompt.iter().chain(&first).chain(&[44, 45, 46]).copied().collect();
        let ids = follow.iter().map(u64::to_string).collect::<Vec<_>>().join(",");
        let want = generate(&model, &ids, 5, &["--hot-fraction", "0.5"]);
        assert_eq!(ask(&follow, 5), want, "--prefix-cache {keep}");
        let (_, text) = server.request("GET", "/metrics", b"", &[]);
        let m = samples(&text);
        assert_eq!(m["moe_lanes_prefix_cache_hits_total"], hits, "--prefix-cache {keep}");
        let reused = if hits > 0.0 { (first_prompt.len() + first.len() - 1) as f64 } else { 0.0 };
        assert_eq!(m["moe_lanes_prefix_cache_reused_tokens_total"], reused);
    }
}

#[test]
fn bad_requests_get_json_errors_naming_the_field_and_change_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny(dir.path());
    let server = Server::start(&model, &["--hot-fraction", "0.5"]);
    let cases: Vec<(&str, &str, Vec<u8>, u16, &str)> = vec![
        ("POST", "/v1/completions", b"{not json".to_vec(), 400, "(body)"),
        ("POST", "/v1/completions", b"[1,2]".to_vec(), 400, "(body)"),
        ("POST", "/v1/completions", br#"{"max_tokens": 2}"#.to_vec(), 400, "prompt"),
        ("POST", "/v1/completions", br#"{"prompt": ["two", "prompts"]}"#.to_vec(), 400, "prompt"),
        ("POST", "/v1/completions", br#"{"prompt": [[1], [2]]}"#.to_vec(), 400, "prompt"),
        ("POST", "/v1/completions", br#"{"prompt": {"text": "a"}}"#.to_vec(), 400, "prompt"),
        ("POST", "/v1/completions", br#"{"prompt": [1, 100000]}"#.to_vec(), 400, "prompt"),
        ("POST", "/v1/completions", br#"{"prompt": [1, -1]}"#.to_vec(), 400, "prompt"),
        ("POST", "/v1/completions", br#"{"prompt": [1], "max_tokens": "many"}"#.to_vec(), 400, "max_tokens"),
        ("POST", "/v1/completions", br#"{"prompt": [1], "max_tokens": 100000}"#.to_vec(), 400, "max_tokens"),
        ("POST", "/v1/completions", br#"{"prompt": [1], "stream": "yes"}"#.to_vec(), 400, "stream"),
        ("POST", "/v1/completions", br#"{"prompt": [1], "temperature": -0.5}"#.to_vec(), 400, "temperature"),
        ("POST", "/v1/completions", br#"{"prompt": [1], "temperature": "hot"}"#.to_vec(), 400, "temperature"),
        ("POST", "/v1/completions", br#"{"prompt": [1], "top_p": 0}"#.to_vec(), 400, "top_p"),
        ("POST", "/v1/completions", br#"{"prompt": [1], "top_p": 1.5}"#.to_vec(), 400, "top_p"),
        ("POST", "/v1/completions", br#"{"prompt": [1], "top_k": 2.5}"#.to_vec(), 400, "top_k"),
        ("POST", "/v1/completions", br#"{"prompt": [1], "min_p": 2}"#.to_vec(), 400, "min_p"),
        (
            "POST",
            "/v1/completions",
            br#"{"prompt": [1], "presence_penalty": 3}"#.to_vec(),
            400,
            "presence_penalty",
        ),
        (
            "POST",
            "/v1/completions",
            br#"{"prompt": [1], "frequency_penalty": -2.5}"#.to_vec(),
            400,
            "frequency_penalty",
        ),
        (
            "POST",
            "/v1/completions",
            br#"{"prompt": [1], "repetition_penalty": 0}"#.to_vec(),
            400,
            "repetition_penalty",
        ),
        ("POST", "/v1/completions", br#"{"prompt": [1], "seed": -1}"#.to_vec(), 400, "seed"),
        ("POST", "/v1/completions", br#"{"prompt": [1], "logprobs": 6}"#.to_vec(), 400, "logprobs"),
        (
            "POST",
            "/v1/completions",
            format!(r#"{{"prompt": [1], "stop": {:?}}}"#, vec!["s"; moe_lanes::text::MAX_STOP_STRINGS + 1])
                .into_bytes(),
            400,
            "stop",
        ),
        ("POST", "/v1/completions", br#"{"prompt": [1], "stop": ["a", ""]}"#.to_vec(), 400, "stop"),
        ("POST", "/v1/completions", br#"{"prompt": [1], "stop": ["a", 1]}"#.to_vec(), 400, "stop"),
        ("POST", "/v1/completions", br#"{"prompt": [1], "stop": [1, 100000]}"#.to_vec(), 400, "stop"),
        (
            "POST",
            "/v1/completions",
            br#"{"prompt": [1], "stop_token_ids": [-3]}"#.to_vec(),
            400,
            "stop_token_ids",
        ),
        ("POST", "/v1/completions", br#"{"prompt": [1], "n": 2}"#.to_vec(), 400, "n"),
        ("POST", "/v1/completions", br#"{"prompt": [1], "bogus": 1}"#.to_vec(), 400, "bogus"),
        ("GET", "/moe-layer-perf?mode=fast", Vec::new(), 400, "mode"),
        ("GET", "/moe-layer-perf?colour=red", Vec::new(), 400, "colour"),
        ("POST", "/moe-hot-cache", br#"{"layers": {"7": [0, 1, 2, 3]}}"#.to_vec(), 400, "layers"),
        ("POST", "/moe-hot-cache", br#"{"layers": {"0": [0, 1, 2, 99]}}"#.to_vec(), 400, "layers"),
        ("POST", "/moe-hot-cache", br#"{"layers": {"0": [4, 5]}}"#.to_vec(), 400, "layers.0"),
        ("POST", "/moe-hot-cache", br#"{"layers": "all"}"#.to_vec(), 400, "layers"),
        ("POST", "/moe-hot-cache", b"\xff\xfe".to_vec(), 400, "(body)"),
        ("POST", "/moe-hot-cache", b"{not json".to_vec(), 400, "(body)"),
        ("POST", "/moe-hot-cache", br#"{"layers": {"0": ["a", 1, 2, 3]}}"#.to_vec(), 400, "layers"),
        ("POST", "/moe-hot-cache", br#"{"layers": {"x": [0, 1, 2, 3]}}"#.to_vec(), 400, "layers"),
        (
            "POST",
            "/moe-hot-cache",
            br#"{"layers": [{"layer": 0, "experts": [1, 2]}]}"#.to_vec(),
            400,
            "layers",
        ),
        (
            "POST",
            "/moe-hot-cache",
            br#"{"layers": [{"layer": 0, "experts": "many"}]}"#.to_vec(),
            400,
            "layers",
        ),
    ];
    let (_, before) = server.json("GET", "/moe-hot-cache", &json!({}));
    for (method, path, body, want_status, want_param) in cases {
        let (status, text) = server.request(method, path, &body, &[]);
        let what = format!("{method} {path} {}", String::from_utf8_lossy(&body));
        assert_eq!(status, want_status, "{what}: {text}");
        let v: Value =
            serde_json::from_str(&text).unwrap_or_else(|e| panic!("{what}: not JSON ({e}): {text}"));
        assert_eq!(v["error"]["param"], want_param, "{what}: {v}");
        assert!(!v["error"]["message"].as_str().unwrap().is_empty());
    }
    let oversize = vec![b' '; moe_lanes_server_max_body() + 10];
    for path in ["/v1/completions", "/moe-hot-cache"] {
        let (status, text) = server.request("POST", path, &oversize, &[]);
        assert_eq!(status, 413, "{path}: {text}");
        assert!(serde_json::from_str::<Value>(&text).is_ok(), "{path}: oversize gets a JSON error: {text}");
    }
    // Unknown paths and methods: JSON errors too.
    for (method, path, want) in
        [("GET", "/nope", 404), ("DELETE", "/moe-hot-cache", 405), ("GET", "/v1/completions", 405)]
    {
        let (status, text) = server.request(method, path, b"", &[]);
        assert_eq!(status, want, "{method} {path}: {text}");
        let v: Value =
            serde_json::from_str(&text).unwrap_or_else(|e| panic!("{method} {path}: not JSON ({e}): {text}"));
        assert!(v["error"]["message"].as_str().unwrap().contains(path), "{v}");
    }
    let (_, after) = server.json("GET", "/moe-hot-cache", &json!({}));
    assert_eq!(before["layers"], after["layers"], "nothing changed");
    assert_eq!(after["updates"], 0);
}

fn token_ids(v: &Value) -> Vec<u64> {
    v["choices"][0]["token_ids"].as_array().unwrap().iter().map(|t| t.as_u64().unwrap()).collect()
}

#[test]
fn sampled_completions_repeat_with_a_seed_report_logprobs_and_stop_on_ids() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny(dir.path());
    let server = Server::start(&model, &[]);
    let body = |seed: u64| {
        json!({"prompt": [4, 8, 15], "max_tokens": 12, "temperature": 1.5, "top_k": 40, "top_p": 0.95,
               "min_p": 0.01, "presence_penalty": 0.5, "seed": seed, "logprobs": 2})
    };
    let (status, a) = server.json("POST", "/v1/completions", &body(7));
    assert_eq!(status, 200, "{a}");
    let (_, b) = server.json("POST", "/v1/completions", &body(7));
    let (_, c) = server.json("POST", "/v1/completions", &body(8));
    assert_eq!(token_ids(&a), token_ids(&b), "same seed, same tokens");
    assert_ne!(token_ids(&a), token_ids(&c), "another seed, other tokens");
    let lp = &a["choices"][0]["logprobs"];
    // the tokens' text, as OpenAI's API (cli/tests/hardening48.rs checks the text itself)
    let names = lp["tokens"].as_array().unwrap();
    assert_eq!(names.len(), 12);
    assert!(names.iter().all(|n| !n.as_str().unwrap().starts_with("token_id:")), "{lp}");
    assert_eq!(lp["token_logprobs"].as_array().unwrap().len(), 12);
    assert!(lp["token_logprobs"].as_array().unwrap().iter().all(|x| x.as_f64().unwrap() <= 0.0));
    assert!(lp["top_logprobs"].as_array().unwrap().iter().all(|m| m.as_object().unwrap().len() == 2));
    assert_eq!(a["choices"][0]["finish_reason"], "length");
    // greedy, stopped by the id of its third token (via `stop` and via `stop_token_ids`)
    let greedy = generate(&model, "4,8,15", 6, &[]);
    for key in ["stop", "stop_token_ids"] {
        let (_, v) = server.json(
            "POST",
            "/v1/completions",
            &json!({"prompt": [4, 8, 15], "max_tokens": 6, "temperature": 0, key: [greedy[2]]}),
        );
        let upto = greedy.iter().position(|&t| t == greedy[2]).unwrap();
        assert_eq!(token_ids(&v), greedy[..upto].to_vec(), "{v}");
        assert_eq!(v["choices"][0]["finish_reason"], "stop");
        assert_eq!(v["usage"]["completion_tokens"], upto);
    }
    let (_, streamed) = server.request(
        "POST",
        "/v1/completions",
        body(7)
            .as_object()
            .cloned()
            .map(|mut m| {
                m.insert("stream".into(), json!(true));
                Value::Object(m)
            })
            .unwrap()
            .to_string()
            .as_bytes(),
        &[],
    );
    let chunks: Vec<Value> = streamed
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    let ids: Vec<u64> = chunks.iter().flat_map(token_ids).collect();
    assert_eq!(ids, token_ids(&a), "streamed with the same seed: the same tokens");
    assert!(chunks[0]["choices"][0]["logprobs"]["token_logprobs"][0].is_number());
}

fn moe_lanes_server_max_body() -> usize {
    1 << 20
}

#[test]
fn a_hot_cache_apply_changes_the_set_between_requests_and_the_output_stays_exact() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny(dir.path());
    let want = generate(&model, "5,6,7", 8, &[]);
    let server = Server::start(&model, &["--hot-experts", &lowest_half(dir.path())]);
    let (status, v) =
        server.json("POST", "/moe-hot-cache", &json!({"layers": {"0": [4, 5, 6, 7], "1": [0, 2, 4, 6]}}));
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["exchanges"], 6);
    let (_, hot) = server.json("GET", "/moe-hot-cache", &json!({}));
    assert_eq!(hot["layers"], json!({"0": [4, 5, 6, 7], "1": [0, 2, 4, 6]}));
    assert_eq!(hot["updates"], 1);
    let (_, v) = server.json(
        "POST",
        "/v1/completions",
        &json!({"prompt": [5, 6, 7], "max_tokens": 8, "temperature": 0}),
    );
    let got: Vec<u64> =
        v["choices"][0]["token_ids"].as_array().unwrap().iter().map(|t| t.as_u64().unwrap()).collect();
    assert_eq!(got, want, "output after the exchange equals the reference engine's");
    let (status, _) = server.request("GET", "/moe-layer-perf?mode=update", b"", &[]);
    assert_eq!(status, 200);
    let (_, perf) = server.json("GET", "/moe-layer-perf", &json!({}));
    assert_eq!(perf["mode"], "update");
}

#[test]
fn a_full_queue_answers_429_and_every_other_request_completes() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny(dir.path());
    let server = std::sync::Arc::new(Server::start(&model, &["--queue", "1"]));
    let handles: Vec<_> = (0..8)
        .map(|_| {
            let s = server.clone();
            std::thread::spawn(move || {
                s.json(
                    "POST",
                    "/v1/completions",
                    &json!({"prompt": [1, 2], "max_tokens": 2000, "temperature": 0}),
                )
            })
        })
        .collect();
    let results: Vec<(u16, Value)> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    let n_ok = results.iter().filter(|(s, v)| *s == 200 && v["usage"]["completion_tokens"] == 2000).count();
    let n_busy =
        results.iter().filter(|(s, v)| *s == 429 && v["error"]["type"] == "rate_limit_error").count();
    assert_eq!(n_ok + n_busy, 8, "{results:?}");
    assert!(n_busy >= 1 && n_ok >= 1, "ok {n_ok}, 429 {n_busy}");
    // refused requests count too: 429 as rejected, a 400 as invalid
    let (status, _) = server.json("POST", "/v1/completions", &json!({"prompt": [1], "max_tokens": -3}));
    assert_eq!(status, 400);
    let (status, _) = server.json("POST", "/v1/chat/completions", &json!({"messages": "not a list"}));
    assert_eq!(status, 400);
    let (_, text) = server.request("GET", "/metrics", b"", &[]);
    assert!(text.contains(&format!("moe_lanes_requests_total{{outcome=\"ok\"}} {n_ok}")), "{text}");
    assert!(text.contains(&format!("moe_lanes_requests_total{{outcome=\"rejected\"}} {n_busy}")), "{text}");
    assert!(text.contains("moe_lanes_requests_total{outcome=\"invalid\"} 2"), "{text}");
    assert!(text.contains("moe_lanes_requests_total{outcome=\"error\"} 0"), "{text}");
}

/// The sum of a family's samples whose name is exactly `name` (any labels).
fn family_sum(samples: &std::collections::BTreeMap<String, f64>, name: &str) -> f64 {
    samples.iter().filter(|(k, _)| k.split('{').next() == Some(name)).map(|(_, v)| v).sum()
}

#[test]
fn metrics_name_every_family_and_admin_endpoints_need_the_token() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny(dir.path());
    let server =
        Server::start(&model, &["--hot-experts", &lowest_half(dir.path()), "--admin-token", "s3cret"]);
    let (_, before) = server.request("GET", "/metrics", b"", &[]);
    server.json("POST", "/v1/completions", &json!({"prompt": [1, 2], "max_tokens": 3}));
    let body = json!({"layers": {"0": [4, 5, 6, 7]}}).to_string();
    let (status, _) = server.request("POST", "/moe-hot-cache", body.as_bytes(), &[]);
    assert_eq!(status, 401);
    let (status, _) =
        server.request("POST", "/moe-hot-cache", body.as_bytes(), &["Authorization: Bearer wrong"]);
    assert_eq!(status, 401);
    let (status, _) = server.request("GET", "/moe-layer-perf?mode=off", b"", &[]);
    assert_eq!(status, 401);
    let (status, v) =
        server.request("POST", "/moe-hot-cache", body.as_bytes(), &["Authorization: Bearer s3cret"]);
    assert_eq!(status, 200, "{v}");
    let (status, text) = server.request("GET", "/metrics", b"", &[]);
    assert_eq!(status, 200);
    let mut families: Vec<&str> = text.lines().filter_map(|l| l.strip_prefix("# TYPE ")).collect();
    families.sort();
    insta::assert_snapshot!("metric_families", families.join("\n"));
    // Every counter and histogram that a request and an apply drive has moved.
    let (was, now) = (samples(&before), samples(&text));
    let moved = |name: &str| family_sum(&now, name) > family_sum(&was, name);
    for name in [
        "moe_lanes_layer_calls_total",
        "moe_lanes_layer_hot_slots_total",
        "moe_lanes_layer_cold_slots_total",
        "moe_lanes_layer_lane_seconds_count",
        "moe_lanes_layer_lane_seconds_sum",
        "moe_lanes_layer_overlap_seconds_count",
        "moe_lanes_layer_join_wait_seconds_count",
        "moe_lanes_prompt_tokens_total",
        "moe_lanes_generated_tokens_total",
        "moe_lanes_requests_total",
        "moe_lanes_queue_wait_seconds_count",
        "moe_lanes_time_to_first_token_seconds_count",
        "moe_lanes_inter_token_seconds_count",
        "moe_lanes_request_seconds_count",
        "moe_lanes_cache_updates_total",
        "moe_lanes_cache_exchanges_total",
        "moe_lanes_cache_bytes_copied_total",
        "moe_lanes_cache_admissions_total",
        "moe_lanes_cache_evictions_total",
    ] {
        assert!(moved(name), "{name} did not move:\n{text}");
    }
    // The two views agree: the per-layer counters equal the perf JSON's totals.
    let (_, perf) = server.json("GET", "/moe-layer-perf", &json!({}));
    for l in perf["layers"].as_array().unwrap() {
        let layer = l["layer"].as_u64().unwrap();
        for (family, field) in [
            ("calls_total", "calls"),
            ("hot_slots_total", "hot_slots_total"),
            ("cold_slots_total", "cold_slots_total"),
        ] {
            let key = format!("moe_lanes_layer_{family}{{layer=\"{layer}\"}}");
            assert_eq!(now[&key], l[field].as_f64().unwrap(), "{key}");
        }
        for family in ["admissions", "evictions"] {
            let key = format!("moe_lanes_cache_{family}_total{{layer=\"{layer}\"}}");
            assert_eq!(now[&key], l[family].as_f64().unwrap(), "{key}");
        }
    }
    assert_eq!(now["moe_lanes_cache_exchanges_total"], perf["updates"].as_f64().unwrap());
    assert!(now["moe_lanes_hot_bytes"] > 0.0);
    assert_eq!(now["moe_lanes_perf_mode{mode=\"full\"}"], 1.0);
    let (status, _) =
        server.request("GET", "/moe-layer-perf?mode=update", b"", &["Authorization: Bearer s3cret"]);
    assert_eq!(status, 200);
    let (_, text) = server.request("GET", "/metrics", b"", &[]);
    let now = samples(&text);
    assert_eq!(
        (now["moe_lanes_perf_mode{mode=\"full\"}"], now["moe_lanes_perf_mode{mode=\"update\"}"]),
        (0.0, 1.0)
    );
}

/// Requests running and waiting move while requests run; a budget is exported when the engine
/// was planned from one, and a learn pass leaves no trace in the served counters.
#[test]
fn running_and_waiting_gauges_move_and_the_budget_is_exported() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny(dir.path());
    // One request at a time, so the second waits.
    let server = std::sync::Arc::new(Server::start(&model, &["--hot-budget-mib", "1", "--parallel", "1"]));
    let (_, text) = server.request("GET", "/metrics", b"", &[]);
    let start = samples(&text);
    assert_eq!(start["moe_lanes_hot_budget_bytes"], 1048576.0);
    assert_eq!(
        family_sum(&start, "moe_lanes_layer_cold_slots_total"),
        0.0,
        "the learn pass is not served traffic"
    );
    let reqs: Vec<_> = (0..2)
        .map(|_| {
            let s = server.clone();
            std::thread::spawn(move || {
                s.json("POST", "/v1/completions", &json!({"prompt": [1], "max_tokens": 3000}))
            })
        })
        .collect();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    let mut seen = (false, false);
    while !(seen.0 && seen.1) && std::time::Instant::now() < deadline {
        let (_, text) = server.request("GET", "/metrics", b"", &[]);
        let now = samples(&text);
        seen.0 |= now["moe_lanes_requests_running"] == 1.0;
        seen.1 |= now["moe_lanes_requests_waiting"] == 1.0;
    }
    assert!(seen.0 && seen.1, "running/waiting seen: {seen:?}");
    for r in reqs {
        assert_eq!(r.join().unwrap().0, 200);
    }
    let (_, text) = server.request("GET", "/metrics", b"", &[]);
    let end = samples(&text);
    assert_eq!((end["moe_lanes_requests_running"], end["moe_lanes_requests_waiting"]), (0.0, 0.0));
}

#[test]
fn sigterm_lets_the_running_request_finish_and_writes_the_perf_json() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny(dir.path());
    let perf = dir.path().join("perf.json");
    let server = Server::start(&model, &["--perf-json", p(&perf)]);
    let addr = server.addr.clone();
    let req = std::thread::spawn(move || {
        json_request(&addr, "POST", "/v1/completions", &json!({"prompt": [1], "max_tokens": 3000}))
    });
    std::thread::sleep(std::time::Duration::from_millis(300));
    let status = server.stop();
    let (code, v) = req.join().unwrap();
    assert_eq!(code, 200, "the in-flight request finished: {v}");
    assert_eq!(v["usage"]["completion_tokens"], 3000);
    assert!(status.success(), "clean exit: {status:?}");
    let report: Value = serde_json::from_str(&std::fs::read_to_string(&perf).unwrap()).unwrap();
    assert!(report["layers"][0]["calls"].as_u64().unwrap() >= 3000);
}

/// Headless Chromium, when installed (`.ci/run` installs Debian's `chromium`).
fn chromium() -> Option<std::path::PathBuf> {
    let path = std::env::var_os("PATH")?;
    ["chromium", "chromium-browser", "google-chrome"]
        .iter()
        .flat_map(|name| std::env::split_paths(&path).map(move |d| d.join(name)))
        .find(|p| p.is_file())
}

/// The live page at `/`: loaded in headless Chromium against a live server while a request
/// runs, its script fills a row and a heatmap row for every layer and the serving figures.
#[test]
fn live_page_shows_every_layer_in_headless_chromium() {
    let Some(browser) = chromium() else {
        eprintln!("SKIP: chromium not found (.ci/run installs Debian's chromium)");
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m5.gguf");
    ok_stdout(&["synth", "--out", p(&path), "--layers", "5"]);
    let server = Server::start(p(&path), &["--hot-fraction", "0.5"]);
    let (status, text) = server.request("GET", "/", b"", &[]);
    assert_eq!(status, 200);
    assert!(!text.contains("http://") && !text.contains("https://"), "the page loads no external assets");
    let addr = server.addr.clone();
    let req = std::thread::spawn(move || {
        json_request(&addr, "POST", "/v1/completions", &json!({"prompt": [1, 2], "max_tokens": 3000}))
    });
    std::thread::sleep(std::time::Duration::from_millis(200));
    let out = std::process::Command::new(&browser)
        .args(["--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=3000", "--dump-dom"])
        .arg(format!("http://{}/", server.addr))
        .output()
        .unwrap();
    let dom = String::from_utf8_lossy(&out.stdout);
    assert!(dom.contains("data-ready=\"1\""), "the page's script ran and reached the server:\n{dom}");
    for layer in 0..5 {
        assert!(dom.contains(&format!("data-layer=\"{layer}\"")), "layer {layer} row missing:\n{dom}");
        assert!(dom.contains(&format!("data-heat-layer=\"{layer}\"")), "layer {layer} heatmap row missing");
    }
    assert!(!dom.contains("data-layer=\"5\""));
    assert!(dom.contains("data-hit-rate=\"\">") && dom.contains("%</td>"), "hit rates shown:\n{dom}");
    assert!(
        dom.contains("data-admissions=\"\">") && dom.contains("data-evictions=\"\">"),
        "admissions shown:\n{dom}"
    );
    assert!(dom.contains("hot-cache policy reuse"), "the policy shows (the default):\n{dom}");
    let running =
        dom.split("data-card=\"running\"><div class=\"v\">").nth(1).and_then(|r| r.split('<').next());
    assert_eq!(running, Some("1"), "the running request shows:\n{dom}");
    assert_eq!(req.join().unwrap().0, 200);
}

/// A manual apply posted while a request runs waits for it: the request's tokens all come from
/// the hot set it started with, the apply answers only after the request ended, and a second
/// apply while the first is pending gets 409.
#[test]
fn a_manual_apply_during_a_running_request_waits_for_it() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny(dir.path());
    let hot = lowest_half(dir.path());
    let want = generate(&model, "1,2", 2000, &["--hot-experts", &hot]);
    // The planned policy: the cache moves only by the apply (an online policy would move it too).
    let server = Server::start(&model, &["--hot-experts", &hot, "--cache-policy", "planned"]);
    let addr = server.addr.clone();
    let req = std::thread::spawn(move || {
        json_request(
            &addr,
            "POST",
            "/v1/completions",
            &json!({"prompt": [1, 2], "max_tokens": 2000, "temperature": 0}),
        )
    });
    // Wait until the request runs.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while server.json("GET", "/health", &json!({})).1["requests_running"] != 1 {
        assert!(std::time::Instant::now() < deadline, "the request never ran");
    }
    let addr = server.addr.clone();
    let apply = std::thread::spawn(move || {
        json_request(&addr, "POST", "/moe-hot-cache", &json!({"layers": {"0": [4, 5, 6, 7]}}))
    });
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while server.json("GET", "/moe-hot-cache", &json!({})).1["apply_pending"] != true {
        assert!(std::time::Instant::now() < deadline, "the apply never became pending");
    }
    let (status, v) = server.json("POST", "/moe-hot-cache", &json!({"layers": {"1": [4, 5, 6, 7]}}));
    assert_eq!(status, 409, "{v}");
    // While the request still runs (read after the hot set), the apply has not happened.
    let (_, hot) = server.json("GET", "/moe-hot-cache", &json!({}));
    let (_, health) = server.json("GET", "/health", &json!({}));
    if health["requests_running"] == 1 {
        assert_eq!(hot["layers"]["0"], json!([0, 1, 2, 3]), "applied while a request ran");
        assert_eq!(hot["apply_pending"], true);
    }
    let ((req_status, out), (apply_status, applied)) = (req.join().unwrap(), apply.join().unwrap());
    assert_eq!(req_status, 200, "{out}");
    assert_eq!(apply_status, 200, "{applied}");
    let got: Vec<u64> =
        out["choices"][0]["token_ids"].as_array().unwrap().iter().map(|t| t.as_u64().unwrap()).collect();
    assert_eq!(got, want, "the running request kept its hot set (output exact)");
    let (_, hot) = server.json("GET", "/moe-hot-cache", &json!({}));
    assert_eq!(hot["layers"]["0"], json!([4, 5, 6, 7]));
    assert_eq!(hot["layers"]["1"], json!([0, 1, 2, 3]), "the refused apply changed nothing");
}

#[test]
fn serve_with_update_auto_follows_the_workload_and_stays_exact() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny(dir.path());
    let want = generate(&model, "5,6,7", 24, &[]);
    let server =
        Server::start(&model, &["--hot-fraction", "0.5", "--update", "auto", "--update-rate", "0.5"]);
    for _ in 0..4 {
        let (_, v) = server.json(
            "POST",
            "/v1/completions",
            &json!({"prompt": [5, 6, 7], "max_tokens": 24, "temperature": 0}),
        );
        let got: Vec<u64> =
            v["choices"][0]["token_ids"].as_array().unwrap().iter().map(|t| t.as_u64().unwrap()).collect();
        assert_eq!(got, want, "output with automatic updates equals the reference engine's");
    }
    let (_, perf) = server.json("GET", "/moe-layer-perf", &json!({}));
    let updates = &perf["cache_updates"];
    assert!(updates["auto_updates"].as_u64().unwrap() >= 1, "{updates}");
    assert_eq!(updates["manual_applies"], 0);
    assert_eq!(perf["model"]["n_layers"], 2);
}

/// The Qwen hybrids serve as the attention-only models do (issue 40): a Qwen3.5-shaped GGUF file
/// (Gated DeltaNet layers, a gated attention layer, a gated shared expert) answers completions
/// and chat with the oracle's tokens while the updater moves experts between requests, and its
/// `/moe-layer-perf` counts every layer.
#[test]
fn a_hybrid_model_serves_the_oracle_tokens_with_the_updater_running() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("h.gguf");
    ok_stdout(&["synth", "--arch", "qwen3_5_moe", "--layers", "5", "--out", p(&path)]);
    let model = p(&path).to_string();
    let args = ["generate", "--model", &model, "--tokens", "5,6,7,8", "--max-new-tokens", "12"];
    let oracle: Value =
        serde_json::from_str(&ok_stdout(&[&args[..], &["--engine", "reference"]].concat())).unwrap();
    let want: Vec<u64> = oracle["tokens"].as_array().unwrap().iter().map(|t| t.as_u64().unwrap()).collect();
    let server =
        Server::start(&model, &["--hot-fraction", "0.5", "--update", "auto", "--update-rate", "0.5"]);
    for _ in 0..3 {
        let (status, v) = server.json(
            "POST",
            "/v1/completions",
            &json!({"prompt": [5, 6, 7, 8], "max_tokens": 12, "temperature": 0}),
        );
        assert_eq!(status, 200, "{v}");
        assert_eq!(token_ids(&v), want);
    }
    let (status, chat) = server.json(
        "POST",
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4, "temperature": 0}),
    );
    assert_eq!(status, 200, "{chat}");
    assert_eq!(chat["usage"]["completion_tokens"], 4, "{chat}");
    let (_, perf) = server.json("GET", "/moe-layer-perf", &json!({}));
    assert_eq!(perf["model"]["n_layers"], 5);
    assert!(perf["cache_updates"]["auto_updates"].as_u64().unwrap() >= 1, "{}", perf["cache_updates"]);
}
