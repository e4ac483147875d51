//! Hang diagnosis. Each worker keeps a [`Beacon`] of where it is (optimizer step, collective
//! sequence number and operation) and a background thread publishes it to the store as a
//! heartbeat. A rank whose collective times out reads everyone's to say who never arrived and
//! where they were; the launcher notices a rank whose heartbeats stop.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use ddpjob_store::StoreClient;

/// Publishing interval for a job with `timeout`: often enough that a stall is seen well within
/// it, never more than once a second.
pub fn interval_for(timeout: Duration) -> Duration {
    (timeout / 5).clamp(Duration::from_millis(100), Duration::from_secs(1))
}

/// Where one worker is, updated by the trainer and the communicator (cheap atomics).
#[derive(Debug, Default)]
pub struct Beacon {
    step: AtomicUsize,
    /// Collectives started so far; the current or last one is number `started - 1`.
    started: AtomicU64,
    in_collective: AtomicBool,
    op: Mutex<&'static str>,
}

impl Beacon {
    /// The optimizer step being computed (1-based; 0 before training).
    pub fn set_step(&self, step: usize) {
        self.step.store(step, Ordering::Relaxed);
    }

    /// Collective number `seq` (`op`) begins.
    pub fn enter(&self, seq: u64, op: &'static str) {
        *self.op.lock().unwrap_or_else(|p| p.into_inner()) = op;
        self.started.store(seq + 1, Ordering::Relaxed);
        self.in_collective.store(true, Ordering::Relaxed);
    }

    pub fn leave(&self) {
        self.in_collective.store(false, Ordering::Relaxed);
    }

    fn beat(&self, rank: usize, beats: u64) -> Beat {
        Beat {
            rank,
            pid: std::process::id(),
            step: self.step.load(Ordering::Relaxed),
            started: self.started.load(Ordering::Relaxed),
            op: self.op.lock().map_or("", |op| *op).to_string(),
            in_collective: self.in_collective.load(Ordering::Relaxed),
            beats,
            unix_ms: now_unix_ms() as u64,
        }
    }
}

/// One published heartbeat.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Beat {
    pub rank: usize,
    pub pid: u32,
    pub step: usize,
    /// Collectives started; the last one is `#started - 1`.
    pub started: u64,
    /// Its operation ("" before the first).
    pub op: String,
    pub in_collective: bool,
    /// Increases with every heartbeat: a value that stops changing means a stalled process.
    pub beats: u64,
    pub unix_ms: u64,
}

impl Beat {
    /// "at step 12, inside collective #56 (all_reduce_mean)", for messages.
    pub fn whereabouts(&self) -> String {
        let last = match self.started {
            0 => "before its first collective".to_string(),
            n if self.in_collective => format!("inside collective #{} ({})", n - 1, self.op),
            n => format!(
                "computing, not in a collective (its last was #{} {})",
                n - 1,
                self.op
            ),
        };
        format!("at step {}, {last}", self.step)
    }
}

/// Publishes a [`Beacon`] every `interval` from a background thread until dropped.
pub struct Heartbeat {
    stop: Arc<AtomicBool>,
}

impl Heartbeat {
    /// Starts publishing on its own store connection (the main thread's is busy in waits).
    pub fn start(
        store_addr: &str,
        token: &str,
        rank: usize,
        beacon: Arc<Beacon>,
        interval: Duration,
    ) -> std::io::Result<Self> {
        let stop = Arc::new(AtomicBool::new(false));
        let client = StoreClient::connect(store_addr, token, Duration::from_secs(10))
            .map_err(|e| std::io::Error::other(e.to_string()))?;
        let flag = stop.clone();
        std::thread::Builder::new()
            .name("ddpjob-heartbeat".into())
            .spawn(move || {
                let key = ddpjob_store::Key::Heartbeat { rank }.to_string();
                let mut beats = 0u64;
                while !flag.load(Ordering::Relaxed) {
                    beats += 1;
                    let beat = serde_json::to_vec(&beacon.beat(rank, beats)).unwrap_or_default();
                    // The store is gone when the job is over; the launcher watches the rest.
                    if client.set(&key, &beat).is_err() {
                        return;
                    }
                    std::thread::sleep(interval);
                }
            })?;
        Ok(Heartbeat { stop })
    }
}

impl Drop for Heartbeat {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// Every rank's last heartbeat (`None`: never published or unreadable).
pub fn read_all(store: &StoreClient, world: usize) -> Vec<Option<Beat>> {
    (0..world)
        .map(|r| {
            let bytes = store
                .get(&ddpjob_store::Key::Heartbeat { rank: r }.to_string())
                .ok()??;
            serde_json::from_slice(&bytes).ok()
        })
        .collect()
}

/// Every rank's heartbeat read from `store`, then [`diagnose`]d for collective `#seq` of a job
/// whose collectives may stall for `timeout`: "did not arrive: rank 1 ..." and such.
pub fn diagnose_in(store: &StoreClient, world: usize, seq: u64, timeout: Duration) -> String {
    let stale_after = 3 * interval_for(timeout) + Duration::from_secs(1);
    diagnose(&read_all(store, world), seq, stale_after)
}

/// Why collective `#seq` could not complete, from the heartbeats: the ranks that never
/// arrived and where each was. `stale_after`: a heartbeat older than this means the process
/// itself stalled or died.
pub fn diagnose(beats: &[Option<Beat>], seq: u64, stale_after: Duration) -> String {
    let now = now_unix_ms() as u64;
    let mut absent = Vec::new();
    for (rank, beat) in beats.iter().enumerate() {
        let Some(b) = beat else {
            absent.push(format!("rank {rank} never sent a heartbeat"));
            continue;
        };
        let age = Duration::from_millis(now.saturating_sub(b.unix_ms));
        let stale = age > stale_after;
        if b.started > seq && !stale {
            continue;
        }
        // A stale heartbeat tells where the rank was then, not now.
        absent.push(match stale {
            true => format!(
                "rank {rank} (pid {}) — no heartbeat for {:.1} s: the process is stopped, dead \
                 or unreachable (its last heartbeat: {})",
                b.pid,
                age.as_secs_f64(),
                b.whereabouts()
            ),
            false => format!(
                "rank {rank} (pid {}) {} — heartbeat {:.1} s ago: alive but stuck in its own \
                 code",
                b.pid,
                b.whereabouts(),
                age.as_secs_f64()
            ),
        });
    }
    if absent.is_empty() {
        return "every rank reached it (heartbeats agree), so the connection between ranks \
                stalled; check the network"
            .into();
    }
    format!("did not arrive: {}", absent.join("; "))
}

/// Milliseconds since the Unix epoch (0 on a clock before it): a heartbeat's time stamp.
fn now_unix_ms() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn beat(rank: usize, step: usize, started: u64, in_collective: bool, age_ms: u64) -> Beat {
        Beat {
            rank,
            pid: 100 + rank as u32,
            step,
            started,
            op: "all_reduce_mean".into(),
            in_collective,
            beats: 7,
            unix_ms: now_unix_ms() as u64 - age_ms,
        }
    }

    #[test]
    fn names_the_ranks_that_never_reached_the_collective_and_where_they_are() {
        let beats = vec![
            Some(beat(0, 12, 58, true, 100)),
            Some(beat(1, 12, 57, false, 200)),
            Some(beat(2, 12, 58, true, 100)),
            Some(beat(3, 11, 55, true, 9_000)),
            None,
        ];
        let text = diagnose(&beats, 57, Duration::from_secs(3));
        assert!(
            text.contains("rank 1 (pid 101) at step 12, computing, not in a collective (its last was #56 all_reduce_mean)"),
            "{text}"
        );
        assert!(text.contains("alive but stuck"), "{text}");
        // A stale heartbeat's whereabouts are then's, and said so.
        assert!(
            text.contains("rank 3 (pid 103) — no heartbeat for 9."),
            "{text}"
        );
        assert!(
            text.contains("(its last heartbeat: at step 11, inside collective #54"),
            "{text}"
        );
        assert!(text.contains("rank 4 never sent a heartbeat"), "{text}");
        assert!(
            !text.contains("rank 0") && !text.contains("rank 2"),
            "{text}"
        );
        let all_there = vec![Some(beat(0, 3, 9, true, 0)), Some(beat(1, 3, 9, true, 0))];
        assert!(diagnose(&all_there, 8, Duration::from_secs(3)).contains("every rank reached it"));
    }

    #[test]
    fn the_beacon_reports_the_collective_it_is_in() {
        let b = Beacon::default();
        b.set_step(4);
        b.enter(9, "barrier");
        let beat = b.beat(1, 3);
        assert_eq!((beat.step, beat.started, beat.in_collective), (4, 10, true));
        assert_eq!(
            beat.whereabouts(),
            "at step 4, inside collective #9 (barrier)"
        );
        b.leave();
        assert!(!b.beat(1, 4).in_collective);
    }
}
