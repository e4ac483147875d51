//! A job's `checkpoints/` directory as every reader sees it: `resume` and restarts (the newest
//! checkpoint that verifies), `show` (the list and the `latest` pointer), and the commands
//! that take a job's weights (`sample`, `eval`, `export`, `init_from`: the final weights or a
//! named checkpoint). What a checkpoint holds says its format (`state.json`'s `format`), and a
//! reader refuses one newer than it understands instead of misreading it.

use std::path::{Path, PathBuf};

use super::{Choice, TrainPosition, choose, step_dir_name};
use crate::jobdir::JobDir;

/// The checkpoint format this build writes and the newest it reads. 1: `model.safetensors`,
/// `optimizer.safetensors`, `state.json` (a [`TrainPosition`]) and their `MANIFEST`; a
/// `state.json` without `format` is format 1 too (written before the field existed).
pub const FORMAT: u32 = 1;

/// `FORMAT`, the default of a `state.json` that does not say.
pub(super) fn first_format() -> u32 {
    1
}

/// One job's `checkpoints/` directory.
#[derive(Debug, Clone)]
pub struct Checkpoints {
    job: JobDir,
}

impl Checkpoints {
    pub fn of(job: &JobDir) -> Self {
        Checkpoints { job: job.clone() }
    }

    pub fn dir(&self) -> PathBuf {
        self.job.checkpoints_dir()
    }

    /// The complete `step-*` checkpoints, oldest first (none when the directory is absent).
    pub fn steps(&self) -> Vec<PathBuf> {
        super::list_checkpoints(&self.dir()).unwrap_or_default()
    }

    /// The checkpoint `latest` points to, by name.
    pub fn latest_name(&self) -> Option<String> {
        super::layout::latest_name(&self.dir())
    }

    /// The newest checkpoint that verifies, and the newer ones that do not (see [`choose`]).
    pub fn newest_good(&self) -> std::io::Result<Choice> {
        choose(&self.dir())
    }

    /// The weights `which` names: `best`, `latest`, `step-N`, or `None` for the job's final
    /// weights (its newest checkpoint's while it is unfinished). `Err` says what there is.
    pub fn weights(&self, which: Option<&str>) -> Result<PathBuf, String> {
        let dir = self.dir();
        let latest = || Some(dir.join(self.latest_name()?).join("model.safetensors"));
        let path = match which {
            None => Some(self.job.model_path())
                .filter(|p| p.is_file())
                .or_else(latest),
            Some("latest") => latest(),
            Some(name) if name == "best" || name.starts_with("step-") => {
                let name = match name.strip_prefix("step-").map(str::parse::<usize>) {
                    Some(Ok(step)) => step_dir_name(step),
                    _ => name.to_string(),
                };
                Some(dir.join(name).join("model.safetensors"))
            }
            Some(other) => {
                return Err(format!(
                    "--checkpoint {other}: expected best, latest or step-N"
                ));
            }
        };
        if let Some(path) = path.filter(|p| p.is_file()) {
            if let Some(checkpoint) = path.parent().filter(|p| *p != self.job.root) {
                check_format(checkpoint)?;
            }
            return Ok(path);
        }
        let final_weights = self.job.root.join("model.safetensors");
        if which.is_some() && final_weights.is_file() {
            return Err(format!(
                "job `{}` has no checkpoint for --checkpoint {} ({}); leave out --checkpoint for \
                 its final weights `{}`",
                self.job.name(),
                which.unwrap_or_default(),
                self.available(),
                final_weights.display()
            ));
        }
        Err(format!(
            "job `{}` has no weights {}in `{}`; train it first (`ddpjob run`), or pick another \
             with --checkpoint ({})",
            self.job.name(),
            which.map_or(String::new(), |c| format!("for --checkpoint {c} ")),
            self.job.root.display(),
            self.available()
        ))
    }

    /// The checkpoints there are, for messages.
    fn available(&self) -> String {
        let mut names: Vec<String> = std::fs::read_dir(self.dir())
            .map(|entries| {
                entries
                    .filter_map(|e| e.ok())
                    // A directory without weights (emptied, half copied) is none to pick.
                    .filter(|e| e.path().join("model.safetensors").is_file())
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .filter(|n| n == "best" || n.starts_with("step-"))
                    .collect()
            })
            .unwrap_or_default();
        names.sort();
        if names.is_empty() {
            "it has no checkpoints".into()
        } else {
            format!("there are: {}", names.join(", "))
        }
    }
}

/// A checkpoint's position (`state.json`), refused when its format is newer than this build's.
pub fn read_position(dir: &Path) -> Result<TrainPosition, String> {
    let bytes = std::fs::read(dir.join("state.json")).map_err(|e| format!("state.json: {e}"))?;
    let position: TrainPosition =
        serde_json::from_slice(&bytes).map_err(|e| format!("state.json: {e}"))?;
    if position.format > FORMAT {
        return Err(newer(position.format));
    }
    Ok(position)
}

/// A checkpoint directory is readable unless its `state.json` says a newer format.
pub(super) fn check_format(dir: &Path) -> Result<(), String> {
    let Ok(bytes) = std::fs::read(dir.join("state.json")) else {
        return Ok(());
    };
    #[derive(serde::Deserialize)]
    struct Format {
        #[serde(default = "first_format")]
        format: u32,
    }
    match serde_json::from_slice::<Format>(&bytes) {
        Ok(f) if f.format > FORMAT => Err(format!("`{}`: {}", dir.display(), newer(f.format))),
        _ => Ok(()),
    }
}

fn newer(format: u32) -> String {
    format!(
        "written by a newer ddpjob (checkpoint format {format}; this one reads formats up to \
         {FORMAT}): use that ddpjob, or a newer build of this one"
    )
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use candle_core::{DType, Device, Tensor};

    use super::super::Checkpointer;
    use super::super::tests::position;
    use super::*;

    /// A job directory with checkpoints of steps 10 and 20.
    fn job_with_checkpoints() -> (tempfile::TempDir, JobDir) {
        let tmp = tempfile::tempdir().unwrap();
        let job = JobDir {
            root: tmp.path().join("j"),
        };
        std::fs::create_dir_all(job.checkpoints_dir()).unwrap();
        let model = HashMap::from([(
            "w".to_string(),
            Tensor::ones(2, DType::F32, &Device::Cpu).unwrap(),
        )]);
        let writer = Checkpointer::new(job.checkpoints_dir(), None);
        for step in [10, 20] {
            writer
                .save(
                    crate::checkpoint::TensorFile::Tensors(&model),
                    crate::checkpoint::TensorFile::Tensors(&HashMap::new()),
                    &position(step),
                )
                .unwrap();
        }
        (tmp, job)
    }

    #[test]
    fn weights_are_named_final_latest_best_or_by_step() {
        let (_tmp, job) = job_with_checkpoints();
        let c = Checkpoints::of(&job);
        let step = |s: &str| c.dir().join(s).join("model.safetensors");
        std::fs::create_dir(c.dir().join("step-00000005")).unwrap();
        assert_eq!(c.weights(None).unwrap(), step("step-00000020"));
        assert_eq!(c.weights(Some("latest")).unwrap(), step("step-00000020"));
        assert_eq!(c.weights(Some("step-10")).unwrap(), step("step-00000010"));
        let err = c.weights(Some("best")).unwrap_err();
        assert!(
            err.contains("there are: step-00000010, step-00000020"),
            "{err}"
        );
        std::fs::remove_dir(c.dir().join("step-00000005")).unwrap();
        assert!(
            c.weights(Some("newest"))
                .unwrap_err()
                .contains("expected best")
        );
        std::fs::write(job.model_path(), b"final").unwrap();
        assert_eq!(c.weights(None).unwrap(), job.model_path());
        // A finished job without the checkpoint asked for points to its final weights.
        let err = c.weights(Some("best")).unwrap_err();
        assert!(
            err.contains("no checkpoint for --checkpoint best")
                && err.contains("leave out --checkpoint for its final weights"),
            "{err}"
        );
        assert_eq!(c.steps().len(), 2);
        assert_eq!(c.latest_name().as_deref(), Some("step-00000020"));
    }

    #[test]
    fn a_newer_format_is_refused_not_set_aside_and_a_missing_one_is_the_first() {
        let (_tmp, job) = job_with_checkpoints();
        let c = Checkpoints::of(&job);
        let newest = c.dir().join("step-00000020");
        let path = newest.join("state.json");
        let mut state: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        assert_eq!(state["format"], FORMAT);
        // Written before the field existed: format 1.
        let mut old = state.clone();
        old.as_object_mut().unwrap().remove("format");
        std::fs::write(&path, old.to_string()).unwrap();
        assert_eq!(read_position(&newest).unwrap().format, 1);
        state["format"] = 2.into();
        std::fs::write(&path, state.to_string()).unwrap();
        assert!(read_position(&newest).unwrap_err().contains("newer ddpjob"));
        assert!(c.weights(None).unwrap_err().contains("checkpoint format 2"));
        let err = c.newest_good().unwrap_err().to_string();
        assert!(err.contains("newer ddpjob"), "{err}");
        assert!(newest.is_dir(), "a newer checkpoint must not be set aside");
    }
}
