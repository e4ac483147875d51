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
/// `tokenizer_files` (`tokenizer.json` first, then its companions) into `dir`. A `dir` that exists and is not empty is refused unless
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
    let mut written = vec!["model.safetensors".to_string(), "config.json".to_string()];
    for (i, file) in tokenizer_files.iter().enumerate() {
        // The tokenizer first, under the name transformers looks for (`data.tokenizer` may
        // name it otherwise).
        let name = match i {
            0 => Some(std::ffi::OsStr::new("tokenizer.json")),
            _ => file.file_name(),
        };
        if let Some(name) = name {
            let to = dir.join(name);
            std::fs::copy(file, &to).map_err(|cause| HfError::Io {
                path: file.clone(),
                cause,
            })?;
            written.push(name.to_string_lossy().into_owned());
        }
    }
    config.insert("torch_dtype".into(), dtype.torch_name().into());
    let text = serde_json::to_string_pretty(&Value::Object(config)).unwrap_or_default();
    write_atomically(&dir.join("config.json"), text.as_bytes())?;
    // A whole model: any other model's files, and an adapter's (transformers would take
    // the directory for one), would go with it wrongly.
    remove_stale(dir, &written, |_| true)
}

/// Files of a Hugging Face model or PEFT adapter directory: what an export writes, and what
/// a previous save of another model may have left that would go with the new one (its shards,
/// another tokenizer). An export with `--force` removes those of its kind it did not write
/// (see [`remove_stale`]); other files are left.
const MODEL_DIR_FILES: &[&str] = &[
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "adapter_config.json",
    "adapter_model.safetensors",
    "adapter_model.bin",
];

/// Whether `name` is a file of a model directory (see [`MODEL_DIR_FILES`]), shards included.
fn is_model_dir_file(name: &str) -> bool {
    let shard = |prefix: &str, ext: &str| {
        name.strip_prefix(prefix)
            .and_then(|rest| rest.strip_suffix(ext))
            .is_some_and(|middle| middle.contains("-of-"))
    };
    MODEL_DIR_FILES.contains(&name)
        || shard("model-", ".safetensors")
        || shard("pytorch_model-", ".bin")
}

/// Makes `dir` to write into, refusing a file, a ddpjob job's directory (or one inside it),
/// or (unless `force`) a directory that is not empty. `flag` is the option that named it.
pub(super) fn prepare_dir(dir: &Path, force: bool, flag: &str) -> Result<(), HfError> {
    if dir.is_file() {
        return Err(HfError::Invalid(format!(
            "`{}` is a file; {flag} names a directory to write into",
            dir.display()
        )));
    }
    if let Some(job) = enclosing_job(dir) {
        return Err(HfError::Invalid(format!(
            "`{}` is inside the directory of job `{}` ({}), whose files an export would \
             replace; {flag} names a directory of its own, e.g. `models/{}`",
            dir.display(),
            job.file_name().unwrap_or_default().to_string_lossy(),
            job.display(),
            job.file_name().unwrap_or_default().to_string_lossy(),
        )));
    }
    let io = |cause| HfError::Io {
        path: dir.to_path_buf(),
        cause,
    };
    if dir.is_dir() {
        let mut entries = std::fs::read_dir(dir).map_err(io)?;
        if entries.next().is_some() && !force {
            return Err(HfError::Invalid(format!(
                "`{}` is not empty; choose another directory or pass --force to replace the \
                 model files in it",
                dir.display()
            )));
        }
    }
    // The user's directory to choose: an error to fix (exit 2), said as a write.
    std::fs::create_dir_all(dir).map_err(|cause| {
        HfError::Invalid(format!(
            "cannot create `{}`: {cause}; {flag} names a directory you can write to",
            dir.display()
        ))
    })
}

/// After an export into `dir` wrote `written`: removes the model-directory files (see
/// [`MODEL_DIR_FILES`]) that `of_kind` says an export of its kind replaces and it did not
/// write, left by an earlier save. Done last, so a failed export leaves the old files.
pub(super) fn remove_stale(
    dir: &Path,
    written: &[String],
    of_kind: impl Fn(&str) -> bool,
) -> Result<(), HfError> {
    let entries = std::fs::read_dir(dir).map_err(|cause| HfError::Io {
        path: dir.to_path_buf(),
        cause,
    })?;
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if is_model_dir_file(&name) && of_kind(&name) && !written.contains(&name) {
            let path = entry.path();
            if path.is_file() {
                std::fs::remove_file(&path).map_err(|cause| HfError::Io { path, cause })?;
            }
        }
    }
    Ok(())
}

/// The ddpjob job directory (one with a `job.toml` and a `state.json`) that `dir` is or is
/// in, if any.
fn enclosing_job(dir: &Path) -> Option<PathBuf> {
    let absolute = std::path::absolute(dir).ok()?;
    // The nearest existing ancestor, resolved (a symlink may lead into a job).
    let existing = absolute
        .ancestors()
        .find(|a| a.exists())?
        .canonicalize()
        .ok()?;
    existing
        .ancestors()
        .find(|a| a.join("job.toml").is_file() && a.join("state.json").is_file())
        .map(Path::to_path_buf)
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

/// Marks `token` (id `id`) as the end of sequence of the model exported to `dir`, the token an
/// instruction-tuned job taught it to end each answer with: `tokenizer_config.json`'s (and
/// `special_tokens_map.json`'s) `eos_token`, and `generation_config.json`'s `eos_token_id`
/// led by `id` (the base's ids kept after it, as an instruct release lists both), so
/// `generate` stops where the model answers.
pub fn mark_end_token(dir: &Path, token: &str, id: u32) -> Result<(), HfError> {
    let edit = |name: &str, change: &dyn Fn(&mut Map<String, Value>)| {
        let path = dir.join(name);
        let Ok(text) = std::fs::read(&path) else {
            return Ok(());
        };
        let Ok(Value::Object(mut json)) = serde_json::from_slice(&text) else {
            return Ok(());
        };
        let before = json.clone();
        change(&mut json);
        if json == before {
            return Ok(());
        }
        let text = serde_json::to_string_pretty(&Value::Object(json)).unwrap_or_default();
        write_atomically(&path, text.as_bytes())
    };
    let name_it = |json: &mut Map<String, Value>| match json.get_mut("eos_token") {
        // An AddedToken written out whole: keep its flags, change its text.
        Some(Value::Object(added)) => {
            added.insert("content".into(), token.into());
        }
        _ => {
            json.insert("eos_token".into(), token.into());
        }
    };
    // Both: an older tokenizer_config.json lets special_tokens_map.json's override it.
    edit("tokenizer_config.json", &name_it)?;
    edit("special_tokens_map.json", &name_it)?;
    edit("generation_config.json", &|json| {
        json.insert("eos_token_id".into(), led_by(id, json.get("eos_token_id")));
    })
}

/// `id`, then the ids of `ids` (one id or a list) that are not `id`: one id alone as a number.
pub fn led_by(id: u32, ids: Option<&Value>) -> Value {
    let mut all = vec![Value::from(id)];
    let others = match ids {
        Some(Value::Array(list)) => list.clone(),
        Some(one @ Value::Number(_)) => vec![one.clone()],
        _ => Vec::new(),
    };
    for other in others {
        if other.as_u64() != Some(u64::from(id)) && !all.contains(&other) {
            all.push(other);
        }
    }
    match all.len() {
        1 => all.remove(0),
        _ => Value::Array(all),
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_end_token_is_named_in_every_file_that_names_one() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path();
        let write = |name: &str, json: &str| std::fs::write(dir.join(name), json).unwrap();
        write(
            "tokenizer_config.json",
            r#"{"eos_token": {"content": "</s>", "special": true}, "x": 1}"#,
        );
        write("special_tokens_map.json", r#"{"eos_token": "</s>"}"#);
        write("generation_config.json", r#"{"eos_token_id": [2, 5]}"#);
        mark_end_token(dir, "<|im_end|>", 7).unwrap();
        let read = |name: &str| -> Value {
            serde_json::from_str(&std::fs::read_to_string(dir.join(name)).unwrap()).unwrap()
        };
        let config = read("tokenizer_config.json");
        assert_eq!(config["eos_token"]["content"], "<|im_end|>");
        assert_eq!(
            (config["eos_token"]["special"].clone(), config["x"].clone()),
            (true.into(), 1.into())
        );
        assert_eq!(read("special_tokens_map.json")["eos_token"], "<|im_end|>");
        assert_eq!(
            read("generation_config.json")["eos_token_id"],
            serde_json::json!([7, 2, 5])
        );
    }

    #[test]
    fn the_end_token_leads_the_ids_it_joins() {
        let json = |text: &str| serde_json::from_str::<Value>(text).unwrap();
        assert_eq!(led_by(7, None), json("7"));
        assert_eq!(led_by(7, Some(&json("7"))), json("7"));
        assert_eq!(led_by(7, Some(&json("2"))), json("[7, 2]"));
        assert_eq!(led_by(7, Some(&json("[2, 7, 9]"))), json("[7, 2, 9]"));
        assert_eq!(led_by(7, Some(&Value::Null)), json("7"));
    }

    #[test]
    fn an_export_replaces_the_model_files_of_its_kind_and_leaves_the_rest() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("out");
        std::fs::create_dir(&dir).unwrap();
        let stale = [
            "tokenizer.json",
            "model-00001-of-00002.safetensors",
            "model.safetensors.index.json",
            "adapter_config.json",
        ];
        for name in stale.iter().chain(&["README.md", "model-notes.txt"]) {
            std::fs::write(dir.join(name), "old").unwrap();
        }
        let err = prepare_dir(&dir, false, "--hf").unwrap_err().to_string();
        assert!(
            err.contains("is not empty") && err.contains("--force"),
            "{err}"
        );
        prepare_dir(&dir, true, "--hf").unwrap();
        let left = || {
            let mut names: Vec<String> = std::fs::read_dir(&dir)
                .unwrap()
                .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .collect();
            names.sort();
            names
        };
        assert_eq!(left().len(), 6, "nothing removed before the export writes");
        // An adapter export replaces the adapter's files only: a base model beside it stays.
        let adapter = ["adapter_model.safetensors".to_string()];
        remove_stale(&dir, &adapter, |n| n.starts_with("adapter_")).unwrap();
        assert_eq!(left().len(), 5);
        assert!(!left().contains(&"adapter_config.json".to_string()));
        // A whole model's export, having written its tokenizer, replaces the rest.
        remove_stale(&dir, &["tokenizer.json".to_string()], |_| true).unwrap();
        assert_eq!(left(), ["README.md", "model-notes.txt", "tokenizer.json"]);
    }

    #[test]
    fn a_job_directory_or_one_inside_it_is_refused_even_with_force() {
        let tmp = tempfile::tempdir().unwrap();
        let job = tmp.path().join("jobs/char");
        std::fs::create_dir_all(job.join("checkpoints/best")).unwrap();
        std::fs::write(job.join("job.toml"), "").unwrap();
        std::fs::write(job.join("state.json"), "{}").unwrap();
        std::fs::write(job.join("model.safetensors"), "weights").unwrap();
        for dir in [
            job.clone(),
            job.join("checkpoints/best"),
            job.join("export/new"),
        ] {
            let err = prepare_dir(&dir, true, "--hf").unwrap_err().to_string();
            assert!(err.contains("inside the directory of job `char`"), "{err}");
        }
        assert_eq!(
            std::fs::read_to_string(job.join("model.safetensors")).unwrap(),
            "weights"
        );
        assert!(!job.join("export").exists());
        // Beside the job is fine.
        prepare_dir(&tmp.path().join("jobs/char-hf"), false, "--hf").unwrap();
    }
}
