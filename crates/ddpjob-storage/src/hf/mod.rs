//! Hugging Face model directories, in and out: `config.json`, `model.safetensors` (or the
//! shards a `model.safetensors.index.json` lists) and `tokenizer.json`. What a field of
//! `config.json` means is the architecture's business (`models::llama::options`); this module
//! finds the files, reads the fields with errors that name them, memory-maps the weights into
//! a model's parameters, and writes an export that `transformers` loads.

pub mod dataset_layout;
mod export;
pub mod hub;
pub mod hub_dataset;
pub mod job_tokenizer;
pub mod peft;
mod quantized;

use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};

use candle_core::safetensors::MmapedSafetensors;
use candle_core::{DType, Device};
use serde_json::{Map, Value};
use thiserror::Error;

use ddpjob_seam::Params;
pub use export::{ExportDtype, export, led_by, mark_end_token};

thread_local! {
    static CHECKING: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Runs `f` with weights checked, not loaded: a model built inside reads only its files'
/// headers, their names, shapes and types set against its parameters as a load would, and
/// touches none of its blank memory. The launcher's and `validate`'s pre-flight of what every
/// worker will load, so weights that do not fit are refused before the job exists.
pub fn checking<T>(f: impl FnOnce() -> T) -> T {
    /// Puts the flag back however `f` ends (a caught panic must not leave real loads dry).
    struct Restore(bool);
    impl Drop for Restore {
        fn drop(&mut self) {
            CHECKING.set(self.0);
        }
    }
    let _restore = Restore(CHECKING.replace(true));
    f()
}

/// Whether weights are only checked here (see [`checking`]).
pub fn is_checking() -> bool {
    CHECKING.get()
}

/// What an export writes: `config.json`'s fields and the tensors of `model.safetensors` by name.
pub type HfParts = (
    Map<String, Value>,
    std::collections::HashMap<String, candle_core::Tensor>,
);

#[derive(Debug, Error)]
pub enum HfError {
    #[error("{0}")]
    Invalid(String),
    #[error("cannot read `{}`: {cause}", path.display())]
    Io {
        path: PathBuf,
        cause: std::io::Error,
    },
    #[error("`{}` is not valid JSON: {cause}", path.display())]
    Json {
        path: PathBuf,
        cause: serde_json::Error,
    },
    #[error("cannot read the weights in `{}`: {cause}", path.display())]
    Weights {
        path: PathBuf,
        cause: candle_core::Error,
    },
}

/// A model directory in the Hugging Face layout, its `config.json` parsed.
#[derive(Debug, Clone)]
pub struct HfDir {
    pub root: PathBuf,
    pub config: Map<String, Value>,
    /// The safetensors files holding the weights (one, or the index's shards).
    pub weight_files: Vec<PathBuf>,
}

impl HfDir {
    /// Opens `root`: it must be a directory with a `config.json` and safetensors weights.
    pub fn open(root: &Path) -> Result<HfDir, HfError> {
        let config = read_config(root)?;
        quantized::refuse_foreign(root, &config)?;
        let weight_files = weight_files(root)?;
        Ok(HfDir {
            root: root.to_path_buf(),
            config,
            weight_files,
        })
    }

    /// Checks that the weight files are whole safetensors files (headers only: cheap), as
    /// the job's config is validated.
    pub fn check_weight_files(&self) -> Result<(), HfError> {
        check_headers(&self.weight_files)
    }

    /// `model_type`, or an error naming the file.
    pub fn model_type(&self) -> Result<&str, HfError> {
        self.config
            .get("model_type")
            .and_then(Value::as_str)
            .ok_or_else(|| self.invalid("has no \"model_type\"; is it a transformers config?"))
    }

    fn invalid(&self, what: &str) -> HfError {
        HfError::Invalid(format!(
            "`{}` {what}",
            self.root.join("config.json").display()
        ))
    }

    /// `key` read by `read` (`what` names the type for the error), `default` when absent
    /// (absent with no default: an error saying it is required).
    fn typed<'a, T>(
        &'a self,
        key: &str,
        default: Option<T>,
        read: impl FnOnce(&'a Value) -> Option<T>,
        what: &str,
    ) -> Result<T, HfError> {
        match self.config.get(key) {
            None | Some(Value::Null) => {
                default.ok_or_else(|| self.invalid(&format!("has no \"{key}\", which is required")))
            }
            Some(v) => {
                read(v).ok_or_else(|| self.invalid(&format!("has \"{key}\": {v}, not {what}")))
            }
        }
    }

    /// The positive integer `key`, `default` when absent.
    pub fn usize_or(&self, key: &str, default: Option<usize>) -> Result<usize, HfError> {
        self.typed(
            key,
            default,
            |v| v.as_u64().map(|n| n as usize),
            "an integer",
        )
    }

    pub fn f64_or(&self, key: &str, default: f64) -> Result<f64, HfError> {
        self.typed(key, Some(default), Value::as_f64, "a number")
    }

    pub fn bool_or(&self, key: &str, default: bool) -> Result<bool, HfError> {
        self.typed(key, Some(default), Value::as_bool, "true or false")
    }

    pub fn str_or<'a>(&'a self, key: &str, default: &'a str) -> Result<&'a str, HfError> {
        self.typed(key, Some(default), Value::as_str, "a string")
    }

    /// Sets every parameter of `params` from the directory's weights, converted to f32.
    /// `ignored` names tensors the file may hold that the model does not use (buffers such as
    /// `rotary_emb.inv_freq`). Any parameter missing, any shape that differs, or any other
    /// tensor left over is an error naming it.
    pub fn load_into(
        &self,
        params: &Params,
        ignored: impl Fn(&str) -> bool,
    ) -> Result<(), HfError> {
        self.load_with(params, &SameLayout(ignored))
    }

    /// [`HfDir::load_into`] for an architecture whose files name or lay out some tensors
    /// unlike the model does (GPT-2's `[in, out]` Conv1D weights): `layout` says where each
    /// parameter is in the file and how to turn it into the parameter's layout.
    pub fn load_with(&self, params: &Params, layout: &dyn FileLayout) -> Result<(), HfError> {
        // SAFETY: the files are mapped read-only and only read while `tensors` lives; a file
        // changed underneath a running job is the same hazard as for any memory-mapped input.
        let tensors = unsafe { MmapedSafetensors::multi(&self.weight_files) }.map_err(|cause| {
            HfError::Weights {
                path: self.root.clone(),
                cause,
            }
        })?;
        let present: HashSet<String> = tensors.tensors().into_iter().map(|(n, _)| n).collect();
        if is_checking() {
            // The header's shape, as a tensor that holds no data.
            let header = |name: &str| {
                let view = tensors.get(name)?;
                DType::try_from(view.dtype())?;
                candle_core::Tensor::zeros((), DType::F32, &Device::Cpu)?.broadcast_as(view.shape())
            };
            return self.load_from(&present, header, params, layout);
        }
        self.load_from(
            &present,
            |name| tensors.load(name, &Device::Cpu),
            params,
            layout,
        )
    }

    /// [`HfDir::load_with`] from the tensors named `present`, read by `load` (the files', or
    /// weights already in memory).
    pub fn load_from(
        &self,
        present: &HashSet<String>,
        load: impl Fn(&str) -> candle_core::Result<candle_core::Tensor>,
        params: &Params,
        layout: &dyn FileLayout,
    ) -> Result<(), HfError> {
        let weights = |cause| HfError::Weights {
            path: self.root.clone(),
            cause,
        };
        let aliases: HashSet<&str> = params.aliases().map(|(a, _)| a).collect();
        let mut used = HashSet::new();
        for (name, var) in params.iter() {
            let file_name = layout.file_name(name, present);
            if file_name.is_none() && ddpjob_spec::is_adapter(name) {
                // A LoRA adapter the base weights do not have: it stays as drawn (B = 0).
                continue;
            }
            let Some(file_name) = file_name else {
                return Err(self.missing(name));
            };
            if let Some(fix) = quantized::saved_in_four_bits(self, &file_name, present) {
                return Err(fix);
            }
            let tensor = self.read_as(name, &file_name, var.dims(), &load, layout)?;
            if !is_checking() {
                tensor
                    .to_dtype(DType::F32)
                    .and_then(|t| t.to_device(var.device()))
                    .and_then(|t| var.set(&t))
                    .map_err(weights)?;
            }
            used.insert(file_name);
        }
        self.fill_packed(present, &load, params, layout, &mut used)?;
        let mut extra: Vec<&String> = present
            .iter()
            .filter(|n| !used.contains(*n) && !aliases.contains(n.as_str()))
            .filter(|n| !layout.ignored(n))
            .collect();
        extra.sort();
        if let Some(first) = extra.first() {
            return Err(HfError::Invalid(format!(
                "`{}` holds {} tensor(s) the model described by its config.json does not have, \
                 e.g. `{first}`; the weights do not belong to this config",
                self.root.display(),
                extra.len()
            )));
        }
        Ok(())
    }
}

impl HfDir {
    /// The error for a tensor `name` the model needs and the files lack.
    fn missing(&self, name: &str) -> HfError {
        HfError::Invalid(format!(
            "`{}` has no tensor `{name}`, which the model described by its config.json needs; \
             the weights do not belong to this config",
            self.root.display()
        ))
    }

    /// The file's tensor `file_name`, read by `load`, in the layout of the model's `name`,
    /// whose shape must be `dims`.
    fn read_as(
        &self,
        name: &str,
        file_name: &str,
        dims: &[usize],
        load: &dyn Fn(&str) -> candle_core::Result<candle_core::Tensor>,
        layout: &dyn FileLayout,
    ) -> Result<candle_core::Tensor, HfError> {
        let weights = |cause| HfError::Weights {
            path: self.root.clone(),
            cause,
        };
        let stored = load(file_name).map_err(weights)?;
        let tensor = layout.to_model(name, stored, dims).map_err(weights)?;
        if tensor.dims() != dims {
            return Err(HfError::Invalid(format!(
                "`{}`: tensor `{file_name}` has shape {:?}, the model expects {dims:?}",
                self.root.display(),
                tensor.dims(),
            )));
        }
        Ok(tensor)
    }
}

/// How an architecture's files hold its parameters (see [`HfDir::load_with`]).
pub trait FileLayout {
    /// The name under which the file holds parameter `name`, among the `present` ones.
    fn file_name(&self, name: &str, present: &HashSet<String>) -> Option<String> {
        present.contains(name).then(|| name.to_string())
    }
    /// The stored tensor of parameter `name` in the model's layout (whose shape is `dims`).
    fn to_model(
        &self,
        _name: &str,
        stored: candle_core::Tensor,
        _dims: &[usize],
    ) -> candle_core::Result<candle_core::Tensor> {
        Ok(stored)
    }
    /// A tensor of the file the model has no use for (a buffer), not an error.
    fn ignored(&self, file_name: &str) -> bool;
}

/// Names and layouts as the model's, some tensors ignored.
pub struct SameLayout<F>(pub F);

impl<F: Fn(&str) -> bool> FileLayout for SameLayout<F> {
    fn ignored(&self, file_name: &str) -> bool {
        (self.0)(file_name)
    }
}

fn read_config(root: &Path) -> Result<Map<String, Value>, HfError> {
    if root.is_file() {
        return Err(HfError::Invalid(format!(
            "`{}` is a file; model.init_from names a model directory (with config.json and \
             model.safetensors), e.g. the one `huggingface-cli download gpt2 --local-dir \
             models/gpt2` makes",
            root.display()
        )));
    }
    if !root.is_dir() {
        // The Hub repository of the directory's usual name, else a placeholder.
        let name = root.file_name().map(|n| n.to_string_lossy().into_owned());
        let repo = match name.as_deref() {
            Some(n @ ("gpt2" | "gpt2-medium" | "gpt2-large" | "gpt2-xl")) => n.to_string(),
            Some(n) if n.starts_with("SmolLM2") => format!("HuggingFaceTB/{n}"),
            Some(n) if n.starts_with("Qwen") => format!("Qwen/{n}"),
            _ => "<repository id>".into(),
        };
        return Err(HfError::Invalid(format!(
            "the model directory `{}` does not exist; download it, e.g. `huggingface-cli \
             download {repo} --local-dir {}`",
            root.display(),
            root.display()
        )));
    }
    let path = root.join("config.json");
    if !path.is_file() {
        return Err(HfError::Invalid(format!(
            "`{}` has no config.json: it is not a Hugging Face model directory",
            root.display()
        )));
    }
    let text = std::fs::read_to_string(&path).map_err(|cause| HfError::Io {
        path: path.clone(),
        cause,
    })?;
    match serde_json::from_str(&text) {
        Ok(Value::Object(map)) => Ok(map),
        Ok(_) => Err(HfError::Invalid(format!(
            "`{}` is not a JSON object",
            path.display()
        ))),
        Err(cause) => Err(HfError::Json { path, cause }),
    }
}

/// Each weight file is a whole safetensors file: its header reads and its tensors cover it
/// exactly (a truncated download, an empty or foreign file fail here, when the job is
/// validated, rather than in a worker once the job exists). Only the headers are read.
fn check_headers(files: &[PathBuf]) -> Result<(), HfError> {
    for file in files {
        // SAFETY: mapped read-only and dropped at once; only the header pages are touched.
        if let Err(cause) = unsafe { MmapedSafetensors::new(file) } {
            return Err(HfError::Invalid(format!(
                "`{}` is not a whole safetensors file ({cause}); an interrupted download? \
                 fetch it again",
                file.display()
            )));
        }
    }
    Ok(())
}

fn weight_files(root: &Path) -> Result<Vec<PathBuf>, HfError> {
    let single = root.join("model.safetensors");
    if single.is_file() {
        return Ok(vec![single]);
    }
    let index = root.join("model.safetensors.index.json");
    if !index.is_file() {
        return Err(HfError::Invalid(format!(
            "`{}` has neither model.safetensors nor model.safetensors.index.json (PyTorch \
             `.bin` weights are not read: save them with `save_pretrained(dir, \
             safe_serialization=True)`)",
            root.display()
        )));
    }
    let text = std::fs::read_to_string(&index).map_err(|cause| HfError::Io {
        path: index.clone(),
        cause,
    })?;
    let parsed: Value = serde_json::from_str(&text).map_err(|cause| HfError::Json {
        path: index.clone(),
        cause,
    })?;
    let map = parsed
        .get("weight_map")
        .and_then(Value::as_object)
        .ok_or_else(|| {
            HfError::Invalid(format!(
                "`{}` has no \"weight_map\" object",
                index.display()
            ))
        })?;
    let files: BTreeMap<&str, ()> = map
        .values()
        .filter_map(Value::as_str)
        .map(|f| (f, ()))
        .collect();
    let mut paths = Vec::new();
    for file in files.keys() {
        let path = root.join(file);
        if !path.is_file() {
            return Err(HfError::Invalid(format!(
                "`{}` lists `{file}`, which is missing from `{}`",
                index.display(),
                root.display()
            )));
        }
        paths.push(path);
    }
    Ok(paths)
}
