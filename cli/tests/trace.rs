//! The expert usage tracer through the real binary: `--trace FILE` on a model-running command
//! writes one JSON line per forward call and layer (the header first), tracing changes no
//! output, and `plan --trace` / `--learn TRACE` replay it as learn counts; a bad line is an
//! error naming the file and the line. And `scripts/policy-compare.sh`, the policies' tg side
//! by side, on the CPU pipeline.

mod bin;

use bin::{failure, moe_lanes, ok_stdout, p};
use serde_json::Value;

const LAYERS: usize = 2;
const EXPERTS: u64 = 16;

/// A synthetic model of [`LAYERS`] layers and [`EXPERTS`] experts with `top_k` and the routing
/// `skew`.
fn synth_skewed(model: &std::path::Path, top_k: usize, skew: &str) {
    let (layers, experts, k) = (LAYERS.to_string(), EXPERTS.to_string(), top_k.to_string());
    ok_stdout(&[
        "synth",
        "--out",
        p(model),
        "--layers",
        &layers,
        "--experts",
        &experts,
        "--top-k",
        &k,
        "--skew",
        skew,
    ]);
}

fn lines(path: &std::path::Path) -> Vec<Value> {
    let text = std::fs::read_to_string(path).unwrap();
    text.lines().map(|l| serde_json::from_str(l).unwrap()).collect()
}

#[test]
fn trace_records_every_call_and_layer_and_replays_as_learn_counts() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("m.gguf");
    let layers = LAYERS.to_string();
    ok_stdout(&["synth", "--out", p(&model), "--layers", &layers, "--experts", "16", "--top-k", "4"]);
    let trace = dir.path().join("t.jsonl");
    let gen = ["generate", "--model", p(&model), "--tokens", "1,2,3,4,5", "--max-new-tokens", "4"];
    let engine = ["--engine", "pipeline", "--hot-fraction", "0.5"];
    let plain = ok_stdout(&[&gen[..], &engine[..]].concat());
    let traced = ok_stdout(&[&gen[..], &engine[..], &["--trace", p(&trace)][..]].concat());
    assert_eq!(traced, plain, "tracing changes no output");
    let rec = lines(&trace);
    assert_eq!(rec[0]["trace"], "moe-lanes-expert-usage");
    assert_eq!(rec[0]["model"]["n_experts"], EXPERTS);
    // one prefill call of 5 tokens, then 3 decode calls of 1 (the 4th token needs no call)
    let calls: Vec<(&str, u64)> = vec![("prefill", 5), ("decode", 1), ("decode", 1), ("decode", 1)];
    assert_eq!(rec.len(), 1 + calls.len() * LAYERS, "header + one line per call and layer");
    let (mut hot, mut cold) = (0, 0);
    for (i, r) in rec[1..].iter().enumerate() {
        let (phase, tokens) = calls[i / LAYERS];
        assert_eq!(
            (r["call"].as_u64().unwrap() as usize, r["layer"].as_u64().unwrap() as usize),
            (i / LAYERS, i % LAYERS)
        );
        assert_eq!((r["phase"].as_str().unwrap(), r["tokens"].as_u64().unwrap()), (phase, tokens), "{r}");
        let experts = r["experts"].as_array().unwrap();
        let sum = |j: usize| experts.iter().map(|e| e[j].as_u64().unwrap()).sum::<u64>();
        assert_eq!((sum(1), sum(2)), (r["hot_slots"].as_u64().unwrap(), r["cold_slots"].as_u64().unwrap()));
        assert_eq!(sum(1) + sum(2), tokens * 4, "every token routes to top-k 4 experts: {r}");
        assert!(
            experts
                .iter()
                .all(|e| e[0].as_u64().unwrap() < EXPERTS
                    && e[1].as_u64().unwrap() + e[2].as_u64().unwrap() > 0)
        );
        (hot, cold) = (hot + sum(1), cold + sum(2));
    }
    assert!(hot > 0 && cold > 0, "half the experts hot: both lanes served slots");

    // Replay: plan from the trace equals plan from --learn TRACE; bench takes it as --learn.
    let plan = ["plan", "--model", p(&model), "--hot-budget-mib", "1", "--json"];
    let from_trace = ok_stdout(&[&plan[..], &["--trace", p(&trace)][..]].concat());
    let from_learn = ok_stdout(&[&plan[..], &["--learn", p(&trace)][..]].concat());
    assert_eq!(from_trace, from_learn);
    let v: Value = serde_json::from_str(&from_trace).unwrap();
    // The trace's counts rank each layer's experts: the plan lists them by count, most used first.
    let mut counts = vec![vec![0u64; EXPERTS as usize]; LAYERS];
    for r in &rec[1..] {
        for e in r["experts"].as_array().unwrap() {
            let c = &mut counts[r["layer"].as_u64().unwrap() as usize][e[0].as_u64().unwrap() as usize];
            *c += e[1].as_u64().unwrap() + e[2].as_u64().unwrap();
        }
    }
    for (l, layer) in v["layers"].as_array().unwrap().iter().enumerate() {
        let order: Vec<u64> = layer["experts"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| counts[l][e.as_u64().unwrap() as usize])
            .collect();
        assert!(
            order.windows(2).all(|w| w[0] >= w[1]),
            "layer {l}: plan order by the trace's counts: {order:?}"
        );
        assert_eq!(order[0], *counts[l].iter().max().unwrap());
    }
    let bench = [
        "bench",
        "--model",
        p(&model),
        "-p",
        "8",
        "-n",
        "2",
        "--runs",
        "1",
        "--json",
        "--engine",
        "pipeline",
        "--hot-budget-mib",
        "1",
        "--learn",
        p(&trace),
    ];
    let b: Value = serde_json::from_str(&ok_stdout(&bench)).unwrap();
    assert_eq!(b["learn_source"], "learn file");
    let both = moe_lanes(&[&plan[..], &["--trace", p(&trace), "--learn", p(&trace)][..]].concat());
    let err = String::from_utf8_lossy(&both.stderr);
    assert!(!both.status.success() && err.contains("--trace") && err.contains("--learn"), "{err}");
}

#[test]
fn a_bad_trace_line_is_an_error_naming_the_file_and_line() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("m.gguf");
    let layers = LAYERS.to_string();
    ok_stdout(&["synth", "--out", p(&model), "--layers", &layers, "--experts", "16", "--top-k", "4"]);
    let trace = dir.path().join("bad.jsonl");
    ok_stdout(&[
        "logits",
        "--model",
        p(&model),
        "--tokens",
        "1,2",
        "--engine",
        "pipeline",
        "--trace",
        p(&trace),
    ]);
    let mut text = std::fs::read_to_string(&trace).unwrap();
    text.push_str("{\"call\": 1, \"phase\": \"decode\", \"layer\": \"two\"}\n");
    std::fs::write(&trace, text).unwrap();
    let err = failure(&["plan", "--model", p(&model), "--trace", p(&trace), "--hot-budget-mib", "1"]);
    assert!(err.contains(&format!("{}:{}:", trace.display(), 2 + LAYERS)), "{err}");
    // another model's trace is refused by its fingerprint
    let other = dir.path().join("o.gguf");
    ok_stdout(&["synth", "--out", p(&other), "--layers", &layers, "--experts", "8", "--top-k", "4"]);
    let err = failure(&["plan", "--model", p(&other), "--learn", p(&trace), "--hot-budget-mib", "1"]);
    assert!(err.contains("another model") && err.contains("n_experts"), "{err}");
    // the oracle keeps no counts: --trace is refused before any work
    let err = failure(&[
        "logits",
        "--model",
        p(&model),
        "--tokens",
        "1",
        "--engine",
        "reference",
        "--trace",
        p(&trace),
        "--force",
    ]);
    assert!(err.contains("--trace") && err.contains("reference"), "{err}");
}

/// The trace's text, as written (a snapshot): the header, then per call and layer one line.
#[test]
fn trace_text_snapshot() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("m.gguf");
    let layers = LAYERS.to_string();
    ok_stdout(&["synth", "--out", p(&model), "--layers", &layers, "--experts", "16", "--top-k", "4"]);
    let trace = dir.path().join("t.jsonl");
    let run = ["logits", "--model", p(&model), "--tokens", "1,2,3", "--engine", "pipeline"];
    ok_stdout(&[&run[..], &["--hot-fraction", "0.5", "--trace", p(&trace)][..]].concat());
    insta::assert_snapshot!("trace_logits", std::fs::read_to_string(&trace).unwrap());
}

/// `bench --scenario locality:...` on a `synth --skew locality:...` model, traced, then
/// `plan --trace --policies`: every policy's replayed hit rate at 25% and 50% of the experts,
/// none above Belady's, the online policies above the static cache (the workload re-picks).
#[test]
fn policies_replay_a_locality_trace_against_belady() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("loc.gguf");
    let spec = "locality:p=0.9,drift=0.01,topics=8";
    synth_skewed(&model, 2, spec);
    let trace = dir.path().join("t.jsonl");
    let bench =
        ["bench", "--model", p(&model), "--engine", "pipeline", "-p", "8", "-n", "300", "--runs", "1"];
    let out = ok_stdout(
        &[
            &bench[..],
            &["--scenario", spec, "--hot-fraction", "0.25", "--cache-policy", "adaptive"],
            &["--trace", p(&trace), "--json"],
        ]
        .concat(),
    );
    let report: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(report["tg_feed"], "locality");
    assert!(report["cache_exchanges"].as_u64().unwrap() > 0, "the adaptive policy moved the cache: {report}");
    // `plan --trace T --policies` with `more` flags, as JSON reports; a report's row of a policy
    let plan = |more: &[&str]| -> Vec<Value> {
        let head = ["plan", "--model", p(&model), "--trace", p(&trace), "--policies", "--json"];
        serde_json::from_str(&ok_stdout(&[&head[..], more].concat())).unwrap()
    };
    let row = |r: &Value, name: &str| -> Value {
        r["rows"].as_array().unwrap().iter().find(|x| x["policy"] == name).unwrap().clone()
    };
    let reports = plan(&["--policy-fractions", "0.25,0.5"]);
    assert_eq!(reports.len(), 2);
    for r in &reports {
        let rate = |name: &str| row(r, name)["hit_rate"].as_f64().unwrap();
        let belady = rate("belady");
        for name in ["static", "online", "lru", "lfu", "tinylfu", "adaptive", "reuse"] {
            assert!(rate(name) <= belady + 1e-12, "{name} above Belady in {r}");
        }
        assert!(rate("adaptive") > rate("static"), "{r}");
        assert!(rate("reuse") > rate("static"), "{r}");
        assert!(rate("lru") > rate("static"), "{r}");
    }
    // --policy-lag 0 (the default, as the engines): the exchanges serve from the next call; LRU
    // gains over the lag of 1
    let hits = |lag: &str| {
        let r = plan(&["--policy-fractions", "0.25", "--policy-lag", lag]);
        row(&r[0], "lru")["hits"].as_u64().unwrap()
    };
    assert!(hits("0") > hits("1"), "LRU serves its admissions a call sooner without the lag");
    assert_eq!(hits("0"), row(&reports[0], "lru")["hits"]);
    let err = failure(&[
        "plan",
        "--model",
        p(&model),
        "--trace",
        p(&trace),
        "--policies",
        "--policy-fractions",
        "1.5",
    ]);
    assert!(err.contains("--policy-fractions") && err.contains("1.5"), "{err}");
}

/// `scripts/policy-compare.sh` through the real binary on the CPU pipeline: with `ROUNDS` the
/// policies take turns (static, reuse, reuse-base, reuse-lagged, static, ...), a `-base` policy
/// runs `BASE_BIN`, a `-lagged` one `lag_steps` 1 (`-inline`: 0), `LABEL=FILE` the engine
/// configuration FILE, every round's bench is logged,
/// and the table has one row per fraction and policy with the rounds' median and spread.
#[test]
fn policy_compare_takes_the_policies_in_turns_and_tables_every_cell() {
    let has = |tool: &str| std::process::Command::new(tool).arg("--version").output().is_ok();
    if !has("bash") || !has("python3") {
        eprintln!("SKIP: bash or python3 not found");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("m.gguf");
    synth_skewed(&model, 4, "skewed");
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../scripts/policy-compare.sh");
    // BASE_BIN: another build (here the same one behind a wrapper that logs each run)
    let base = dir.path().join("base.sh");
    let base_log = dir.path().join("base.log");
    let wrapper = format!(
        "#!/bin/bash\necho run >> '{}'\nexec '{}' \"$@\"\n",
        p(&base_log),
        env!("CARGO_BIN_EXE_moe-lanes")
    );
    std::fs::write(&base, wrapper).unwrap();
    std::process::Command::new("chmod").arg("+x").arg(&base).status().unwrap();
    // LABEL=FILE: any engine configuration, named LABEL
    let counted = dir.path().join("counted.json");
    std::fs::write(&counted, r#"{"cache_policy": {"copy_cost": {"pcie_overlapped": false}}}"#).unwrap();
    let policies = format!("static reuse reuse-base reuse-lagged counted={}", p(&counted));
    let out = std::process::Command::new("bash")
        .arg(script)
        .arg(env!("CARGO_BIN_EXE_moe-lanes"))
        .envs([
            ("MODEL", p(&model)),
            ("SPEC", "skewed"),
            ("ROUNDS", "2"),
            ("RUNS", "1"),
            ("P", "8"),
            ("N", "16"),
            ("FRACTIONS", "0.5"),
            ("POLICIES", policies.as_str()),
            ("BASE_BIN", p(&base)),
            ("EXTRA_ARGS", "--engine pipeline"),
            ("OUT", p(dir.path())),
        ])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}{}", String::from_utf8_lossy(&out.stderr));
    let runs = std::fs::read_to_string(dir.path().join("policy-compare/runs.tsv")).unwrap();
    let order: Vec<&str> = runs.lines().map(|l| l.split('\t').next().unwrap()).collect();
    let names = ["static", "reuse", "reuse-base", "reuse-lagged", "counted"];
    assert_eq!(order, [names, names].concat(), "{runs}");
    let lagged = std::fs::read_to_string(dir.path().join("policy-compare/reuse-lagged.json")).unwrap();
    assert!(lagged.contains(r#""kind": "reuse", "lag_steps": 1"#), "{lagged}");
    let base_runs = std::fs::read_to_string(&base_log).unwrap();
    assert_eq!(base_runs.lines().count(), 2, "BASE_BIN ran the -base policy once a round");
    for l in runs.lines() {
        let median = l.split('\t').nth(2).and_then(|c| c.split(' ').next()).unwrap();
        assert!(median.parse::<f64>().is_ok_and(|v| v > 0.0), "a tg in every round: {l}");
    }
    for pol in names {
        let row = text
            .lines()
            .find(|l| l.starts_with(&format!("| 0.5 | {pol} | ")))
            .unwrap_or_else(|| panic!("{text}"));
        let cells: Vec<&str> = row.split('|').map(str::trim).collect();
        assert!(cells[3].parse::<f64>().is_ok(), "{row}");
        assert!(cells[4].starts_with('[') && cells[4].ends_with(']'), "{row}");
    }
}
