//! One model view over both file formats: open a GGUF file or a Hugging Face safetensors
//! directory, validate every tensor the adapter needs (presence, shape, dtype) once at open, then
//! hand out zero-copy [`TensorRef`]s by role — per layer, per expert — whatever the names on disk.
//!
//! Invariant: after `Model::open` succeeds, every role the adapter requires exists with the
//! expected shape, so the accessors below cannot fail for required roles.

pub mod arch;
pub mod config;
pub mod context;
pub mod expert_extras;
pub mod mla;
pub mod naming;

use crate::format::dtype::DType;
use crate::format::gguf::{GgufError, GgufFile, MetaValue};
use crate::format::safetensors::{SafetensorsError, SafetensorsModel};
use crate::format::tensor::TensorError;
use crate::format::tensor::TensorRef;
use crate::model::arch::HfNaming;
use crate::model::arch::{
    Adapter, AttentionSpec, DeltaNetSpec, Ffn, LatentAttentionSpec, LayerPlan, LayerSpec, Mixer, QkNorm,
};
use crate::model::config::{ConfigError, HybridConfig, ModelConfig};
use crate::model::expert_extras::{ExpertBiasRef, LayerExpertBiases, OwnedLayerExperts};
use crate::model::naming::{ExpertProj, GlobalRole, LayerRole};
use serde::Serialize;
use std::path::{Path, PathBuf};

/// Which on-disk format a model came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ModelFormat {
    Gguf,
    Safetensors,
}

/// Anything that stops a model from opening, naming the file and the tensor or key.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("{path}: no such file or directory")]
    NotFound { path: PathBuf },
    #[error(
        "{path}: not a regular file or a directory (a model is a GGUF file or a directory with config.json)"
    )]
    NotAFile { path: PathBuf },
    #[error("{path}: a safetensors file alone is not a model; pass its directory ({dir}), which holds config.json")]
    SafetensorsFile { path: PathBuf, dir: PathBuf },
    #[error(transparent)]
    Gguf(#[from] GgufError),
    #[error(transparent)]
    Safetensors(#[from] SafetensorsError),
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("{path}: missing metadata key '{key}'")]
    MissingMetadata { path: PathBuf, key: String },
    #[error("{path}: metadata key '{key}' must be {expected}")]
    BadMetadata { path: PathBuf, key: String, expected: &'static str },
    #[error("{path}: missing tensor '{tensor}'")]
    MissingTensor { path: PathBuf, tensor: String },
    #[error("{path}: tensor '{tensor}' has shape {found:?}, but the config implies {expected:?}")]
    ShapeMismatch { path: PathBuf, tensor: String, expected: Vec<usize>, found: Vec<usize> },
    #[error("{path}: tensor '{tensor}' {reason}")]
    BadValues { path: PathBuf, tensor: String, reason: String },
    #[error("{path}: tensor '{tensor}' has dtype {dtype}; {allowed} expected")]
    DTypeMismatch { path: PathBuf, tensor: String, dtype: DType, allowed: &'static str },
    #[error("{path}: {reason}")]
    BadTensor { path: PathBuf, reason: String },
}

enum Source {
    Gguf(GgufFile),
    Safetensors(SafetensorsModel),
}

/// The three projections of one expert, zero-copy.
#[derive(Debug, Clone, Copy)]
pub struct ExpertRef<'a> {
    /// `[ff, hidden]`
    pub gate: TensorRef<'a>,
    /// `[ff, hidden]`
    pub up: TensorRef<'a>,
    /// `[hidden, ff]`
    pub down: TensorRef<'a>,
}

/// An opened, validated model.
pub struct Model {
    path: PathBuf,
    source: Source,
    config: ModelConfig,
    adapter: &'static Adapter,
    /// What each layer is, from the adapter's architecture file.
    plan: LayerPlan,
    expert_dtype: DType,
    /// `[ff, hidden]`, borrowed by expert gate/up views of stacked GGUF tensors.
    gate_up_shape: [usize; 2],
    /// `[hidden, ff]`, borrowed by expert down views.
    down_shape: [usize; 2],
    /// Where a safetensors checkpoint keeps its tensors (found at open).
    hf_layout: HfLayout,
    /// Per layer, experts rewritten at open from a layout the engines cannot read in place
    /// (GPT-OSS's input-major fused checkpoints); empty otherwise.
    owned_experts: Vec<OwnedLayerExperts>,
    /// Per layer, the experts' biases (a plan with `expert_bias`); empty otherwise.
    expert_biases: Vec<LayerExpertBiases>,
    /// Per layer, a latent attention's `k_b` / `v_b` split at open from a fused `kv_b`
    /// (`None`: read in place, or not a latent attention layer).
    owned_kv_b: Vec<Option<mla::OwnedKvB>>,
}

/// How a Hugging Face checkpoint lays its language model out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct HfLayout {
    /// `model.` or, in a multimodal checkpoint, `model.language_model.`.
    prefix: &'static str,
    /// Each layer's experts in transformers' two stacked tensors instead of one per projection
    /// (in a GGUF file: llama.cpp's `ffn_gate_up_exps` beside `ffn_down_exps`).
    fused_experts: bool,
}

impl HfLayout {
    const PLAIN: HfLayout = HfLayout { prefix: "model.", fused_experts: false };

    /// The layout a checkpoint's tensor names show (fused experts looked for in layer
    /// `moe_layer`, the first with experts).
    fn detect(st: &SafetensorsModel, moe_layer: usize, naming: HfNaming) -> HfLayout {
        let prefix = if st.tensor("model.language_model.embed_tokens.weight").is_some() {
            "model.language_model."
        } else {
            "model."
        };
        let layout = HfLayout { prefix, fused_experts: false };
        let fused = st.tensor(&layout.name(naming::hf_fused_experts_of(naming, moe_layer, false))).is_some();
        HfLayout { fused_experts: fused, ..layout }
    }

    /// A name as [`naming`] spells it (`model.…`), moved under this layout's prefix.
    fn name(&self, name: String) -> String {
        match name.strip_prefix("model.") {
            Some(rest) if self.prefix != "model." => format!("{}{rest}", self.prefix),
            _ => name,
        }
    }
}

impl Model {
    /// Open a GGUF file or a directory with `config.json` and safetensors.
    pub fn open(path: &Path) -> Result<Model, ModelError> {
        let kind = std::fs::metadata(path).map_err(|_| ModelError::NotFound { path: path.into() })?;
        if !kind.is_file() && !kind.is_dir() {
            // A FIFO or a device would block or stream forever.
            return Err(ModelError::NotAFile { path: path.into() });
        }
        if kind.is_file() && path.extension().is_some_and(|e| e == "safetensors") {
            let dir = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new(".")).into();
            return Err(ModelError::SafetensorsFile { path: path.into(), dir });
        }
        let (source, config, adapter, hf_layout, plan) = if path.is_dir() {
            let st = SafetensorsModel::open(path)?;
            let (config, adapter) = ModelConfig::from_hf_json(st.config(), &st.config_path())?;
            let plan = LayerPlan::new(adapter, &config);
            let moe_layer = plan.layers().iter().position(LayerSpec::has_experts).unwrap_or(0);
            let layout = HfLayout::detect(&st, moe_layer, adapter.hf_naming);
            (Source::Safetensors(st), config, adapter, layout, plan)
        } else {
            let file = GgufFile::open(path)?;
            let (config, adapter) = config_from_gguf(&file)?;
            let plan = LayerPlan::new(adapter, &config);
            let moe_layer = plan.layers().iter().position(LayerSpec::has_experts).unwrap_or(0);
            let fused = file.tensor(&naming::gguf_gate_up_experts(moe_layer)).is_some();
            let layout = HfLayout { fused_experts: fused, ..HfLayout::PLAIN };
            (Source::Gguf(file), config, adapter, layout, plan)
        };
        let mut model = Model {
            path: path.into(),
            source,
            plan,
            gate_up_shape: [config.expert_ff, config.hidden],
            down_shape: [config.hidden, config.expert_ff],
            config,
            adapter,
            expert_dtype: DType::F32,
            hf_layout,
            owned_experts: Vec::new(),
            expert_biases: Vec::new(),
            owned_kv_b: Vec::new(),
        };
        model.load_expert_extras()?;
        model.load_kv_b()?;
        model.validate()?;
        Ok(model)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn format(&self) -> ModelFormat {
        match self.source {
            Source::Gguf(_) => ModelFormat::Gguf,
            Source::Safetensors(_) => ModelFormat::Safetensors,
        }
    }

    /// The GGUF file behind a GGUF model (its metadata holds the tokenizer); `None` for a
    /// safetensors directory.
    pub fn gguf(&self) -> Option<&GgufFile> {
        match &self.source {
            Source::Gguf(file) => Some(file),
            Source::Safetensors(_) => None,
        }
    }

    /// Fault the model's file mappings into this process's page tables now
    /// (`MADV_POPULATE_READ`; what is not in the page cache is read from disk), as llama.cpp
    /// maps with `MAP_POPULATE`. Engines that compute experts from RAM call it at build, so the
    /// first use of a rarely routed expert inside a timed call does not take one page fault per
    /// 4 KiB of it (at 50% skewed, 16-layer BF16, the first timed tg128 ran at 277-334 t/s and
    /// later ones at 380-403). A kernel without the advice leaves the maps as they were.
    pub fn populate(&self) -> std::io::Result<()> {
        match &self.source {
            Source::Gguf(file) => file.populate(),
            Source::Safetensors(st) => st.populate(),
        }
    }

    /// The read-only maps every tensor of the model borrows from (one per file).
    pub fn mappings(&self) -> Vec<std::sync::Arc<memmap2::Mmap>> {
        match &self.source {
            Source::Gguf(file) => vec![file.mapping().clone()],
            Source::Safetensors(st) => st.mappings(),
        }
    }

    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// Limit sessions to `positions` (from [`context::resolve_context`]); every engine built on
    /// this model checks prompt + new tokens against it before any work.
    pub fn set_context(&mut self, positions: usize) {
        assert!(positions >= 1 && positions <= self.config.max_positions, "resolve_context checks the size");
        self.config.max_positions = positions;
    }

    pub fn adapter(&self) -> &'static Adapter {
        self.adapter
    }

    /// The pipeline switches this architecture opts into.
    pub fn profile(&self) -> crate::model::arch::Profile {
        self.adapter.profile
    }

    /// Every layer's kind: the plan each engine walks.
    pub fn plan(&self) -> &LayerPlan {
        &self.plan
    }

    /// The spec of layer `layer_idx`.
    pub fn layer_spec(&self, layer_idx: usize) -> &LayerSpec {
        self.plan.layer(layer_idx)
    }

    /// Element type of the expert weights: the one all float experts share, or for a quantised
    /// model the type of layer 0's gate projection (others may differ: see [`Model::expert`]).
    pub fn expert_dtype(&self) -> DType {
        self.expert_dtype
    }

    /// A model-wide tensor; `None` only for `Output` when embeddings are tied.
    pub fn global(&self, role: GlobalRole) -> Option<TensorRef<'_>> {
        self.raw(&self.global_name(role))
    }

    /// The lm_head weights: `Output`, or the token embedding when tied.
    pub fn lm_head(&self) -> TensorRef<'_> {
        self.global(GlobalRole::Output)
            .or_else(|| self.global(GlobalRole::TokenEmbedding))
            .expect("validated at open: token embedding exists")
    }

    /// A per-layer tensor; `None` when the adapter does not use that role.
    pub fn layer(&self, layer_idx: usize, role: LayerRole) -> Option<TensorRef<'_>> {
        self.raw(&self.layer_name(layer_idx, role))
    }

    /// An RMSNorm weight of layer `layer_idx` (`None` for a role the layer lacks) as the scale
    /// every engine multiplies by: zero-centred checkpoints store `w` for `1 + w`, and this adds
    /// the one, so no engine needs to know.
    pub fn norm_weight(&self, layer_idx: usize, role: LayerRole) -> Result<Option<Vec<f32>>, TensorError> {
        let centred = self.config.zero_centred_norms && role.is_centred_norm();
        self.layer(layer_idx, role).map(|t| scale_of(t, centred)).transpose()
    }

    /// The final RMSNorm's scale (see [`Model::norm_weight`]).
    pub fn output_norm_weight(&self) -> Result<Vec<f32>, TensorError> {
        let t = self.global(GlobalRole::OutputNorm).expect("validated at open");
        scale_of(t, self.config.zero_centred_norms)
    }

    /// A DeltaNet layer's `A_log` (`[v_heads]`, the log of its decay rate): llama.cpp's converter
    /// stores `-exp(A_log)` instead (`ssm_a`, checked negative at open), and this takes the log
    /// back, so no engine needs to know.
    pub fn delta_a_log(&self, layer_idx: usize) -> Result<Vec<f32>, TensorError> {
        let stored = self.required(layer_idx, LayerRole::DeltaALog).to_f32_vec()?;
        Ok(match self.source {
            Source::Gguf(_) => stored.iter().map(|a| (-a).ln()).collect(),
            Source::Safetensors(_) => stored,
        })
    }

    /// Same as [`Model::layer`] for roles the adapter requires (validated at open).
    pub fn required(&self, layer_idx: usize, role: LayerRole) -> TensorRef<'_> {
        self.layer(layer_idx, role).expect("validated at open: required layer tensor exists")
    }

    /// The three projections of expert `expert_idx` in layer `layer_idx`.
    pub fn expert(&self, layer_idx: usize, expert_idx: usize) -> ExpertRef<'_> {
        assert!(
            layer_idx < self.config.n_layers && expert_idx < self.config.n_experts,
            "expert id out of range"
        );
        let proj = |p: ExpertProj| self.expert_proj(layer_idx, expert_idx, p);
        ExpertRef { gate: proj(ExpertProj::Gate), up: proj(ExpertProj::Up), down: proj(ExpertProj::Down) }
    }

    /// The biases of expert `expert_idx` of layer `layer_idx`, when the plan gives experts biases.
    pub fn expert_bias(&self, layer_idx: usize, expert_idx: usize) -> Option<ExpertBiasRef<'_>> {
        let c = &self.config;
        self.expert_biases.get(layer_idx).map(|b| b.expert(expert_idx, c.expert_ff, c.hidden))
    }

    /// Rewrite GPT-OSS's fused safetensors experts and decode every expert bias, once.
    fn load_expert_extras(&mut self) -> Result<(), ModelError> {
        use crate::model::expert_extras as x;
        let c = &self.config;
        let d = x::Dims { n_experts: c.n_experts, hidden: c.hidden, ff: c.expert_ff };
        let fused_oss = self.adapter.hf_naming == crate::model::arch::HfNaming::GptOss
            && matches!(self.source, Source::Safetensors(_));
        let biased = self.plan.layers().iter().any(|l| l.as_moe().is_some_and(|m| m.expert_bias));
        let (mut owned, mut biases, mut expert_dtype) = (Vec::new(), Vec::new(), None);
        for l in 0..c.n_layers {
            let find = |name: String| {
                let name = self.hf_layout.name(name);
                self.raw(&name)
                    .ok_or_else(|| ModelError::MissingTensor { path: self.file_of(&name), tensor: name })
            };
            if fused_oss {
                let path = self.file_of(&naming::hf_fused_experts(l, false));
                let gate_up = find(naming::hf_fused_experts(l, false))?;
                let (layer, dtype) =
                    x::rewrite_gpt_oss_layer(&path, gate_up, find(naming::hf_fused_experts(l, true))?, &d)?;
                owned.push(layer);
                expert_dtype = Some(dtype);
                if biased {
                    let gu = find(naming::hf_fused_expert_bias(l, false))?;
                    biases.push(x::gpt_oss_biases(
                        &path,
                        gu,
                        find(naming::hf_fused_expert_bias(l, true))?,
                        &d,
                    )?);
                }
            } else if biased {
                let path = self.path.clone();
                biases.push(x::gguf_biases(&path, l, |n| self.raw(n), &d)?);
            }
        }
        self.owned_experts = owned;
        self.expert_biases = biases;
        if let Some(dtype) = expert_dtype {
            self.expert_dtype = dtype;
        }
        Ok(())
    }

    /// Bytes of one expert's gate + up + down (the largest over layers when quantised types mix).
    pub fn expert_bytes(&self) -> usize {
        (0..self.config.n_layers).map(|l| self.expert_bytes_of_layer(l)).max().unwrap_or(0)
    }

    /// Bytes of one expert of each layer (a `_M` file's layers differ: some keep their down
    /// projections in Q6_K); what the planner packs into a byte budget.
    pub fn layer_expert_bytes(&self) -> Vec<u64> {
        (0..self.config.n_layers).map(|l| self.expert_bytes_of_layer(l) as u64).collect()
    }

    /// A latent attention layer's `k_b` and `v_b` ([`mla`]: split at open from a fused `kv_b`,
    /// or in place).
    pub fn mla_kv_b(&self, layer_idx: usize) -> (TensorRef<'_>, TensorRef<'_>) {
        match self.owned_kv_b.get(layer_idx).and_then(Option::as_ref) {
            Some(owned) => owned.views(),
            None => (self.required(layer_idx, LayerRole::MlaKB), self.required(layer_idx, LayerRole::MlaVB)),
        }
    }

    /// Every latent attention layer's `k_b` / `v_b`: checked in place, or split from `kv_b`.
    fn load_kv_b(&mut self) -> Result<(), ModelError> {
        let mut owned = Vec::with_capacity(self.config.n_layers);
        for l in 0..self.config.n_layers {
            let Mixer::LatentAttention(m) = self.plan.layer(l).mixer else {
                owned.push(None);
                continue;
            };
            let (k_shape, v_shape) = mla::split_shapes(&m);
            let (k_name, v_name) =
                (self.layer_name(l, LayerRole::MlaKB), self.layer_name(l, LayerRole::MlaVB));
            if self.raw(&k_name).is_some()
                || self.raw(&v_name).is_none() && self.raw(&self.layer_name(l, LayerRole::MlaKvB)).is_none()
            {
                self.check_tensor(&k_name, &k_shape)?;
                self.check_tensor(&v_name, &v_shape)?;
                owned.push(None);
                continue;
            }
            let kv_name = self.layer_name(l, LayerRole::MlaKvB);
            self.check_tensor(&kv_name, &[m.n_heads * (m.nope_dim + m.v_dim), m.kv_lora_rank])?;
            let kv_b = self.raw(&kv_name).expect("checked above");
            owned.push(Some(mla::split_kv_b(&self.file_of(&kv_name), kv_b, &m)?));
        }
        self.owned_kv_b = owned;
        Ok(())
    }

    /// Bytes of one expert of layer `l` (the experts of a layer share their types), its f32
    /// biases included where it has them (GPT-OSS: the GPU's hot cache keeps them beside each
    /// slot); 0 for a layer without experts (a dense FFN layer), which the planners never fill.
    pub fn expert_bytes_of_layer(&self, l: usize) -> usize {
        if !self.plan.layer(l).has_experts() {
            return 0;
        }
        let e = self.expert(l, 0);
        let bias = self.expert_bias(l, 0).map_or(0, |b| 4 * (b.gate.len() + b.up.len() + b.down.len()));
        e.gate.data.len() + e.up.data.len() + e.down.data.len() + bias
    }

    /// Bytes of every expert of every layer (layers may differ in type: a `_M` file keeps some
    /// layers' down projections in Q6_K).
    pub fn all_experts_bytes(&self) -> u64 {
        self.layer_expert_bytes().iter().sum::<u64>() * self.config.n_experts as u64
    }

    /// Every tensor name in the file with its dtype, shape and byte size.
    pub fn tensor_list(&self) -> Vec<(String, DType, Vec<usize>, usize)> {
        match &self.source {
            Source::Gguf(f) => f
                .tensor_infos()
                .iter()
                .map(|t| (t.name.clone(), t.dtype, t.shape.clone(), t.n_bytes))
                .collect(),
            Source::Safetensors(s) => s
                .tensor_names()
                .into_iter()
                .filter_map(|n| s.tensor(n))
                .map(|t| (t.name.to_string(), t.dtype, t.shape.to_vec(), t.data.len()))
                .collect(),
        }
    }

    fn raw(&self, name: &str) -> Option<TensorRef<'_>> {
        match &self.source {
            Source::Gguf(f) => f.tensor(name),
            Source::Safetensors(s) => s.tensor(name),
        }
    }

    /// The file a tensor lives in (for error messages).
    fn file_of(&self, name: &str) -> PathBuf {
        match &self.source {
            Source::Gguf(f) => f.path().to_path_buf(),
            Source::Safetensors(s) => {
                s.file_of(name).map(Path::to_path_buf).unwrap_or_else(|| s.dir().to_path_buf())
            }
        }
    }

    fn global_name(&self, role: GlobalRole) -> String {
        match self.source {
            Source::Gguf(_) => naming::gguf_global(role).to_string(),
            Source::Safetensors(_) => self.hf_layout.name(naming::hf_global(role).to_string()),
        }
    }

    fn layer_name(&self, layer_idx: usize, role: LayerRole) -> String {
        match self.source {
            Source::Gguf(_) => naming::gguf_layer(self.adapter, layer_idx, role),
            Source::Safetensors(_) => {
                self.hf_layout.name(naming::hf_layer(self.adapter.hf_naming, layer_idx, role))
            }
        }
    }

    /// The tensor holding the weights of `proj` for layer `layer_idx`'s experts: per expert, or
    /// stacked (GGUF, transformers' fused form), with the stacked tensor's rows of this
    /// projection (`gate_up_proj` holds gate then up).
    fn expert_tensor_name(&self, layer_idx: usize, expert_idx: usize, proj: ExpertProj) -> String {
        match self.source {
            Source::Gguf(_) if self.hf_layout.fused_experts && proj != ExpertProj::Down => {
                naming::gguf_gate_up_experts(layer_idx)
            }
            Source::Gguf(_) => naming::gguf_experts(layer_idx, proj),
            Source::Safetensors(_) if self.hf_layout.fused_experts => self.hf_layout.name(
                naming::hf_fused_experts_of(self.adapter.hf_naming, layer_idx, proj == ExpertProj::Down),
            ),
            Source::Safetensors(_) => {
                self.hf_layout.name(naming::hf_expert(self.adapter.hf_naming, layer_idx, expert_idx, proj))
            }
        }
    }

    fn expert_proj(&self, layer_idx: usize, expert_idx: usize, proj: ExpertProj) -> TensorRef<'_> {
        let shape: &[usize] = if proj == ExpertProj::Down { &self.down_shape } else { &self.gate_up_shape };
        if let Some(layer) = self.owned_experts.get(layer_idx) {
            let all = layer.of(proj);
            let n = all.len() / self.config.n_experts;
            let name = if proj == ExpertProj::Down { "down_proj" } else { "gate_up_proj" };
            return TensorRef { name, dtype: self.expert_dtype, shape, data: &all[expert_idx * n..][..n] };
        }
        let t = self.raw(&self.expert_tensor_name(layer_idx, expert_idx, proj)).expect("validated at open");
        let stacked = matches!(self.source, Source::Gguf(_)) || self.hf_layout.fused_experts;
        if !stacked {
            return t;
        }
        let n_bytes = t.data.len() / self.config.n_experts;
        let mut begin = expert_idx * n_bytes;
        let mut len = n_bytes;
        if self.hf_layout.fused_experts && proj != ExpertProj::Down {
            len = n_bytes / 2;
            begin += if proj == ExpertProj::Up { len } else { 0 };
        }
        TensorRef { name: t.name, dtype: t.dtype, shape, data: &t.data[begin..begin + len] }
    }

    /// The roles layer `layer_idx` requires, as its spec says.
    pub fn required_layer_roles(&self, layer_idx: usize) -> Vec<LayerRole> {
        required_layer_roles(self.layer_spec(layer_idx))
    }

    /// Expected row-major shape of a per-layer tensor of layer `layer_idx`.
    pub fn expected_layer_shape(&self, layer_idx: usize, role: LayerRole) -> Vec<usize> {
        expected_layer_shape(&self.config, self.layer_spec(layer_idx), role)
    }

    fn validate(&mut self) -> Result<(), ModelError> {
        let c = self.config.clone();
        self.check_tensor(&self.global_name(GlobalRole::TokenEmbedding), &[c.vocab, c.hidden])?;
        self.check_tensor(&self.global_name(GlobalRole::OutputNorm), &[c.hidden])?;
        let output = self.global_name(GlobalRole::Output);
        if !c.tied_embeddings || self.raw(&output).is_some() {
            self.check_tensor(&output, &[c.vocab, c.hidden])?;
        }
        for layer_idx in 0..c.n_layers {
            for role in self.required_layer_roles(layer_idx) {
                let shape = self.expected_layer_shape(layer_idx, role);
                self.check_tensor(&self.layer_name(layer_idx, role), &shape)?;
            }
            self.validate_experts(layer_idx)?;
            self.validate_decay(layer_idx)?;
        }
        Ok(())
    }

    /// A GGUF DeltaNet layer stores `-exp(A_log)`, which [`Model::delta_a_log`] takes the log of:
    /// every value must be negative and finite.
    fn validate_decay(&self, layer_idx: usize) -> Result<(), ModelError> {
        let gguf = matches!(self.source, Source::Gguf(_));
        if !gguf || !matches!(self.plan.layer(layer_idx).mixer, Mixer::GatedDeltaNet(_)) {
            return Ok(());
        }
        let name = self.layer_name(layer_idx, LayerRole::DeltaALog);
        let bad = |reason: String| ModelError::BadValues {
            path: self.file_of(&name),
            tensor: name.clone(),
            reason,
        };
        let values =
            self.required(layer_idx, LayerRole::DeltaALog).to_f32_vec().map_err(|e| bad(e.to_string()))?;
        match values.iter().position(|a| !(a.is_finite() && *a < 0.0)) {
            Some(i) => Err(bad(format!(
                "holds {} at {i}: llama.cpp's ssm_a is -exp(A_log), negative and finite",
                values[i]
            ))),
            None => Ok(()),
        }
    }

    fn validate_experts(&mut self, layer_idx: usize) -> Result<(), ModelError> {
        if !self.owned_experts.is_empty() || !self.plan.layer(layer_idx).has_experts() {
            return Ok(()); // checked when they were rewritten
        }
        let c = &self.config;
        for proj in ExpertProj::ALL {
            let per_expert =
                if proj == ExpertProj::Down { [c.hidden, c.expert_ff] } else { [c.expert_ff, c.hidden] };
            let dtype = match self.source {
                Source::Gguf(_) if !self.hf_layout.fused_experts => {
                    let name = naming::gguf_experts(layer_idx, proj);
                    self.check_tensor(&name, &[c.n_experts, per_expert[0], per_expert[1]])?
                }
                _ if self.hf_layout.fused_experts => {
                    if proj == ExpertProj::Up {
                        continue; // the gate's tensor holds it
                    }
                    let rows = if proj == ExpertProj::Down { per_expert[0] } else { 2 * per_expert[0] };
                    let name = self.expert_tensor_name(layer_idx, 0, proj);
                    self.check_tensor(&name, &[c.n_experts, rows, per_expert[1]])?
                }
                _ => {
                    let mut dtype = DType::F32;
                    for expert_idx in 0..c.n_experts {
                        let name = self.expert_tensor_name(layer_idx, expert_idx, proj);
                        dtype = self.check_tensor(&name, &per_expert)?;
                    }
                    dtype
                }
            };
            // Quantised files mix block types per tensor (a `_M` mix puts Q6_K on some
            // down projections); float experts share one dtype.
            let mixed_quant = !dtype.is_float() && !self.expert_dtype.is_float();
            let first_moe = self.plan.layers().iter().position(LayerSpec::has_experts) == Some(layer_idx);
            if first_moe && proj == ExpertProj::Gate {
                self.expert_dtype = dtype;
            } else if dtype != self.expert_dtype && !mixed_quant {
                let name = self.expert_tensor_name(layer_idx, 0, proj);
                return Err(ModelError::DTypeMismatch {
                    path: self.file_of(&name),
                    tensor: name,
                    dtype,
                    allowed: "the same dtype as every other expert tensor (or any quantised type when they are quantised)",
                });
            }
        }
        Ok(())
    }

    /// Check presence, shape (leading 1-dims ignored) and dtype (vectors float); returns the dtype.
    fn check_tensor(&self, name: &str, expected: &[usize]) -> Result<DType, ModelError> {
        let t = self
            .raw(name)
            .ok_or_else(|| ModelError::MissingTensor { path: self.file_of(name), tensor: name.into() })?;
        if without_ones(t.shape) != without_ones(expected) {
            return Err(ModelError::ShapeMismatch {
                path: self.file_of(name),
                tensor: name.into(),
                expected: expected.to_vec(),
                found: t.shape.to_vec(),
            });
        }
        // Vectors (norms, biases, the shared expert's gate) are read as floats; matrices may be
        // stored in any element type, GGML quantised blocks included.
        let vector = without_ones(expected).len() <= 1;
        if vector && !t.dtype.is_float() {
            return Err(ModelError::DTypeMismatch {
                path: self.file_of(name),
                tensor: name.into(),
                dtype: t.dtype,
                allowed: "F32, F16 or BF16",
            });
        }
        Ok(t.dtype)
    }
}

/// A shape without its unit dims: `[1, hidden]` is `[hidden]`, a conv's `[channels, 1, width]`
/// is `[channels, width]` (the bytes are the same either way).
fn without_ones(shape: &[usize]) -> Vec<usize> {
    shape.iter().copied().filter(|&d| d != 1).collect()
}

/// A norm weight as f32, plus one when stored zero-centred.
fn scale_of(t: TensorRef<'_>, centred: bool) -> Result<Vec<f32>, TensorError> {
    let mut w = t.to_f32_vec()?;
    if centred {
        w.iter_mut().for_each(|v| *v += 1.0);
    }
    Ok(w)
}

/// The per-layer roles a layer of this kind requires.
pub fn required_layer_roles(spec: &LayerSpec) -> Vec<LayerRole> {
    use LayerRole::*;
    let mut roles = vec![AttnNorm, FfnNorm];
    if spec.post_norms {
        roles.extend([PostAttnNorm, PostFfnNorm]);
    }
    if spec.output_scale {
        roles.push(LayerScalar);
    }
    match &spec.mixer {
        Mixer::Attention(attention) => {
            roles.extend([Q, K, O]);
            if !attention.values_from_keys {
                roles.push(V);
            }
            if attention.qkv_bias {
                roles.extend([QBias, KBias, VBias]);
            }
            if attention.qk_norm != QkNorm::None {
                roles.extend([QNorm, KNorm]);
            }
            if attention.o_bias {
                roles.push(OBias);
            }
            if attention.sinks {
                roles.push(Sinks);
            }
        }
        Mixer::GatedDeltaNet(d) => {
            roles.extend(naming::delta_input_roles(d.projections));
            roles.extend([DeltaConv, DeltaDtBias, DeltaALog, DeltaNorm, DeltaOut]);
        }
        // `k_b` / `v_b` (or a fused `kv_b`) are checked by `Model::load_kv_b`.
        Mixer::LatentAttention(m) => {
            if m.q_lora_rank.is_some() {
                roles.extend([MlaQA, MlaQANorm, MlaQB]);
            } else {
                roles.push(Q);
            }
            roles.extend([MlaKvA, MlaKvANorm, O]);
        }
    }
    match &spec.ffn {
        Ffn::Moe(moe) => {
            roles.push(Router);
            if let Some(shared) = moe.shared {
                roles.extend([SharedGate, SharedUp, SharedDown]);
                if shared.gated {
                    roles.push(SharedExpertGate);
                }
            }
            if moe.router.bias {
                roles.push(RouterBias);
            }
            if moe.router.selection_bias {
                roles.push(RouterSelectionBias);
            }
            if moe.router.scaled_input {
                roles.push(RouterInputScale);
            }
            if moe.router.per_expert_scale {
                roles.push(RouterExpertScale);
            }
            if moe.branch_norms {
                roles.extend([SharedPostNorm, ExpertsNorm, ExpertsPostNorm]);
            }
        }
        Ffn::Dense(_) => roles.extend([DenseGate, DenseUp, DenseDown]),
    }
    roles
}

/// Row-major shape of a per-layer tensor of a layer of kind `spec`, as the config implies.
pub fn expected_layer_shape(c: &ModelConfig, spec: &LayerSpec, role: LayerRole) -> Vec<usize> {
    use LayerRole::*;
    let shared_ff = spec.shared_expert().map_or(0, |s| s.ff);
    let n_experts = spec.as_moe().map_or(0, |m| m.router.n_experts);
    let dense_ff = match spec.ffn {
        Ffn::Dense(d) => d.ff,
        Ffn::Moe(_) => 0,
    };
    match (role, &spec.mixer) {
        (AttnNorm | FfnNorm, _) => vec![c.hidden],
        (PostAttnNorm | PostFfnNorm | SharedPostNorm | ExpertsNorm | ExpertsPostNorm, _) => vec![c.hidden],
        (RouterInputScale, _) => vec![c.hidden],
        (LayerScalar, _) => vec![1],
        (Router, _) => vec![n_experts, c.hidden],
        (RouterBias | RouterSelectionBias | RouterExpertScale, _) => vec![n_experts],
        (SharedGate | SharedUp, _) => vec![shared_ff, c.hidden],
        (SharedDown, _) => vec![c.hidden, shared_ff],
        (SharedExpertGate, _) => vec![1, c.hidden],
        (DenseGate | DenseUp, _) => vec![dense_ff, c.hidden],
        (DenseDown, _) => vec![c.hidden, dense_ff],
        (_, Mixer::Attention(a)) => attention_shape(c, a, role),
        (_, Mixer::GatedDeltaNet(d)) => delta_net_shape(c, d, role),
        (_, Mixer::LatentAttention(m)) => latent_attention_shape(c, m, role),
    }
}

fn latent_attention_shape(c: &ModelConfig, m: &LatentAttentionSpec, role: LayerRole) -> Vec<usize> {
    use LayerRole::*;
    let q_rank = m.q_lora_rank.unwrap_or(0);
    match role {
        MlaQA => vec![q_rank, c.hidden],
        MlaQANorm => vec![q_rank],
        MlaQB => vec![m.q_dim(), q_rank],
        Q => vec![m.q_dim(), c.hidden],
        MlaKvA => vec![m.kv_lora_rank + m.rope_dim, c.hidden],
        MlaKvANorm => vec![m.kv_lora_rank],
        MlaKvB => vec![m.n_heads * (m.nope_dim + m.v_dim), m.kv_lora_rank],
        MlaKB => mla::split_shapes(m).0.to_vec(),
        MlaVB => mla::split_shapes(m).1.to_vec(),
        O => vec![c.hidden, m.n_heads * m.v_dim],
        _ => unreachable!("{role:?} is not a latent attention tensor"),
    }
}

fn attention_shape(c: &ModelConfig, a: &AttentionSpec, role: LayerRole) -> Vec<usize> {
    use LayerRole::*;
    let (q_dim, kv_dim) = (a.q_dim(c.n_heads), a.kv_dim());
    let q_rows = if a.output_gate { 2 * q_dim } else { q_dim };
    match role {
        Q => vec![q_rows, c.hidden],
        K | V => vec![kv_dim, c.hidden],
        O => vec![c.hidden, q_dim],
        QBias => vec![q_rows],
        OBias => vec![c.hidden],
        Sinks => vec![c.n_heads],
        KBias | VBias => vec![kv_dim],
        QNorm | KNorm if a.qk_norm == QkNorm::PerHead => vec![a.head_dim],
        QNorm => vec![q_dim],
        KNorm => vec![kv_dim],
        _ => unreachable!("{role:?} is not an attention tensor"),
    }
}

fn delta_net_shape(c: &ModelConfig, d: &DeltaNetSpec, role: LayerRole) -> Vec<usize> {
    use LayerRole::*;
    match role {
        DeltaQkvz => vec![d.conv_dim() + d.value_dim(), c.hidden],
        DeltaBa => vec![2 * d.n_v_heads, c.hidden],
        DeltaQkv => vec![d.conv_dim(), c.hidden],
        DeltaZ => vec![d.value_dim(), c.hidden],
        DeltaB | DeltaA => vec![d.n_v_heads, c.hidden],
        DeltaConv => vec![d.conv_dim(), d.conv_kernel],
        DeltaDtBias | DeltaALog => vec![d.n_v_heads],
        DeltaNorm => vec![d.v_head_dim],
        DeltaOut => vec![c.hidden, d.value_dim()],
        _ => unreachable!("{role:?} is not a DeltaNet tensor"),
    }
}

/// Reads typed GGUF metadata with errors naming the key.
pub struct GgufMeta<'a> {
    file: &'a GgufFile,
    arch: &'a str,
}

impl GgufMeta<'_> {
    fn key(&self, suffix: &str) -> String {
        format!("{}.{suffix}", self.arch)
    }

    /// An optional count (`expert_shared_count`).
    pub(crate) fn opt_count(&self, suffix: &str) -> Result<Option<usize>, ModelError> {
        Ok(self.opt_u64(suffix)?.map(|v| v as usize))
    }

    fn opt_u64(&self, suffix: &str) -> Result<Option<u64>, ModelError> {
        let key = self.key(suffix);
        match self.file.get(&key) {
            None => Ok(None),
            Some(v) => v.as_u64().map(Some).ok_or_else(|| self.bad(key, "a non-negative integer")),
        }
    }

    pub(crate) fn usize(&self, suffix: &str) -> Result<usize, ModelError> {
        self.opt_u64(suffix)?.map(|v| v as usize).ok_or_else(|| ModelError::MissingMetadata {
            path: self.file.path().into(),
            key: self.key(suffix),
        })
    }

    fn opt_f32(&self, suffix: &str) -> Result<Option<f32>, ModelError> {
        let key = self.key(suffix);
        match self.file.get(&key) {
            None => Ok(None),
            Some(v) => v.as_f64().map(|x| Some(x as f32)).ok_or_else(|| self.bad(key, "a number")),
        }
    }

    fn opt_bool(&self, suffix: &str) -> Result<Option<bool>, ModelError> {
        let key = self.key(suffix);
        match self.file.get(&key) {
            None => Ok(None),
            Some(v) => v.as_bool().map(Some).ok_or_else(|| self.bad(key, "a bool")),
        }
    }

    /// The layers a forward pass runs, and the multi-token-prediction (NextN) layers llama.cpp's
    /// converter appends after them (`block_count` counts both; those are loaded and not run).
    fn layer_counts(&self) -> Result<(usize, usize), ModelError> {
        let all = self.usize("block_count")?;
        let mtp = self.opt_u64("nextn_predict_layers")?.unwrap_or(0) as usize;
        if mtp >= all {
            return Err(self.bad(self.key("nextn_predict_layers"), "fewer than block_count"));
        }
        Ok((all - mtp, mtp))
    }

    /// A hybrid architecture's DeltaNet sizes (llama.cpp's `ssm.*` keys) and which layers are
    /// full attention (`attention.recurrent_layers`, else `full_attention_interval`, default 4).
    fn hybrid(&self, adapter: &Adapter, n_layers: usize) -> Result<Option<HybridConfig>, ModelError> {
        let Some((projections, v_heads)) = adapter.hybrid.gguf_delta_net else { return Ok(None) };
        let n_v_heads = self.usize("ssm.time_step_rank")?;
        let full_attention_layers = match self.file.get(&self.key("attention.recurrent_layers")) {
            Some(v) => {
                let flags: Option<Vec<bool>> =
                    v.as_array().and_then(|a| a.values.iter().map(|x| x.as_bool()).collect());
                let key = self.key("attention.recurrent_layers");
                let flags = flags
                    .filter(|f| f.len() >= n_layers)
                    .ok_or_else(|| self.bad(key, "an array of bools with one entry per layer"))?;
                (0..n_layers).filter(|&l| !flags[l]).collect()
            }
            None => {
                let interval = self.opt_u64("full_attention_interval")?.unwrap_or(4) as usize;
                if interval == 0 {
                    return Err(self.bad(self.key("full_attention_interval"), "greater than zero"));
                }
                HybridConfig::every_nth_full(interval, n_layers)
            }
        };
        Ok(Some(HybridConfig {
            n_k_heads: self.usize("ssm.group_count")?,
            n_v_heads,
            k_head_dim: self.usize("ssm.state_size")?,
            v_head_dim: self.usize("ssm.inner_size")? / n_v_heads.max(1),
            conv_kernel: self.usize("ssm.conv_kernel")?,
            full_attention_layers,
            projections,
            v_heads,
        }))
    }

    /// llama.cpp's deepseek2 latent attention keys (`attention.kv_lora_rank`, ...). Files from
    /// before llama.cpp split `attn_kv_b` have no `attention.key_length_mla` /
    /// `value_length_mla`: their `key_length` / `value_length` are the per-head sizes (llama.cpp's
    /// `is_mla()` false), and the fused `attn_kv_b` is split at open.
    fn mla(&self) -> Result<Option<crate::model::config::MlaConfig>, ModelError> {
        let Some(kv_lora_rank) = self.opt_count("attention.kv_lora_rank")? else { return Ok(None) };
        let rope = self.usize("rope.dimension_count")?;
        let split = self.opt_count("attention.key_length_mla")?.is_some();
        let (key_suffix, value_suffix) = if split {
            ("attention.key_length_mla", "attention.value_length_mla")
        } else {
            ("attention.key_length", "attention.value_length")
        };
        let key = self.usize(key_suffix)?;
        if key <= rope {
            return Err(self.bad(self.key(key_suffix), "greater than rope.dimension_count"));
        }
        // The converter writes 0.1 * mscale_all_dim (llama.cpp's TAG_DEEPSEEK2_YARN_LOG_MUL_FIX).
        let log_mul = self.opt_f32("rope.scaling.yarn_log_multiplier")?.unwrap_or(0.0);
        Ok(Some(crate::model::config::MlaConfig {
            q_lora_rank: self.opt_count("attention.q_lora_rank")?,
            kv_lora_rank,
            qk_nope_head_dim: key - rope,
            qk_rope_head_dim: rope,
            v_head_dim: self.usize(value_suffix)?,
            mscale_all_dim: log_mul / 0.1,
        }))
    }

    /// `leading_dense_block_count` dense layers of `feed_forward_length`.
    fn dense_layers(&self) -> Result<Option<crate::model::config::DenseLayers>, ModelError> {
        match self.opt_count("leading_dense_block_count")? {
            None | Some(0) => Ok(None),
            Some(count) => {
                Ok(Some(crate::model::config::DenseLayers { count, ff: self.usize("feed_forward_length")? }))
            }
        }
    }

    /// Sigmoid gating (`expert_gating_func` 2), its groups and weight scale.
    fn sigmoid_routing(&self) -> Result<Option<crate::model::config::SigmoidRouting>, ModelError> {
        let gating = self.opt_u64("expert_gating_func")?;
        let scale = self.opt_f32("expert_weights_scale")?;
        if gating != Some(2) && scale.is_none() {
            return Ok(None);
        }
        if let Some(g) = gating.filter(|&g| g != 2) {
            let _ = g;
            return Err(self.bad(
                self.key("expert_gating_func"),
                "2 (sigmoid): softmax gating of deepseek2 is not supported",
            ));
        }
        Ok(Some(crate::model::config::SigmoidRouting {
            n_group: self.opt_count("expert_group_count")?.filter(|&n| n > 0).unwrap_or(1),
            topk_group: self.opt_count("expert_group_used_count")?.filter(|&n| n > 0).unwrap_or(1),
            routed_scaling_factor: scale.unwrap_or(1.0),
        }))
    }

    fn bad(&self, key: String, expected: &'static str) -> ModelError {
        ModelError::BadMetadata { path: self.file.path().into(), key, expected }
    }
}

/// Build the model config from GGUF metadata (llama.cpp key names) and tensor shapes.
pub fn config_from_gguf(file: &GgufFile) -> Result<(ModelConfig, &'static Adapter), ModelError> {
    let path = file.path();
    let arch = file.get("general.architecture").ok_or_else(|| ModelError::MissingMetadata {
        path: path.into(),
        key: "general.architecture".into(),
    })?;
    let arch = arch.as_str().ok_or_else(|| ModelError::BadMetadata {
        path: path.into(),
        key: "general.architecture".into(),
        expected: "a string",
    })?;
    let meta = GgufMeta { file, arch };
    let n_experts = meta.opt_u64("expert_count")?.unwrap_or(0) as usize;
    let adapter = crate::model::arch::for_gguf_arch(arch, n_experts)
        .map_err(|source| ModelError::Config(ConfigError::Arch { path: path.into(), source }))?;
    let gemma4 = adapter.arch == crate::model::arch::Arch::Gemma4;
    let (n_layers, mtp_layers) = meta.layer_counts()?;
    let hidden = meta.usize("embedding_length")?;
    let n_heads = meta.usize("attention.head_count")?;
    let head_dim = match meta.opt_u64("attention.key_length")? {
        Some(d) => d as usize,
        None if n_heads > 0 => hidden / n_heads,
        None => 0,
    };
    let dims = (adapter.gguf_expert_dims)(&meta, n_experts)?;
    let vocab = file.tensor(naming::gguf_global(GlobalRole::TokenEmbedding)).map(|t| t.shape[0]);
    let vocab = match (vocab, meta.opt_u64("vocab_size")?) {
        (Some(v), _) => v,
        (None, Some(v)) => v as usize,
        (None, None) => {
            return Err(ModelError::MissingTensor { path: path.into(), tensor: "token_embd.weight".into() })
        }
    };
    let mla = meta.mla()?;
    // llama.cpp's deepseek2 is MQA over the latent (`head_count_kv` 1, `key_length` 576); the
    // plan's latent attention reads the sizes from `mla`, and `head_dim` is the RoPE part's.
    let (head_dim, n_kv_heads) = match &mla {
        Some(m) => (m.qk_rope_head_dim, n_heads),
        None if gemma4 => crate::model::arch::gemma4_gguf_sliding_sizes(&meta)?,
        None => (head_dim, meta.opt_u64("attention.head_count_kv")?.map(|v| v as usize).unwrap_or(n_heads)),
    };
    let mut yarn = gguf_yarn(&meta)?;
    if let (Some(y), Some(_)) = (yarn.as_mut(), &mla) {
        // DeepSeek-V3 and Kimi K2 have `mscale` = `mscale_all_dim`: transformers' attention
        // factor is their ratio, 1 (llama.cpp's converter writes no `attn_factor` for them).
        if meta.opt_f32("rope.scaling.attn_factor")?.is_none() {
            y.attention_factor = 1.0;
        }
        // transformers' default for DeepSeek (`truncate`), which llama.cpp's correction dims
        // (floor / ceil) follow.
        y.truncate = true;
    }
    let mut config = ModelConfig {
        arch: adapter.arch,
        n_layers,
        hidden,
        n_heads,
        n_kv_heads,
        head_dim,
        vocab,
        n_experts: dims.n_experts,
        n_experts_used: meta.usize("expert_used_count")?,
        expert_ff: dims.expert_ff,
        shared_expert_ff: dims.shared_expert_ff,
        rms_eps: meta.opt_f32("attention.layer_norm_rms_epsilon")?.unwrap_or(1e-6),
        rope_theta: meta.opt_f32("rope.freq_base")?.unwrap_or(adapter.default_rope_theta),
        rope_style: adapter.gguf_rope_style,
        rope_linear: gguf_rope_linear(&meta)?,
        norm_topk_prob: meta.opt_bool("expert_weights_norm")?.unwrap_or(adapter.gguf_default_norm_topk),
        tied_embeddings: file.tensor(naming::gguf_global(GlobalRole::Output)).is_none(),
        max_positions: meta.opt_u64("context_length")?.map(|v| v as usize).unwrap_or(4096),
        sliding_window: meta.opt_u64("attention.sliding_window")?.map(|w| w as usize),
        // llama.cpp's SWA pattern for the one architecture here that has a window key: layers
        // 0, 2, 4, ... (`load_swa_pattern(ml, 2)`).
        sliding_window_layers: (meta.file.get(&meta.key("attention.sliding_window")).is_some())
            .then(|| crate::model::config::every_other_layer(meta.usize("block_count").unwrap_or(0))),
        yarn,
        clip_qkv: meta.opt_f32("attention.clamp_kqv")?,
        rotary_dims: meta.opt_u64("rope.dimension_count")?.map_or(head_dim, |d| d as usize),
        hybrid: meta.hybrid(adapter, n_layers)?,
        zero_centred_norms: false,
        mtp_layers,
        mla,
        dense_layers: meta.dense_layers()?,
        sigmoid_routing: meta.sigmoid_routing()?,
        qk_norm: false,
        attention_bias: false,
        global_attention: None,
        embedding_scale: None,
        final_logit_softcap: None,
    };
    if gemma4 {
        crate::model::arch::gemma4_gguf_traits(&meta, &mut config)?;
    }
    config.validate().map_err(|(field, reason)| {
        ModelError::Config(ConfigError::Invalid { path: path.into(), field: field.into(), reason })
    })?;
    // Where the architecture leaves the q/k norm to the config (GLM-4.5's `use_qk_norm`), the
    // file says it by carrying the norms, as llama.cpp reads it; where the architecture fixes
    // it, the flag stays unset as in a `config.json`.
    let fixed = (0..config.n_layers)
        .find_map(|l| (adapter.layer)(&config, l).as_attention().map(|a| a.qk_norm != QkNorm::None))
        .unwrap_or(true);
    config.qk_norm = !fixed && file.tensor("blk.0.attn_q_norm.weight").is_some();
    // The same for the q/k/v biases (GLM-4.5's `attention_bias`; llama.cpp loads them when present).
    if config.attention_bias_is_optional(adapter) {
        config.attention_bias = file.tensor(&naming::gguf_layer(adapter, 0, LayerRole::QBias)).is_some();
    }
    Ok((config, adapter))
}

/// YaRN from `rope.scaling.*` (llama.cpp's keys; the attention factor as transformers derives it
/// unless `rope.scaling.attn_factor` says). The correction range is rounded to whole dims as
/// llama.cpp rounds it (`ggml_rope_yarn_corr_dims`: floor and ceil, for every model): a GGUF file
/// has no key for transformers' `truncate: false` (GPT-OSS's), and llama.cpp reads none.
fn gguf_yarn(meta: &GgufMeta<'_>) -> Result<Option<crate::model::arch::YarnSpec>, ModelError> {
    let key = meta.key("rope.scaling.type");
    let kind = match meta.file.get(&key) {
        None => return Ok(None),
        Some(v) => v.as_str().ok_or_else(|| meta.bad(key.clone(), "a string"))?,
    };
    match kind {
        "none" | "linear" => return Ok(None),
        "yarn" => {}
        _ => return Err(meta.bad(key, "'yarn', 'linear' or 'none' (other RoPE scaling is not supported)")),
    }
    let factor = meta.opt_f32("rope.scaling.factor")?.unwrap_or(1.0);
    Ok(Some(crate::model::arch::YarnSpec {
        factor,
        original_context: meta.usize("rope.scaling.original_context_length")?,
        beta_fast: meta.opt_f32("rope.scaling.yarn_beta_fast")?.unwrap_or(32.0),
        beta_slow: meta.opt_f32("rope.scaling.yarn_beta_slow")?.unwrap_or(1.0),
        truncate: true,
        attention_factor: meta
            .opt_f32("rope.scaling.attn_factor")?
            .unwrap_or_else(|| crate::model::arch::yarn_default_attention_factor(factor)),
    }))
}

/// Linear RoPE scaling's factor (`rope.scaling.type` "linear", `rope.scaling.factor`; llama.cpp's
/// `freq_scale` is its inverse), at least 1.
fn gguf_rope_linear(meta: &GgufMeta<'_>) -> Result<Option<f32>, ModelError> {
    let key = meta.key("rope.scaling.type");
    if meta.file.get(&key).and_then(|v| v.as_str()) != Some("linear") {
        return Ok(None);
    }
    match meta.opt_f32("rope.scaling.factor")? {
        Some(f) if f >= 1.0 && f.is_finite() => Ok(Some(f)),
        _ => Err(meta.bad(meta.key("rope.scaling.factor"), "a factor >= 1 for linear RoPE scaling")),
    }
}

/// Metadata value helpers used by writers.
pub fn meta_u32(v: usize) -> MetaValue {
    MetaValue::U32(v as u32)
}

#[cfg(all(test, target_os = "linux"))]
mod populate_tests {
    use super::*;

    /// Minor page faults of the calling thread so far (`/proc/thread-self/stat`, field 10).
    fn thread_minor_faults() -> u64 {
        let stat = std::fs::read_to_string("/proc/thread-self/stat").unwrap();
        let after_comm = &stat[stat.rfind(')').unwrap() + 2..];
        after_comm.split(' ').nth(7).unwrap().parse().unwrap()
    }

    /// Faults of touching every page of every expert tensor once, on `model`'s mapping.
    fn faults_touching_experts(model: &Model) -> (u64, usize) {
        let c = model.config();
        let before = thread_minor_faults();
        let (mut sum, mut pages) = (0u64, 0usize);
        for l in 0..c.n_layers {
            for e in 0..c.n_experts {
                let x = model.expert(l, e);
                for t in [x.gate, x.up, x.down] {
                    for b in t.data.iter().step_by(4096) {
                        sum = sum.wrapping_add(u64::from(*b));
                        pages += 1;
                    }
                }
            }
        }
        std::hint::black_box(sum);
        (thread_minor_faults() - before, pages)
    }

    /// A fresh mapping faults as its expert pages are first read; a populated one does not
    /// (the kernel maps file pages many at a time, so the plain count is well below one a page:
    /// 29 for 6144 pages on the build machine).
    #[test]
    fn populate_takes_the_first_use_page_faults_out_of_expert_reads() {
        use crate::synth::{tiny_test_options, write_synthetic, DimOverrides, Skew};
        let dir = tempfile::tempdir().unwrap();
        let dims = DimOverrides {
            hidden: Some(512),
            head_dim: Some(64),
            expert_ff: Some(512),
            ..Default::default()
        };
        let opts = tiny_test_options(dir.path().join("m.gguf"), dims, DType::BF16, 9, Skew::Uniform);
        write_synthetic(&opts, &mut |_, _| {}).unwrap();
        let (plain, pages) = faults_touching_experts(&Model::open(&opts.out).unwrap());
        let populated_model = Model::open(&opts.out).unwrap();
        populated_model.populate().unwrap();
        let (populated, _) = faults_touching_experts(&populated_model);
        assert!(pages >= 256, "{pages} pages of experts");
        assert!(plain >= 4, "a fresh mapping faults on first use ({plain} faults over {pages} pages)");
        assert!(
            populated * 4 <= plain,
            "populated: {populated} faults vs {plain} unpopulated over {pages} pages"
        );
    }
}
