//! Hub dataset ids (`HuggingFaceH4/ultrachat_200k`) where parquet files are accepted, resolved
//! through the Hugging Face cache as `datasets.load_dataset` resolves them: the repository's
//! file list at the revision (the Hub's `/api/datasets/{id}/revision/{revision}`), the config's
//! splits told apart by their names (`dataset_layout`), and when the repository holds no
//! parquet for them (jsonl, csv, a loading script, a README's own `configs:`) the Hub's parquet
//! export on the `refs/convert/parquet` branch. The files are downloaded into
//! `datasets--{org}--{name}/snapshots/{commit}` with `hf-hub`, as models are (`hub`), and the
//! revision pinned to its commit first; offline, or with the Hub out of reach, the cache alone.
//!
//! It knows files and HTTP, never rows: the caller reads the files as any other parquet.

use std::path::{Path, PathBuf};

use hf_hub::api::sync::ApiError;
use hf_hub::{Cache, Repo, RepoType};

use super::HfError;
use super::dataset_layout::{self, DEFAULT_CONFIG, Layout, Splits};
use super::hub::{HubEnv, api, is_commit, status};

/// The branch the Hub keeps its parquet export of every public dataset on.
pub const EXPORT: &str = "refs/convert/parquet";

/// A split's files in the cache.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HubSplit {
    pub name: String,
    /// Whole, in the snapshot, in name order.
    pub files: Vec<PathBuf>,
    /// A path `parquet_rows::sources` reads as exactly these files: the one file, or its
    /// directory and a glob of their names.
    pub path: String,
}

/// A Hub dataset's splits resolved to files of the cache.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HubDataset {
    /// The commit the files are of.
    pub commit: String,
    /// The branch read: the revision asked for, or `EXPORT` when its parquet export was.
    pub branch: String,
    pub config: String,
    pub layout: Layout,
    /// In the order asked.
    pub splits: Vec<HubSplit>,
    pub downloaded: bool,
    /// Why the cache was read without asking the Hub (out of reach), for a warning.
    pub unchecked: Option<String>,
}

/// What to read: the dataset `id`'s `config` (`None`: the only one, or `default`) at
/// `revision` (a branch, tag or commit), its `splits`.
#[derive(Debug, Clone, Copy)]
pub struct DatasetQuery<'a> {
    pub id: &'a str,
    pub config: Option<&'a str>,
    pub revision: &'a str,
    pub splits: &'a [&'a str],
}

/// The query's splits as files of the cache, downloading what it lacks (unless offline).
pub fn resolve_dataset(q: &DatasetQuery, env: &HubEnv) -> Result<HubDataset, HfError> {
    if env.offline {
        return from_cache(q, env).map_err(|why| {
            HfError::Invalid(format!(
                "{why}; HF_HUB_OFFLINE forbids downloading: unset it on a machine that reaches \
                 the Hub, or fetch the files first with `hf download {} --repo-type dataset \
                 --revision {}`",
                q.id, q.revision
            ))
        });
    }
    let api = api(env)?;
    let listing = |revision: &str| -> Result<(String, Vec<String>), ApiError> {
        let repo = Repo::with_revision(q.id.into(), RepoType::Dataset, revision.into());
        let info = api.repo(repo).info()?;
        Ok((
            info.sha,
            info.siblings.into_iter().map(|s| s.rfilename).collect(),
        ))
    };
    let (commit, files) = match listing(q.revision) {
        Ok(found) => found,
        Err(e) if status(&e).is_none() => {
            return from_cache(q, env)
                .map(|found| HubDataset {
                    unchecked: Some(format!(
                        "the Hub ({}) is out of reach ({e}): dataset `{}` read from the cache \
                         as commit {}, which may not be its newest",
                        env.endpoint, q.id, found.commit
                    )),
                    ..found
                })
                .map_err(|why| HfError::Invalid(format!("cannot reach the Hub ({e}), and {why}")));
        }
        Err(e) => return Err(listing_error(&e, q, q.revision, env)),
    };
    let own = choose(q, &files);
    let (commit, branch, files, (config, layout, picked)) = match own {
        Ok(picked) => (commit, q.revision.to_string(), files, picked),
        // Not in the repository's own parquet: the Hub's export of it (of the main branch only).
        Err(why) if q.revision == "main" => match listing(EXPORT) {
            Ok((export_commit, export_files)) => {
                let picked = choose(q, &export_files).map_err(|export_why| {
                    HfError::Invalid(format!(
                        "{why}; nor does its parquet export ({EXPORT}): {export_why}"
                    ))
                })?;
                (export_commit, EXPORT.to_string(), export_files, picked)
            }
            Err(e) if status(&e) == Some(404) => {
                return Err(HfError::Invalid(format!(
                    "{why}, and the Hub has no parquet export ({EXPORT}) of it"
                )));
            }
            Err(e) => return Err(listing_error(&e, q, EXPORT, env)),
        },
        Err(why) => return Err(HfError::Invalid(why)),
    };
    let pinned = api.repo(Repo::with_revision(
        q.id.into(),
        RepoType::Dataset,
        commit.clone(),
    ));
    let dir = snapshot(env, q.id, &commit);
    let mut downloaded = false;
    for file in picked.iter().flatten() {
        if dir.join(file).is_file() {
            continue;
        }
        pinned
            .download(file)
            .map_err(|e| download_error(&e, q, &commit, file, env))?;
        downloaded = true;
    }
    // `refs/{branch}` names the commit, as huggingface_hub writes it.
    if !is_commit(&branch) {
        let cache = Cache::new(env.cache.clone());
        let repo = Repo::with_revision(q.id.into(), RepoType::Dataset, branch.clone());
        cache
            .repo(repo.clone())
            .create_ref(&commit)
            .map_err(|cause| HfError::Io {
                path: repo_dir(env, q.id).join("refs").join(&branch),
                cause,
            })?;
    }
    Ok(HubDataset {
        splits: splits_in(q, &dir, &picked, &files)?,
        commit,
        branch,
        config,
        layout,
        downloaded,
        unchecked: None,
    })
}

/// The files of each split asked (config, layout, files by split), or what is not there.
fn choose(
    q: &DatasetQuery,
    files: &[String],
) -> Result<(String, Layout, Vec<Vec<String>>), String> {
    let (layout, found): (Layout, Splits) = dataset_layout::splits(files);
    let at = format!("dataset `{}` (revision {})", q.id, q.revision);
    if found.is_empty() {
        return Err(format!("{at} holds no parquet files"));
    }
    let configs: Vec<&str> = found.keys().map(String::as_str).collect();
    let config = match q.config {
        Some(c) if found.contains_key(c) => c.to_string(),
        Some(c) => {
            return Err(format!(
                "{at} has no config \"{c}\" in its parquet files; its configs: {} (data.config)",
                configs.join(", ")
            ));
        }
        None if found.contains_key(DEFAULT_CONFIG) => DEFAULT_CONFIG.into(),
        None if configs.len() == 1 => configs[0].to_string(),
        None => {
            return Err(format!(
                "{at} has several configs: {}; choose one with data.config",
                configs.join(", ")
            ));
        }
    };
    let splits = &found[&config];
    let mut picked = Vec::new();
    for split in q.splits {
        let files = match splits.get(*split) {
            Some(files) => files.clone(),
            None if layout == Layout::Named => {
                let named = dataset_layout::named_split(files, split);
                named.into_iter().cloned().collect()
            }
            None => Vec::new(),
        };
        if files.is_empty() {
            return Err(format!(
                "{at} has no split \"{split}\" in config \"{config}\"; its splits: {} \
                 (data.split, data.val_split)",
                splits.keys().cloned().collect::<Vec<_>>().join(", ")
            ));
        }
        picked.push(files);
    }
    Ok((config, layout, picked))
}

fn splits_in(
    q: &DatasetQuery,
    dir: &Path,
    picked: &[Vec<String>],
    all: &[String],
) -> Result<Vec<HubSplit>, HfError> {
    let mut splits = Vec::new();
    for (name, files) in q.splits.iter().zip(picked) {
        let pattern = dataset_layout::pattern(files, all).ok_or_else(|| {
            HfError::Invalid(format!(
                "the files of split \"{name}\" of dataset `{}` lie in several directories \
                 ({}): name them with data.train_path / data.val_path instead of data.hub",
                q.id,
                files.join(", ")
            ))
        })?;
        splits.push(HubSplit {
            name: name.to_string(),
            files: files.iter().map(|f| dir.join(f)).collect(),
            path: dir.join(pattern).display().to_string(),
        });
    }
    Ok(splits)
}

/// The query from the cache alone: the revision's commit (`refs/{revision}`, else the export's),
/// its snapshot's files; or why not.
fn from_cache(q: &DatasetQuery, env: &HubEnv) -> Result<HubDataset, String> {
    let not_cached = format!(
        "dataset `{}` (revision {}) is not in the Hugging Face cache {}",
        q.id,
        q.revision,
        env.cache.display()
    );
    let mut last = not_cached.clone();
    let mut branches = vec![q.revision];
    if q.revision == "main" {
        branches.push(EXPORT);
    }
    for branch in branches {
        let Some(commit) = cached_commit(env, q.id, branch) else {
            continue;
        };
        let dir = snapshot(env, q.id, &commit);
        let files = files_under(&dir);
        match choose(q, &files) {
            Ok((config, layout, picked)) => {
                return Ok(HubDataset {
                    splits: splits_in(q, &dir, &picked, &files).map_err(|e| e.to_string())?,
                    commit,
                    branch: branch.to_string(),
                    config,
                    layout,
                    downloaded: false,
                    unchecked: None,
                });
            }
            Err(why) => last = format!("{not_cached} whole: {why}"),
        }
    }
    Err(last)
}

/// The paths (from `dir`, with `/`) of the files under `dir`.
fn files_under(dir: &Path) -> Vec<String> {
    let mut found = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            if path.is_dir() {
                stack.push(path);
            } else if let Ok(rel) = path.strip_prefix(dir) {
                let parts: Vec<String> = rel
                    .components()
                    .map(|c| c.as_os_str().to_string_lossy().into_owned())
                    .collect();
                found.push(parts.join("/"));
            }
        }
    }
    found.sort();
    found
}

fn repo_dir(env: &HubEnv, id: &str) -> PathBuf {
    env.cache
        .join(format!("datasets--{}", id.replace('/', "--")))
}

fn snapshot(env: &HubEnv, id: &str, commit: &str) -> PathBuf {
    repo_dir(env, id).join("snapshots").join(commit)
}

fn cached_commit(env: &HubEnv, id: &str, revision: &str) -> Option<String> {
    if is_commit(revision) {
        return Some(revision.into());
    }
    let text = std::fs::read_to_string(repo_dir(env, id).join("refs").join(revision)).ok()?;
    Some(text.trim().to_string()).filter(|c| is_commit(c))
}

/// The file list of `revision` could not be had.
fn listing_error(e: &ApiError, q: &DatasetQuery, revision: &str, env: &HubEnv) -> HfError {
    let id = q.id;
    HfError::Invalid(match status(e) {
        Some(401 | 403) => format!(
            "the Hub ({}) refused dataset `{id}`: it does not exist (check data.hub), or it is \
             private or gated ({})",
            env.endpoint,
            match env.token {
                Some(_) => "the token given (HF_TOKEN or `hf auth login`) is not allowed it",
                None => "no token was given: run `hf auth login` or set HF_TOKEN",
            }
        ),
        Some(404) => format!(
            "the Hub ({}) has no dataset `{id}` at revision {revision}: check data.hub and \
             data.revision (default main)",
            env.endpoint
        ),
        Some(code) => format!(
            "the Hub ({}) answered {code} for the files of dataset `{id}` (revision \
             {revision}): try again later",
            env.endpoint
        ),
        None => format!("cannot list dataset `{id}` at {}: {e}", env.endpoint),
    })
}

fn download_error(
    e: &ApiError,
    q: &DatasetQuery,
    commit: &str,
    file: &str,
    env: &HubEnv,
) -> HfError {
    HfError::Invalid(format!(
        "cannot download `{file}` of dataset `{}` (commit {commit}) from {}: {e}; on a machine \
         without the network, fetch it elsewhere with `hf download {} --repo-type dataset` \
         into the cache ({}) and set HF_HUB_OFFLINE=1",
        q.id,
        env.endpoint,
        q.id,
        env.cache.display()
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(cache: &Path) -> HubEnv {
        HubEnv {
            cache: cache.into(),
            endpoint: "http://127.0.0.1:9".into(),
            token: None,
            offline: true,
        }
    }

    #[test]
    fn offline_the_cache_alone_answers_and_says_what_is_missing() {
        let tmp = tempfile::tempdir().unwrap();
        let env = env(tmp.path());
        let commit = "c".repeat(40);
        let repo = repo_dir(&env, "org/chat");
        std::fs::create_dir_all(repo.join("refs")).unwrap();
        std::fs::write(repo.join("refs/main"), &commit).unwrap();
        let data = snapshot(&env, "org/chat", &commit).join("data");
        std::fs::create_dir_all(&data).unwrap();
        for f in [
            "train-00000-of-00002.parquet",
            "train-00001-of-00002.parquet",
        ] {
            std::fs::write(data.join(f), b"x").unwrap();
        }
        let q = DatasetQuery {
            id: "org/chat",
            config: None,
            revision: "main",
            splits: &["train"],
        };
        let found = resolve_dataset(&q, &env).unwrap();
        assert_eq!(found.commit, commit);
        assert_eq!(found.splits[0].files.len(), 2);
        assert!(
            found.splits[0]
                .path
                .ends_with("data/train-0000*-of-00002.parquet")
        );
        let test = DatasetQuery {
            splits: &["train", "test"],
            ..q
        };
        let e = resolve_dataset(&test, &env).unwrap_err().to_string();
        assert!(
            e.contains("no split \"test\"") && e.contains("its splits: train"),
            "{e}"
        );
        assert!(e.contains("HF_HUB_OFFLINE"), "{e}");
        let other = DatasetQuery {
            id: "org/none",
            ..q
        };
        let e = resolve_dataset(&other, &env).unwrap_err().to_string();
        assert!(e.contains("not in the Hugging Face cache"), "{e}");
    }
}
