//! Files a job keeps that are too large to hold in memory (a corpus's tokens, the tokenised
//! examples), written where the launcher says (`DataContext::staging_dir`, beside the job)
//! before the job exists and moved in when it is made (see `ddpjob_seam::Contents::Staged`).
//! Only the writing is here: what goes in the files is `corpus`'s and `examples`'s.

use std::fs::{File, OpenOptions};
use std::io::{BufWriter, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{LazyLock, Once};
use std::time::{SystemTime, UNIX_EPOCH};

use super::DataError;
use ddpjob_seam::JobFile;
use ddpjob_spec::DataContext;

/// A file being written for the job as `name`: removed if dropped before [`Staged::keep`].
pub struct Staged {
    name: &'static str,
    /// Empty once kept.
    path: PathBuf,
    out: Option<BufWriter<File>>,
    /// Bytes written.
    pub len: u64,
}

impl Staged {
    /// A new, empty file in `cx`'s staging directory, named so that two launchers (or two
    /// files of one, or containers of the same pid on a shared file system) never share it;
    /// files a launcher of this host that is gone left behind are removed first.
    pub fn create(cx: &DataContext, name: &'static str) -> Result<Staged, DataError> {
        static MADE: AtomicUsize = AtomicUsize::new(0);
        static SWEPT: Once = Once::new();
        let dir = cx.staging_dir();
        SWEPT.call_once(|| sweep(&dir));
        let n = MADE.fetch_add(1, Ordering::Relaxed);
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let path = dir.join(format!(
            "{}{}-{n}-{nanos:09}-{name}",
            prefix(),
            std::process::id()
        ));
        let file =
            (OpenOptions::new().write(true).create_new(true).open(&path)).map_err(|cause| {
                DataError::Io {
                    path: path.clone(),
                    cause,
                }
            })?;
        Ok(Staged {
            name,
            path,
            out: Some(BufWriter::with_capacity(1 << 20, file)),
            len: 0,
        })
    }

    /// Where it is being written.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Everything written so far on disk (to map it).
    pub fn flush(&mut self) -> Result<(), DataError> {
        self.writer().flush().map_err(|e| self.io(e))
    }

    fn io(&self, cause: std::io::Error) -> DataError {
        DataError::Io {
            path: self.path.clone(),
            cause,
        }
    }

    fn writer(&mut self) -> &mut BufWriter<File> {
        self.out.as_mut().expect("written before it is kept")
    }

    /// Appends `bytes`.
    pub fn write(&mut self, bytes: &[u8]) -> Result<(), DataError> {
        self.writer().write_all(bytes).map_err(|e| self.io(e))?;
        self.len += bytes.len() as u64;
        Ok(())
    }

    /// Writes with `write` (to a buffered writer of the file); `len` then counts nothing of it.
    pub fn write_with(
        &mut self,
        write: impl FnOnce(&mut BufWriter<File>) -> std::io::Result<()>,
    ) -> Result<(), DataError> {
        write(self.writer()).map_err(|e| self.io(e))
    }

    /// Moves its bytes from `at` on to the end of `into`, cutting them from this file.
    pub fn split_off_into(&mut self, at: u64, into: &mut Staged) -> Result<(), DataError> {
        self.writer().flush().map_err(|e| self.io(e))?;
        let mut tail = File::open(&self.path).map_err(|e| self.io(e))?;
        tail.seek(SeekFrom::Start(at)).map_err(|e| self.io(e))?;
        let moved = std::io::copy(&mut tail, into.writer()).map_err(|e| into.io(e))?;
        into.len += moved;
        let file = self.writer().get_mut();
        let cut = file
            .set_len(at)
            .and_then(|()| file.seek(SeekFrom::Start(at)));
        cut.map_err(|e| self.io(e))?;
        self.len = at;
        Ok(())
    }

    /// Written whole: the job's file (which removes it if never kept).
    pub fn keep(mut self) -> Result<JobFile, DataError> {
        let out = self.out.take().expect("kept once");
        let file = out.into_inner().map_err(|e| self.io(e.into_error()))?;
        file.sync_all().map_err(|e| self.io(e))?;
        Ok(JobFile::staged(self.name, std::mem::take(&mut self.path)))
    }
}

/// What this host's staged files are named from: `.ddpjob-staged-<host>-` then the pid.
fn prefix() -> &'static str {
    static PREFIX: LazyLock<String> = LazyLock::new(|| {
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|h| h.trim().to_string())
            .unwrap_or_default();
        format!(".ddpjob-staged-{host}-")
    });
    &PREFIX
}

/// Removes from `dir` the files staged on this host by launchers that are gone (killed while
/// they tokenised: no `Drop` ran): their pid no longer runs.
fn sweep(dir: &Path) {
    let prefix = prefix();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(pid) = name
            .strip_prefix(prefix)
            .and_then(|rest| rest.split('-').next())
            .and_then(|pid| pid.parse::<u32>().ok())
        else {
            continue;
        };
        if pid != std::process::id() && !Path::new(&format!("/proc/{pid}")).exists() {
            let _ = std::fs::remove_file(entry.path());
        }
    }
}

impl Drop for Staged {
    fn drop(&mut self) {
        // A kept file's path was handed on; this one was abandoned half written.
        if !self.path.as_os_str().is_empty() {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}
