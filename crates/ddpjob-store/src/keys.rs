//! Every key ddpjob's processes use in the rendezvous store, in one place: what it holds, who
//! writes it and who waits for it. The store's operations are in `protocol.rs`.

use std::fmt;

/// What `Key::Registered` keys start with (a timeout lists the ranks missing under it).
pub const REGISTERED_PREFIX: &str = "worker/";
/// What `Key::RingAddr` keys start with.
pub const RING_ADDR_PREFIX: &str = "ring/addr/";
/// What the launchers' own keys start with (`JobReady` and the restart protocol's): the keys
/// kept when the store is cleared between restart attempts.
pub const LAUNCH_PREFIX: &str = "launch/";

/// A rendezvous-store key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Key {
    /// Node 0's launcher has prepared the job (created it, or chosen the checkpoint it
    /// continues from, or found it finished): its plan, which other nodes' launchers wait for.
    JobReady,
    /// How many other nodes' launchers have read a plan that says the job already finished
    /// (node 0 keeps its store up until they all have).
    PlanSeen,
    /// The first failure of restart attempt `attempt` on any node (a `nodes::Failure`); every
    /// node's launcher stops its workers when it appears.
    AttemptFailed { attempt: usize },
    /// Counter electing the node whose failure of `attempt` is recorded (the first to add).
    AttemptFailures { attempt: usize },
    /// Node `node` has stopped its workers of `attempt`; node 0 waits for every node.
    AttemptStopped { attempt: usize, node: usize },
    /// Node 0's decision after `attempt` failed: the checkpoint the next attempt starts from,
    /// or that the job is given up.
    AttemptNext { attempt: usize },
    /// Counter of the launchers that joined as node `node` (nodes > 0): a second one is a
    /// duplicated `--node-rank`, refused before it can disturb the job.
    NodeJoined { node: usize },
    /// The address of the last client the store refused for another job's token (a launcher
    /// with another config or job name): named when ranks do not join.
    Refused,
    /// A worker is up (`pid P node N`); every worker waits for all of them.
    Registered { rank: usize },
    /// A node's local rank 0 has the data on disk (or says why not); the node's other ranks
    /// wait for it.
    DataReady { node: usize },
    /// A worker's latest heartbeat (step and time); the launcher's watchdog reads it.
    Heartbeat { rank: usize },
    /// A CPU worker's ring listening address; its left neighbour connects to it.
    RingAddr { rank: usize },
    /// A CPU worker's listening address for the tree-ordered all-reduce of world-size-invariant
    /// training; each of its partners (rank ^ 2^i) connects to it.
    PairAddr { rank: usize },
    /// Rank 0's NCCL unique id for a restart attempt (each attempt forms a new communicator).
    NcclId { attempt: usize },
}

impl fmt::Display for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Key::JobReady => write!(f, "{LAUNCH_PREFIX}plan"),
            Key::PlanSeen => write!(f, "{LAUNCH_PREFIX}plan-seen"),
            Key::AttemptFailed { attempt } => write!(f, "{LAUNCH_PREFIX}{attempt}/failed"),
            Key::AttemptFailures { attempt } => write!(f, "{LAUNCH_PREFIX}{attempt}/failures"),
            Key::AttemptStopped { attempt, node } => {
                write!(f, "{LAUNCH_PREFIX}{attempt}/stopped/{node}")
            }
            Key::AttemptNext { attempt } => write!(f, "{LAUNCH_PREFIX}{attempt}/next"),
            Key::NodeJoined { node } => write!(f, "{LAUNCH_PREFIX}joined/{node}"),
            Key::Refused => write!(f, "{LAUNCH_PREFIX}refused"),
            Key::Registered { rank } => write!(f, "{REGISTERED_PREFIX}{rank}"),
            Key::DataReady { node } => write!(f, "data/node{node}"),
            Key::Heartbeat { rank } => write!(f, "heartbeat/{rank}"),
            Key::RingAddr { rank } => write!(f, "{RING_ADDR_PREFIX}{rank}"),
            Key::PairAddr { rank } => write!(f, "tree/addr/{rank}"),
            Key::NcclId { attempt } => write!(f, "nccl/id/{attempt}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_distinct_and_none_is_a_prefix_of_another() {
        let keys: Vec<String> = [
            Key::JobReady,
            Key::PlanSeen,
            Key::AttemptFailed { attempt: 1 },
            Key::AttemptFailures { attempt: 1 },
            Key::AttemptStopped {
                attempt: 1,
                node: 1,
            },
            Key::AttemptNext { attempt: 1 },
            Key::NodeJoined { node: 1 },
            Key::Refused,
            Key::Registered { rank: 1 },
            Key::Registered { rank: 12 },
            Key::DataReady { node: 1 },
            Key::Heartbeat { rank: 1 },
            Key::RingAddr { rank: 1 },
            Key::PairAddr { rank: 1 },
            Key::NcclId { attempt: 1 },
        ]
        .iter()
        .map(Key::to_string)
        .collect();
        for (i, a) in keys.iter().enumerate() {
            for b in &keys[i + 1..] {
                assert_ne!(a, b);
            }
            // Clearing the store between attempts keeps the launchers' keys, and only them.
            assert_eq!(a.starts_with(LAUNCH_PREFIX), i < 8, "{a}");
        }
    }
}
