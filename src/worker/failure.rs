//! How a worker tells the launcher why it failed: a small JSON record beside its log
//! (`logs/rank-N.failure.json`), written for an error the worker returns and, through a panic
//! hook, for a panic (in a model's `forward`, say). The launcher reads the record; it does not
//! scrape log lines.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// Why a rank failed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FailureRecord {
    pub rank: usize,
    pub kind: FailureKind,
    /// The error's message, or the panic's message with its source location.
    pub message: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FailureKind {
    /// The worker returned an error.
    Error,
    /// A thread of the worker panicked.
    Panic,
    /// The worker returned an error before training that a restart would meet again (the
    /// job's config, data, model, device or checkpoint); the launcher does not restart for it.
    Setup,
}

/// Where the record of the rank whose log is `log` goes: beside it (`rank-N.failure.json`).
fn beside(log: &Path) -> PathBuf {
    log.with_extension("failure.json")
}

/// Where rank `rank`'s record goes.
pub fn path(job_dir: &Path, rank: usize) -> PathBuf {
    beside(&super::log_path(job_dir, rank))
}

/// The record beside the log file `log`, if any.
pub fn read_beside(log: &Path) -> Option<FailureRecord> {
    serde_json::from_slice(&std::fs::read(beside(log)).ok()?).ok()
}

/// Writes the record (best effort: a worker that cannot write it still fails, with its log).
/// The first record of an attempt wins: a panic's record is not replaced by the error the
/// unwinding turns it into.
pub fn write(job_dir: &Path, record: &FailureRecord) {
    let path = path(job_dir, record.rank);
    if path.exists() {
        return;
    }
    if let Ok(json) = serde_json::to_vec(record) {
        let _ = std::fs::write(path, json);
    }
}

/// Removes an earlier attempt's record as a worker starts.
pub fn clear(job_dir: &Path, rank: usize) {
    let _ = std::fs::remove_file(path(job_dir, rank));
}

/// Records any panic of this process as rank `rank`'s failure, then reports it as Rust does.
pub fn record_panics(job_dir: PathBuf, rank: usize) {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let payload = info.payload();
        let what = payload
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "a panic without a message".into());
        let at = info
            .location()
            .map_or(String::new(), |l| format!(" at {}:{}", l.file(), l.line()));
        let thread = std::thread::current()
            .name()
            .unwrap_or("unnamed")
            .to_string();
        let record = FailureRecord {
            rank,
            kind: FailureKind::Panic,
            message: format!("panicked{at} (thread {thread}): {what}"),
        };
        write(&job_dir, &record);
        default(info);
    }));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_record_is_kept_and_read_beside_the_log() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("logs")).unwrap();
        let first = FailureRecord {
            rank: 1,
            kind: FailureKind::Panic,
            message: "panicked at x.rs:3: boom".into(),
        };
        write(dir.path(), &first);
        write(
            dir.path(),
            &FailureRecord {
                kind: FailureKind::Error,
                message: "later".into(),
                ..first.clone()
            },
        );
        let log = dir.path().join("logs/rank-1.log");
        assert_eq!(read_beside(&log), Some(first));
        clear(dir.path(), 1);
        assert_eq!(read_beside(&log), None);
    }
}
