//! The expert usage tracer (seed 001): per forward call and layer, the phase, the experts the
//! router chose (each with its hot and cold slot counts) and the layer's hot/cold slot counts,
//! written as JSON lines; and the replay of a trace as learn counts (`plan`, `--learn`).
//!
//! A trace is a header line, then one line per call and layer:
//! ```text
//! {"trace":"moe-lanes-expert-usage","version":1,"model":{"architecture":"qwen3_moe",...}}
//! {"call":0,"phase":"prefill","tokens":12,"layer":0,"hot_slots":20,"cold_slots":76,"experts":[[3,5,1],[9,0,2]]}
//! ```
//! `experts` lists `[expert, hot slots, cold slots]` for every expert routed in that call and
//! layer, in expert order. The tracer reads the counts off the engine's [`PerfState`] (the
//! difference over the call), so it sees what every engine records and costs nothing when no
//! trace is asked for (no tracer, no snapshot); it needs a perf mode that counts (`full` or
//! `update`). Lines go through a buffered writer, flushed once per call.

use crate::cache::observe::{ExpertObservation, LayerObservation, Observations, ObserveError};
use crate::cache::perf::{ModelFingerprint, PerfMode, PerfState};
use crate::forward::Phase;
use crate::output::{AtomicFile, OutputError};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

/// The header's `trace` value.
pub const TRACE_KIND: &str = "moe-lanes-expert-usage";
/// The format version this build writes and reads.
pub const TRACE_VERSION: u32 = 1;

#[derive(Serialize, Deserialize)]
struct TraceHeader {
    trace: String,
    version: u32,
    model: ModelFingerprint,
}

/// One line of a trace: one layer of one forward call.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TraceRecord {
    pub call: u64,
    pub phase: String,
    pub tokens: usize,
    pub layer: usize,
    pub hot_slots: u64,
    pub cold_slots: u64,
    /// `[expert, hot slots, cold slots]` per routed expert.
    pub experts: Vec<[u64; 3]>,
}

/// Writing or reading a trace failed.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("the expert trace reads the perf state's counts: it needs the gpu or pipeline engine in perf mode full or update")]
    NoCounts,
    #[error("{path}: line 1 is not a moe-lanes expert trace header ({TRACE_KIND}, version {TRACE_VERSION})")]
    Header { path: PathBuf },
    #[error("{path}:{line}: {source}")]
    Line { path: PathBuf, line: usize, source: serde_json::Error },
    #[error("{path}:{line}: {what} {value} is out of range (the model has {limit})")]
    OutOfRange { path: PathBuf, line: usize, what: &'static str, value: u64, limit: usize },
    #[error(transparent)]
    Observe(#[from] ObserveError),
}

/// Records the routed experts of every call into a trace file (or any writer).
pub struct ExpertTracer<W: Write = TraceFile> {
    out: W,
    path: PathBuf,
    /// Per layer and expert, the (hot, cold) counts before the current call.
    before: Vec<[u64; 2]>,
    n_experts: usize,
    calls: u64,
    line: String,
}

impl ExpertTracer<TraceFile> {
    /// Write `path` (under a temporary name, renamed into place when the tracer is dropped; check
    /// it first with [`crate::output::check_output`]) and its header for `model`.
    pub fn create(path: &Path, model: &ModelFingerprint) -> Result<Self, TraceError> {
        let file = AtomicFile::create(path).map_err(|e| match e {
            OutputError::Io { source, .. } => TraceError::Io { path: path.into(), source },
            refused => {
                TraceError::Io { path: path.into(), source: std::io::Error::other(refused.to_string()) }
            }
        })?;
        let out = TraceFile { out: Some(BufWriter::with_capacity(1 << 16, file)) };
        ExpertTracer::new(out, path, model)
    }
}

/// A trace being written: every call's lines are flushed to a temporary file, which is renamed to
/// the trace's path when the tracer is dropped (a failed run keeps the calls it completed).
pub struct TraceFile {
    out: Option<BufWriter<AtomicFile>>,
}

impl Write for TraceFile {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.out.as_mut().expect("open until dropped").write(buf)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.out.as_mut().expect("open until dropped").flush()
    }
}

impl Drop for TraceFile {
    fn drop(&mut self) {
        // An error here has no caller to go to; the temporary file is removed either way.
        if let Some(Ok(file)) = self.out.take().map(BufWriter::into_inner) {
            let _ = file.commit();
        }
    }
}

impl<W: Write> ExpertTracer<W> {
    /// A tracer writing to `out` (`path` names it in errors); writes the header.
    pub fn new(mut out: W, path: &Path, model: &ModelFingerprint) -> Result<Self, TraceError> {
        let header = TraceHeader { trace: TRACE_KIND.into(), version: TRACE_VERSION, model: model.clone() };
        let text = serde_json::to_string(&header).expect("a header serializes");
        writeln!(out, "{text}").map_err(|source| TraceError::Io { path: path.into(), source })?;
        let n_experts = model.n_experts;
        let before = vec![[0; 2]; model.n_layers * n_experts];
        Ok(ExpertTracer { out, path: path.into(), before, n_experts, calls: 0, line: String::new() })
    }

    /// Take the counts before a call (`perf`: the engine's; `None` or perf mode `off` count
    /// nothing, which is an error).
    pub fn before_call(&mut self, perf: Option<&PerfState>) -> Result<(), TraceError> {
        let perf = perf.filter(|p| p.mode() != PerfMode::Off).ok_or(TraceError::NoCounts)?;
        for (l, layer) in perf.report().layers.iter().enumerate() {
            for e in 0..self.n_experts.min(layer.hot_experts.len()) {
                self.before[l * self.n_experts + e] = [layer.hot_experts[e], layer.cold_experts[e]];
            }
        }
        Ok(())
    }

    /// Write one line per layer for the call just made (`phase`, `n_tokens`), then flush.
    pub fn after_call(
        &mut self,
        perf: Option<&PerfState>,
        phase: Phase,
        n_tokens: usize,
    ) -> Result<(), TraceError> {
        let perf = perf.ok_or(TraceError::NoCounts)?;
        for (l, layer) in perf.report().layers.iter().enumerate() {
            let mut rec = TraceRecord {
                call: self.calls,
                phase: phase.name().into(),
                tokens: n_tokens,
                layer: l,
                hot_slots: 0,
                cold_slots: 0,
                experts: Vec::new(),
            };
            for e in 0..self.n_experts.min(layer.hot_experts.len()) {
                let [hot0, cold0] = self.before[l * self.n_experts + e];
                let hot = layer.hot_experts[e].saturating_sub(hot0);
                let cold = layer.cold_experts[e].saturating_sub(cold0);
                if hot + cold > 0 {
                    rec.experts.push([e as u64, hot, cold]);
                    (rec.hot_slots, rec.cold_slots) = (rec.hot_slots + hot, rec.cold_slots + cold);
                }
            }
            self.line.clear();
            self.line.push_str(&serde_json::to_string(&rec).expect("a record serializes"));
            self.line.push('\n');
            self.out.write_all(self.line.as_bytes()).map_err(|source| self.io(source))?;
        }
        self.calls += 1;
        self.out.flush().map_err(|source| self.io(source))
    }

    fn io(&self, source: std::io::Error) -> TraceError {
        TraceError::Io { path: self.path.clone(), source }
    }
}

/// Whether `text` starts with a trace header (else it is a learn file or perf JSON).
pub fn is_trace(text: &str) -> bool {
    let first = text.lines().next().unwrap_or("");
    serde_json::from_str::<serde_json::Value>(first).is_ok_and(|v| v.get("trace").is_some())
}

/// A trace's records in file order, each checked against `model` (layer and expert ids in range;
/// the header's fingerprint `model`'s), with the header's fingerprint. `source` names the trace
/// in errors; a bad line is an error naming it by number (1-based).
pub fn trace_records(
    source: &Path,
    text: &str,
    model: &ModelFingerprint,
) -> Result<(ModelFingerprint, Vec<TraceRecord>), TraceError> {
    let mut lines = text.lines().enumerate();
    let header = lines.next().and_then(|(_, l)| serde_json::from_str::<TraceHeader>(l).ok());
    let header = header.filter(|h| h.trace == TRACE_KIND && h.version == TRACE_VERSION);
    let header = header.ok_or_else(|| TraceError::Header { path: source.into() })?;
    crate::cache::observe::check_fingerprint(source, model, &header.model)?;
    let (n_layers, n_experts) = (model.n_layers, model.n_experts);
    let mut records = Vec::new();
    for (i, text) in lines.filter(|(_, l)| !l.trim().is_empty()) {
        let line = i + 1;
        let rec: TraceRecord = serde_json::from_str(text).map_err(|source_err| TraceError::Line {
            path: source.into(),
            line,
            source: source_err,
        })?;
        let range = |what, value: u64, limit| TraceError::OutOfRange {
            path: source.into(),
            line,
            what,
            value,
            limit,
        };
        if rec.layer >= n_layers {
            return Err(range("layer", rec.layer as u64, n_layers));
        }
        if let Some(&[e, _, _]) = rec.experts.iter().find(|x| x[0] >= n_experts as u64) {
            return Err(range("expert", e, n_experts));
        }
        records.push(rec);
    }
    Ok((header.model, records))
}

/// A trace's counts as learn counts for `model`: per layer and expert the hot and cold slots
/// summed over every call (branch counts, no timings). `source` names the trace in errors; a
/// bad line is an error naming it by number (1-based).
pub fn parse_trace(source: &Path, text: &str, model: &ModelFingerprint) -> Result<Observations, TraceError> {
    let (header, records) = trace_records(source, text, model)?;
    let (n_layers, n_experts) = (model.n_layers, model.n_experts);
    let mut counts = vec![vec![[0u64; 2]; n_experts]; n_layers];
    let mut calls = vec![0u64; n_layers];
    for rec in &records {
        calls[rec.layer] += 1;
        for &[e, hot, cold] in &rec.experts {
            let c = &mut counts[rec.layer][e as usize];
            (c[0], c[1]) = (c[0] + hot, c[1] + cold);
        }
    }
    let layers = counts
        .iter()
        .enumerate()
        .map(|(layer, experts)| LayerObservation {
            layer,
            experts: experts
                .iter()
                .enumerate()
                .map(|(expert, &[hot, cold])| ExpertObservation { expert, hot, cold, raw: hot + cold })
                .collect(),
            has_branch_counts: true,
            calls: calls[layer],
            ..LayerObservation::default()
        })
        .collect();
    Ok(Observations {
        model: Some(header),
        n_experts,
        n_experts_used: model.n_experts_used,
        layers,
        phases: BTreeMap::new(),
    })
}

/// Read a learn file, a perf JSON or an expert trace (told apart by the trace header) as
/// observations for `model`.
pub fn read_learn_or_trace(path: &Path, model: &ModelFingerprint) -> Result<Observations, TraceError> {
    let text =
        std::fs::read_to_string(path).map_err(|source| TraceError::Io { path: path.into(), source })?;
    if is_trace(&text) {
        parse_trace(path, &text, model)
    } else {
        Ok(crate::cache::observe::parse_observations(path, &text, model)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fingerprint() -> ModelFingerprint {
        ModelFingerprint {
            architecture: "qwen3_moe".into(),
            n_layers: 2,
            n_experts: 4,
            n_experts_used: 2,
            expert_shape: [8, 4],
        }
    }

    #[test]
    fn records_the_difference_over_each_call_and_replays_it() {
        let fp = fingerprint();
        let mut perf = PerfState::new(PerfMode::Full, 2, 4, 2);
        let mut tracer = ExpertTracer::new(Vec::new(), Path::new("mem"), &fp).unwrap();
        perf.record_slot(0, 1, true); // before the traced calls: not in the trace
        tracer.before_call(Some(&perf)).unwrap();
        perf.record_slot(0, 1, true);
        perf.record_slot(0, 3, false);
        perf.record_slot(1, 2, false);
        tracer.after_call(Some(&perf), Phase::Prefill, 1).unwrap();
        tracer.before_call(Some(&perf)).unwrap();
        perf.record_slot(1, 2, true);
        tracer.after_call(Some(&perf), Phase::Decode, 1).unwrap();
        let text = String::from_utf8(tracer.out.clone()).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 5, "{text}");
        assert!(is_trace(&text));
        let rec: TraceRecord = serde_json::from_str(lines[1]).unwrap();
        assert_eq!(rec.experts, vec![[1, 1, 0], [3, 0, 1]]);
        assert_eq!((rec.hot_slots, rec.cold_slots, rec.phase.as_str()), (1, 1, "prefill"));
        let rec: TraceRecord = serde_json::from_str(lines[4]).unwrap();
        assert_eq!((rec.call, rec.layer, rec.experts.clone()), (1, 1, vec![[2, 1, 0]]));
        let obs = parse_trace(Path::new("mem"), &text, &fp).unwrap();
        assert_eq!(obs.counts(), vec![vec![0, 1, 0, 1], vec![0, 0, 2, 0]]);
        assert_eq!(obs.layers[1].experts[2], ExpertObservation { expert: 2, hot: 1, cold: 1, raw: 2 });
    }

    #[test]
    fn bad_lines_name_the_file_and_line() {
        let fp = fingerprint();
        let mut tracer = ExpertTracer::new(Vec::new(), Path::new("t.jsonl"), &fp).unwrap();
        let perf = PerfState::new(PerfMode::Full, 2, 4, 2);
        tracer.before_call(Some(&perf)).unwrap();
        tracer.after_call(Some(&perf), Phase::Prefill, 3).unwrap();
        let good = String::from_utf8(tracer.out).unwrap();
        let p = Path::new("t.jsonl");
        let err = parse_trace(p, &format!("{good}{{\"call\": oops}}\n"), &fp).unwrap_err();
        assert!(err.to_string().starts_with("t.jsonl:4: "), "{err}");
        let bad_expert = r#"{"call":1,"phase":"decode","tokens":1,"layer":0,"hot_slots":0,"cold_slots":1,"experts":[[9,0,1]]}"#;
        let err = parse_trace(p, &format!("{good}{bad_expert}\n"), &fp).unwrap_err();
        assert_eq!(err.to_string(), "t.jsonl:4: expert 9 is out of range (the model has 4)");
        let err = parse_trace(p, "{\"layers\": []}\n", &fp).unwrap_err();
        assert!(matches!(err, TraceError::Header { .. }), "{err}");
        let other = ModelFingerprint { n_experts: 8, ..fp.clone() };
        assert!(matches!(parse_trace(p, &good, &other), Err(TraceError::Observe(_))));
        let mut off = PerfState::new(PerfMode::Off, 2, 4, 2);
        off.set_mode(PerfMode::Off);
        assert!(matches!(tracer_for(&fp).before_call(Some(&off)), Err(TraceError::NoCounts)));
        assert!(matches!(tracer_for(&fp).before_call(None), Err(TraceError::NoCounts)));
    }

    fn tracer_for(fp: &ModelFingerprint) -> ExpertTracer<Vec<u8>> {
        ExpertTracer::new(Vec::new(), Path::new("mem"), fp).unwrap()
    }
}
