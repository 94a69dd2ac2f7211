//! A running `moe-lanes serve` and a raw HTTP/1.1 client for it (shared by the serve tests).

use super::command;
use serde_json::Value;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Stdio};

/// A running server, stopped (SIGTERM) when dropped.
pub struct Server {
    pub child: Child,
    pub addr: String,
}

impl Server {
    pub fn start(model: &str, extra: &[&str]) -> Server {
        let mut args = vec!["serve", "--model", model, "--listen", "127.0.0.1:0", "--engine", "pipeline"];
        args.extend(extra);
        let mut child = command().args(&args).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
        let addr =
            line.trim().strip_prefix("listening on http://").unwrap_or_else(|| panic!("{line}")).to_string();
        Server { child, addr }
    }

    pub fn request(&self, method: &str, path: &str, body: &[u8], headers: &[&str]) -> (u16, String) {
        request(&self.addr, method, path, body, headers)
    }

    pub fn json(&self, method: &str, path: &str, body: &Value) -> (u16, Value) {
        json_request(&self.addr, method, path, body)
    }

    pub fn stop(mut self) -> std::process::ExitStatus {
        sigterm(self.child.id());
        self.child.wait().unwrap()
    }
}

/// A raw HTTP/1.1 request (a hand-written client: the tests need to send malformed and
/// oversize bodies and read the raw event stream, which a client crate would get in the way of).
pub fn request(addr: &str, method: &str, path: &str, body: &[u8], headers: &[&str]) -> (u16, String) {
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

pub fn json_request(addr: &str, method: &str, path: &str, body: &Value) -> (u16, Value) {
    let (status, text) = request(addr, method, path, body.to_string().as_bytes(), &[]);
    (status, serde_json::from_str(&text).unwrap_or_else(|e| panic!("{path}: not JSON ({e}): {text}")))
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
    }
}

pub fn sigterm(pid: u32) {
    std::process::Command::new("kill").args(["-TERM", &pid.to_string()]).status().unwrap();
}

/// Undo `Transfer-Encoding: chunked` when present (streamed responses).
pub fn dechunk(body: &str) -> String {
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

/// A streamed (or plain) POST, timed: the status, when the first `data:` line (or, for a
/// plain response, the whole body) arrived, and the body.
pub struct Timed {
    pub status: u16,
    pub first_byte: std::time::Duration,
    pub first_data: Option<std::time::Duration>,
    pub body: String,
}

pub fn timed_post(addr: &str, path: &str, body: &Value) -> Timed {
    let start = std::time::Instant::now();
    let mut s = TcpStream::connect(addr).unwrap();
    let body = body.to_string();
    let head = format!("POST {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n", body.len());
    s.write_all(head.as_bytes()).unwrap();
    s.write_all(body.as_bytes()).unwrap();
    let mut reader = BufReader::new(s);
    let (mut raw, mut line) = (String::new(), String::new());
    let (mut first_byte, mut first_data) = (None, None);
    while reader.read_line(&mut line).unwrap_or(0) > 0 {
        first_byte.get_or_insert_with(|| start.elapsed());
        if first_data.is_none() && line.starts_with("data: ") {
            first_data = Some(start.elapsed());
        }
        raw.push_str(&line);
        line.clear();
    }
    let status = raw.split(' ').nth(1).and_then(|c| c.parse().ok()).unwrap_or_else(|| panic!("{raw}"));
    let body = raw.split_once("\r\n\r\n").map(|(_, b)| dechunk(b)).unwrap_or_default();
    Timed { status, first_byte: first_byte.unwrap_or_default(), first_data, body }
}

/// The `data:` payloads of an event stream (`[DONE]` included).
pub fn sse_data(body: &str) -> Vec<String> {
    body.lines().filter_map(|l| l.strip_prefix("data: ")).map(str::to_string).collect()
}

/// A POST whose client reads the first `data:` line of the answer, then hangs up.
pub fn post_and_hang_up(addr: &str, path: &str, body: &Value) {
    let mut s = TcpStream::connect(addr).unwrap();
    let body = body.to_string();
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).unwrap();
    s.write_all(body.as_bytes()).unwrap();
    let mut reader = BufReader::new(s);
    let mut line = String::new();
    while reader.read_line(&mut line).unwrap_or(0) > 0 && !line.starts_with("data: ") {
        line.clear();
    }
    assert!(line.starts_with("data: "), "no event before the hang-up");
    let _ = reader.into_inner().shutdown(std::net::Shutdown::Both);
}

/// Every sample of `/metrics` (`name{labels}` -> value).
pub fn metric_samples(text: &str) -> std::collections::BTreeMap<String, f64> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .filter_map(|l| l.rsplit_once(' '))
        .filter_map(|(k, v)| Some((k.to_string(), v.parse().ok()?)))
        .collect()
}
