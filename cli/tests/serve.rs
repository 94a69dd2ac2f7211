//! `moe-lanes serve` through the real binary: completions equal `generate`, streaming, every
//! endpoint's bad requests (4xx JSON naming the field, nothing changed), hot-cache apply between
//! requests, the bounded queue (429), metrics, the admin token, and graceful shutdown.

mod bin;

use bin::{command, ok_stdout, p};
use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Stdio};

/// A running server, stopped (SIGTERM) when dropped.
struct Server {
    child: Child,
    addr: String,
}

impl Server {
    fn start(model: &str, extra: &[&str]) -> Server {
        let mut args = vec!["serve", "--model", model, "--listen", "127.0.0.1:0", "--engine", "pipeline"];
        args.extend(extra);
        let mut child = command().args(&args).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
        let addr =
            line.trim().strip_prefix("listening on http://").unwrap_or_else(|| panic!("{line}")).to_string();
        Server { child, addr }
    }

    fn request(&self, method: &str, path: &str, body: &[u8], headers: &[&str]) -> (u16, String) {
        request(&self.addr, method, path, body, headers)
    }

    fn json(&self, method: &str, path: &str, body: &Value) -> (u16, Value) {
        json_request(&self.addr, method, path, body)
    }

    fn stop(mut self) -> std::process::ExitStatus {
        sigterm(self.child.id());
        self.child.wait().unwrap()
    }
}

/// A raw HTTP/1.1 request (a hand-written client: the tests need to send malformed and
/// oversize bodies and read the raw event stream, which a client crate would get in the way of).
fn request(addr: &str, method: &str, path: &str, body: &[u8], headers: &[&str]) -> (u16, String) {
    {
        let mut s = TcpStream::connect(addr).unwrap();
        let mut head = format!("{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n", body.len());
        for h in headers {
            head.push_str(h);
            head.push_str("\r\n");
        }
        head.push_str("\r\n");
        s.write_all(head.as_bytes()).unwrap();
        let _ = s.write_all(body);
        let mut raw = Vec::new();
        let _ = s.read_to_end(&mut raw);
        let raw = String::from_utf8_lossy(&raw).to_string();
        let status = raw.split(' ').nth(1).and_then(|c| c.parse().ok()).unwrap_or_else(|| panic!("{raw}"));
        let body = raw.split_once("\r\n\r\n").map(|(_, b)| b.to_string()).unwrap_or_default();
        (status, dechunk(&body))
    }
}

fn json_request(addr: &str, method: &str, path: &str, body: &Value) -> (u16, Value) {
    let (status, text) = request(addr, method, path, body.to_string().as_bytes(), &[]);
    (status, serde_json::from_str(&text).unwrap_or_else(|e| panic!("{path}: not JSON ({e}): {text}")))
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
    }
}

fn sigterm(pid: u32) {
    std::process::Command::new("kill").args(["-TERM", &pid.to_string()]).status().unwrap();
}

/// Undo `Transfer-Encoding: chunked` when present (streamed responses).
fn dechunk(body: &str) -> String {
    let mut out = String::new();
    let mut rest = body;
    loop {
        let Some((size, after)) = rest.split_once("\r\n") else { return body.to_string() };
        let Ok(n) = usize::from_str_radix(size.trim(), 16) else { return body.to_string() };
        if n == 0 {
            return out;
        }
        out.push_str(&after[..n.min(after.len())]);
        rest = after.get(n + 2..).unwrap_or("");
    }
}

fn tiny(dir: &std::path::Path) -> String {
    let path = dir.join("t.gguf");
    ok_stdout(&["synth", "--out", p(&path)]);
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
    let (status, v) =
        server.json("POST", "/v1/completions", &json!({"prompt": [1, 2, 3], "max_tokens": 6, "model": "t"}));
    assert_eq!(status, 200, "{v}");
    let got: Vec<u64> =
        v["choices"][0]["token_ids"].as_array().unwrap().iter().map(|t| t.as_u64().unwrap()).collect();
    assert_eq!(got, want);
    assert_eq!(v["usage"], json!({"prompt_tokens": 3, "completion_tokens": 6, "total_tokens": 9}));
    let (status, text) = server.request(
        "POST",
        "/v1/completions",
        json!({"prompt": [[1, 2, 3]], "max_tokens": 6, "stream": true}).to_string().as_bytes(),
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

#[test]
fn bad_requests_get_json_errors_naming_the_field_and_change_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny(dir.path());
    let server = Server::start(&model, &["--hot-fraction", "0.5"]);
    let cases: Vec<(&str, &str, Vec<u8>, u16, &str)> = vec![
        ("POST", "/v1/completions", b"{not json".to_vec(), 400, "(body)"),
        ("POST", "/v1/completions", b"[1,2]".to_vec(), 400, "(body)"),
        ("POST", "/v1/completions", br#"{"max_tokens": 2}"#.to_vec(), 400, "prompt"),
        ("POST", "/v1/completions", br#"{"prompt": "text"}"#.to_vec(), 400, "prompt"),
        ("POST", "/v1/completions", br#"{"prompt": [1, 100000]}"#.to_vec(), 400, "prompt"),
        ("POST", "/v1/completions", br#"{"prompt": [1, -1]}"#.to_vec(), 400, "prompt"),
        ("POST", "/v1/completions", br#"{"prompt": [1], "max_tokens": "many"}"#.to_vec(), 400, "max_tokens"),
        ("POST", "/v1/completions", br#"{"prompt": [1], "max_tokens": 100000}"#.to_vec(), 400, "max_tokens"),
        ("POST", "/v1/completions", br#"{"prompt": [1], "stream": "yes"}"#.to_vec(), 400, "stream"),
        ("POST", "/v1/completions", br#"{"prompt": [1], "temperature": 0.8}"#.to_vec(), 400, "temperature"),
        ("POST", "/v1/completions", br#"{"prompt": [1], "bogus": 1}"#.to_vec(), 400, "bogus"),
        ("GET", "/moe-layer-perf?mode=fast", Vec::new(), 400, "mode"),
        ("GET", "/moe-layer-perf?colour=red", Vec::new(), 400, "colour"),
        ("POST", "/moe-hot-cache", br#"{"layers": {"7": [0, 1, 2, 3]}}"#.to_vec(), 400, "layers"),
        ("POST", "/moe-hot-cache", br#"{"layers": {"0": [0, 1, 2, 99]}}"#.to_vec(), 400, "layers"),
        ("POST", "/moe-hot-cache", br#"{"layers": {"0": [4, 5]}}"#.to_vec(), 400, "layers.0"),
        ("POST", "/moe-hot-cache", br#"{"layers": "all"}"#.to_vec(), 400, "layers"),
        ("POST", "/moe-hot-cache", b"\xff\xfe".to_vec(), 400, "(body)"),
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
    let (status, text) = server.request("POST", "/v1/completions", &oversize, &[]);
    assert_eq!(status, 413, "{text}");
    assert!(serde_json::from_str::<Value>(&text).is_ok(), "oversize gets a JSON error: {text}");
    let (_, after) = server.json("GET", "/moe-hot-cache", &json!({}));
    assert_eq!(before["layers"], after["layers"], "nothing changed");
    assert_eq!(after["updates"], 0);
}

fn moe_lanes_server_max_body() -> usize {
    1 << 20
}

#[test]
fn a_hot_cache_apply_changes_the_set_between_requests_and_the_output_stays_exact() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny(dir.path());
    let want = generate(&model, "5,6,7", 8, &[]);
    let server = Server::start(&model, &["--hot-fraction", "0.5"]);
    let (status, v) =
        server.json("POST", "/moe-hot-cache", &json!({"layers": {"0": [4, 5, 6, 7], "1": [0, 2, 4, 6]}}));
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["exchanges"], 6);
    let (_, hot) = server.json("GET", "/moe-hot-cache", &json!({}));
    assert_eq!(hot["layers"], json!({"0": [4, 5, 6, 7], "1": [0, 2, 4, 6]}));
    assert_eq!(hot["updates"], 1);
    let (_, v) = server.json("POST", "/v1/completions", &json!({"prompt": [5, 6, 7], "max_tokens": 8}));
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
                s.json("POST", "/v1/completions", &json!({"prompt": [1, 2], "max_tokens": 2000}))
            })
        })
        .collect();
    let results: Vec<(u16, Value)> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    let n_ok = results.iter().filter(|(s, v)| *s == 200 && v["usage"]["completion_tokens"] == 2000).count();
    let n_busy =
        results.iter().filter(|(s, v)| *s == 429 && v["error"]["type"] == "rate_limit_error").count();
    assert_eq!(n_ok + n_busy, 8, "{results:?}");
    assert!(n_busy >= 1 && n_ok >= 1, "ok {n_ok}, 429 {n_busy}");
    let (_, text) = server.request("GET", "/metrics", b"", &[]);
    assert!(text.contains(&format!("moe_lanes_requests_total{{outcome=\"ok\"}} {n_ok}")), "{text}");
}

#[test]
fn metrics_name_every_family_and_admin_endpoints_need_the_token() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny(dir.path());
    let server = Server::start(&model, &["--hot-fraction", "0.5", "--admin-token", "s3cret"]);
    server.json("POST", "/v1/completions", &json!({"prompt": [1, 2], "max_tokens": 3}));
    let (status, text) = server.request("GET", "/metrics", b"", &[]);
    assert_eq!(status, 200);
    let mut families: Vec<&str> = text.lines().filter_map(|l| l.strip_prefix("# TYPE ")).collect();
    families.sort();
    insta::assert_snapshot!("metric_families", families.join("\n"));
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

#[test]
fn serve_with_update_auto_follows_the_workload_and_stays_exact() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny(dir.path());
    let want = generate(&model, "5,6,7", 24, &[]);
    let server =
        Server::start(&model, &["--hot-fraction", "0.5", "--update", "auto", "--update-rate", "0.5"]);
    for _ in 0..4 {
        let (_, v) = server.json("POST", "/v1/completions", &json!({"prompt": [5, 6, 7], "max_tokens": 24}));
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
