//! The job directory contract: `jobs/<name>/` with job.toml, state.json, metrics.jsonl, logs/,
//! checkpoints/, model.safetensors, summary.json and curves.svg. Files are replaced atomically.

pub mod record;
pub mod sink;
pub mod tensorboard;

use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use thiserror::Error;

#[derive(Debug, Error)]
pub enum JobDirError {
    #[error(
        "job `{name}` already exists in `{}` ({status}, epoch {epoch}, step {step}) and is not finished; \
         {}, or choose another name with --name",
        dir.display(), match checkpointed {
            true => format!("continue it with `ddpjob resume {name}{}` (or run with --resume auto)", jobs_dir_flag(dir)),
            false => format!("it has no checkpoint: train it again with `ddpjob resume {name}{} --from-scratch`", jobs_dir_flag(dir)),
        }
    )]
    ExistsUnfinished {
        name: String,
        dir: PathBuf,
        status: Status,
        epoch: usize,
        step: usize,
        checkpointed: bool,
    },
    #[error("job `{name}` already finished in `{}`; pick a new name with --name {name}-2 (runs are never overwritten)", dir.display())]
    ExistsFinished { name: String, dir: PathBuf },
    #[error("`{}` already exists but is not a ddpjob job directory (no readable state.json); use --name or --jobs-dir", dir.display())]
    ExistsForeign { dir: PathBuf },
    #[error(
        "job `{name}` is being run by another ddpjob (pid {pid}); wait for it to end, or stop \
         it (Ctrl-C, or `kill {pid}`) before resuming"
    )]
    Busy { name: String, pid: String },
    #[error(
        "job `{name}` already exists in `{}` and another ddpjob (pid {pid}) is running it; \
         choose another name with --name, or wait for it (`ddpjob show {name}`)",
        dir.display()
    )]
    ExistsRunning {
        name: String,
        dir: PathBuf,
        pid: String,
    },
    #[error("the jobs directory `{}` {what}; pass --jobs-dir a directory (created if missing)", dir.display())]
    JobsDirIsAFile { dir: PathBuf, what: String },
    #[error("cannot write `{}`: {cause}", path.display())]
    Io {
        path: PathBuf,
        cause: std::io::Error,
    },
}

/// ` --jobs-dir D` when the job directory `dir` is not under the default `jobs/`.
fn jobs_dir_flag(dir: &Path) -> String {
    dir.parent().map(jobs_dir_option).unwrap_or_default()
}

/// ` --jobs-dir D` for the directory of jobs `jobs_dir`, unless it is the default `jobs`: what a
/// command printed for the user to run next needs to find the job.
pub fn jobs_dir_option(jobs_dir: &Path) -> String {
    match jobs_dir {
        dir if dir == Path::new("jobs") || dir.as_os_str().is_empty() => String::new(),
        dir => format!(" --jobs-dir {}", shell_word(&dir.display().to_string())),
    }
}

/// `word` as a shell reads it back: as it is when it holds nothing a shell would split or
/// expand, else in single quotes (a path with spaces pasted from a message must still work).
pub fn shell_word(word: &str) -> String {
    let plain = |c: char| c.is_ascii_alphanumeric() || "_-./:@%+=,".contains(c);
    match !word.is_empty() && word.chars().all(plain) {
        true => word.to_string(),
        false => format!("'{}'", word.replace('\'', "'\\''")),
    }
}

/// What makes `dir`, which is there in some form, unusable as a directory of jobs (a file, a
/// device, a symbolic link that leads nowhere or in a loop); `None` for a directory or
/// nothing at all (it is created).
pub fn not_a_directory(dir: &Path) -> Option<String> {
    match fs::metadata(dir) {
        Ok(m) if m.is_file() => Some("is a file, not a directory".into()),
        Ok(m) if !m.is_dir() => Some("is not a directory".into()),
        Ok(_) => None,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound && fs::symlink_metadata(dir).is_ok() => {
            Some("is a symbolic link to nothing".into())
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => Some(format!("cannot be used as a directory ({e})")),
    }
}

/// Maps an I/O error on `path` to [`JobDirError::Io`].
pub fn io(path: &Path) -> impl FnOnce(std::io::Error) -> JobDirError + '_ {
    move |cause| JobDirError::Io {
        path: path.to_path_buf(),
        cause,
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    Running,
    Finished,
    Failed,
    Interrupted,
}

impl std::fmt::Display for Status {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = match self {
            Status::Running => "running",
            Status::Finished => "finished",
            Status::Failed => "failed",
            Status::Interrupted => "interrupted",
        };
        f.write_str(s)
    }
}

/// `state.json`: where the job is.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JobState {
    pub status: Status,
    pub epoch: usize,
    pub step: usize,
    pub total_steps: usize,
    pub world_size: usize,
    pub updated_unix: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_loss: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// Automatic restarts of the worker group so far (`distributed.max_restarts`).
    #[serde(default)]
    pub restarts: usize,
    /// What the task's evaluations report, the headline first (the task seam's
    /// `MetricInfo`), written as training starts so `show` and `list` word a running job's
    /// metrics as its task declared them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub metrics: Vec<ddpjob_seam::MetricInfo>,
}

pub fn now_unix() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

pub fn now_unix_ms() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis())
}

impl JobState {
    /// A job at its start: running, nothing done yet.
    pub fn running(world_size: usize, total_steps: usize) -> Self {
        JobState {
            status: Status::Running,
            epoch: 0,
            step: 0,
            total_steps,
            world_size,
            updated_unix: now_unix(),
            last_loss: None,
            error: None,
            restarts: 0,
            metrics: Vec::new(),
        }
    }
}

/// The directory `path` is in: `.` for a bare file name (whose `parent()` is empty).
pub fn directory_of(path: &Path) -> &Path {
    match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir,
        _ => Path::new("."),
    }
}

/// Writes `bytes` to `path` through a temp file, fsync and rename: readers see old or new, whole.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let dir = directory_of(path);
    let tmp = dir.join(format!(
        ".{}.tmp",
        path.file_name()
            .map_or("file".into(), |n| n.to_string_lossy())
    ));
    let mut f = File::create(&tmp)?;
    f.write_all(bytes)?;
    f.sync_all()?;
    fs::rename(&tmp, path)?;
    sync_dir(dir)
}

/// Writes `tensors` to `path` as safetensors, readable as any file this process creates.
/// The safetensors crate writes through a temp file of mode 0600, which made weights (a job's,
/// a checkpoint's, an export's) unreadable to the other users of a shared model directory.
pub fn save_tensors(
    tensors: &std::collections::HashMap<String, candle_core::Tensor>,
    path: &Path,
) -> candle_core::Result<()> {
    // The header metadata `save_pretrained` writes, which transformers before 4.38 requires.
    let metadata = std::collections::HashMap::from([("format".to_string(), "pt".to_string())]);
    safetensors::tensor::serialize_to_file(tensors, Some(metadata), path)
        .map_err(|e| candle_core::Error::Msg(format!("cannot write `{}`: {e}", path.display())))?;
    use std::os::unix::fs::PermissionsExt;
    let mode = 0o666 & !process_umask();
    fs::set_permissions(path, fs::Permissions::from_mode(mode)).map_err(candle_core::Error::from)
}

/// The process's file-creation mask (`Umask:` in `/proc/self/status`; 022 where unknown).
/// Read rather than set and restored, which would race with threads creating files.
fn process_umask() -> u32 {
    let status = fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("Umask:"))
        .and_then(|v| u32::from_str_radix(v.trim(), 8).ok())
        .unwrap_or(0o022)
}

/// Makes a rename or create in `dir` durable.
pub fn sync_dir(dir: &Path) -> std::io::Result<()> {
    File::open(dir)?.sync_all()
}

/// An existing or new job directory.
#[derive(Debug, Clone)]
pub struct JobDir {
    pub root: PathBuf,
}

impl JobDir {
    pub fn open(jobs_dir: &Path, name: &str) -> Self {
        JobDir {
            root: jobs_dir.join(name),
        }
    }

    /// Fails (without touching anything) if the job already exists.
    pub fn ensure_new(&self, name: &str) -> Result<(), JobDirError> {
        if let Some(jobs_dir) = self.root.parent()
            && let Some(what) = not_a_directory(jobs_dir)
        {
            return Err(JobDirError::JobsDirIsAFile {
                dir: jobs_dir.to_path_buf(),
                what,
            });
        }
        if !self.root.exists() {
            return Ok(());
        }
        let dir = self.root.clone();
        match self.state_or_rebuilt() {
            Some(s) if s.status == Status::Finished => Err(JobDirError::ExistsFinished {
                name: name.into(),
                dir,
            }),
            Some(_) if let Some(pid) = self.running_launcher() => Err(JobDirError::ExistsRunning {
                name: name.into(),
                dir,
                pid,
            }),
            Some(s) => Err(JobDirError::ExistsUnfinished {
                name: name.into(),
                checkpointed: self.has_checkpoint(),
                dir,
                status: s.status,
                epoch: s.epoch,
                step: s.step,
            }),
            // Created a moment ago by a launcher that has not written its state yet.
            None if let Some(pid) = self.running_launcher() => Err(JobDirError::ExistsRunning {
                name: name.into(),
                dir,
                pid,
            }),
            None => Err(JobDirError::ExistsForeign { dir }),
        }
    }

    /// Creates the directory, `logs/` and `checkpoints/`; fails if another run created it first.
    pub fn create(&self, name: &str) -> Result<(), JobDirError> {
        self.ensure_new(name)?;
        if let Some(parent) = self.root.parent() {
            fs::create_dir_all(parent).map_err(io(parent))?;
        }
        let create = || fs::create_dir(&self.root);
        let failed = |e: std::io::Error| match e.kind() {
            std::io::ErrorKind::AlreadyExists => JobDirError::ExistsForeign {
                dir: self.root.clone(),
            },
            _ => JobDirError::Io {
                path: self.root.clone(),
                cause: e,
            },
        };
        if let Err(e) = create() {
            if e.kind() != std::io::ErrorKind::AlreadyExists {
                return Err(failed(e));
            }
            // Another launcher created it between the check and here: it locks it at once.
            for _ in 0..40 {
                if self.running_launcher().is_some() {
                    break;
                }
                std::thread::sleep(std::time::Duration::from_millis(50));
            }
            self.ensure_new(name)?;
            // Gone again meanwhile: one more try.
            create().map_err(failed)?;
        }
        for sub in [self.logs_dir(), self.checkpoints_dir()] {
            if let Err(e) = fs::create_dir(&sub) {
                // Half made, it would block the name without being a job.
                let _ = fs::remove_dir_all(&self.root);
                return Err(io(&sub)(e));
            }
        }
        Ok(())
    }

    /// [`create`](Self::create), then `fill` it: a directory left half made (a full disk)
    /// would be no job yet block the name, so it is removed when `fill` fails.
    pub fn create_with<T, E: From<JobDirError>>(
        &self,
        name: &str,
        fill: impl FnOnce() -> Result<T, E>,
    ) -> Result<T, E> {
        self.create(name)?;
        fill().inspect_err(|_| {
            let _ = fs::remove_dir_all(&self.root);
        })
    }

    /// Whether it has a checkpoint to resume from (one `resume` may still find damaged).
    pub fn has_checkpoint(&self) -> bool {
        crate::checkpoint::layout::any_in(&self.checkpoints_dir())
    }

    pub fn job_toml(&self) -> PathBuf {
        self.root.join("job.toml")
    }
    pub fn state_path(&self) -> PathBuf {
        self.root.join("state.json")
    }
    pub fn metrics_path(&self) -> PathBuf {
        self.root.join("metrics.jsonl")
    }
    /// Where `[logging] tensorboard = true` writes its event files.
    pub fn tensorboard_dir(&self) -> PathBuf {
        self.root.join("tensorboard")
    }
    pub fn logs_dir(&self) -> PathBuf {
        self.root.join("logs")
    }
    pub fn checkpoints_dir(&self) -> PathBuf {
        self.root.join("checkpoints")
    }
    pub fn model_path(&self) -> PathBuf {
        self.root.join("model.safetensors")
    }
    pub fn summary_path(&self) -> PathBuf {
        self.root.join("summary.json")
    }
    pub fn curves_path(&self) -> PathBuf {
        self.root.join("curves.svg")
    }
    /// The job's name: its directory's.
    /// `ddpjob COMMAND NAME`, with `--jobs-dir` when the job is not under `jobs/`: a command
    /// for the user to run next, which finds this job.
    pub fn cli(&self, command: &str) -> String {
        format!(
            "ddpjob {command} {}{}",
            shell_word(&self.name()),
            jobs_dir_flag(&self.root)
        )
    }

    pub fn name(&self) -> String {
        self.root.file_name().map_or_else(
            || self.root.display().to_string(),
            |n| n.to_string_lossy().into_owned(),
        )
    }

    pub fn write_file(&self, path: &Path, bytes: &[u8]) -> Result<(), JobDirError> {
        write_atomic(path, bytes).map_err(io(path))
    }

    pub fn write_json<T: Serialize>(&self, path: &Path, value: &T) -> Result<(), JobDirError> {
        let mut text = serde_json::to_string_pretty(value).unwrap_or_default();
        text.push('\n');
        self.write_file(path, text.as_bytes())
    }

    pub fn write_state(&self, state: &JobState) -> Result<(), JobDirError> {
        self.write_json(&self.state_path(), state)
    }

    pub fn read_state(&self) -> Option<JobState> {
        serde_json::from_slice(&fs::read(self.state_path()).ok()?).ok()
    }

    /// The job's state: `state.json`, or, when that is missing or damaged in a directory
    /// with a `job.toml`, one rebuilt from what the directory holds, so the job is listed
    /// and resumable rather than taken for a stranger's directory: finished when it has its
    /// summary and weights, else interrupted at its newest checkpoint (`checkpoints/latest`),
    /// with a note saying so.
    pub fn state_or_rebuilt(&self) -> Option<JobState> {
        if let Some(state) = self.read_state() {
            return Some(state);
        }
        // A job's directory: its config and what only a job's run leaves (a checkpoint, its
        // results, or rank 0's metrics). Another node's copy of a multi-node job (config and
        // logs only) is not one to list or resume.
        let ran = crate::checkpoint::layout::has_latest(&self.checkpoints_dir())
            || (self.summary_path().is_file() && self.model_path().is_file())
            || self.metrics_path().is_file();
        if !self.job_toml().is_file() || !ran {
            return None;
        }
        let json = |path: PathBuf| -> Option<serde_json::Value> {
            serde_json::from_slice(&fs::read(path).ok()?).ok()
        };
        let number = |v: &serde_json::Value, key: &str| v[key].as_u64().unwrap_or(0) as usize;
        let updated = fs::metadata(self.state_path())
            .or_else(|_| fs::metadata(&self.root))
            .and_then(|m| m.modified())
            .ok()
            .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
            .map_or(0, |d| d.as_secs());
        let note = "state.json was missing or unreadable; this state was rebuilt from the job's \
                    files (`ddpjob resume` writes a new one)";
        let mut state = JobState {
            status: Status::Interrupted,
            epoch: 0,
            step: 0,
            total_steps: 0,
            world_size: 1,
            updated_unix: updated,
            last_loss: None,
            error: Some(note.into()),
            restarts: 0,
            metrics: Vec::new(),
        };
        if let Some(summary) = json(self.summary_path()).filter(|s| s.is_object())
            && self.model_path().is_file()
        {
            state.status = Status::Finished;
            (state.epoch, state.step) = (number(&summary, "epochs"), number(&summary, "steps"));
            state.total_steps = state.step;
            state.world_size = number(&summary, "world_size").max(1);
            state.last_loss = summary["final_train_loss"].as_f64();
            return Some(state);
        }
        if let Some(position) = crate::checkpoint::layout::latest_position(&self.checkpoints_dir())
        {
            (state.epoch, state.step) = (number(&position, "epoch"), number(&position, "step"));
            state.world_size = number(&position, "world_size").max(1);
        }
        Some(state)
    }

    /// Appends one line (a [`record::Record`]'s JSON) to `metrics.jsonl`.
    pub fn append_metrics_line(&self, line: &str) -> Result<(), JobDirError> {
        let path = self.metrics_path();
        let mut f = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .map_err(io(&path))?;
        writeln!(f, "{line}").map_err(io(&path))
    }
}

/// `flock(file, op)` without waiting (`op`: `LOCK_EX` or `LOCK_SH`): whether it was taken.
fn try_flock(file: &File, op: libc::c_int) -> bool {
    // SAFETY: flock on a descriptor the caller owns.
    unsafe { libc::flock(std::os::fd::AsRawFd::as_raw_fd(file), op | libc::LOCK_NB) == 0 }
}

/// Held while a launcher runs a job; released (by the kernel, too) when it exits.
#[derive(Debug)]
pub struct JobLock {
    _file: File,
}

impl JobDir {
    /// Takes the job's lock (`.lock`, with the holder's pid in it) without waiting.
    pub fn lock(&self, name: &str) -> Result<JobLock, JobDirError> {
        let path = self.root.join(".lock");
        let mut file = OpenOptions::new()
            .create(true)
            .truncate(false)
            .read(true)
            .write(true)
            .open(&path)
            .map_err(io(&path))?;
        // A few tries: `running_launcher` (another command asking whether the job runs)
        // holds a shared lock for an instant.
        let taken = (0..5).any(|attempt| {
            if attempt > 0 {
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            try_flock(&file, libc::LOCK_EX)
        });
        if !taken {
            let pid = fs::read_to_string(&path).unwrap_or_default();
            return Err(JobDirError::Busy {
                name: name.into(),
                pid: pid.trim().to_string(),
            });
        }
        file.set_len(0).map_err(io(&path))?;
        write!(file, "{}", std::process::id()).map_err(io(&path))?;
        Ok(JobLock { _file: file })
    }

    /// The pid of the launcher running this job now, if one is (it holds `.lock`): tried with
    /// a shared lock, released at once.
    pub fn running_launcher(&self) -> Option<String> {
        let path = self.root.join(".lock");
        let file = File::open(&path).ok()?;
        let free = try_flock(&file, libc::LOCK_SH);
        // Locked a moment before its pid is written: "unknown" rather than nothing.
        (!free).then(|| {
            let pid = fs::read_to_string(&path).unwrap_or_default();
            match pid.trim() {
                "" => "unknown".to_string(),
                pid => pid.to_string(),
            }
        })
    }

    /// Drops the `metrics.jsonl` lines written after a checkpoint at (`epoch`, `step`), so a
    /// resumed run continues the history instead of repeating part of it; `None`: a run that
    /// starts over from nothing, whose history starts over too.
    pub fn rewind_metrics(&self, to: Option<(usize, usize)>) -> Result<(), JobDirError> {
        let path = self.metrics_path();
        let text = match record::read_text(&path) {
            Ok(Some(text)) => text,
            Ok(None) => return Ok(()),
            Err(e) => return Err(JobDirError::Io { path, cause: e }),
        };
        let kept: String = text
            .lines()
            .filter(|line| {
                let (Some(record), Some((epoch, step))) = (record::Record::parse(line), to) else {
                    return false;
                };
                let (at, of_epoch) = (record.step(), record.epoch());
                let is_epoch = matches!(record, record::Record::Epoch { .. });
                // An epoch line at the checkpoint's step belongs to it only if that epoch ended
                // before the checkpoint (an epoch-boundary one).
                at < step || (at == step && (!is_epoch || of_epoch < epoch))
            })
            .map(|l| format!("{l}\n"))
            .collect();
        self.write_file(&path, kept.as_bytes())
    }
}

/// Every job under `jobs_dir` with a readable state, newest first.
pub fn list_jobs(jobs_dir: &Path) -> std::io::Result<Vec<(String, JobState)>> {
    let mut jobs = Vec::new();
    let entries = match fs::read_dir(jobs_dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(jobs),
        Err(e) => return Err(e),
    };
    for entry in entries {
        let entry = entry?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if let Some(state) = JobDir::open(jobs_dir, &name).state_or_rebuilt() {
            jobs.push((name, state));
        }
    }
    jobs.sort_by(|a, b| {
        b.1.updated_unix
            .cmp(&a.1.updated_unix)
            .then_with(|| a.0.cmp(&b.0))
    });
    Ok(jobs)
}

/// Lowercase hex of a digest (the checksums of `MANIFEST` and of downloaded files).
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_directory_or_nothing_can_be_a_jobs_dir() {
        let tmp = tempfile::tempdir().unwrap();
        let at = |name: &str| tmp.path().join(name);
        std::fs::create_dir(at("dir")).unwrap();
        std::fs::write(at("file"), "").unwrap();
        std::os::unix::fs::symlink(at("loop-b"), at("loop-a")).unwrap();
        std::os::unix::fs::symlink(at("loop-a"), at("loop-b")).unwrap();
        std::os::unix::fs::symlink(at("nowhere"), at("dangling")).unwrap();
        assert_eq!(not_a_directory(&at("dir")), None);
        assert_eq!(not_a_directory(&at("missing")), None);
        let what = |p: &Path| not_a_directory(p).unwrap();
        assert_eq!(what(&at("file")), "is a file, not a directory");
        assert_eq!(what(Path::new("/dev/null")), "is not a directory");
        assert!(
            what(&at("loop-a")).contains("symbolic links"),
            "{}",
            what(&at("loop-a"))
        );
        assert_eq!(what(&at("dangling")), "is a symbolic link to nothing");
        let job = JobDir::open(&at("loop-a"), "x");
        assert!(matches!(
            job.ensure_new("x"),
            Err(JobDirError::JobsDirIsAFile { .. })
        ));
    }

    #[test]
    fn saved_weights_are_as_readable_as_any_other_file_written() {
        use std::os::unix::fs::PermissionsExt;
        let tmp = tempfile::tempdir().unwrap();
        let weights = tmp.path().join("model.safetensors");
        let t = candle_core::Tensor::ones(3, candle_core::DType::F32, &candle_core::Device::Cpu);
        let tensors = std::collections::HashMap::from([("w".to_string(), t.unwrap())]);
        save_tensors(&tensors, &weights).unwrap();
        let other = tmp.path().join("config.json");
        fs::write(&other, "{}").unwrap();
        let mode = |p: &Path| fs::metadata(p).unwrap().permissions().mode() & 0o777;
        // 0600 before (the safetensors crate's temp file), whatever the umask.
        assert_eq!(mode(&weights), mode(&other));
        assert_eq!(mode(&other), 0o666 & !process_umask());
    }

    #[test]
    fn a_job_another_launcher_has_just_created_is_named_as_running_not_foreign() {
        let tmp = tempfile::tempdir().unwrap();
        let first = JobDir::open(tmp.path(), "rc");
        first.create("rc").unwrap();
        let _lock = first.lock("rc").unwrap();
        // No state.json yet: the other launcher is still writing its files.
        let second = JobDir::open(tmp.path(), "rc");
        for err in [second.ensure_new("rc"), second.create("rc")] {
            let err = err.unwrap_err();
            assert!(matches!(err, JobDirError::ExistsRunning { .. }), "{err}");
        }
    }

    #[test]
    fn a_jobs_dir_that_is_a_file_is_named_and_left_alone() {
        let tmp = tempfile::tempdir().unwrap();
        let file = tmp.path().join("jobs");
        fs::write(&file, "notes").unwrap();
        let job = JobDir::open(&file, "mnist");
        let err = job.create("mnist").unwrap_err();
        assert!(matches!(&err, JobDirError::JobsDirIsAFile { dir, .. } if dir == &file));
        assert!(
            err.to_string().contains("is a file, not a directory"),
            "{err}"
        );
        assert_eq!(fs::read_to_string(&file).unwrap(), "notes");
    }

    /// Commands printed for the user to paste name odd paths so a shell reads them back.
    #[test]
    fn printed_commands_quote_what_a_shell_would_split() {
        assert_eq!(shell_word("jobs/run-1.x"), "jobs/run-1.x");
        assert_eq!(shell_word("dir with spaces"), "'dir with spaces'");
        assert_eq!(shell_word("it's"), "'it'\\''s'");
        assert_eq!(shell_word("ünï"), "'ünï'");
        assert_eq!(shell_word(""), "''");
        assert_eq!(
            jobs_dir_option(Path::new("/tmp/a b/jobs")),
            " --jobs-dir '/tmp/a b/jobs'"
        );
        let job = JobDir::open(Path::new("/tmp/a b/jobs"), "x");
        assert_eq!(
            job.cli("resume"),
            "ddpjob resume x --jobs-dir '/tmp/a b/jobs'"
        );
    }

    /// A job directory whose filling failed (a full disk) is removed: the name is free again,
    /// not blocked by a directory that is no job.
    #[test]
    fn a_job_directory_that_could_not_be_filled_is_removed() {
        let tmp = tempfile::tempdir().unwrap();
        let job = JobDir::open(tmp.path(), "x");
        let failed: Result<(), JobDirError> = job.create_with("x", || {
            fs::write(job.root.join("job.toml"), "half").unwrap();
            Err(std::io::Error::other("No space left on device")).map_err(|cause| JobDirError::Io {
                path: job.root.join("state.json"),
                cause,
            })
        });
        assert!(failed.is_err());
        assert!(!job.root.exists());
        job.create_with("x", || Ok::<_, JobDirError>(())).unwrap();
        assert!(job.logs_dir().is_dir() && job.checkpoints_dir().is_dir());
    }

    #[test]
    fn metrics_rewind_to_a_checkpoint_and_the_lock_is_exclusive() {
        let root = std::env::temp_dir().join(format!("ddpjob-jobdir-{}", std::process::id()));
        let _ = fs::remove_dir_all(&root);
        fs::create_dir_all(&root).unwrap();
        let job = JobDir { root: root.clone() };
        let lines = [
            r#"{"kind":"train","epoch":0,"step":4}"#,
            r#"{"kind":"train","epoch":0,"step":8}"#,
            r#"{"kind":"epoch","epoch":0,"step":8}"#,
            r#"{"kind":"train","epoch":1,"step":12}"#,
        ];
        fs::write(job.metrics_path(), lines.join("\n") + "\n").unwrap();
        let kept = |epoch, step| {
            job.rewind_metrics(Some((epoch, step))).unwrap();
            fs::read_to_string(job.metrics_path())
                .unwrap()
                .lines()
                .count()
        };
        // At the epoch-boundary checkpoint (epoch 1 next, step 8) the epoch-0 line stays...
        assert_eq!(kept(1, 8), 3);
        // ...at a mid-epoch one at the same step (a stop before evaluation) it goes.
        assert_eq!(kept(0, 8), 2);
        // A byte that is not UTF-8 costs its line only.
        let mut bytes = fs::read(job.metrics_path()).unwrap();
        bytes.extend(b"{\"kind\":\"train\",\xff}\n");
        fs::write(job.metrics_path(), bytes).unwrap();
        assert_eq!(kept(0, 8), 2);
        // The step-0 evaluation of a run that starts over is written again: none kept.
        job.rewind_metrics(None).unwrap();
        assert_eq!(fs::read_to_string(job.metrics_path()).unwrap(), "");

        let lock = job.lock("j").unwrap();
        let busy = job.lock("j").unwrap_err().to_string();
        assert!(
            busy.contains(&format!("pid {}", std::process::id())),
            "{busy}"
        );
        drop(lock);
        job.lock("j").unwrap();
        fs::remove_dir_all(&root).unwrap();
    }
}
