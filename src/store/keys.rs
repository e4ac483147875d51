//! Every key ddpjob's processes use in the rendezvous store, in one place: what it holds, who
//! writes it and who waits for it. The store's operations are in `protocol.rs`.

use std::fmt;

/// What `Key::Registered` keys start with (a timeout lists the ranks missing under it).
pub const REGISTERED_PREFIX: &str = "worker/";
/// What `Key::RingAddr` keys start with.
pub const RING_ADDR_PREFIX: &str = "ring/addr/";

/// A rendezvous-store key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Key {
    /// Node 0's launcher has created the job directory; other nodes' launchers wait for it.
    /// The only key kept when the store is cleared between restart attempts.
    JobReady,
    /// A worker is up (`pid P node N`); every worker waits for all of them.
    Registered { rank: usize },
    /// A node's local rank 0 has the data on disk (or says why not); the node's other ranks
    /// wait for it.
    DataReady { node: usize },
    /// A worker's latest heartbeat (step and time); the launcher's watchdog reads it.
    Heartbeat { rank: usize },
    /// A CPU worker's ring listening address; its left neighbour connects to it.
    RingAddr { rank: usize },
    /// Rank 0's NCCL unique id for a restart attempt (each attempt forms a new communicator).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))] // GPU builds only
    NcclId { attempt: usize },
}

impl fmt::Display for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Key::JobReady => f.write_str("job/ready"),
            Key::Registered { rank } => write!(f, "{REGISTERED_PREFIX}{rank}"),
            Key::DataReady { node } => write!(f, "data/node{node}"),
            Key::Heartbeat { rank } => write!(f, "heartbeat/{rank}"),
            Key::RingAddr { rank } => write!(f, "{RING_ADDR_PREFIX}{rank}"),
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
            Key::Registered { rank: 1 },
            Key::Registered { rank: 12 },
            Key::DataReady { node: 1 },
            Key::Heartbeat { rank: 1 },
            Key::RingAddr { rank: 1 },
            Key::NcclId { attempt: 1 },
        ]
        .iter()
        .map(Key::to_string)
        .collect();
        for (i, a) in keys.iter().enumerate() {
            for b in &keys[i + 1..] {
                assert_ne!(a, b);
            }
            // Clearing the store keeps keys that start with JobReady's.
            assert!(i == 0 || !a.starts_with(&keys[0]), "{a}");
        }
    }
}
