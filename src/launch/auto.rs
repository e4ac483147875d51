//! `run --resume auto`: the idempotent `run` a scheduler needs when it starts the same command
//! again (a requeued Slurm job, a restarted pod): a new job starts, an unfinished one with the
//! same resolved config continues from its newest good checkpoint, a finished one is left as
//! it is, and one whose config differs is refused with the keys that differ.

use std::collections::BTreeMap;

use super::RunError;
use crate::config::{self, LoadedConfig};
use crate::jobdir::{JobDir, Status};

/// Whether `run` may continue an existing job (`--resume`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResumeMode {
    /// An existing job is an error (a job is never overwritten).
    Never,
    /// An existing job with the same config is continued, or left alone when finished.
    Auto,
}

/// What `run --resume auto` does for a config.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// No such job yet: a normal run.
    Start,
    /// Continue the unfinished job of this name.
    Continue(String),
    /// Nothing to do: the job finished; the message says so.
    AlreadyFinished(String),
}

/// Decides for `loaded` in `jobs_dir`; a job with another resolved config is refused.
pub fn decide(jobs_dir: &std::path::Path, loaded: &LoadedConfig) -> Result<Decision, RunError> {
    let name = &loaded.spec.name;
    let job = JobDir::open(jobs_dir, name);
    if !job.root.exists() {
        return Ok(Decision::Start);
    }
    let Some(state) = job.state_or_rebuilt() else {
        // Not a ddpjob job: `ensure_new` words this refusal.
        job.ensure_new(name)?;
        return Ok(Decision::Start);
    };
    let frozen = config::load(&job.job_toml(), &[])?;
    // Another number of workers (a requeued job given another allocation) continues, the rest
    // of the epoch re-sharded, as `resume --nproc-per-node` does and as another --nnodes does.
    let (workers, changed): (Vec<String>, Vec<String>) = differences(&frozen, loaded)
        .into_iter()
        .partition(|d| d.starts_with(WORKERS_KEY));
    if !changed.is_empty() {
        return Err(RunError::Usage(format!(
            "job `{name}` exists in `{}` with another config, so --resume auto will not continue \
             it: {}. Run it under another name (`--name`), or continue it as it was with \
             `{}`",
            job.root.display(),
            changed.join("; "),
            job.cli("resume")
        )));
    }
    if let (Some(workers), false) = (workers.first(), state.status == Status::Finished) {
        outln!("--resume auto: job `{name}` continues with another number of workers ({workers})");
    }
    Ok(match state.status {
        Status::Finished => Decision::AlreadyFinished(format!(
            "job `{name}` already finished ({} steps); nothing to do (--resume auto). Its results \
             are in `{}`",
            state.step,
            job.root.display()
        )),
        _ => Decision::Continue(name.clone()),
    })
}

/// The key whose change `--resume auto` follows rather than refuses.
const WORKERS_KEY: &str = "distributed.nproc_per_node:";

/// The keys whose resolved values differ, as `key: old -> new`.
fn differences(frozen: &LoadedConfig, now: &LoadedConfig) -> Vec<String> {
    // Paths compared as the files they name from here (a job.toml freezes them absolute).
    let here = std::env::current_dir().unwrap_or_default();
    let (old, new) = (
        flatten(&frozen.frozen_toml(&here)),
        flatten(&now.frozen_toml(&here)),
    );
    let keys: std::collections::BTreeSet<&String> = old.keys().chain(new.keys()).collect();
    let show = |v: Option<&String>| v.cloned().unwrap_or_else(|| "(unset)".into());
    keys.into_iter()
        .filter(|k| old.get(*k) != new.get(*k))
        .map(|k| format!("{k}: {} -> {}", show(old.get(k)), show(new.get(k))))
        .collect()
}

/// Dotted key → value of a TOML document (arrays and values as TOML writes them).
fn flatten(text: &str) -> BTreeMap<String, String> {
    fn walk(prefix: &str, value: &toml::Value, out: &mut BTreeMap<String, String>) {
        match value {
            toml::Value::Table(table) => {
                for (k, v) in table {
                    let key = if prefix.is_empty() {
                        k.clone()
                    } else {
                        format!("{prefix}.{k}")
                    };
                    walk(&key, v, out);
                }
            }
            other => {
                out.insert(prefix.to_string(), other.to_string());
            }
        }
    }
    let mut out = BTreeMap::new();
    if let Ok(value) = text.parse::<toml::Table>() {
        walk("", &toml::Value::Table(value), &mut out);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn loaded(text: &str, overrides: &[&str]) -> LoadedConfig {
        let overrides: Vec<String> = overrides.iter().map(|s| s.to_string()).collect();
        config::load_str(std::path::Path::new("j.toml"), text.into(), &overrides).unwrap()
    }

    #[test]
    fn differences_name_each_changed_key_with_both_values() {
        let text = "name = \"j\"\n[data]\ndataset = \"synthetic\"\n[train]\nlr = 0.01\n";
        let a = loaded(text, &[]);
        assert!(differences(&a, &loaded(text, &[])).is_empty());
        let b = loaded(text, &["train.lr=0.02", "train.epochs=3"]);
        assert_eq!(
            differences(&a, &b),
            ["train.epochs: 1 -> 3", "train.lr: 0.01 -> 0.02"]
        );
    }

    /// Paths are compared as the files they name from here: a `job.toml` that froze them
    /// absolute (or, from an older version, kept them relative) is the config that names them
    /// relative; a path to another file is a difference.
    #[test]
    fn paths_differ_only_when_they_name_other_files() {
        let text = |path: &str| {
            format!(
                "name = \"j\"\n[model]\narch = \"gpt\"\nblock_size = 8\n[data]\n\
                 dataset = \"text\"\npath = \"{path}\"\n"
            )
        };
        let relative = loaded(&text("data/x.txt"), &[]);
        let here = std::env::current_dir().unwrap().join("data/x.txt");
        let frozen = loaded(&text(&here.display().to_string()), &[]);
        assert!(differences(&frozen, &relative).is_empty());
        assert!(differences(&relative, &relative).is_empty());
        let frozen_toml = relative.frozen_toml(std::path::Path::new("/base"));
        assert!(
            frozen_toml.contains("path = \"/base/data/x.txt\"")
                && frozen_toml.contains("tokenizer = \"char\""),
            "{frozen_toml}"
        );
        let other = loaded(&text("data/y.txt"), &[]);
        assert_eq!(differences(&frozen, &other).len(), 1);
    }
}
