//! The launcher's watchdog over its workers' heartbeats: remembers where each rank was last
//! seen (for failure reports) and notices a rank whose heartbeats stopped while its process is
//! still there (stopped, or stuck in the kernel), which no collective timeout would name.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use ddpjob_comm::heartbeat::Beat;
use ddpjob_store::Key;
use ddpjob_store::StoreClient;

/// How often the launcher reads heartbeats.
const CHECK_EVERY: Duration = Duration::from_millis(500);

pub struct Watchdog<'a> {
    store: Option<&'a StoreClient>,
    stale_after: Duration,
    /// rank → (last beat, when its `beats` counter last changed).
    seen: HashMap<usize, (Beat, Instant)>,
    next_check: Instant,
}

impl<'a> Watchdog<'a> {
    /// `stale_after`: `distributed.timeout_s`.
    pub fn new(store: &'a StoreClient, stale_after: Duration) -> Self {
        Watchdog {
            store: Some(store),
            stale_after,
            seen: HashMap::new(),
            next_check: Instant::now(),
        }
    }

    /// A watchdog that watches nothing (benchmarks, tests).
    pub fn none() -> Self {
        Watchdog {
            store: None,
            stale_after: Duration::MAX,
            seen: HashMap::new(),
            next_check: Instant::now(),
        }
    }

    /// Reads the heartbeats of `ranks` (still running) if it is time; returns a report for the
    /// first one whose heartbeats stopped.
    pub fn check(&mut self, ranks: &[(usize, u32)]) -> Option<String> {
        let store = self.store?;
        let now = Instant::now();
        if now < self.next_check {
            return None;
        }
        self.next_check = now + CHECK_EVERY;
        for &(rank, pid) in ranks {
            let Some((beat, silent)) = self.observe(store, rank, now) else {
                continue;
            };
            if silent > self.stale_after {
                return Some(format!(
                    "rank {rank} (pid {pid}) stopped sending heartbeats: none for {:.0} s \
                     (distributed.timeout_s = {}); last seen {}; its process is still there \
                     but not running (stopped, or stuck in the kernel), so it was stopped with \
                     the others",
                    silent.as_secs_f64(),
                    self.stale_after.as_secs(),
                    beat.whereabouts()
                ));
            }
        }
        None
    }

    /// Of `ranks` (still running), the first whose heartbeats have stopped by now (read afresh:
    /// none for two of its heartbeat intervals and a check's), with how long ago and where it
    /// last was: when another rank failed waiting in a collective, the one it waited for.
    pub fn stalled(&mut self, ranks: &[(usize, u32)]) -> Option<(usize, u32, Duration, Beat)> {
        let store = self.store?;
        let quiet = 2 * ddpjob_comm::heartbeat::interval_for(self.stale_after) + CHECK_EVERY;
        let now = Instant::now();
        ranks.iter().find_map(|&(rank, pid)| {
            let (beat, silent) = self.observe(store, rank, now)?;
            (silent > quiet).then_some((rank, pid, silent, beat))
        })
    }

    /// `rank`'s latest heartbeat, remembered, and how long its counter has not moved by `now`.
    fn observe(
        &mut self,
        store: &StoreClient,
        rank: usize,
        now: Instant,
    ) -> Option<(Beat, Duration)> {
        let bytes = store.get(&Key::Heartbeat { rank }.to_string()).ok()??;
        let beat = serde_json::from_slice::<Beat>(&bytes).ok()?;
        let changed = match self.seen.get(&rank) {
            Some((old, since)) if old.beats == beat.beats => *since,
            _ => now,
        };
        self.seen.insert(rank, (beat.clone(), changed));
        Some((beat, now.duration_since(changed)))
    }

    /// The last optimizer step `rank` was seen at.
    pub fn last_step(&self, rank: usize) -> Option<usize> {
        self.seen.get(&rank).map(|(b, _)| b.step)
    }
}
