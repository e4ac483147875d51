//! The tokenizer an export ships, kept in the job when it starts (`tokenizer/` in the job
//! directory): the model directory or tokenizer file the job named may move or change later,
//! and an export must carry the tokenizer the job trained with, its companions
//! (`tokenizer_config.json`, `special_tokens_map.json`, `generation_config.json`,
//! `chat_template.jinja`) and the ids
//! the base's `config.json` gave its special tokens.

use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

use crate::vocab::Vocab;
use ddpjob_spec::JobSpec;

/// The job's copy, under its directory.
pub const DIR: &str = "tokenizer";
/// The base's `bos_token_id`, `eos_token_id` and `pad_token_id`, kept beside its tokenizer.
const BASE_IDS: &str = "base_token_ids.json";
const MAIN: &str = "tokenizer.json";
const COMPANIONS: [&str; 4] = [
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    // The chat template transformers 5 saves beside the tokenizer.
    "chat_template.jinja",
];
const SPECIAL_IDS: [&str; 3] = ["bos_token_id", "eos_token_id", "pad_token_id"];

/// A Hugging Face tokenizer's files and what goes with them in an export.
#[derive(Debug, Default, PartialEq)]
pub struct TokenizerFiles {
    /// `tokenizer.json` (whatever its name where it was found) first, then its companions.
    pub files: Vec<PathBuf>,
    /// The base model's special-token ids, when the tokenizer is the base's own.
    pub base_ids: Map<String, Value>,
}

impl TokenizerFiles {
    pub fn is_empty(&self) -> bool {
        self.files.is_empty()
    }
}

/// The tokenizer of the job in `job_root` as an export carries it: the copy the job kept, or,
/// for a job of an older version, where its config says the tokenizer is now. Nothing for
/// ddpjob's own char and byte vocabularies. `data_tokenizer`: the `tokenizer.json` the job's
/// data names (its dataset's `tokenizer_file`, which the registry knows).
pub fn of_job(spec: &JobSpec, data_tokenizer: Option<PathBuf>, job_root: &Path) -> TokenizerFiles {
    if let Some(kept) = kept(job_root) {
        return read(&kept);
    }
    match Vocab::load(&Vocab::path_in(job_root)) {
        Ok(Vocab::HuggingFace(_)) | Err(_) => named_by(spec, data_tokenizer),
        Ok(_) => TokenizerFiles::default(),
    }
}

/// The directory of the copy the job at `job_root` kept, if it has one.
pub fn kept(job_root: &Path) -> Option<PathBuf> {
    let dir = job_root.join(DIR);
    dir.join(MAIN).is_file().then_some(dir)
}

/// Copies the tokenizer `spec` names (the data's, else the base's) into the new job at `job_root`.
pub fn keep(
    spec: &JobSpec,
    data_tokenizer: Option<PathBuf>,
    job_root: &Path,
) -> std::io::Result<()> {
    let found = named_by(spec, data_tokenizer);
    let Some((main, companions)) = found.files.split_first() else {
        return Ok(());
    };
    let dir = job_root.join(DIR);
    std::fs::create_dir_all(&dir)?;
    crate::jobdir::write_atomic(&dir.join(MAIN), &std::fs::read(main)?)?;
    for file in companions {
        if let Some(name) = file.file_name() {
            crate::jobdir::write_atomic(&dir.join(name), &std::fs::read(file)?)?;
        }
    }
    if !found.base_ids.is_empty() {
        let text = serde_json::to_string_pretty(&Value::Object(found.base_ids)).unwrap_or_default();
        crate::jobdir::write_atomic(&dir.join(BASE_IDS), text.as_bytes())?;
    }
    Ok(())
}

/// Where `spec` says the tokenizer is: the data's `tokenizer.json` (`data_tokenizer`), else the `tokenizer.json` of
/// `model.init_from` (a model directory, or a job's kept copy); its companions from the same
/// directory; the base's special-token ids when it is the base's own tokenizer.
fn named_by(spec: &JobSpec, data_tokenizer: Option<PathBuf>) -> TokenizerFiles {
    let base = spec.model.init_from().map(PathBuf::from);
    let main = match (data_tokenizer, &base) {
        (Some(file), _) => file,
        (None, Some(base)) if base.join(MAIN).is_file() => base.join(MAIN),
        // A job's (`init_from = "jobs/NAME"`): the copy it kept.
        (None, Some(base)) => match kept(base) {
            Some(kept) => kept.join(MAIN),
            None => return TokenizerFiles::default(),
        },
        (None, None) => return TokenizerFiles::default(),
    };
    if !main.is_file() {
        return TokenizerFiles::default();
    }
    let dir = main.parent().unwrap_or(Path::new("."));
    if dir.join(BASE_IDS).is_file() {
        return read(dir);
    }
    let files = with_companions(main.clone(), dir);
    let own = base.as_deref().is_some_and(|b| same_dir(b, dir));
    let base_ids = match (own, &base) {
        (true, Some(base)) => special_ids(&base.join("config.json")),
        _ => Map::new(),
    };
    TokenizerFiles { files, base_ids }
}

/// A kept copy, as [`keep`] wrote it.
fn read(dir: &Path) -> TokenizerFiles {
    TokenizerFiles {
        files: with_companions(dir.join(MAIN), dir),
        base_ids: special_ids(&dir.join(BASE_IDS)),
    }
}

/// `main`, then the companions of it that `dir` has.
fn with_companions(main: PathBuf, dir: &Path) -> Vec<PathBuf> {
    let companions = COMPANIONS.iter().map(|name| dir.join(name));
    std::iter::once(main)
        .chain(companions.filter(|p| p.is_file()))
        .collect()
}

/// `bos_token_id`, `eos_token_id` and `pad_token_id` of a JSON object file (a `config.json`),
/// those it has.
fn special_ids(path: &Path) -> Map<String, Value> {
    let json = std::fs::read(path)
        .ok()
        .and_then(|text| serde_json::from_slice::<Value>(&text).ok());
    let Some(Value::Object(json)) = json else {
        return Map::new();
    };
    json.into_iter()
        .filter(|(key, id)| SPECIAL_IDS.contains(&key.as_str()) && !id.is_null())
        .collect()
}

fn same_dir(a: &Path, b: &Path) -> bool {
    let canonical = |p: &Path| std::fs::canonicalize(p).unwrap_or_else(|_| p.to_path_buf());
    canonical(a) == canonical(b)
}
