//! One node's worker group through its attempts: spawn every worker with the torchrun
//! environment, supervise them, and after a failure restart the whole group from the newest
//! good checkpoint (`distributed.max_restarts`), or give up with every failure listed.

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use super::nodes::{self, Nodes};
use super::supervise::{self, Outcome};
use super::watch::Watchdog;
use super::{Layout, RunError, absolute};
use crate::checkpoint;
use crate::config::JobSpec;
use crate::jobdir::{JobDir, JobDirError, now_unix, now_unix_ms};
use crate::worker::{self, WorkerEnv};
use ddpjob_store::{LAUNCH_PREFIX, StoreClient, StoreServer};

/// Everything needed to start this node's workers, attempt after attempt.
pub(super) struct Group<'a> {
    pub job: &'a JobDir,
    pub spec: &'a JobSpec,
    pub layout: &'a Layout,
    pub token: &'a str,
    pub port: u16,
    pub started: Instant,
    /// Node 0's store (cleared between attempts); `None` on other nodes.
    pub server: Option<&'a StoreServer>,
    pub client: &'a StoreClient,
    /// The other nodes' launchers, on a multi-node job.
    pub nodes: Option<Nodes<'a>>,
}

/// How an attempt failed, as every node reports it.
struct AttemptFailure {
    /// One line, naming the node and rank where it began.
    summary: String,
    /// The error of a job that fails here: the summary, this node's ranks and log tail.
    report: String,
    /// Not worth a restart: a failure before training that would repeat (a data or model
    /// error), or another node that cannot read the checkpoints.
    fatal: bool,
}

impl Group<'_> {
    fn name(&self) -> String {
        self.spec.name.clone()
    }

    /// Runs attempts until the workers finish, are interrupted, or fail more often than
    /// `distributed.max_restarts` allows. `resume_from`: the first attempt's checkpoint.
    /// From here on Ctrl-C (and SIGTERM, SIGUSR1) stops the workers in order instead of
    /// killing the launcher. On several nodes every node's launcher runs this loop, in step.
    pub fn execute(&self, mut resume_from: Option<PathBuf>) -> Result<(), RunError> {
        crate::signals::install();
        let max_restarts = self.spec.distributed.max_restarts;
        let grace = Duration::from_secs(self.spec.distributed.timeout_s) + Duration::from_secs(10);
        let mut failures: Vec<String> = Vec::new();
        for attempt in 0.. {
            let mut workers = self.spawn(attempt, resume_from.as_ref())?;
            let stale_after = Duration::from_secs(self.spec.distributed.timeout_s);
            let mut watch = Watchdog::new(self.client, stale_after);
            let peer_failure = || self.peer_failure(attempt);
            let failed = match supervise::supervise(&mut workers, &mut watch, grace, &peer_failure)
            {
                Outcome::Finished => return Ok(()),
                Outcome::Interrupted { signal, clean } => {
                    return Err(RunError::Interrupted {
                        name: self.name(),
                        signal,
                        after: self.after_interrupt(clean),
                    });
                }
                Outcome::Failed {
                    summary,
                    report,
                    lost_peer,
                    repeats,
                } => self.agree_on_failure(attempt, summary, report, lost_peer, repeats)?,
                Outcome::PeerFailed { summary } => self.peer_failed(attempt, summary)?,
            };
            failures.push(format!("  attempt {}: {}", attempt + 1, failed.summary));
            if attempt >= max_restarts || failed.fatal {
                if max_restarts == 0 || failed.fatal {
                    let not_restarted = match (failed.fatal, max_restarts) {
                        (true, 1..) => format!(
                            "\nnot restarted (distributed.max_restarts = {max_restarts}): the \
                             failure came before training and a restart would meet it again; \
                             fix it, then run the job again (`--resume auto` continues it)"
                        ),
                        _ => self.after_failure(),
                    };
                    return Err(RunError::Failed {
                        name: self.name(),
                        report: failed.report + &not_restarted,
                    });
                }
                return Err(RunError::GaveUp {
                    name: self.name(),
                    restarts: max_restarts,
                    failures: failures.join("\n"),
                    report: failed.report + &self.after_failure(),
                });
            }
            resume_from = self.next_start(attempt, &failed)?;
            let from = resume_from
                .as_ref()
                .map_or("the start (no checkpoint yet)".into(), |d| {
                    format!("checkpoint `{}`", d.display())
                });
            let line = format!(
                "restart {}/{max_restarts} of job `{}` from {from} after: {}",
                attempt + 1,
                self.name(),
                failed.summary
            );
            errln!("{line}");
            self.record_restart(attempt + 1, &line)?;
        }
        unreachable!("the attempts loop returns")
    }

    /// Another node's failure of `attempt`, once one is recorded (multi-node jobs).
    fn peer_failure(&self, attempt: usize) -> Option<String> {
        let nodes = self.nodes.as_ref()?;
        // A store that does not answer means node 0 is gone; the workers notice that too.
        let failure = nodes.failure(attempt).ok().flatten()?;
        (failure.node != self.layout.node_rank).then(|| failure.describe())
    }

    /// This node's workers failed: on several nodes, tell the others (unless another node's
    /// failure came first, which is then the one every node reports) and say the workers are
    /// gone.
    fn agree_on_failure(
        &self,
        attempt: usize,
        summary: String,
        report: String,
        lost_peer: bool,
        repeats: bool,
    ) -> Result<AttemptFailure, RunError> {
        let Some(nodes) = &self.nodes else {
            return Ok(AttemptFailure {
                summary,
                report,
                fatal: repeats,
            });
        };
        let unreachable = |e| self.node0_gone(e, &report);
        if lost_peer {
            // A rank that only lost its peer points elsewhere: give the node where the cause
            // is a moment to say so first.
            nodes.settled_failure(attempt).map_err(unreachable)?;
        }
        nodes
            .report_failure(attempt, &summary, repeats)
            .map_err(unreachable)?;
        nodes.stopped(attempt).map_err(unreachable)?;
        match nodes.failure(attempt).map_err(unreachable)? {
            Some(first) if first.node != self.layout.node_rank => Ok(AttemptFailure {
                summary: first.describe(),
                report: format!(
                    "{}; the workers of every node were stopped\non this node: {report}",
                    first.describe()
                ),
                fatal: first.fatal,
            }),
            _ => Ok(AttemptFailure {
                summary: format!("node {}: {summary}", self.layout.node_rank),
                report,
                fatal: repeats,
            }),
        }
    }

    /// Another node's workers failed first and this node's were stopped.
    fn peer_failed(&self, attempt: usize, summary: String) -> Result<AttemptFailure, RunError> {
        let nodes = self
            .nodes
            .as_ref()
            .expect("a peer failure on several nodes");
        let report = format!("{summary}; the workers of every node were stopped");
        nodes
            .stopped(attempt)
            .map_err(|e| self.node0_gone(e, &report))?;
        let fatal = nodes
            .failure(attempt)
            .ok()
            .flatten()
            .is_some_and(|f| f.fatal);
        Ok(AttemptFailure {
            summary,
            report,
            fatal,
        })
    }

    fn node0_gone(&self, e: ddpjob_store::StoreError, report: &str) -> RunError {
        RunError::Failed {
            name: self.name(),
            report: format!(
                "node 0's launcher cannot be reached any more ({e}), so the nodes cannot agree \
                 on a restart; this node's workers were stopped after: {report}"
            ),
        }
    }

    /// The checkpoint the next attempt starts from: node 0 chooses it (once every node's
    /// workers are gone) and tells the other nodes; a single node just chooses it.
    fn next_start(
        &self,
        attempt: usize,
        failed: &AttemptFailure,
    ) -> Result<Option<PathBuf>, RunError> {
        let Some(nodes) = &self.nodes else {
            return self.restart_point();
        };
        let cannot_restart = |why: String| RunError::Failed {
            name: self.name(),
            report: format!("{why}\nthe failure: {}", failed.report),
        };
        if self.layout.node_rank == 0 {
            nodes.await_stopped(attempt).map_err(cannot_restart)?;
            // Absolute: the other nodes' launchers may run in other directories.
            let from = self.restart_point()?.map(|d| absolute(&d));
            nodes
                .publish_next(attempt, from.as_deref())
                .map_err(|e| cannot_restart(e.to_string()))?;
            return Ok(from);
        }
        let from = nodes.await_next(attempt).map_err(cannot_restart)?;
        if let Some(dir) = &from
            && let Err(why) = nodes::check_shared(dir, self.layout.node_rank, "checkpoint")
        {
            // Node 0 has started its next attempt: stop it too, for good.
            let _ = nodes.report_failure(attempt + 1, &why, true);
            return Err(RunError::Usage(why));
        }
        Ok(from)
    }

    /// Node 0 after a failure: the newest checkpoint that verifies (damaged newer ones named),
    /// the metrics rewound to it, and a fresh store for the next group.
    fn restart_point(&self) -> Result<Option<PathBuf>, RunError> {
        let dir = self.job.checkpoints_dir();
        let choice = checkpoint::Checkpoints::of(self.job)
            .newest_good()
            .map_err(|cause| JobDirError::Io {
                path: dir.clone(),
                cause,
            })?;
        rewind_to(self.job, &choice)?;
        if let Some(server) = self.server {
            server.clear_except(LAUNCH_PREFIX);
        }
        Ok(choice.usable)
    }

    /// Node 0 counts the restarts in `state.json` (the other nodes' view of the job directory
    /// is node 0's on a shared file system, or has no state).
    fn record_restart(&self, restarts: usize, line: &str) -> Result<(), RunError> {
        if self.layout.node_rank != 0 {
            return Ok(());
        }
        if let Some(mut state) = self.job.read_state() {
            state.restarts = restarts;
            state.updated_unix = now_unix();
            state.error = Some(line.to_string());
            self.job.write_state(&state)?;
        }
        Ok(())
    }

    /// What continues a failed job once its cause is fixed: from the newest checkpoint, or
    /// from the start where none was written. `resume` reads the job's own `job.toml`, so a
    /// setting's fix goes there. On several nodes only node 0's directory is sure to hold the
    /// checkpoints, so no checkpoint is named.
    fn after_failure(&self) -> String {
        if self.layout.nnodes > 1 {
            return format!(
                "\nonce the cause is fixed, the same `ddpjob run` command on the {} nodes with \
                 `--resume auto` continues from the newest checkpoint (or trains it again \
                 without one)",
                self.layout.nnodes
            );
        }
        let settings = format!(
            "once the cause is fixed (a setting's fix goes in `{}`, which resume reads)",
            self.job.job_toml().display()
        );
        match crate::checkpoint::Checkpoints::of(self.job).latest_name() {
            Some(latest) => format!(
                "\n{settings}, `{}` continues from checkpoint `{latest}`",
                self.job.cli("resume")
            ),
            None => format!(
                "\nno checkpoint was written; {settings}, `{} --from-scratch` trains it again",
                self.job.cli("resume")
            ),
        }
    }

    /// What an interrupted job left behind, for the message.
    fn after_interrupt(&self, clean: bool) -> String {
        let resume = match self.layout.nnodes {
            1 => format!("continue with `{}`", self.job.cli("resume")),
            n => format!(
                "continue on {n} nodes with the same `ddpjob run` command and `--resume auto` \
                 (or on one node with `{}`)",
                self.job.cli("resume")
            ),
        };
        match (
            clean,
            crate::checkpoint::Checkpoints::of(self.job).latest_name(),
        ) {
            (true, Some(latest)) => {
                format!("every worker stopped after checkpoint `{latest}`; {resume}")
            }
            (true, None) => "the workers stopped before training began; nothing to resume".into(),
            (false, Some(latest)) => format!(
                "the workers were stopped before all of them had checkpointed; the newest \
                 checkpoint is `{latest}`; {resume}"
            ),
            (false, None) => "the workers were stopped; no checkpoint was written".into(),
        }
    }

    /// Starts one worker per local slot; on a spawn failure the ones started are stopped.
    fn spawn(
        &self,
        attempt: usize,
        resume_from: Option<&PathBuf>,
    ) -> Result<Vec<supervise::Worker>, RunError> {
        let layout = self.layout;
        let exe = std::env::current_exe().map_err(|cause| RunError::Spawn { rank: 0, cause })?;
        let threads = threads_per_worker(layout.nproc).to_string();
        let started_ms = now_unix_ms().saturating_sub(self.started.elapsed().as_millis());
        let job_dir = absolute(&self.job.root);
        let resume_from = resume_from.map(|d| absolute(d));
        let mut workers = Vec::new();
        for local_rank in 0..layout.nproc {
            let rank = layout.node_rank * layout.nproc + local_rank;
            let mut cmd = Command::new(&exe);
            cmd.arg("worker");
            WorkerEnv {
                rank,
                local_rank,
                world_size: layout.world_size(),
                local_world_size: layout.nproc,
                node_rank: layout.node_rank,
                master_addr: layout.master_addr.clone(),
                master_port: self.port,
                job_dir: job_dir.clone(),
                restart_count: attempt,
                token: self.token.to_string(),
                started_unix_ms: Some(started_ms),
                resume_from: resume_from.clone(),
                device: layout.placement.device_of(local_rank),
            }
            .apply(&mut cmd);
            for var in ["RAYON_NUM_THREADS", "OMP_NUM_THREADS"] {
                if std::env::var_os(var).is_none() {
                    cmd.env(var, &threads);
                }
            }
            // A CPU worker runs its threads as row shards (train::shards), each calling
            // candle's element-wise ops single-threaded; candle's own pool would make them
            // queue behind one lock and spin a thread of its own.
            cmd.env("CANDLE_NUM_THREADS", "1");
            let log = worker::log_path(&job_dir, rank);
            match supervise::spawn(cmd, rank, &log, rank == 0) {
                Ok(w) => workers.push(w),
                Err(cause) => {
                    supervise::stop(&mut workers, true);
                    return Err(RunError::Spawn { rank, cause });
                }
            }
        }
        Ok(workers)
    }
}

/// Sets damaged checkpoints aside (saying so) and rewinds `metrics.jsonl` to the chosen one.
pub(super) fn rewind_to(job: &JobDir, choice: &checkpoint::Choice) -> Result<(), RunError> {
    let dir = job.checkpoints_dir();
    let io = |cause| JobDirError::Io {
        path: dir.clone(),
        cause,
    };
    for warning in choice.set_aside().map_err(io)? {
        errln!("warning: {warning}");
    }
    if let Some(note) = choice.set_aside_later_best(&dir).map_err(io)? {
        errln!("note: {note}");
    }
    let to = choice.position.as_ref().map(|p| (p.epoch, p.step));
    Ok(job.rewind_metrics(to)?)
}

/// Threads per worker: the node's cores split evenly (as torchrun sets OMP_NUM_THREADS).
pub(super) fn threads_per_worker(nproc: usize) -> usize {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    (cores / nproc).max(1)
}
