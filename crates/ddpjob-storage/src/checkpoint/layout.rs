//! Where a job's checkpoints lie in its `checkpoints/` folder: `step-NNNNNNNN` directories, a
//! `latest` file naming the newest, a `state.json` position in each. The one place outside the
//! writer that knows these names; the job directory asks here whether a job has checkpoints
//! and where it stopped, so this module must not import the job directory or the rest of
//! `checkpoint` (they import it).

use std::fs;
use std::path::{Path, PathBuf};

/// The file naming the newest complete checkpoint.
pub const LATEST: &str = "latest";
/// What every checkpoint directory's name starts with.
pub const STEP_PREFIX: &str = "step-";
/// A checkpoint's training position.
pub const POSITION: &str = "state.json";

/// Whether `dir` (a job's `checkpoints/`) holds a checkpoint to resume from: `latest`, or a
/// `step-*` directory (one `resume` may still find damaged).
pub fn any_in(dir: &Path) -> bool {
    has_latest(dir)
        || fs::read_dir(dir).is_ok_and(|entries| {
            entries
                .flatten()
                .any(|e| e.file_name().to_string_lossy().starts_with(STEP_PREFIX))
        })
}

/// Whether `dir` has a `latest` file (a checkpoint was completed there).
pub fn has_latest(dir: &Path) -> bool {
    dir.join(LATEST).is_file()
}

/// The checkpoint `latest` in `dir` names, by name.
pub fn latest_name(dir: &Path) -> Option<String> {
    let text = fs::read_to_string(dir.join(LATEST)).ok()?;
    Some(text.trim().to_string()).filter(|n| !n.is_empty())
}

/// The `state.json` of the checkpoint `latest` in `dir` names, as JSON (what a rebuilt job
/// state reads its epoch, step and world size from).
pub fn latest_position(dir: &Path) -> Option<serde_json::Value> {
    let path: PathBuf = dir.join(latest_name(dir)?).join(POSITION);
    serde_json::from_slice(&fs::read(path).ok()?).ok()
}
