//! Helpers shared by integration tests: synthetic models in temp dirs, GGUF rewriting for
//! corruption tests, and fixture discovery.
#![allow(dead_code)]

pub mod llama_layout;

use moe_lanes::arch::{self as adapter, Adapter};
use moe_lanes::dtype::DType;
use moe_lanes::gguf::{GgufFile, GgufWriter, MetaValue};
use moe_lanes::synth::{write_synthetic, DimOverrides, Preset, Skew, SynthFormat, SynthOptions};
use std::path::{Path, PathBuf};

pub const ARCHS: [&str; 4] = ["qwen3_moe", "mixtral", "olmoe", "qwen2_moe"];

pub fn adapter(name: &str) -> &'static Adapter {
    adapter::by_name(name).unwrap()
}

pub fn synth_options(arch: &str, format: SynthFormat, out: PathBuf, seed: u64) -> SynthOptions {
    SynthOptions {
        adapter: adapter(arch),
        preset: Preset::Tiny,
        dims: DimOverrides::default(),
        dtype: DType::BF16,
        seed,
        skew: Skew::Skewed,
        format,
        out,
        vocab_from: None,
    }
}

/// Write a tiny synthetic model and return its path.
pub fn synth_tiny(dir: &Path, arch: &str, format: SynthFormat, seed: u64) -> PathBuf {
    let name = match format {
        SynthFormat::Gguf => format!("{arch}-{seed}.gguf"),
        SynthFormat::Safetensors => format!("{arch}-{seed}-st"),
    };
    let opts = synth_options(arch, format, dir.join(name), seed);
    write_synthetic(&opts, &mut |_, _| {}).unwrap();
    opts.out
}

/// How `rewrite_gguf` treats one tensor.
#[derive(Clone)]
pub enum TensorEdit {
    Keep,
    Drop,
    Replace { dtype: DType, shape: Vec<usize> },
}

/// Copy a GGUF file, editing metadata and tensors; replaced tensors are zero-filled.
pub fn rewrite_gguf(
    src: &Path,
    dst: &Path,
    edit_meta: impl Fn(&str, &MetaValue) -> Option<MetaValue>,
    edit_tensor: impl Fn(&str) -> TensorEdit,
) {
    let file = GgufFile::open(src).unwrap();
    let mut w = GgufWriter::new();
    for (key, value) in file.metadata() {
        if let Some(v) = edit_meta(key, value) {
            w.add_metadata(key.clone(), v);
        }
    }
    let mut sources: Vec<Option<String>> = Vec::new();
    for info in file.tensor_infos() {
        match edit_tensor(&info.name) {
            TensorEdit::Keep => {
                w.add_tensor(info.name.clone(), info.dtype, &info.shape);
                sources.push(Some(info.name.clone()));
            }
            TensorEdit::Drop => {}
            TensorEdit::Replace { dtype, shape } => {
                w.add_tensor(info.name.clone(), dtype, &shape);
                sources.push(None);
            }
        }
    }
    let specs: Vec<(DType, Vec<usize>)> = file
        .tensor_infos()
        .iter()
        .filter_map(|i| match edit_tensor(&i.name) {
            TensorEdit::Keep => Some((i.dtype, i.shape.clone())),
            TensorEdit::Drop => None,
            TensorEdit::Replace { dtype, shape } => Some((dtype, shape)),
        })
        .collect();
    w.write(
        dst,
        &mut |idx, out| match &sources[idx] {
            Some(name) => out.write_all(file.tensor(name).unwrap().data),
            None => {
                let (dtype, shape) = &specs[idx];
                out.write_all(&vec![0u8; dtype.bytes_for(shape.iter().product()).unwrap()])
            }
        },
        &mut |_| {},
    )
    .unwrap();
}

/// Where the golden fixtures are: `MOE_LANES_FIXTURES` (the GPU machine's staged copy) or
/// `tests/fixtures`.
pub fn fixtures_root() -> PathBuf {
    std::env::var_os("MOE_LANES_FIXTURES")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo_root().join("tests/fixtures"))
}

/// The names of the committed golden fixtures, sorted.
pub fn fixture_names() -> Vec<String> {
    fixture_dirs().iter().map(|d| d.file_name().unwrap().to_string_lossy().into_owned()).collect()
}

/// The committed golden fixtures (directory per fixture).
pub fn fixture_dirs() -> Vec<PathBuf> {
    let root = fixtures_root();
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(&root)
        .unwrap_or_else(|e| panic!("fixtures at {}: {e}", root.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.join("golden.json").exists())
        .collect();
    dirs.sort();
    assert!(dirs.len() >= 8, "expected the 8 committed fixtures in {}", root.display());
    dirs
}

/// max |a - b| / max |b| over all rows.
pub fn max_rel_err(ours: &[Vec<f32>], theirs: &[Vec<f32>]) -> f32 {
    assert_eq!(ours.len(), theirs.len(), "row count");
    let mut worst = 0.0f32;
    for (a, b) in ours.iter().zip(theirs) {
        assert_eq!(a.len(), b.len(), "row length");
        let scale = b.iter().fold(0.0f32, |m, v| m.max(v.abs())).max(1e-12);
        let diff = a.iter().zip(b).fold(0.0f32, |m, (x, y)| m.max((x - y).abs()));
        worst = worst.max(diff / scale);
    }
    worst
}

/// The repository root: the manifest dir of the root package, or the parent of `cli/`.
pub fn repo_root() -> PathBuf {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    if manifest.join("tests/fixtures").is_dir() {
        manifest.to_path_buf()
    } else {
        manifest.parent().expect("cli/ has a parent").to_path_buf()
    }
}

/// The real tokenizer data the tests use (vocabulary GGUFs, llama.cpp's test vectors, chat
/// templates): `tests/fixtures/tokenizers`, a copy of the design repository's `tokenizers/` with
/// its licence, inside this repository so a clone on its own passes its tests.
pub fn tokenizers() -> PathBuf {
    let dir = repo_root().join("tests/fixtures/tokenizers");
    assert!(
        dir.join("ggml-vocab-qwen2.gguf").is_file(),
        "{}: the tokenizer fixtures are missing",
        dir.display()
    );
    dir
}

/// llama.cpp's tokenizer test vectors for `<name>.gguf`: (input text, expected ids) pairs.
pub fn vocab_test_vectors(name: &str) -> Vec<(String, Vec<u32>)> {
    let dir = tokenizers();
    let inp = std::fs::read_to_string(dir.join(format!("{name}.gguf.inp"))).unwrap();
    let out = std::fs::read_to_string(dir.join(format!("{name}.gguf.out"))).unwrap();
    let mut inputs: Vec<&str> = inp.split("\n__ggml_vocab_test__\n").collect();
    if inputs.last() == Some(&"") {
        inputs.pop();
    }
    let expected: Vec<Vec<u32>> =
        out.lines().map(|l| l.split_whitespace().map(|t| t.parse().unwrap()).collect()).collect();
    assert_eq!(inputs.len(), expected.len(), "{name}: inputs and expected lines differ in count");
    inputs.into_iter().map(str::to_owned).zip(expected).collect()
}

/// Whether a CUDA device is usable: false (with a "SKIP" line) without one, a panic instead when
/// `MOE_LANES_REQUIRE_GPU` is set (the GPU machine, where a skip would hide a failure). Opened
/// as the engines open it (`env::cuda_config`: the cubin cache of `MOE_LANES_NVRTC_CACHE`).
pub fn gpu_usable() -> bool {
    let opened = moe_lanes::env::cuda_config()
        .map_err(|e| e.to_string())
        .and_then(|c| moe_lanes::gpu::CudaBackend::with_config(&c).map_err(|e| e.to_string()));
    match opened {
        Ok(_) => true,
        Err(e) => {
            if std::env::var_os("MOE_LANES_REQUIRE_GPU").is_some() {
                panic!("MOE_LANES_REQUIRE_GPU is set but CUDA is not usable: {e}");
            }
            eprintln!("SKIP: no CUDA device: {e}");
            announce_gpu_skip(&e.to_string());
            false
        }
    }
}

/// Once per test binary, a "GPU tests skipped" line that plain `cargo test` shows: written to
/// the process's stderr directly, which the test harness does not capture (it captures only
/// `eprintln!`), so a green run never hides that the GPU tests passed without running.
pub fn announce_gpu_skip(why: &str) {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        use std::io::Write;
        let exe = std::env::current_exe().ok();
        let name = exe.as_deref().and_then(|p| p.file_stem()).map(|s| s.to_string_lossy().into_owned());
        let name = name.map(|n| n.rsplit_once('-').map_or(n.clone(), |(b, _)| b.to_string())).unwrap_or_default();
        let line = format!(
            "GPU tests skipped ({name}): no CUDA device: {why}; they pass without running (MOE_LANES_REQUIRE_GPU=1 fails them instead)\n"
        );
        let _ = std::io::stderr().lock().write_all(line.as_bytes());
    });
}

/// How [`rebuild_gguf`] writes one tensor of its source.
pub enum Rebuilt {
    Keep,
    Drop,
    /// Its decoded values rounded to bf16 (the weights the GPU engine holds for a float matrix,
    /// or for a latent layer's `k_b` / `v_b` of any type).
    Bf16,
}

/// A tensor [`rebuild_gguf`] adds: name, shape (outermost first) and values, written as bf16.
pub type NewTensor = (String, Vec<usize>, Vec<f32>);

/// Copy a GGUF file with its contents: metadata through `edit_meta` (None drops a key), each
/// tensor kept, dropped or rounded to bf16 by `edit`, then `extra` tensors.
pub fn rebuild_gguf(
    src: &Path,
    dst: &Path,
    edit_meta: impl Fn(&str, &MetaValue) -> Option<MetaValue>,
    edit: impl Fn(&moe_lanes::gguf::GgufTensorInfo) -> Rebuilt,
    extra: Vec<NewTensor>,
) {
    let file = GgufFile::open(src).unwrap();
    let mut w = GgufWriter::new();
    for (key, value) in file.metadata() {
        if let Some(v) = edit_meta(key, value) {
            w.add_metadata(key.clone(), v);
        }
    }
    // round to nearest even (no NaN in a model's weights)
    let bf16 = |v: &[f32]| -> Vec<u8> {
        let round = |b: u32| ((b + 0x7fff + ((b >> 16) & 1)) >> 16) as u16;
        v.iter().flat_map(|x| round(x.to_bits()).to_le_bytes()).collect()
    };
    let mut data: Vec<Vec<u8>> = Vec::new();
    for info in file.tensor_infos() {
        let t = file.tensor(&info.name).unwrap();
        match edit(info) {
            Rebuilt::Keep => {
                w.add_tensor(info.name.clone(), info.dtype, &info.shape);
                data.push(t.data.to_vec());
            }
            Rebuilt::Drop => {}
            Rebuilt::Bf16 => {
                w.add_tensor(info.name.clone(), DType::BF16, &info.shape);
                data.push(bf16(&t.to_f32_vec().unwrap()));
            }
        }
    }
    for (name, shape, values) in extra {
        w.add_tensor(name, DType::BF16, &shape);
        data.push(bf16(&values));
    }
    w.write(dst, &mut |idx, out| out.write_all(&data[idx]), &mut |_| {}).unwrap();
}

/// The positions whose routing was a near tie in some layer: a choice whose margin is below
/// `share` of its largest score ([`moe_lanes::reference::RoutingObserver::on_margin`]), where an
/// engine's rounding of the router's input may choose the other expert and its row then leaves
/// the reference by far more than the rounding.
pub struct NearTies {
    pub share: f32,
    pub positions: std::collections::BTreeSet<usize>,
}

impl NearTies {
    pub fn new(share: f32) -> NearTies {
        NearTies { share, positions: std::collections::BTreeSet::new() }
    }
}

impl moe_lanes::reference::RoutingObserver for NearTies {
    fn on_route(&mut self, _: usize, _: usize, _: &[(usize, f32)]) {}
    fn on_margin(&mut self, _: usize, position: usize, margin: f32, scale: f32) {
        if margin < self.share * scale {
            self.positions.insert(position);
        }
    }
}
