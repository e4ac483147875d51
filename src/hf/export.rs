//! Writing a Hugging Face model directory: `config.json`, `model.safetensors` and the
//! tokenizer files, each written to a temporary name and renamed, so a directory that has a
//! `config.json` has the rest too.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Tensor};
use serde_json::{Map, Value};

use super::HfError;

/// The dtype of the exported weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExportDtype {
    F32,
    Bf16,
}

impl ExportDtype {
    /// `config.json`'s `torch_dtype` for it.
    pub fn torch_name(self) -> &'static str {
        match self {
            ExportDtype::F32 => "float32",
            ExportDtype::Bf16 => "bfloat16",
        }
    }
}

/// Writes `config` as `config.json`, `tensors` as `model.safetensors` (in `dtype`) and copies
/// `tokenizer_files` into `dir`. A `dir` that exists and is not empty is refused unless
/// `force`.
pub fn export(
    dir: &Path,
    mut config: Map<String, Value>,
    tensors: HashMap<String, Tensor>,
    tokenizer_files: &[PathBuf],
    dtype: ExportDtype,
    force: bool,
) -> Result<(), HfError> {
    prepare_dir(dir, force, "--hf")?;
    save_weights(dir, "model.safetensors", tensors, dtype)?;
    for file in tokenizer_files {
        if let Some(name) = file.file_name() {
            let to = dir.join(name);
            std::fs::copy(file, &to).map_err(|cause| HfError::Io {
                path: file.clone(),
                cause,
            })?;
        }
    }
    config.insert("torch_dtype".into(), dtype.torch_name().into());
    let text = serde_json::to_string_pretty(&Value::Object(config)).unwrap_or_default();
    write_atomically(&dir.join("config.json"), text.as_bytes())
}

/// Makes `dir` to write into, refusing a file or (unless `force`) a directory that is not
/// empty; `flag` is the option that named it.
pub(super) fn prepare_dir(dir: &Path, force: bool, flag: &str) -> Result<(), HfError> {
    if dir.is_file() {
        return Err(HfError::Invalid(format!(
            "`{}` is a file; {flag} names a directory to write into",
            dir.display()
        )));
    }
    if dir.is_dir() {
        let mut entries = std::fs::read_dir(dir).map_err(|cause| HfError::Io {
            path: dir.to_path_buf(),
            cause,
        })?;
        if entries.next().is_some() && !force {
            return Err(HfError::Invalid(format!(
                "`{}` is not empty; choose another directory or pass --force to overwrite its \
                 files",
                dir.display()
            )));
        }
    }
    std::fs::create_dir_all(dir).map_err(|cause| HfError::Io {
        path: dir.to_path_buf(),
        cause,
    })
}

/// `tensors` in `dtype` as the safetensors file `name` in `dir`, written under a temporary
/// name and renamed.
pub(super) fn save_weights(
    dir: &Path,
    name: &str,
    tensors: HashMap<String, Tensor>,
    dtype: ExportDtype,
) -> Result<(), HfError> {
    let want = match dtype {
        ExportDtype::F32 => DType::F32,
        ExportDtype::Bf16 => DType::BF16,
    };
    let mut converted = HashMap::with_capacity(tensors.len());
    for (name, t) in tensors {
        let t = t
            .to_dtype(want)
            .and_then(|t| t.to_device(&candle_core::Device::Cpu))
            .and_then(|t| t.contiguous())
            .map_err(|cause| HfError::Weights {
                path: dir.to_path_buf(),
                cause,
            })?;
        converted.insert(name, t);
    }
    let weights = dir.join(name);
    let partial = dir.join(format!(".{name}.partial"));
    crate::jobdir::save_tensors(&converted, &partial).map_err(|cause| HfError::Weights {
        path: partial.clone(),
        cause,
    })?;
    std::fs::rename(&partial, &weights).map_err(|cause| HfError::Io {
        path: weights.clone(),
        cause,
    })
}

pub(super) fn write_atomically(path: &Path, bytes: &[u8]) -> Result<(), HfError> {
    let partial = path.with_extension("partial");
    std::fs::write(&partial, bytes).map_err(|cause| HfError::Io {
        path: partial.clone(),
        cause,
    })?;
    std::fs::rename(&partial, path).map_err(|cause| HfError::Io {
        path: path.to_path_buf(),
        cause,
    })
}
