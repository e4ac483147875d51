//! Hub ids (`Qwen/Qwen3-0.6B`) where a model directory is accepted, resolved as
//! `from_pretrained` resolves them: the Hugging Face cache (`HF_HUB_CACHE`, else `HF_HOME/hub`,
//! else `~/.cache/huggingface/hub`) holds `models--{org}--{name}/refs/{revision}` (a commit sha)
//! and `snapshots/{sha}/{files}`; what is missing is downloaded from `HF_ENDPOINT` with Hugging
//! Face's own `hf-hub` crate (progress bar per file, resumable `.part` files renamed only when
//! whole, `HF_TOKEN` or the token `hf auth login` saved); `HF_HUB_OFFLINE=1` reads the cache
//! alone. A revision is pinned to its commit before any weight is fetched, so every file of a
//! job comes from one commit even while the repository changes.
//!
//! It knows files and HTTP only, never what a model is: the caller reads the snapshot directory
//! as any other Hugging Face directory.

use std::path::{Path, PathBuf};

use hf_hub::api::sync::{Api, ApiBuilder, ApiError};
use hf_hub::{Cache, Repo, RepoType};
use serde_json::Value;

use super::HfError;

/// The files of a model directory read besides the weights, when the repository has them.
const COMPANIONS: [&str; 5] = [
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",
];
const INDEX: &str = "model.safetensors.index.json";
const WEIGHTS: &str = "model.safetensors";

/// A Hub model resolved to a directory of the cache.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HubModel {
    /// The commit the revision asked for is.
    pub commit: String,
    /// `snapshots/{commit}` in the cache: a Hugging Face model directory.
    pub dir: PathBuf,
    /// Whether anything was downloaded.
    pub downloaded: bool,
    /// Why the cache was read without asking the Hub whether the revision moved (it could not
    /// be reached), for a warning.
    pub unchecked: Option<String>,
}

/// Where the Hub and its cache are, from the environment as `huggingface_hub` reads it.
#[derive(Debug, Clone)]
pub struct HubEnv {
    pub cache: PathBuf,
    pub endpoint: String,
    pub token: Option<String>,
    pub offline: bool,
}

impl HubEnv {
    /// `HF_HUB_CACHE`, `HF_HOME`, `HF_ENDPOINT`, `HF_TOKEN` (else `HF_TOKEN_PATH`'s or
    /// `HF_HOME/token`'s), `HF_HUB_OFFLINE`.
    pub fn from_env() -> HubEnv {
        let var = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
        let home = var("HF_HOME").map(PathBuf::from).unwrap_or_else(|| {
            let cache = var("XDG_CACHE_HOME")
                .map(PathBuf::from)
                .or_else(|| var("HOME").map(|h| Path::new(&h).join(".cache")))
                .unwrap_or_else(|| PathBuf::from(".cache"));
            cache.join("huggingface")
        });
        let token_file = var("HF_TOKEN_PATH").map_or_else(|| home.join("token"), PathBuf::from);
        let token = var("HF_TOKEN").or_else(|| {
            std::fs::read_to_string(token_file)
                .ok()
                .map(|t| t.trim().to_string())
                .filter(|t| !t.is_empty())
        });
        let offline = var("HF_HUB_OFFLINE")
            .is_some_and(|v| ["1", "on", "yes", "true"].contains(&v.to_lowercase().as_str()));
        HubEnv {
            cache: var("HF_HUB_CACHE").map_or_else(|| home.join("hub"), PathBuf::from),
            endpoint: var("HF_ENDPOINT")
                .unwrap_or_else(|| "https://huggingface.co".into())
                .trim_end_matches('/')
                .to_string(),
            token,
            offline,
        }
    }

    /// `models--{org}--{name}` of the cache.
    fn repo_dir(&self, id: &str) -> PathBuf {
        self.cache
            .join(format!("models--{}", id.replace('/', "--")))
    }
}

/// Whether `text` reads as a Hub model id (`org/name`, the Hub's characters), not a path.
pub fn looks_like_id(text: &str) -> bool {
    let part = |p: &str| {
        !p.is_empty()
            && !p.starts_with(['.', '-'])
            && p.chars()
                .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
    };
    matches!(text.split_once('/'), Some((org, name)) if part(org) && part(name) && !name.contains('/'))
}

/// The model `id` at `revision` as a directory of the cache, downloading what it lacks (unless
/// offline).
pub fn resolve(id: &str, revision: &str, env: &HubEnv) -> Result<HubModel, HfError> {
    let cached = cached_commit(env, id, revision).filter(|c| complete(&snapshot(env, id, c)));
    let model = |commit: String, downloaded| HubModel {
        dir: snapshot(env, id, &commit),
        commit,
        downloaded,
        unchecked: None,
    };
    if env.offline {
        return match cached {
            Some(commit) => Ok(model(commit, false)),
            None => Err(HfError::Invalid(format!(
                "`{id}` (revision {revision}) is not in the Hugging Face cache {} and \
                 HF_HUB_OFFLINE forbids downloading it: unset HF_HUB_OFFLINE (or set it to 0) \
                 on a machine that reaches the Hub, or fetch it first with `hf download {id} \
                 --revision {revision}`",
                env.cache.display()
            ))),
        };
    }
    // A commit sha already whole in the cache is what it will always be: no request.
    if is_commit(revision)
        && let Some(commit) = &cached
    {
        return Ok(model(commit.clone(), false));
    }
    let api = api(env)?;
    let asked = api.repo(Repo::with_revision(
        id.into(),
        RepoType::Model,
        revision.into(),
    ));
    let commit = match api.metadata(&asked.url("config.json")) {
        Ok(found) => found.commit_hash().to_string(),
        // The Hub out of reach (no answer at all) and the revision whole in the cache: that,
        // as `from_pretrained` falls back to it.
        Err(e) if status(&e).is_none() && cached.is_some() => {
            let commit = cached.unwrap_or_default();
            return Ok(HubModel {
                unchecked: Some(format!(
                    "the Hub ({}) is out of reach ({e}): `{id}` revision {revision} read from the \
                     cache as commit {commit}, which may not be its newest",
                    env.endpoint
                )),
                ..model(commit, false)
            });
        }
        Err(e) => return Err(hub_error(e, id, revision, "config.json", env)),
    };
    let pinned = api.repo(Repo::with_revision(
        id.into(),
        RepoType::Model,
        commit.clone(),
    ));
    let dir = snapshot(env, id, &commit);
    let mut downloaded = false;
    let mut fetch = |file: &str, required: bool| -> Result<bool, HfError> {
        if dir.join(file).is_file() {
            return Ok(true);
        }
        match pinned.download(file) {
            Ok(_) => {
                downloaded = true;
                Ok(true)
            }
            Err(e) if !required && status(&e) == Some(404) => Ok(false),
            Err(e) => Err(hub_error(e, id, &commit, file, env)),
        }
    };
    fetch("config.json", true)?;
    if fetch(INDEX, false)? {
        for shard in shards(&dir.join(INDEX))? {
            fetch(&shard, true)?;
        }
    } else if !fetch(WEIGHTS, false)? {
        return Err(HfError::Invalid(format!(
            "`{id}` (commit {commit}) has neither {WEIGHTS} nor {INDEX}: ddpjob reads \
             safetensors weights, not pytorch_model.bin"
        )));
    }
    for file in COMPANIONS {
        fetch(file, false)?;
    }
    // `refs/{revision}` names the commit, as huggingface_hub writes it (for a branch or a tag).
    if !is_commit(revision) {
        Cache::new(env.cache.clone())
            .repo(Repo::with_revision(
                id.into(),
                RepoType::Model,
                revision.into(),
            ))
            .create_ref(&commit)
            .map_err(|cause| HfError::Io {
                path: env.repo_dir(id).join("refs").join(revision),
                cause,
            })?;
    }
    Ok(model(commit, downloaded))
}

pub(super) fn api(env: &HubEnv) -> Result<Api, HfError> {
    ApiBuilder::from_cache(Cache::new(env.cache.clone()))
        .with_endpoint(env.endpoint.clone())
        .with_token(env.token.clone())
        .with_progress(true)
        .with_retries(3)
        .build()
        .map_err(|e| HfError::Invalid(format!("cannot set up the Hub's client: {e}")))
}

/// The commit `revision` names in the cache: itself when a sha, else `refs/{revision}`'s.
fn cached_commit(env: &HubEnv, id: &str, revision: &str) -> Option<String> {
    if is_commit(revision) {
        return Some(revision.into());
    }
    let text = std::fs::read_to_string(env.repo_dir(id).join("refs").join(revision)).ok()?;
    Some(text.trim().to_string()).filter(|c| is_commit(c))
}

fn snapshot(env: &HubEnv, id: &str, commit: &str) -> PathBuf {
    env.repo_dir(id).join("snapshots").join(commit)
}

pub(super) fn is_commit(revision: &str) -> bool {
    revision.len() == 40 && revision.chars().all(|c| c.is_ascii_hexdigit())
}

/// Whether a snapshot holds `config.json` and whole weights (the file, or the index and every
/// shard it lists).
fn complete(dir: &Path) -> bool {
    if !dir.join("config.json").is_file() {
        return false;
    }
    match shards(&dir.join(INDEX)) {
        Ok(shards) => shards.iter().all(|s| dir.join(s).is_file()),
        Err(_) => dir.join(WEIGHTS).is_file(),
    }
}

/// The shard files an index's `weight_map` names, each once, in order.
fn shards(index: &Path) -> Result<Vec<String>, HfError> {
    let text = std::fs::read_to_string(index).map_err(|cause| HfError::Io {
        path: index.into(),
        cause,
    })?;
    let bad = || HfError::Invalid(format!("`{}` has no weight_map of files", index.display()));
    let json: Value = serde_json::from_str(&text).map_err(|_| bad())?;
    let map = json
        .get("weight_map")
        .and_then(Value::as_object)
        .ok_or_else(bad)?;
    let mut files: Vec<String> = Vec::new();
    for file in map.values() {
        let file = file.as_str().ok_or_else(bad)?;
        // A shard's name is a file beside the index, never a path out of the snapshot.
        if file.contains('/') || file.starts_with('.') {
            return Err(bad());
        }
        if !files.iter().any(|f| f == file) {
            files.push(file.into());
        }
    }
    Ok(files)
}

/// The HTTP status of a failed request, when the Hub answered.
pub(super) fn status(e: &ApiError) -> Option<u16> {
    match e {
        ApiError::RequestError(e) => match e.as_ref() {
            ureq::Error::StatusCode(code) => Some(*code),
            _ => None,
        },
        ApiError::TooManyRetries(e) => status(e),
        _ => None,
    }
}

/// What a failed request means for the user, and what fixes it.
fn hub_error(e: ApiError, id: &str, revision: &str, file: &str, env: &HubEnv) -> HfError {
    let fetch = format!("`hf download {id} --revision {revision}`");
    let problem = match status(&e) {
        Some(401 | 403) => format!(
            "the Hub ({}) refused `{id}`: the repository is private or gated (accept its terms \
             on its page), or does not exist; {}",
            env.endpoint,
            match env.token {
                Some(_) => "the token given (HF_TOKEN or `hf auth login`) is not allowed it",
                None => "no token was given: run `hf auth login` or set HF_TOKEN",
            }
        ),
        Some(404) => format!(
            "the Hub ({}) has no `{file}` for `{id}` at revision {revision}: check the id and \
             the revision (model.revision; default main)",
            env.endpoint
        ),
        Some(code) => format!(
            "the Hub ({}) answered {code} for `{file}` of `{id}`: try again later, or fetch it \
             with {fetch}",
            env.endpoint
        ),
        None => format!(
            "cannot download `{file}` of `{id}` from {}: {e}; on a machine without the \
             network, fetch it elsewhere with {fetch} into the cache ({}) and set \
             HF_HUB_OFFLINE=1",
            env.endpoint,
            env.cache.display()
        ),
    };
    HfError::Invalid(problem)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_told_from_paths() {
        for id in ["Qwen/Qwen3-0.6B", "HuggingFaceTB/SmolLM2-135M", "a/b.c_d-e"] {
            assert!(looks_like_id(id), "{id}");
        }
        for path in [
            "models/x/y",
            "./models",
            "../up/model",
            "/abs/path",
            "gpt2",
            "org/",
            "/name",
            "a b/c",
            "jobs/NAME/checkpoints/best",
        ] {
            assert!(!looks_like_id(path), "{path}");
        }
    }

    #[test]
    fn shards_are_read_from_the_index_once_each_and_never_outside() {
        let tmp = tempfile::tempdir().unwrap();
        let index = tmp.path().join(INDEX);
        let map = r#"{"weight_map": {"a": "m-1.safetensors", "b": "m-2.safetensors", "c": "m-1.safetensors"}}"#;
        std::fs::write(&index, map).unwrap();
        assert_eq!(
            shards(&index).unwrap(),
            ["m-1.safetensors", "m-2.safetensors"]
        );
        std::fs::write(&index, r#"{"weight_map": {"a": "../../etc/passwd"}}"#).unwrap();
        assert!(shards(&index).is_err());
    }
}
