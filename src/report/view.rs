//! Everything `ddpjob show` and `ddpjob list` say about a job, read from its directory without
//! touching it: state (and whether a "running" job's launcher is still alive), the frozen
//! config, the metric history, the summary and the checkpoints.

use std::path::{Path, PathBuf};

use crate::checkpoint::{self, TrainPosition};
use crate::config::{self, JobSpec};
use crate::jobdir::{JobDir, JobState, Status};
use crate::task::{MetricInfo, MetricValues};
use crate::train::Summary;

use super::history::History;

/// A job as found on disk.
pub struct JobView {
    pub name: String,
    pub dir: PathBuf,
    pub state: JobState,
    /// For a job whose state says running: the launcher's pid and whether it is alive.
    pub launcher: Option<(u32, bool)>,
    /// The frozen `job.toml`, validated; `None` if it is missing or no longer valid.
    pub spec: Option<JobSpec>,
    pub history: History,
    pub summary: Option<Summary>,
    pub checkpoints: Vec<CheckpointInfo>,
    /// The checkpoint `checkpoints/latest` names.
    pub latest: Option<String>,
}

pub struct CheckpointInfo {
    pub name: String,
    /// Where training stood; `None` if its state.json is unreadable.
    pub position: Option<TrainPosition>,
    pub bytes: u64,
}

impl JobView {
    /// Reads the job `name` under `jobs_dir`; `None` if it has no readable `state.json`.
    pub fn load(jobs_dir: &Path, name: &str) -> Option<JobView> {
        let state = JobDir::open(jobs_dir, name).state_or_rebuilt()?;
        Some(JobView::with_state(jobs_dir, name, state))
    }

    /// The rest of the job, its `state.json` already read.
    fn with_state(jobs_dir: &Path, name: &str, state: JobState) -> JobView {
        let job = JobDir::open(jobs_dir, name);
        let launcher = (state.status == Status::Running)
            .then(|| launcher_of(&job))
            .flatten();
        // As its workers ran it: a train.global_batch_size shared by the job's world size.
        let spec = config::load(&job.job_toml(), &[]).ok().map(|l| {
            let world = state.world_size.max(1);
            l.spec.for_world_size(world).unwrap_or(l.spec)
        });
        let summary = std::fs::read(job.summary_path())
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok());
        let stored = checkpoint::Checkpoints::of(&job);
        // `best` (checkpoint.keep_best) is one more on disk, listed after the steps.
        let best =
            Some(stored.dir().join("best")).filter(|b| b.join("model.safetensors").is_file());
        let checkpoints = stored
            .steps()
            .into_iter()
            .chain(best)
            .map(|dir| CheckpointInfo {
                name: dir
                    .file_name()
                    .map_or_else(String::new, |n| n.to_string_lossy().into_owned()),
                position: checkpoint::read_position(&dir).ok(),
                bytes: dir_size(&dir),
            })
            .collect();
        let latest = stored.latest_name();
        JobView {
            name: name.to_string(),
            history: History::read(&job.metrics_path()).unwrap_or_default(),
            dir: job.root,
            state,
            launcher,
            spec,
            summary,
            checkpoints,
            latest,
        }
    }

    /// The status to show: `stale` for a job whose state says running but whose launcher is
    /// gone (killed with SIGKILL, or its machine rebooted).
    pub fn status(&self) -> String {
        match self.launcher {
            Some((_, false)) => "stale".into(),
            _ => self.state.status.to_string(),
        }
    }

    /// Optimizer steps done: for a job training now, its latest logged step (`state.json` is
    /// written at checkpoints and epoch ends only); else where its state stands (a crashed
    /// job's later log lines are past its checkpoint, where it resumes).
    pub fn step(&self) -> usize {
        let training = matches!(self.launcher, Some((_, true)))
            && self.state.status == crate::jobdir::Status::Running;
        let logged = self.history.train.last().map(|p| p.step);
        match (training, logged) {
            (true, Some(logged)) => self.state.step.max(logged),
            _ => self.state.step,
        }
    }

    /// Every job under `jobs_dir` with a readable state, most recently updated first.
    pub fn load_all(jobs_dir: &Path) -> std::io::Result<Vec<JobView>> {
        Ok(crate::jobdir::list_jobs(jobs_dir)?
            .into_iter()
            .map(|(name, state)| JobView::with_state(jobs_dir, &name, state))
            .collect())
    }

    /// `mlp (hidden = [64])`, or `?` without a readable config.
    pub fn model(&self) -> String {
        self.spec
            .as_ref()
            .map_or("?".into(), |s| s.model.describe())
    }

    /// `fashion-mnist`, `synthetic 2048/512`, or `?`.
    pub fn data(&self) -> String {
        let registry = crate::registry::Registry::current();
        self.spec
            .as_ref()
            .map_or("?".into(), |s| registry.describe_data(&s.data))
    }

    /// What the job's evaluations report, the headline first (see the task seam's
    /// `Metric`): as its task declared them in `state.json` or `summary.json`; for a job of
    /// an older version, inferred from the metrics its records and summary hold, or from its
    /// config before any evaluation.
    pub fn metrics(&self) -> Vec<MetricInfo> {
        if !self.state.metrics.is_empty() {
            return self.state.metrics.clone();
        }
        if let Some(s) = self.summary.as_ref().filter(|s| !s.metrics.is_empty()) {
            return s.metrics.clone();
        }
        let mut names: Vec<&str> = self
            .history
            .metric_names
            .iter()
            .map(|n| n.as_str())
            .collect();
        if let Some(summary) = &self.summary {
            names.extend(summary.metric_names());
        }
        let language = self
            .spec
            .as_ref()
            .is_some_and(|s| s.model.language().is_some());
        inferred_metrics(names, language)
    }

    /// The best evaluation by the headline metric (a classifier's most accurate, a language
    /// model's lowest loss), periodic evaluations included.
    pub fn best(&self) -> Option<Best> {
        let headline = self.metrics().into_iter().next()?;
        let e = self.history.best_by(&headline)?;
        Some(Best {
            step: e.step,
            epoch: e.epoch,
            headline,
            metrics: e.metrics,
        })
    }

    /// Samples per optimizer step over all workers: batch × accumulation × world size.
    pub fn global_batch(&self) -> Option<usize> {
        let t = &self.spec.as_ref()?.train;
        Some(
            t.global_batch_size
                .unwrap_or(t.batch_size * t.accumulation * self.state.world_size.max(1)),
        )
    }

    /// Training losses for a sparkline: log intervals, else epoch means.
    pub fn loss_series(&self) -> Vec<f64> {
        if self.history.train.is_empty() {
            self.history.epochs.iter().map(|e| e.train_loss).collect()
        } else {
            self.history.train.iter().map(|p| p.loss).collect()
        }
    }

    /// (met, total) of the recorded expectations, if any were checked.
    pub fn expectations_met(&self) -> Option<(usize, usize)> {
        let results = &self.summary.as_ref()?.expectations;
        (!results.is_empty()).then(|| (results.iter().filter(|r| r.met).count(), results.len()))
    }
}

/// The metrics of a job of an older version, from the names its records and summary hold and
/// whether its config is a language model's: with nothing evaluated yet, the built-in ones its
/// task reports.
fn inferred_metrics(mut names: Vec<&str>, language: bool) -> Vec<MetricInfo> {
    if names.is_empty() {
        names.extend(["loss", "accuracy"]);
    }
    if language && !names.contains(&"perplexity") {
        names.push("perplexity");
    }
    MetricInfo::inferred(names)
}

/// The best evaluation of a job (see [`JobView::best`]).
#[derive(Debug, Clone, PartialEq)]
pub struct Best {
    pub step: usize,
    /// The 0-based epoch, for an end-of-epoch evaluation.
    pub epoch: Option<usize>,
    /// The metric it is the best by.
    pub headline: MetricInfo,
    /// Every metric of that evaluation.
    pub metrics: MetricValues,
}

impl Best {
    /// The value of the metric it is the best by.
    pub fn value(&self) -> f64 {
        self.metrics.value(&self.headline.name)
    }
}

/// The pid in `.lock` and whether that process still exists.
fn launcher_of(job: &JobDir) -> Option<(u32, bool)> {
    let text = std::fs::read_to_string(job.root.join(".lock")).ok()?;
    let pid: u32 = text.trim().parse().ok()?;
    // SAFETY: signal 0 only checks that the process exists; EPERM means it does.
    let alive = unsafe { libc::kill(pid as libc::pid_t, 0) } == 0
        || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM);
    Some((pid, alive))
}

fn dir_size(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .filter_map(|e| e.ok()?.metadata().ok())
                .filter(|m| m.is_file())
                .map(|m| m.len())
                .sum()
        })
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::inferred_metrics;

    #[test]
    fn a_job_not_yet_evaluated_is_judged_by_its_tasks_built_in_headline() {
        let names = |infos: Vec<crate::task::MetricInfo>| -> Vec<String> {
            infos.into_iter().map(|i| i.name).collect()
        };
        assert_eq!(
            names(inferred_metrics(vec![], true)),
            ["loss", "perplexity", "accuracy"]
        );
        assert_eq!(names(inferred_metrics(vec![], false)), ["accuracy", "loss"]);
        // What its records hold decides once there are some.
        let recorded = vec!["loss", "accuracy", "perplexity"];
        assert_eq!(names(inferred_metrics(recorded, false))[0], "loss");
    }
}
