//! A job's MLflow run, fed from its `metrics.jsonl`: made once, its id kept in the job
//! directory (`mlflow.json`), so `resume`, restarts, requeues and `ddpjob sync` continue the
//! same run. What is sent is what the job recorded, by the names TensorBoard gets
//! (`train/loss`, `test/<metric>`), by optimizer step, each key's last step sent kept with the
//! id: steps a restart rewinds and trains again (to the same values, bit for bit) are not
//! logged twice, and whatever a dead server missed is sent when it answers, or by `sync`.
//! Params are the frozen `job.toml` flattened (`train.lr`, `model.lora.r`) with ddpjob's
//! version and the world size; at the end the status, the error as a tag, and the artifacts.

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};

use std::collections::VecDeque;
use std::io::{Read, Seek, SeekFrom};
use std::time::Instant;

use super::batch::{Batch, MAX_METRICS, Metric, batches};
use super::mlflow::{Auth, Client, MlflowError};
use ddpjob_storage::jobdir::record::{parse_all, read_all};
use ddpjob_storage::jobdir::tensorboard::scalars;
use ddpjob_storage::jobdir::{JobDir, Status, now_unix_ms};

/// Where a job's run goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    /// The tracking server (`logging.mlflow_uri`, else `MLFLOW_TRACKING_URI`).
    pub uri: String,
    /// `logging.mlflow_experiment`, else `MLFLOW_EXPERIMENT_NAME`, else the job's name.
    pub experiment: Option<String>,
    /// Upload `model.safetensors` too (`logging.mlflow_log_model`).
    pub log_model: bool,
}

/// The file in the job directory that keeps the run.
pub const KEPT: &str = "mlflow.json";

/// What the job directory keeps of its run.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
struct Kept {
    uri: String,
    experiment_id: String,
    run_id: String,
    artifact_uri: String,
    params_logged: bool,
    /// Per metric key, the last step sent.
    sent: BTreeMap<String, u64>,
}

/// A job's run, live or synced.
pub struct Tracker {
    job: JobDir,
    client: Client,
    target: Target,
    kept: Kept,
    /// How far `metrics.jsonl` has been read (bytes of whole lines).
    offset: u64,
    /// The server was seen to have the run (looked up or made by this tracker): not asked again
    /// at every poll, only after a refused batch.
    run_seen: bool,
    /// Values read from it and not sent yet, in order.
    backlog: VecDeque<Metric>,
}

impl Tracker {
    /// The run of `job` on `target`'s server (made at the first `sync`), continuing the one
    /// `mlflow.json` names on the same server.
    pub fn new(job: JobDir, target: Target) -> Result<Tracker, String> {
        let client = Client::new(&target.uri, Auth::from_env())?;
        let kept = std::fs::read_to_string(job.root.join(KEPT))
            .ok()
            .and_then(|t| serde_json::from_str::<Kept>(&t).ok())
            .filter(|k| k.uri == client.uri())
            .unwrap_or_default();
        Ok(Tracker {
            job,
            client,
            target,
            kept,
            offset: 0,
            run_seen: false,
            backlog: VecDeque::new(),
        })
    }

    pub fn uri(&self) -> &str {
        self.client.uri()
    }

    /// The job's name (for `ddpjob sync NAME`).
    pub fn job_name(&self) -> String {
        self.job.name()
    }

    /// The run's id, once made.
    pub fn run_id(&self) -> Option<&str> {
        Some(self.kept.run_id.as_str()).filter(|id| !id.is_empty())
    }

    fn keep(&self) {
        let text = serde_json::to_string_pretty(&self.kept).unwrap_or_default();
        // Best effort: a run continued without it logs its steps again, nothing worse.
        let _ = ddpjob_storage::jobdir::write_atomic(&self.job.root.join(KEPT), text.as_bytes());
    }

    /// Makes the run if there is none (or the server lost it), then logs its params.
    fn ensure_run(&mut self) -> Result<(), MlflowError> {
        if self.run_seen {
            return Ok(());
        }
        if let Some(id) = self.run_id().map(String::from) {
            if self.client.run(&id)?.is_some() {
                self.run_seen = true;
                return Ok(());
            }
            self.kept = Kept::default();
        }
        let name = self.job.name();
        let experiment = (self.target.experiment.clone())
            .or_else(|| std::env::var("MLFLOW_EXPERIMENT_NAME").ok())
            .filter(|e| !e.is_empty())
            .unwrap_or_else(|| name.clone());
        let experiment_id = self.client.experiment_id(&experiment)?;
        let (records, _) = read_all(&self.job.metrics_path()).unwrap_or_default();
        let start_ms = records
            .first()
            .map_or(now_unix_ms() as u64, |r| r.time() * 1000);
        let mut tags = vec![
            ("mlflow.source.name".to_string(), "ddpjob".to_string()),
            ("mlflow.source.type".to_string(), "JOB".to_string()),
            (
                "ddpjob.job_dir".to_string(),
                std::path::absolute(&self.job.root)
                    .unwrap_or(self.job.root.clone())
                    .display()
                    .to_string(),
            ),
        ];
        if let Ok(user) = std::env::var("USER") {
            tags.push(("mlflow.user".to_string(), user));
        }
        let run = self
            .client
            .create_run(&experiment_id, &name, start_ms, &tags)?;
        self.kept = Kept {
            uri: self.client.uri().to_string(),
            experiment_id: run.experiment_id,
            run_id: run.run_id,
            artifact_uri: run.artifact_uri,
            params_logged: false,
            sent: BTreeMap::new(),
        };
        self.keep();
        self.run_seen = true;
        // A new run has none of the job's values: all are read again for it.
        (self.offset, self.backlog) = (0, VecDeque::new());
        Ok(())
    }

    /// Sends what the job recorded and the server has not got; the number of metric values
    /// sent. On an error what was sent stays sent (and kept); the rest goes next time.
    pub fn sync(&mut self) -> Result<usize, MlflowError> {
        self.sync_until(None)
    }

    /// [`Tracker::sync`], sending no more batches once `until` has passed (the rest waits for
    /// the next call), so a backlog never holds up the end of a job for long.
    pub fn sync_until(&mut self, until: Option<Instant>) -> Result<usize, MlflowError> {
        self.ensure_run()?;
        let run_id = self.kept.run_id.clone();
        if !self.kept.params_logged {
            let params = params(&self.job);
            for batch in batches(Vec::new(), params, Vec::new()) {
                self.client.log_batch(&run_id, &batch)?;
            }
            self.kept.params_logged = true;
            self.keep();
        }
        self.read_on();
        let mut sent = 0;
        while !self.backlog.is_empty() {
            if until.is_some_and(|u| Instant::now() >= u) {
                break;
            }
            let take = self.backlog.len().min(MAX_METRICS);
            let batch = Batch {
                metrics: self.backlog.iter().take(take).cloned().collect(),
                ..Batch::default()
            };
            if let Err(e) = self.client.log_batch(&run_id, &batch) {
                // Refused: perhaps the run was deleted meanwhile; look it up next time.
                self.run_seen &= e.is_transient();
                return Err(e);
            }
            for m in self.backlog.drain(..take) {
                let last = self.kept.sent.entry(m.key.clone()).or_insert(m.step);
                *last = (*last).max(m.step);
            }
            sent += take;
            self.keep();
        }
        Ok(sent)
    }

    /// Reads the whole lines `metrics.jsonl` gained since the last read into the backlog (only
    /// values past each key's last step sent). A file shorter than what was read was rewound
    /// (a resume, a restart): it is read again from the start, the steps already sent skipped.
    fn read_on(&mut self) {
        let path = self.job.metrics_path();
        let Ok(mut file) = std::fs::File::open(&path) else {
            return;
        };
        let len = file.metadata().map_or(0, |m| m.len());
        if len < self.offset {
            self.offset = 0;
            self.backlog.clear();
        }
        if len == self.offset || file.seek(SeekFrom::Start(self.offset)).is_err() {
            return;
        }
        let mut bytes = Vec::new();
        if file.read_to_end(&mut bytes).is_err() {
            return;
        }
        // A line still being written waits for the next read.
        let Some(end) = bytes.iter().rposition(|&b| b == b'\n') else {
            return;
        };
        let text = String::from_utf8_lossy(&bytes[..=end]);
        let (records, _) = parse_all(&text);
        let mut last = self.kept.sent.clone();
        for m in &self.backlog {
            last.insert(m.key.clone(), m.step);
        }
        self.backlog.extend(unsent(&records, &last));
        self.offset += end as u64 + 1;
    }

    /// Marks the run running again (a resumed or restarted job), with its world size.
    pub fn running(&mut self, world_size: usize) -> Result<(), MlflowError> {
        self.ensure_run()?;
        let tags = vec![("ddpjob.world_size".to_string(), world_size.to_string())];
        for batch in batches(Vec::new(), Vec::new(), tags) {
            self.client.log_batch(&self.kept.run_id, &batch)?;
        }
        self.client.update_run(&self.kept.run_id, "RUNNING", None)
    }

    /// Ends the run as the job ended (`state.json`): everything sent, the artifacts uploaded,
    /// the status `FINISHED`, `FAILED` (the error as the tag `ddpjob.error`) or `KILLED`
    /// (interrupted: SIGTERM, a preemption). Warnings for artifacts that could not go.
    pub fn finish(&mut self) -> Result<Vec<String>, MlflowError> {
        self.finish_until(None)
    }

    /// [`Tracker::finish`], sending the backlog only until `until`.
    pub fn finish_until(&mut self, until: Option<Instant>) -> Result<Vec<String>, MlflowError> {
        self.sync_until(until)?;
        if !self.backlog.is_empty() {
            return Err(MlflowError::Behind {
                uri: self.client.uri().to_string(),
                left: self.backlog.len(),
            });
        }
        let state = self.job.read_state();
        let status = match state.as_ref().map(|s| s.status) {
            Some(Status::Finished) => "FINISHED",
            Some(Status::Interrupted) => "KILLED",
            Some(Status::Running) => "RUNNING",
            _ => "FAILED",
        };
        let run_id = self.kept.run_id.clone();
        if let Some(error) = state.as_ref().and_then(|s| s.error.clone()) {
            let tags = vec![("ddpjob.error".to_string(), error)];
            for batch in batches(Vec::new(), Vec::new(), tags) {
                self.client.log_batch(&run_id, &batch)?;
            }
        }
        let mut warnings = Vec::new();
        let mut files = vec![
            self.job.summary_path(),
            self.job.curves_path(),
            self.job.root.join("job.toml"),
        ];
        if self.target.log_model {
            files.push(self.job.model_path());
        }
        // An artifact that does not go is a warning: the run's status is set whatever happens.
        for file in files.iter().filter(|f| f.is_file()) {
            if let Err(e) = self.client.upload_artifact(&self.kept.artifact_uri, file) {
                warnings.push(e.to_string());
            }
        }
        let end = (status != "RUNNING").then_some(now_unix_ms() as u64);
        self.client.update_run(&run_id, status, end)?;
        Ok(warnings)
    }
}

/// The metric values of `records` past each key's last step in `sent`, in order; one value
/// per key and step (an epoch's evaluation is in its epoch record too).
fn unsent(
    records: &[ddpjob_storage::jobdir::record::Record],
    sent: &BTreeMap<String, u64>,
) -> Vec<Metric> {
    let mut last: BTreeMap<String, u64> = sent.clone();
    let mut fresh = Vec::new();
    for record in records {
        let step = record.step() as u64;
        for (key, value) in scalars(record) {
            let new = last.get(&key).is_none_or(|&s| step > s);
            if new {
                last.insert(key.clone(), step);
                fresh.push(Metric {
                    key,
                    value,
                    timestamp_ms: record.time() * 1000,
                    step,
                });
            }
        }
    }
    fresh
}

/// The frozen config flattened (`train.lr` = `0.001`), with ddpjob's version and the world
/// size the job started on.
fn params(job: &JobDir) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let doc = std::fs::read_to_string(job.root.join("job.toml"))
        .ok()
        .and_then(|t| t.parse::<toml::Table>().ok())
        .unwrap_or_default();
    flatten("", &doc, &mut out);
    out.push(("ddpjob.version".into(), env!("CARGO_PKG_VERSION").into()));
    if let Some(state) = job.read_state() {
        out.push(("world_size".into(), state.world_size.to_string()));
    }
    out
}

fn flatten(prefix: &str, table: &toml::Table, out: &mut Vec<(String, String)>) {
    for (key, value) in table {
        let name = match prefix.is_empty() {
            true => key.clone(),
            false => format!("{prefix}.{key}"),
        };
        match value {
            toml::Value::Table(t) => flatten(&name, t, out),
            toml::Value::String(s) => out.push((name, s.clone())),
            other => out.push((name, other.to_string())),
        }
    }
}

/// Whether `job` has a run of its own (for `show` and `sync`).
pub fn run_of(job: &Path) -> Option<(String, String)> {
    let kept: Kept = serde_json::from_str(&std::fs::read_to_string(job.join(KEPT)).ok()?).ok()?;
    Some((kept.uri, kept.run_id)).filter(|(_, id)| !id.is_empty())
}
