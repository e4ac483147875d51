//! Reading checkpoints back: the newest one whose MANIFEST verifies (naming the newer ones that
//! do not, and why), and its tensors and position.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};

use super::dir::{check_format, read_position};
use super::{CheckpointError, TrainPosition, list_checkpoints, verify};

/// A checkpoint loaded into memory.
pub struct Restored {
    pub dir: PathBuf,
    pub model: HashMap<String, Tensor>,
    pub optimizer: HashMap<String, Tensor>,
    pub position: TrainPosition,
}

/// What [`choose`] found in a `checkpoints/` directory.
#[derive(Debug, Default)]
pub struct Choice {
    /// The newest checkpoint that verifies, and its position.
    pub usable: Option<PathBuf>,
    pub position: Option<TrainPosition>,
    /// Newer checkpoints that do not, newest first, with the reason.
    pub skipped: Vec<(PathBuf, String)>,
}

impl Choice {
    /// Renames the skipped checkpoints to `damaged-step-*` (`damaged-step-*-2`, ... when the
    /// same step was set aside before; kept for inspection, never deleted), so the resumed run
    /// can write that step afresh; returns one line per skipped checkpoint for the user.
    pub fn set_aside(&self) -> std::io::Result<Vec<String>> {
        let mut lines = Vec::new();
        for (dir, why) in &self.skipped {
            let name = dir.file_name().map_or("".into(), |n| n.to_string_lossy());
            let aside = unused_name(&dir.with_file_name(format!("damaged-{name}")));
            std::fs::rename(dir, &aside)?;
            lines.push(format!(
                "checkpoint `{name}` is damaged ({why}); skipped, and kept as `{}`",
                aside.display()
            ));
        }
        Ok(lines)
    }

    /// `checkpoints/best` taken after the step this choice continues from (by the run the
    /// resume rewinds: its evaluation leaves `metrics.jsonl` and the restored best record) is
    /// renamed `discarded-best-step-N`, so `best` never holds weights the job's record does
    /// not describe; the resumed run writes it again when an evaluation earns it. Returns the
    /// line for the user.
    pub fn set_aside_later_best(&self, dir: &Path) -> std::io::Result<Option<String>> {
        let best = dir.join("best");
        let from = self.position.as_ref().map_or(0, |p| p.step);
        let Ok(taken) = read_position(&best) else {
            return Ok(None);
        };
        if taken.step <= from {
            return Ok(None);
        }
        let aside = unused_name(&dir.join(format!("discarded-best-step-{:08}", taken.step)));
        std::fs::rename(&best, &aside)?;
        Ok(Some(format!(
            "`best` holds the weights evaluated after step {}, past step {from} where the job \
             continues; kept as `{}`, and `best` is written again when an evaluation earns it",
            taken.step,
            aside.display()
        )))
    }
}

/// `path`, or `path-2`, `path-3`, ... when it is taken (a step set aside before).
fn unused_name(path: &Path) -> PathBuf {
    (1..)
        .map(|n| match n {
            1 => path.to_path_buf(),
            n => PathBuf::from(format!("{}-{n}", path.display())),
        })
        .find(|aside| !aside.exists())
        .expect("an unused name")
}

/// Verifies checkpoints from the newest down and stops at the first good one. A missing
/// directory means no checkpoint yet.
pub fn choose(dir: &Path) -> std::io::Result<Choice> {
    let mut choice = Choice::default();
    let all = match list_checkpoints(dir) {
        Ok(all) => all,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(choice),
        Err(e) => return Err(e),
    };
    for candidate in all.into_iter().rev() {
        // A newer build's checkpoint is not damaged: stop rather than set it aside.
        check_format(&candidate).map_err(std::io::Error::other)?;
        match verify(&candidate).and_then(|()| read_position(&candidate)) {
            Ok(position) => {
                choice.usable = Some(candidate);
                choice.position = Some(position);
                break;
            }
            Err(why) => choice.skipped.push((candidate, why)),
        }
    }
    Ok(choice)
}

/// Loads a checkpoint's model and optimizer tensors and its position onto `device`.
pub fn load(dir: &Path, device: &Device) -> Result<Restored, CheckpointError> {
    let unreadable = |problem: String| CheckpointError::Unreadable {
        path: dir.to_path_buf(),
        problem,
    };
    let position = read_position(dir).map_err(unreadable)?;
    let tensors = |file: &str| {
        candle_core::safetensors::load(dir.join(file), device)
            .map_err(|e| unreadable(format!("{file}: {e}")))
    };
    Ok(Restored {
        dir: dir.to_path_buf(),
        model: tensors("model.safetensors")?,
        optimizer: tensors("optimizer.safetensors")?,
        position,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_step_damaged_again_is_set_aside_beside_the_first_one() {
        let tmp = tempfile::tempdir().unwrap();
        let step = tmp.path().join("step-00000014");
        for round in ["first", "second", "third"] {
            std::fs::create_dir_all(&step).unwrap();
            std::fs::write(step.join("note"), round).unwrap();
            let choice = Choice {
                skipped: vec![(step.clone(), "no MANIFEST".into())],
                ..Choice::default()
            };
            let lines = choice.set_aside().unwrap();
            assert!(lines[0].contains("is damaged (no MANIFEST)"), "{lines:?}");
        }
        let kept = |name: &str| std::fs::read_to_string(tmp.path().join(name).join("note"));
        assert_eq!(kept("damaged-step-00000014").unwrap(), "first");
        assert_eq!(kept("damaged-step-00000014-2").unwrap(), "second");
        assert_eq!(kept("damaged-step-00000014-3").unwrap(), "third");
        assert!(!step.exists());
    }
}
