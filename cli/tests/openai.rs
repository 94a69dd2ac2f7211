//! The OpenAI-compatible text API of `serve` through the real binary, on a synthetic model with
//! a real vocabulary (`synth --vocab-from` Qwen2's, which carries a chat template): text
//! completions equal `run`, stop strings, chat, streaming that reassembles to the plain answer,
//! OpenAI-shaped errors (snapshots), cancellation on hang-up, bounded loopback loads (16
//! clients; 64 with a fifth hanging up, twice, memory back to its baseline), and the official
//! `openai` Python package as the client.

#[path = "../../tests/common/mod.rs"]
mod common;

mod bin;

use bin::server::{metric_samples, post_and_hang_up, sse_data, timed_post, Server, Timed};
use bin::{ok_stdout, p};
use serde_json::{json, Value};
use std::time::{Duration, Instant};

/// A synthetic model with Qwen2's tokenizer and chat template.
fn qwen(dir: &std::path::Path) -> String {
    let vocab = common::tokenizers().join("ggml-vocab-qwen2.gguf");
    let path = dir.join("qwen-synth.gguf");
    ok_stdout(&["synth", "--out", p(&path), "--vocab-from", p(&vocab)]);
    p(&path).to_string()
}

/// `run`'s greedy text for `prompt` (its stdout ends with one newline after the text).
fn run_text(model: &str, prompt: &str, n: usize) -> String {
    let n = n.to_string();
    let out = ok_stdout(&[
        "run",
        "--model",
        model,
        "--prompt",
        prompt,
        "-n",
        &n,
        "--temperature",
        "0",
        "--engine",
        "pipeline",
    ]);
    out.strip_suffix('\n').unwrap_or(&out).to_string()
}

fn post(server: &Server, path: &str, body: Value) -> (u16, Value) {
    server.json("POST", path, &body)
}

/// The chunks of a streamed answer (without `[DONE]`, which must end it).
fn chunks(t: &Timed) -> Vec<Value> {
    assert_eq!(t.status, 200, "{}", t.body);
    let data = sse_data(&t.body);
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"), "{}", t.body);
    data[..data.len() - 1].iter().map(|d| serde_json::from_str(d).unwrap()).collect()
}

fn streamed_text(chunks: &[Value]) -> String {
    chunks.iter().filter_map(|c| c["choices"][0]["text"].as_str()).collect()
}

#[test]
fn text_completion_equals_run_plain_and_streamed() {
    let dir = tempfile::tempdir().unwrap();
    let model = qwen(dir.path());
    let prompt = "Hello, world! Ünïcödé 你好";
    let want = run_text(&model, prompt, 12);
    assert!(!want.is_empty());
    let server = Server::start(&model, &[]);
    let body = json!({"model": "anything", "prompt": prompt, "max_tokens": 12, "temperature": 0});
    let (status, v) = post(&server, "/v1/completions", body.clone());
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["choices"][0]["text"], want);
    assert_eq!(v["object"], "text_completion");
    let n_prompt = serde_json::from_str::<Vec<u32>>(&ok_stdout(&[
        "tokenize",
        "--model",
        &model,
        "--text",
        prompt,
        "--special",
    ]))
    .unwrap()
    .len();
    let n_out = v["choices"][0]["token_ids"].as_array().unwrap().len();
    assert_eq!(
        v["usage"],
        json!({"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out})
    );
    // An array of one string is the same prompt; streamed pieces join to the same text.
    let mut body = body;
    body["prompt"] = json!([prompt]);
    body["stream"] = json!(true);
    let c = chunks(&timed_post(&server.addr, "/v1/completions", &body));
    assert_eq!(streamed_text(&c), want);
    let last = c.last().unwrap();
    assert_eq!(last["choices"][0]["finish_reason"], v["choices"][0]["finish_reason"]);
    assert_eq!(last["usage"], v["usage"]);
    let (_, models) = server.json("GET", "/v1/models", &json!({}));
    assert_eq!(models["object"], "list");
    assert_eq!(models["data"][0]["id"], "qwen-synth");
    assert_eq!(models["data"][0]["object"], "model");
}

#[test]
fn stop_strings_end_the_text_before_them_plain_and_streamed() {
    let dir = tempfile::tempdir().unwrap();
    let model = qwen(dir.path());
    let server = Server::start(&model, &[]);
    let body = json!({"prompt": "Once upon a time", "max_tokens": 24, "temperature": 0});
    let (_, full) = post(&server, "/v1/completions", body.clone());
    let full_text = full["choices"][0]["text"].as_str().unwrap().to_string();
    let chars: Vec<char> = full_text.chars().collect();
    assert!(chars.len() >= 8, "{full_text}");
    // A stop string spanning the middle of the text (likely over a token boundary).
    let at = chars.len() / 2;
    let stop: String = chars[at..at + 3].iter().collect();
    let want = &full_text[..full_text.find(&stop).unwrap()];
    for stream in [false, true] {
        let mut b = body.clone();
        b["stop"] = json!(["never-there", stop]);
        b["stream"] = json!(stream);
        let (text, finish, usage) = if stream {
            let c = chunks(&timed_post(&server.addr, "/v1/completions", &b));
            let last = c.last().unwrap().clone();
            (streamed_text(&c), last["choices"][0]["finish_reason"].clone(), last["usage"].clone())
        } else {
            let (_, v) = post(&server, "/v1/completions", b);
            (
                v["choices"][0]["text"].as_str().unwrap().to_string(),
                v["choices"][0]["finish_reason"].clone(),
                v["usage"].clone(),
            )
        };
        assert_eq!(text, want, "stream {stream}: stop {stop:?}");
        assert_eq!(finish, "stop");
        assert!(usage["completion_tokens"].as_u64().unwrap() < 24, "it stopped generating: {usage}");
    }
}

/// The ids `/v1/chat/completions` should generate from: the model's template, as the library
/// renders and tokenizes it.
fn chat_prompt_ids(model: &str, messages: &[(&str, &str)]) -> (Vec<u32>, Vec<u32>) {
    use moe_lanes::text::{ChatMessage, ChatTemplate, RenderOptions, Tokenizer};
    let tok = Tokenizer::from_gguf_path(model.as_ref()).unwrap();
    let template = ChatTemplate::from_tokenizer(&tok, model.as_ref()).unwrap();
    let msgs: Vec<ChatMessage> = messages.iter().map(|(r, c)| ChatMessage::new(*r, *c)).collect();
    let opts = RenderOptions { add_generation_prompt: true, ..RenderOptions::default() };
    (template.encode(&tok, &msgs, opts).unwrap(), tok.eog_ids().to_vec())
}

#[test]
fn chat_completion_follows_the_template_and_streams_to_the_same_content() {
    let dir = tempfile::tempdir().unwrap();
    let model = qwen(dir.path());
    let server = Server::start(&model, &[]);
    let conversation = [
        ("system", "You are terse."),
        ("user", "Say hello in French."),
        ("assistant", "Bonjour."),
        ("user", "And in German?"),
    ];
    let messages: Vec<Value> = conversation.iter().map(|(r, c)| json!({"role": r, "content": c})).collect();
    let body = json!({"model": "x", "messages": messages, "max_tokens": 12, "temperature": 0});
    let (status, v) = post(&server, "/v1/chat/completions", body.clone());
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");
    let content = v["choices"][0]["message"]["content"].as_str().unwrap().to_string();
    // The same ids through /v1/completions (token-id prompt, stopping on the EOG ids) give the
    // same text: the messages went through the template.
    let (ids, eog) = chat_prompt_ids(&model, &conversation);
    let (_, c) = post(
        &server,
        "/v1/completions",
        json!({"prompt": ids, "max_tokens": 12, "temperature": 0, "stop_token_ids": eog}),
    );
    assert_eq!(content, c["choices"][0]["text"].as_str().unwrap());
    assert_eq!(v["usage"], c["usage"]);
    assert_eq!(v["choices"][0]["finish_reason"], c["choices"][0]["finish_reason"]);
    // logprobs: one entry per generated token, with its alternatives.
    let mut lp = body.clone();
    lp["logprobs"] = json!(true);
    lp["top_logprobs"] = json!(2);
    let (_, l) = post(&server, "/v1/chat/completions", lp);
    assert_eq!(l["choices"][0]["message"]["content"], content, "logprobs change nothing else");
    let entries = l["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(entries.len() as u64, v["usage"]["completion_tokens"].as_u64().unwrap());
    assert!(entries
        .iter()
        .all(|e| e["logprob"].as_f64().unwrap() <= 0.0 && e["top_logprobs"].as_array().unwrap().len() == 2));
    // Text parts are the same message.
    let mut parts = body.clone();
    parts["messages"][3]["content"] =
        json!([{"type": "text", "text": "And in "}, {"type": "text", "text": "German?"}]);
    assert_eq!(post(&server, "/v1/chat/completions", parts).1["choices"][0]["message"]["content"], content);
    // Streamed: the first delta names the role, the deltas join to the same content.
    let mut b = body;
    b["stream"] = json!(true);
    let c = chunks(&timed_post(&server.addr, "/v1/chat/completions", &b));
    assert!(c.iter().all(|ch| ch["object"] == "chat.completion.chunk"));
    assert_eq!(c[0]["choices"][0]["delta"]["role"], "assistant");
    let joined: String = c.iter().filter_map(|ch| ch["choices"][0]["delta"]["content"].as_str()).collect();
    assert_eq!(joined, content);
    let last = c.last().unwrap();
    assert_eq!(last["choices"][0]["finish_reason"], v["choices"][0]["finish_reason"]);
    assert_eq!(last["usage"], v["usage"]);
}

#[test]
fn bad_chat_requests_are_openai_shaped_errors() {
    let dir = tempfile::tempdir().unwrap();
    let model = qwen(dir.path());
    let server = Server::start(&model, &["--ctx-size", "64"]);
    let user = |c: Value| json!([{"role": "user", "content": c}]);
    insta::assert_snapshot!(
        "chat_no_messages",
        error_body(&server, "/v1/chat/completions", json!({"messages": []}))
    );
    insta::assert_snapshot!(
        "chat_bad_content",
        error_body(&server, "/v1/chat/completions", json!({"messages": user(json!(5))}))
    );
    insta::assert_snapshot!(
        "chat_image_part",
        error_body(
            &server,
            "/v1/chat/completions",
            json!({"messages": user(json!([{"type": "image_url", "image_url": {"url": "x"}}]))})
        )
    );
    insta::assert_snapshot!(
        "chat_context_overflow",
        error_body(&server, "/v1/chat/completions", json!({"messages": user(json!("hi")), "max_tokens": 60}))
    );
    insta::assert_snapshot!(
        "chat_top_logprobs_without_logprobs",
        error_body(
            &server,
            "/v1/chat/completions",
            json!({"messages": user(json!("hi")), "top_logprobs": 2})
        )
    );
    // A model without a chat template (a SentencePiece vocabulary without ChatML's markers): 400
    // naming messages and the missing template.
    let tiny = dir.path().join("tiny.gguf");
    let spm = common::tokenizers().join("ggml-vocab-llama-spm.gguf");
    ok_stdout(&["synth", "--out", p(&tiny), "--vocab-from", p(&spm)]);
    let plain = Server::start(p(&tiny), &[]);
    let (status, v) = post(&plain, "/v1/chat/completions", json!({"messages": user(json!("hi"))}));
    assert_eq!(status, 400, "{v}");
    assert_eq!(v["error"]["param"], "messages");
    let message = v["error"]["message"].as_str().unwrap();
    assert!(message.contains("no chat template") && message.contains("--chat-template"), "{message}");
}

/// One chat answer of `model` served as is (no `--chat-template`), as the README's OpenAI example
/// asks for it.
fn readme_chat(model: &str) -> Value {
    let server = Server::start(model, &[]);
    let body = json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 16});
    let (status, v) = post(&server, "/v1/chat/completions", body);
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");
    assert!(v["choices"][0]["message"]["content"].is_string(), "{v}");
    v
}

/// Chat out of the box: `synth` (its own vocabulary has ChatML's markers, so it carries the ChatML
/// template) and the demo model answer `/v1/chat/completions` without `--chat-template`, with the
/// prompt rendered as ChatML; nothing outside the repository is needed (the README's example).
#[test]
fn synth_and_demo_models_chat_out_of_the_box() {
    let dir = tempfile::tempdir().unwrap();
    let q = dir.path().join("q.gguf");
    ok_stdout(&["synth", "--out", p(&q)]);
    let v = readme_chat(p(&q));
    let (ids, _) = chat_prompt_ids(p(&q), &[("user", "Hi")]);
    assert_eq!(v["usage"]["prompt_tokens"].as_u64().unwrap() as usize, ids.len());
    let tok = moe_lanes::text::Tokenizer::from_gguf_path(&q).unwrap();
    assert_eq!(tok.decode(&ids, false).unwrap(), "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
    let home = tempfile::tempdir().unwrap();
    let demo = || {
        let out = bin::command()
            .args(["demo", "--max-new-tokens", "2"])
            .env("MOE_LANES_HOME", home.path())
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    demo();
    let cached = home.path().join("default-qwen3moe-small.gguf");
    readme_chat(p(&cached));
    // A demo model cached by an earlier version (no template) is written again, with it.
    let old = home.path().join("old.gguf");
    let keep = |k: &str, v: &moe_lanes::gguf::MetaValue| (k != "tokenizer.chat_template").then(|| v.clone());
    common::rewrite_gguf(&cached, &old, keep, |_| common::TensorEdit::Keep);
    std::fs::rename(&old, &cached).unwrap();
    assert!(demo().contains("has no chat template; writing it again"));
    readme_chat(p(&cached));
}

/// `serve --chat-template` with a file that cannot be read or does not parse stops with an error
/// naming it (exit 1) instead of serving without a chat API.
#[test]
fn serve_refuses_a_chat_template_it_cannot_use() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("m.gguf");
    ok_stdout(&["synth", "--out", p(&model)]);
    let broken = dir.path().join("broken.jinja");
    std::fs::write(&broken, "{% for message in messages %}{{ message['content'] }").unwrap();
    for (template, want) in
        [("/nonexistent/t.jinja", "cannot read the chat template"), (p(&broken), "syntax error")]
    {
        let args = ["serve", "--model", p(&model), "--listen", "127.0.0.1:0", "--engine", "pipeline"];
        let mut child = bin::command()
            .args(args)
            .args(["--chat-template", template])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let start = Instant::now();
        while child.try_wait().unwrap().is_none() {
            if start.elapsed() > Duration::from_secs(60) {
                bin::server::sigterm(child.id());
                let out = child.wait_with_output().unwrap();
                panic!("--chat-template {template}: still serving: {}", String::from_utf8_lossy(&out.stderr));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let stderr =
            bin::failure_of(child.wait_with_output().unwrap(), &format!("--chat-template {template}"));
        assert!(stderr.contains("--chat-template") && stderr.contains(want), "{stderr}");
        assert!(stderr.contains(template), "the error names the file: {stderr}");
    }
}

/// The error body without its message's volatile parts (none today) as pretty JSON.
fn error_body(server: &Server, path: &str, body: Value) -> String {
    let (status, v) = post(server, path, body);
    assert_eq!(status, 400, "{v}");
    format!("{status}\n{}", serde_json::to_string_pretty(&v).unwrap())
}

#[test]
fn bad_text_requests_are_openai_shaped_errors() {
    let dir = tempfile::tempdir().unwrap();
    let model = qwen(dir.path());
    let server = Server::start(&model, &["--ctx-size", "64"]);
    let long = "word ".repeat(100);
    insta::assert_snapshot!(
        "context_overflow_max_tokens",
        error_body(&server, "/v1/completions", json!({"prompt": "Hello", "max_tokens": 100}))
    );
    insta::assert_snapshot!(
        "context_overflow_prompt",
        error_body(&server, "/v1/completions", json!({"prompt": long, "max_tokens": 4}))
    );
    insta::assert_snapshot!(
        "batch_of_prompts",
        error_body(&server, "/v1/completions", json!({"prompt": ["one", "two"]}))
    );
    insta::assert_snapshot!(
        "too_many_stop_strings",
        error_body(
            &server,
            "/v1/completions",
            json!({"prompt": "a", "stop": (0..=moe_lanes::text::MAX_STOP_STRINGS).map(|i| i.to_string()).collect::<Vec<_>>()})
        )
    );
    insta::assert_snapshot!(
        "unknown_field",
        error_body(&server, "/v1/completions", json!({"prompt": "a", "best_of": 3}))
    );
    // Nothing ran.
    let (_, text) = server.request("GET", "/metrics", b"", &[]);
    assert_eq!(metric_samples(&text)["moe_lanes_generated_tokens_total"], 0.0);
}

fn generated_and_cancelled(server: &Server) -> (f64, f64) {
    let (_, text) = server.request("GET", "/metrics", b"", &[]);
    let m = metric_samples(&text);
    (m["moe_lanes_generated_tokens_total"], m["moe_lanes_requests_total{outcome=\"cancelled\"}"])
}

#[test]
fn a_client_that_hangs_up_cancels_its_generation() {
    let dir = tempfile::tempdir().unwrap();
    let model = qwen(dir.path());
    let server = Server::start(&model, &[]);
    for stream in [true, false] {
        let (_, cancelled_before) = generated_and_cancelled(&server);
        let body = json!({"prompt": [1, 2, 3], "max_tokens": 4000, "temperature": 0, "stream": stream});
        if stream {
            post_and_hang_up(&server.addr, "/v1/completions", &body);
        } else {
            // A plain request's client gives up before the answer.
            let addr = server.addr.clone();
            let mut s = std::net::TcpStream::connect(&addr).unwrap();
            let b = body.to_string();
            use std::io::Write;
            write!(s, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n\r\n{b}", b.len())
                .unwrap();
            let deadline = Instant::now() + Duration::from_secs(10);
            while server.json("GET", "/health", &json!({})).1["requests_running"] != 1 {
                assert!(Instant::now() < deadline, "the request never ran");
            }
            drop(s);
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        while generated_and_cancelled(&server).1 == cancelled_before {
            assert!(Instant::now() < deadline, "stream {stream}: the cancelled counter never moved");
            std::thread::sleep(Duration::from_millis(20));
        }
        let (generated, _) = generated_and_cancelled(&server);
        std::thread::sleep(Duration::from_millis(300));
        assert_eq!(generated_and_cancelled(&server).0, generated, "stream {stream}: tokens kept coming");
        let (_, text) = server.request("GET", "/metrics", b"", &[]);
        assert_eq!(
            metric_samples(&text)["moe_lanes_requests_total{outcome=\"ok\"}"],
            0.0,
            "none ran to its end"
        );
        assert_eq!(server.json("GET", "/health", &json!({})).1["requests_running"], 0);
    }
}

/// One load request: its prompt, whether it streams, and how it went.
struct Outcome {
    i: usize,
    stream: bool,
    timed: Timed,
}

/// The answer's text and token ids, streamed or not.
fn answer(o: &Outcome) -> (String, Vec<u64>) {
    let ids = |v: &Value| -> Vec<u64> {
        v["choices"][0]["token_ids"].as_array().unwrap().iter().map(|t| t.as_u64().unwrap()).collect()
    };
    if o.stream {
        let c = chunks(&o.timed);
        (streamed_text(&c), c.iter().flat_map(ids).collect())
    } else {
        let v: Value = serde_json::from_str(&o.timed.body).unwrap();
        (v["choices"][0]["text"].as_str().unwrap().to_string(), ids(&v))
    }
}

fn load_prompt(i: usize) -> String {
    format!("Request {i}: tell me about number {}", i * 7919 % 1000)
}

/// Requests `0..n` from `clients` threads, each claiming the next index and sending it by `each`
/// (which may return no outcome: a client that hung up); every outcome.
fn spread<T: Send + 'static>(
    addr: &str,
    clients: usize,
    n: usize,
    each: impl Fn(&str, usize) -> Option<T> + Send + Sync + 'static,
) -> Vec<T> {
    let (each, next) =
        (std::sync::Arc::new(each), std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0)));
    let threads: Vec<_> = (0..clients)
        .map(|_| {
            let (addr, next, each) = (addr.to_string(), next.clone(), each.clone());
            std::thread::spawn(move || {
                let mut out = Vec::new();
                loop {
                    let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    if i >= n {
                        return out;
                    }
                    out.extend(each(&addr, i));
                }
            })
        })
        .collect();
    threads.into_iter().flat_map(|t| t.join().expect("no client thread panics")).collect()
}

/// `n` requests from `concurrency` threads (request `i` streams when `i` is odd).
fn drive(addr: &str, n: usize, concurrency: usize, max_tokens: usize) -> Vec<Outcome> {
    spread(addr, concurrency, n, move |addr, i| {
        let stream = i % 2 == 1;
        let body =
            json!({"prompt": load_prompt(i), "max_tokens": max_tokens, "temperature": 0, "stream": stream});
        Some(Outcome { i, stream, timed: timed_post(addr, "/v1/completions", &body) })
    })
}

fn percentile(sorted: &[Duration], q: f64) -> Duration {
    sorted[((sorted.len() - 1) as f64 * q).round() as usize]
}

/// The bounded loopback load: `MOE_LANES_LOAD_REQUESTS` requests (40 by default; the closing
/// figures use 200), 16 concurrent, mixed streaming and not, each answer whole and equal to the
/// same prompt's answer alone; then a queue of 1 under the same load answers 429.
#[test]
fn loopback_load_every_answer_whole_and_its_own_and_429_when_full() {
    let n: usize = std::env::var("MOE_LANES_LOAD_REQUESTS").ok().and_then(|v| v.parse().ok()).unwrap_or(40);
    let (concurrency, max_tokens) = (16, 8);
    let dir = tempfile::tempdir().unwrap();
    let model = qwen(dir.path());
    let server = Server::start(&model, &["--queue", "256"]);
    let alone: Vec<Outcome> = (0..n)
        .map(|i| {
            let body = json!({"prompt": load_prompt(i), "max_tokens": max_tokens, "temperature": 0});
            Outcome { i, stream: false, timed: timed_post(&server.addr, "/v1/completions", &body) }
        })
        .collect();
    let start = Instant::now();
    let outcomes = drive(&server.addr, n, concurrency, max_tokens);
    let took = start.elapsed();
    assert_eq!(outcomes.len(), n);
    let mut tokens = 0;
    for o in &outcomes {
        assert_eq!(o.timed.status, 200, "request {}: {}", o.i, o.timed.body);
        let (text, ids) = answer(o);
        assert_eq!(
            (&text, &ids),
            (&answer(&alone[o.i]).0, &answer(&alone[o.i]).1),
            "request {} (stream {})",
            o.i,
            o.stream
        );
        tokens += ids.len();
    }
    let mut ttft: Vec<Duration> = outcomes.iter().filter_map(|o| o.timed.first_data).collect();
    ttft.sort();
    println!(
        "load: {n} requests, {concurrency} concurrent, {max_tokens} max tokens: {:.1} requests/s, {:.1} generated tokens/s, time to first token (streamed) p50 {:.1} ms, p99 {:.1} ms",
        n as f64 / took.as_secs_f64(),
        tokens as f64 / took.as_secs_f64(),
        percentile(&ttft, 0.5).as_secs_f64() * 1e3,
        percentile(&ttft, 0.99).as_secs_f64() * 1e3,
    );
    // A queue of one: some get 429 (OpenAI-shaped), every other answer is still whole and its own.
    let small = Server::start(&model, &["--queue", "1"]);
    let outcomes = drive(&small.addr, concurrency * 2, concurrency, 64);
    let busy = outcomes.iter().filter(|o| o.timed.status == 429).count();
    for o in &outcomes {
        if o.timed.status == 429 {
            let v: Value = serde_json::from_str(&o.timed.body).unwrap();
            assert_eq!(v["error"]["type"], "rate_limit_error", "{v}");
        } else {
            assert_eq!(o.timed.status, 200, "{}", o.timed.body);
            let (_, ids) = answer(o);
            assert!(!ids.is_empty() && ids.len() <= 64, "request {}: whole", o.i);
        }
    }
    assert!(busy >= 1 && busy < outcomes.len(), "429s: {busy} of {}", outcomes.len());
    println!("queue of 1: {busy} of {} requests answered 429", outcomes.len());
    for s in [server, small] {
        assert!(s.stop().success(), "clean exit, no panic");
    }
}

/// Load request `i` of the many-client test: every fifth streams a long answer and hangs up after
/// its first event; the rest ask for 8 tokens, every other one streamed, prompts of 1 to 6
/// sentences.
fn many_client_request(addr: &str, i: usize) -> Option<Outcome> {
    let prompt = (0..1 + i % 6).map(|k| load_prompt(i * 7 + k)).collect::<Vec<_>>().join(" ");
    if i % 5 == 4 {
        let body = json!({"prompt": prompt, "max_tokens": 4000, "temperature": 0, "stream": true});
        post_and_hang_up(addr, "/v1/completions", &body);
        return None;
    }
    let stream = i % 2 == 1;
    let body = json!({"prompt": prompt, "max_tokens": 8, "temperature": 0, "stream": stream});
    Some(Outcome { i, stream, timed: timed_post(addr, "/v1/completions", &body) })
}

/// One round of the many-client load: `clients` threads send requests `0..n`
/// ([`many_client_request`]); the answers of the clients that stayed, once every hang-up is
/// counted cancelled and nothing runs or waits.
fn many_client_round(server: &Server, clients: usize, n: usize) -> Vec<Outcome> {
    let cancelled_before = generated_and_cancelled(server).1;
    let outcomes = spread(&server.addr, clients, n, many_client_request);
    let hang_ups = (0..n).filter(|i| i % 5 == 4).count() as f64;
    assert_eq!(outcomes.len() as f64 + hang_ups, n as f64, "every request accounted for");
    let deadline = Instant::now() + Duration::from_secs(30);
    while generated_and_cancelled(server).1 - cancelled_before < hang_ups {
        assert!(Instant::now() < deadline, "hang-ups counted: {:?}", generated_and_cancelled(server));
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(generated_and_cancelled(server).1 - cancelled_before, hang_ups, "only the hang-ups cancelled");
    let health = server.json("GET", "/health", &json!({})).1;
    assert_eq!(
        (&health["requests_running"], &health["requests_waiting"]),
        (&json!(0), &json!(0)),
        "{health}"
    );
    outcomes
}

/// The server process's resident memory in KiB (Linux `/proc`), if it can be read.
fn resident_kib(server: &Server) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{}/status", server.child.id())).ok()?;
    status.lines().find_map(|l| l.strip_prefix("VmRSS:")?.trim().strip_suffix(" kB")?.parse().ok())
}

/// The bounded loopback load with many clients: `MOE_LANES_LOAD_CLIENTS` threads (64 by
/// default) send `MOE_LANES_LOAD_REQUESTS` requests (192; longer runs with more), a fifth of
/// them hanging up mid-stream, twice. Nothing is lost or mixed: every answer of a client that
/// stayed is whole and equal to its prompt's answer alone, every hang-up and nothing else is
/// counted cancelled, the server goes back to idle after each round, and the second round leaves
/// it no larger than the first did (memory back to its baseline: within 32 MiB).
#[test]
fn many_clients_some_hanging_up_lose_nothing_and_mix_nothing() {
    let env = |k: &str, d: usize| std::env::var(k).ok().and_then(|v| v.parse().ok()).unwrap_or(d);
    let (clients, n) = (env("MOE_LANES_LOAD_CLIENTS", 64), env("MOE_LANES_LOAD_REQUESTS", 192));
    let dir = tempfile::tempdir().unwrap();
    let model = qwen(dir.path());
    let server = Server::start(&model, &["--queue", "1024"]);
    many_client_round(&server, clients, n);
    let baseline = resident_kib(&server);
    let start = Instant::now();
    let outcomes = many_client_round(&server, clients, n);
    let took = start.elapsed();
    if let (Some(before), Some(after)) = (baseline, resident_kib(&server)) {
        println!("resident memory after the first round {before} KiB, after the second {after} KiB");
        assert!(after <= before + 32 * 1024, "the server grew by {} KiB in a round", after - before);
    }
    for o in &outcomes {
        assert_eq!(o.timed.status, 200, "request {}: {}", o.i, o.timed.body);
        let prompt = (0..1 + o.i % 6).map(|k| load_prompt(o.i * 7 + k)).collect::<Vec<_>>().join(" ");
        let body = json!({"prompt": prompt, "max_tokens": 8, "temperature": 0});
        let alone =
            Outcome { i: o.i, stream: false, timed: timed_post(&server.addr, "/v1/completions", &body) };
        assert_eq!(answer(o), answer(&alone), "request {} (stream {}) is its own, whole", o.i, o.stream);
    }
    let (_, text) = server.request("GET", "/metrics", b"", &[]);
    assert_eq!(metric_samples(&text)["moe_lanes_requests_total{outcome=\"error\"}"], 0.0);
    println!("{clients} clients, {n} requests a round, a fifth hung up: {:.1} s a round", took.as_secs_f64());
    assert!(server.stop().success(), "clean exit, no panic");
}

/// The official `openai` Python package as the client (tests/openai_client/test_openai.py).
/// Skips, saying so, where `python3 -c "import openai"` fails, unless
/// `MOE_LANES_REQUIRE_OPENAI=1` (`.ci/run` installs the package and sets it).
#[test]
fn the_official_openai_python_client_drives_the_server() {
    let has_openai = std::process::Command::new("python3")
        .args(["-c", "import openai"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !has_openai {
        assert!(
            std::env::var("MOE_LANES_REQUIRE_OPENAI").as_deref() != Ok("1"),
            "MOE_LANES_REQUIRE_OPENAI=1 but python3 cannot import openai (pip install openai)"
        );
        eprintln!("SKIP: python3 cannot import openai (pip install openai; .ci/run does)");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let model = qwen(dir.path());
    let server = Server::start(&model, &[]);
    let script = common::repo_root().join("tests/openai_client/test_openai.py");
    let out = std::process::Command::new("python3")
        .arg(&script)
        .arg(format!("http://{}", server.addr))
        .output()
        .unwrap();
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{}:\n{stdout}\n{stderr}", script.display());
    assert!(stdout.contains("all checks passed"), "{stdout}");
}

/// `scripts/serve-load.py` (the servers' side by side: `benches/compare-llama-cpp.sh server`)
/// against the server: every streamed request whole (clients x requests x max_tokens tokens,
/// latencies reported, exit 0), and answers shorter than it asked for counted as failures by
/// reason (exit 1). Skips, saying so, without python3.
#[test]
fn the_load_script_counts_every_stream_and_every_short_one() {
    if !std::process::Command::new("python3").arg("--version").output().is_ok_and(|o| o.status.success()) {
        eprintln!("SKIP: no python3");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let model = qwen(dir.path());
    let server = Server::start(&model, &["--parallel", "4"]);
    let script = common::repo_root().join("scripts/serve-load.py");
    let load = |extra: &str| {
        let json = dir.path().join("load.json");
        let url = format!("http://{}", server.addr);
        let args = ["--clients", "4", "--requests", "2", "--prompt-tokens", "12", "--max-tokens", "6"];
        let out = std::process::Command::new("python3")
            .arg(&script)
            .args(["--url", &url, "--vocab", "1000", "--extra", extra, "--json", p(&json)])
            .args(args)
            .output()
            .unwrap();
        let summary: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
        (out.status.success(), summary)
    };
    let (ok, whole) = load("{}");
    assert!(ok, "{whole}");
    assert_eq!(
        (whole["requests"].as_u64(), whole["completion_tokens"].as_u64()),
        (Some(8), Some(48)),
        "{whole}"
    );
    assert_eq!(whole["failed"], serde_json::json!({}), "{whole}");
    for key in ["tokens_per_s", "ttft_ms_p50", "ttft_ms_p99", "itl_ms_p50", "itl_ms_p99"] {
        assert!(whole[key].as_f64().is_some_and(|v| v > 0.0), "{key}: {whole}");
    }
    // the server asked for 2 tokens a request where the client expects 6
    let (ok, short) = load(r#"{"max_tokens": 2}"#);
    assert!(!ok, "{short}");
    assert_eq!(short["failed"], serde_json::json!({"short answer": 8}), "{short}");
}
