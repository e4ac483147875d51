//! Where rank 0's metric records go: `metrics.jsonl` always, a TensorBoard event file when
//! `[logging] tensorboard = true`. Every sink takes the same typed [`Record`].

use std::fs::{self, File, OpenOptions};
use std::io::{BufWriter, Write};
use std::path::PathBuf;
use std::time::{SystemTime, UNIX_EPOCH};

use super::record::Record;
use super::tensorboard;
use super::{JobDir, JobDirError, io};

/// A destination of metric records.
pub trait MetricsSink: Send {
    /// Records `record`; durable when this returns (a crash right after loses nothing).
    fn write(&mut self, record: &Record) -> Result<(), JobDirError>;
}

/// `metrics.jsonl`: one JSON line per record (**contract**).
pub struct JsonlSink {
    job: JobDir,
}

impl JsonlSink {
    /// Appends to `job`'s `metrics.jsonl`.
    pub fn new(job: JobDir) -> Self {
        JsonlSink { job }
    }
}

impl MetricsSink for JsonlSink {
    fn write(&mut self, record: &Record) -> Result<(), JobDirError> {
        self.job.append_metrics_line(&record.to_line())
    }
}

/// `tensorboard/events.out.tfevents.*` under the job directory.
pub struct TensorBoardSink {
    path: PathBuf,
    out: BufWriter<File>,
}

impl TensorBoardSink {
    /// Starts the job's event file over: the files of earlier attempts are removed and the
    /// records of `metrics.jsonl` (which a resume has already rewound to its checkpoint) are
    /// replayed, so a resumed job continues the same curves without repeating a step.
    pub fn start(job: &JobDir) -> Result<Self, JobDirError> {
        let dir = job.tensorboard_dir();
        if dir.exists() {
            for entry in fs::read_dir(&dir).map_err(io(&dir))? {
                let path = entry.map_err(io(&dir))?.path();
                let name = path.file_name().map(|n| n.to_string_lossy().into_owned());
                if name.is_some_and(|n| n.starts_with("events.out.tfevents.")) {
                    fs::remove_file(&path).map_err(io(&path))?;
                }
            }
        }
        fs::create_dir_all(&dir).map_err(io(&dir))?;
        let host = std::fs::read_to_string("/etc/hostname")
            .map(|h| h.trim().to_string())
            .unwrap_or_else(|_| "localhost".into());
        let path = dir.join(format!(
            "events.out.tfevents.{}.{host}.{}",
            now().floor() as u64,
            std::process::id()
        ));
        let file = OpenOptions::new()
            .create(true)
            .write(true)
            .truncate(true)
            .open(&path)
            .map_err(io(&path))?;
        let mut sink = TensorBoardSink {
            out: BufWriter::new(file),
            path,
        };
        sink.emit(&tensorboard::file_version_event(now()))?;
        let (records, _) =
            super::record::read_all(&job.metrics_path()).map_err(io(&job.metrics_path()))?;
        for record in &records {
            sink.append(record, record.time() as f64)?;
        }
        sink.flush()?;
        Ok(sink)
    }

    fn emit(&mut self, event: &[u8]) -> Result<(), JobDirError> {
        tensorboard::write_record(&mut self.out, event).map_err(|cause| JobDirError::Io {
            path: self.path.clone(),
            cause,
        })
    }

    fn append(&mut self, record: &Record, wall_time: f64) -> Result<(), JobDirError> {
        for (tag, value) in tensorboard::scalars(record) {
            let event =
                tensorboard::scalar_event(wall_time, record.step() as i64, &tag, value as f32);
            self.emit(&event)?;
        }
        Ok(())
    }

    fn flush(&mut self) -> Result<(), JobDirError> {
        self.out.flush().map_err(|cause| JobDirError::Io {
            path: self.path.clone(),
            cause,
        })
    }
}

impl MetricsSink for TensorBoardSink {
    fn write(&mut self, record: &Record) -> Result<(), JobDirError> {
        self.append(record, now())?;
        self.flush()
    }
}

fn now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}
