//! What the launchers of a multi-node job tell each other through node 0's store. Node 0 decides
//! for every node how the job goes on (start it, continue it from a checkpoint, or nothing to
//! do), and the nodes restart together, as torchrun's elastic agents do: the first failure of an
//! attempt on any node stops the workers of every node, each node says when its workers are
//! gone, and node 0 chooses the checkpoint every node's next attempt starts from.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::{RunError, RunOptions, join_job};
use crate::jobdir::JobDir;
use ddpjob_store::{Key, StoreClient, StoreError};

/// How the job goes on, as node 0 decided it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "plan", rename_all = "snake_case")]
pub enum Plan {
    /// A new job.
    Start,
    /// An unfinished job, from this checkpoint (`None`: from the start).
    Continue { from: Option<PathBuf> },
    /// The job has finished; the message says so.
    Finished { message: String },
}

/// The plan and node 0's job directory (absolute): where the other nodes' workers read the
/// checkpoints from, so it must be on a file system they share.
#[derive(Debug, Serialize, Deserialize)]
struct PlanRecord {
    job_dir: PathBuf,
    #[serde(flatten)]
    plan: Plan,
}

/// The first failure of an attempt, as the node that saw it reported it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Failure {
    pub node: usize,
    /// One line: the rank, its status and step (and why, from its failure record).
    pub summary: String,
    /// Not worth a restart: the next attempt would fail the same way.
    pub fatal: bool,
}

impl Failure {
    pub fn describe(&self) -> String {
        format!("node {}: {}", self.node, self.summary)
    }
}

/// This launcher's side of the conversation.
pub struct Nodes<'a> {
    pub client: &'a StoreClient,
    pub node_rank: usize,
    pub nnodes: usize,
    /// `distributed.timeout_s`: how long a node may take to answer.
    pub patience: Duration,
}

/// How often a launcher waiting for the others looks at its own signals.
const SLICE: Duration = Duration::from_millis(500);

impl Nodes<'_> {
    /// Node 0: tells the other nodes how the job goes on.
    pub fn publish_plan(&self, job_dir: &Path, plan: Plan) -> Result<(), StoreError> {
        let record = PlanRecord {
            job_dir: job_dir.to_path_buf(),
            plan,
        };
        let json = serde_json::to_vec(&record).expect("a plan serialises");
        self.client.set(&Key::JobReady.to_string(), &json)
    }

    /// Other nodes: node 0's plan and job directory, once node 0 has prepared the job.
    pub fn await_plan(&self) -> Result<(PathBuf, Plan), StoreError> {
        let bytes = self
            .client
            .wait_get(&Key::JobReady.to_string(), self.patience)?;
        let record: PlanRecord =
            serde_json::from_slice(&bytes).map_err(|e| StoreError::Refused {
                addr: "node 0".into(),
                reason: format!(
                    "its plan for the job is unreadable ({e}); is it another ddpjob version?"
                ),
            })?;
        Ok((record.job_dir, record.plan))
    }

    /// Other nodes: says they have read a `Finished` plan, so node 0 may leave.
    pub fn plan_seen(&self) -> Result<(), StoreError> {
        self.client.add(&Key::PlanSeen.to_string(), 1).map(|_| ())
    }

    /// Node 0, after publishing a `Finished` plan: waits (up to the patience) until every other
    /// node has read it; the ones that have not are named.
    pub fn await_plan_seen(&self) -> Result<(), String> {
        let deadline = Instant::now() + self.patience;
        loop {
            let seen = self
                .client
                .add(&Key::PlanSeen.to_string(), 0)
                .map_err(|e| e.to_string())?;
            if seen as usize + 1 >= self.nnodes {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(format!(
                    "{} of {} other node(s) did not come to hear it within {} s \
                     (distributed.timeout_s)",
                    self.nnodes - 1 - seen as usize,
                    self.nnodes - 1,
                    self.patience.as_secs()
                ));
            }
            std::thread::sleep(SLICE / 5);
        }
    }

    /// Records this node's failure of `attempt` unless another node's came first.
    pub fn report_failure(
        &self,
        attempt: usize,
        summary: &str,
        fatal: bool,
    ) -> Result<(), StoreError> {
        let first = self
            .client
            .add(&Key::AttemptFailures { attempt }.to_string(), 1)?
            == 1;
        if first {
            let failure = Failure {
                node: self.node_rank,
                summary: summary.to_string(),
                fatal,
            };
            let json = serde_json::to_vec(&failure).expect("a failure serialises");
            self.client
                .set(&Key::AttemptFailed { attempt }.to_string(), &json)?;
        }
        Ok(())
    }

    /// The failure of `attempt` recorded by any node, if there is one yet.
    pub fn failure(&self, attempt: usize) -> Result<Option<Failure>, StoreError> {
        let bytes = self
            .client
            .get(&Key::AttemptFailed { attempt }.to_string())?;
        Ok(bytes.and_then(|b| serde_json::from_slice(&b).ok()))
    }

    /// The failure of `attempt`, waiting briefly for the node elected to record it (it may be
    /// between its `add` and its `set`).
    pub fn settled_failure(&self, attempt: usize) -> Result<Option<Failure>, StoreError> {
        let key = Key::AttemptFailed { attempt }.to_string();
        match self.client.wait_get(&key, Duration::from_secs(2)) {
            Ok(bytes) => Ok(serde_json::from_slice(&bytes).ok()),
            Err(StoreError::Timeout { .. }) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// This node's workers of `attempt` are all gone.
    pub fn stopped(&self, attempt: usize) -> Result<(), StoreError> {
        let key = Key::AttemptStopped {
            attempt,
            node: self.node_rank,
        };
        self.client.set(&key.to_string(), b"1")
    }

    /// Node 0: waits until every node's workers of `attempt` are gone; the error names the
    /// nodes that did not say so in time (their launcher, or their host, is gone).
    pub fn await_stopped(&self, attempt: usize) -> Result<(), String> {
        let keys: Vec<String> = (0..self.nnodes)
            .map(|node| Key::AttemptStopped { attempt, node }.to_string())
            .collect();
        match self.wait_patiently(&keys, self.patience) {
            Ok(()) => Ok(()),
            Err(StoreError::Timeout { missing, .. }) => {
                let nodes: Vec<String> = (0..self.nnodes)
                    .filter(|&n| missing.contains(&keys[n]))
                    .map(|n| format!("node {n}"))
                    .collect();
                Err(format!(
                    "{} did not stop {} workers within {} s (distributed.timeout_s): its \
                     launcher was killed or its host is down, so the job cannot restart; \
                     look at that node, then continue the job with `ddpjob run ... --resume auto`",
                    nodes.join(", "),
                    if nodes.len() == 1 { "its" } else { "their" },
                    self.patience.as_secs()
                ))
            }
            Err(e) => Err(e.to_string()),
        }
    }

    /// Node 0: the checkpoint every node's next attempt starts from.
    pub fn publish_next(&self, attempt: usize, from: Option<&Path>) -> Result<(), StoreError> {
        let json = serde_json::to_vec(&from).expect("a path serialises");
        self.client
            .set(&Key::AttemptNext { attempt }.to_string(), &json)
    }

    /// Other nodes: the checkpoint node 0 chose after `attempt` failed.
    pub fn await_next(&self, attempt: usize) -> Result<Option<PathBuf>, String> {
        let key = Key::AttemptNext { attempt }.to_string();
        // Node 0 first waits up to the patience for the slowest node.
        let waited = self.wait_patiently(std::slice::from_ref(&key), self.patience * 2);
        let bytes = waited
            .and_then(|()| self.client.get(&key))
            .map_err(|e| format!("node 0 did not say how to restart: {e}"))?;
        bytes
            .and_then(|b| serde_json::from_slice(&b).ok())
            .ok_or_else(|| "node 0's restart decision is unreadable".to_string())
    }

    /// Waits up to `limit` for `keys`, in short slices so a second Ctrl-C is not ignored.
    fn wait_patiently(&self, keys: &[String], limit: Duration) -> Result<(), StoreError> {
        let started = Instant::now();
        loop {
            match self.client.wait(keys, SLICE) {
                Err(StoreError::Timeout { missing, .. }) => {
                    if started.elapsed() >= limit || crate::signals::received() > 1 {
                        return Err(StoreError::Timeout {
                            missing,
                            waited_s: started.elapsed().as_secs_f64(),
                        });
                    }
                }
                other => return other,
            }
        }
    }
}

/// What a node other than 0 does, as node 0 decided it.
pub(super) enum Followed {
    /// Train, from this checkpoint (node 0's, read through a shared file system).
    Train(Option<PathBuf>),
    /// Nothing: the job finished already.
    Finished(String),
}

/// Nodes > 0: waits for node 0's plan and checks this node can follow it.
pub(super) fn follow_node0(
    job: &JobDir,
    opts: &RunOptions,
    nodes: &Nodes,
) -> Result<Followed, RunError> {
    let spec = &opts.loaded.spec;
    let (node0_dir, plan) = nodes.await_plan().map_err(|e| match e {
        StoreError::Timeout { .. } => RunError::Failed {
            name: spec.name.clone(),
            report: format!(
                "node 0 did not finish preparing it (data download, job directory, checkpoint) \
                 within {} s (distributed.timeout_s); see node 0's output",
                nodes.patience.as_secs()
            ),
        },
        other => other.into(),
    })?;
    // Workers of a restarted or continued job read node 0's checkpoints.
    let must_read = match &plan {
        Plan::Finished { message } => {
            nodes.plan_seen()?;
            return Ok(Followed::Finished(format!("{message} (node 0 says)")));
        }
        Plan::Continue { from: Some(dir) } => Some((dir.clone(), "checkpoint")),
        _ if spec.distributed.max_restarts > 0 => {
            Some((node0_dir.join("state.json"), "the job's state.json"))
        }
        _ => None,
    };
    if let Some((path, what)) = must_read
        && let Err(why) = check_shared(&path, nodes.node_rank, what)
    {
        // Node 0 is starting its workers: they stop at once.
        let _ = nodes.report_failure(0, &why, true);
        return Err(RunError::Usage(why));
    }
    // A new job reads its data afresh, as node 0 does: what a directory of the same name
    // holds on this node may be an earlier job's (its vocabulary, its record of the files).
    let continuing = matches!(plan, Plan::Continue { .. });
    super::prepare_data(spec, job, continuing)?;
    join_job(job, opts)?;
    Ok(Followed::Train(match plan {
        Plan::Continue { from } => from,
        _ => None,
    }))
}

/// What another node needs to read from node 0's job directory (`what`), checked before it
/// starts workers that would fail on it.
pub fn check_shared(path: &Path, node_rank: usize, what: &str) -> Result<(), String> {
    if path.exists() {
        return Ok(());
    }
    Err(format!(
        "node {node_rank} cannot read {what} `{}`, which node 0 wrote: restarts and resumes of a \
         multi-node job read node 0's checkpoints on every node, so the job directory must be on \
         a file system every node mounts at the same path (put --jobs-dir on it), or set \
         distributed.max_restarts = 0 and continue the job on one node with `ddpjob resume`",
        path.display()
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use ddpjob_store::StoreServer;

    fn pair() -> (StoreServer, StoreClient, StoreClient) {
        let server = StoreServer::bind("127.0.0.1:0".parse().unwrap(), "t").unwrap();
        let addr = server.addr().to_string();
        let a = StoreClient::connect(&addr, "t", Duration::from_secs(5)).unwrap();
        let b = StoreClient::connect(&addr, "t", Duration::from_secs(5)).unwrap();
        (server, a, b)
    }

    fn nodes(client: &StoreClient, node_rank: usize) -> Nodes<'_> {
        Nodes {
            client,
            node_rank,
            nnodes: 2,
            patience: Duration::from_secs(1),
        }
    }

    #[test]
    fn the_first_failure_of_an_attempt_is_the_one_every_node_reads() {
        let (_server, a, b) = pair();
        let (n0, n1) = (nodes(&a, 0), nodes(&b, 1));
        assert!(n0.failure(0).unwrap().is_none());
        n1.report_failure(0, "rank 1 was killed by signal 9", false)
            .unwrap();
        n0.report_failure(0, "rank 0 lost its peer", false).unwrap();
        let seen = n0.settled_failure(0).unwrap().unwrap();
        assert_eq!(seen.describe(), "node 1: rank 1 was killed by signal 9");
        // Another attempt starts clean.
        assert!(n1.failure(1).unwrap().is_none());
    }

    #[test]
    fn a_node_that_never_stops_is_named_after_the_patience() {
        let (_server, a, b) = pair();
        let (n0, n1) = (nodes(&a, 0), nodes(&b, 1));
        n0.stopped(3).unwrap();
        let started = Instant::now();
        let err = n0.await_stopped(3).unwrap_err();
        assert!(
            err.starts_with("node 1 did not stop its workers within 1 s"),
            "{err}"
        );
        assert!(started.elapsed() < Duration::from_secs(5));
        n1.stopped(3).unwrap();
        n0.await_stopped(3).unwrap();
        n0.publish_next(3, Some(Path::new("/j/checkpoints/step-10")))
            .unwrap();
        assert_eq!(
            n1.await_next(3).unwrap().as_deref(),
            Some(Path::new("/j/checkpoints/step-10"))
        );
    }

    #[test]
    fn the_plan_reaches_the_other_nodes_with_node_0s_job_directory() {
        let (_server, a, b) = pair();
        let (n0, n1) = (nodes(&a, 0), nodes(&b, 1));
        let plan = Plan::Continue {
            from: Some("/j/checkpoints/step-4".into()),
        };
        n0.publish_plan(Path::new("/j"), plan.clone()).unwrap();
        assert_eq!(n1.await_plan().unwrap(), (PathBuf::from("/j"), plan));
        assert!(n0.await_plan_seen().is_err());
        n1.plan_seen().unwrap();
        n0.await_plan_seen().unwrap();
    }

    #[test]
    fn a_job_directory_the_node_cannot_see_is_explained() {
        let err =
            check_shared(Path::new("/nonexistent/j/state.json"), 1, "the job's state").unwrap_err();
        assert!(err.contains("node 1 cannot read the job's state"), "{err}");
        assert!(err.contains("file system every node mounts"), "{err}");
    }
}
