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
    /// Renames the skipped checkpoints to `damaged-step-*` (kept for inspection, never
    /// deleted), so the resumed run can write that step afresh; returns one line per skipped
    /// checkpoint for the user.
    pub fn set_aside(&self) -> std::io::Result<Vec<String>> {
        let mut lines = Vec::new();
        for (dir, why) in &self.skipped {
            let name = dir.file_name().map_or("".into(), |n| n.to_string_lossy());
            let aside = dir.with_file_name(format!("damaged-{name}"));
            std::fs::rename(dir, &aside)?;
            lines.push(format!(
                "checkpoint `{name}` is damaged ({why}); skipped, and kept as `{}`",
                aside.display()
            ));
        }
        Ok(lines)
    }
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
