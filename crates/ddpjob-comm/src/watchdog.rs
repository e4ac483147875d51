//! The NCCL watchdog (torch's `NCCL_TIMEOUT`): NCCL collectives are queued on the GPU and
//! return at once, so a rank that never joins leaves the others' kernels waiting forever and
//! their host blocked at its next synchronisation, where no timeout of ours runs. A thread per
//! worker watches every queued collective's completion and NCCL's asynchronous error; one
//! still pending after `distributed.timeout_s`, or an error (NCCL's asynchronous one, or a CUDA
//! error its completion event reports), fails the worker with a message naming the collective,
//! so the launcher's restart logic applies: the failure record is written first, then the
//! communicator is aborted (which ends the waiting kernels, and may itself block), then the
//! worker ends. The decisions are here, apart from CUDA, and tested on the
//! CPU; `nccl.rs` supplies the completion events, the error query and the abort.

#![cfg_attr(not(feature = "cuda"), allow(dead_code))] // used by GPU builds and the tests

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A collective queued on the device and not yet seen complete.
struct Pending {
    seq: u64,
    op: &'static str,
    since: Instant,
    /// Whether its work (and everything queued before it) has finished, or the device's error.
    done: Box<dyn Fn() -> Result<bool, String> + Send>,
}

/// What the watchdog concludes.
#[derive(Debug, Clone, PartialEq)]
pub enum Verdict {
    Fine,
    /// Collective `#seq` has been queued for `waited` without completing.
    Hung {
        seq: u64,
        op: &'static str,
        waited: Duration,
    },
    /// The communicator reported an error (a peer died, a network failure).
    Failed(String),
    /// The completion event of collective `#seq` reported a CUDA error (a fault in it or in
    /// work queued before it): failed at once, not taken for a hang `timeout_s` later.
    DeviceError {
        seq: u64,
        op: &'static str,
        error: String,
    },
}

impl Verdict {
    /// The worker's error message for a verdict other than `Fine`.
    pub fn describe(&self, rank: usize, timeout: Duration) -> String {
        match self {
            Verdict::Fine => String::new(),
            Verdict::Hung { seq, op, waited } => format!(
                "rank {rank}: NCCL collective `{op}` #{seq} did not complete within {} s \
                 (distributed.timeout_s; waited {:.1} s); the communicator is aborted",
                timeout.as_secs(),
                waited.as_secs_f64()
            ),
            Verdict::Failed(why) => {
                format!("rank {rank}: NCCL reported an error: {why}; the communicator is aborted")
            }
            Verdict::DeviceError { seq, op, error } => format!(
                "rank {rank}: the GPU reported {error} while NCCL collective `{op}` #{seq} (or \
                 work queued before it) ran; the communicator is aborted"
            ),
        }
    }

    /// The collective a hang waits for, for the heartbeat diagnosis.
    pub fn hung_seq(&self) -> Option<u64> {
        match self {
            Verdict::Hung { seq, .. } => Some(*seq),
            _ => None,
        }
    }
}

/// The collectives of one communicator that the device has not finished yet, oldest first.
#[derive(Default)]
pub struct CollectiveWatch {
    pending: Mutex<VecDeque<Pending>>,
}

impl CollectiveWatch {
    /// Collective `#seq` (`op`) was queued; `done` says when its work has finished, or the
    /// error the device reported instead.
    pub fn queued(
        &self,
        seq: u64,
        op: &'static str,
        done: impl Fn() -> Result<bool, String> + Send + 'static,
    ) {
        self.queued_at(seq, op, Instant::now(), done);
    }

    fn queued_at(
        &self,
        seq: u64,
        op: &'static str,
        since: Instant,
        done: impl Fn() -> Result<bool, String> + Send + 'static,
    ) {
        let mut pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        pending.push_back(Pending {
            seq,
            op,
            since,
            done: Box::new(done),
        });
    }

    /// Forgets what has completed (the device finishes its queue in order) and judges the
    /// oldest collective still pending at `now`; an `async_error`, or a device error from a
    /// completion event, fails at once.
    pub fn check(&self, now: Instant, timeout: Duration, async_error: Option<String>) -> Verdict {
        if let Some(error) = async_error {
            return Verdict::Failed(error);
        }
        let mut pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        while let Some(p) = pending.front() {
            match (p.done)() {
                Ok(true) => {
                    pending.pop_front();
                }
                Ok(false) => break,
                Err(error) => {
                    return Verdict::DeviceError {
                        seq: p.seq,
                        op: p.op,
                        error,
                    };
                }
            }
        }
        match pending.front() {
            Some(p) if now.duration_since(p.since) > timeout => Verdict::Hung {
                seq: p.seq,
                op: p.op,
                waited: now.duration_since(p.since),
            },
            _ => Verdict::Fine,
        }
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.pending.lock().unwrap().len()
    }
}

/// What the watchdog needs from the communicator's device side.
pub trait DeviceComm: Send + Sync {
    /// An error NCCL reported asynchronously, if any (`ncclCommGetAsyncError`).
    fn async_error(&self) -> Option<String>;
    /// Ends every collective of this communicator, waiting or not (`ncclCommAbort`).
    fn abort(&self);
}

/// The watchdog thread; stops when dropped.
pub struct Watchdog {
    stop: Arc<AtomicBool>,
}

impl Watchdog {
    /// Checks `watch` every `interval`; on a hang or an error, hands the verdict to `report`
    /// (the failure record), then aborts `comm`, then calls `end` (which ends the worker).
    pub fn spawn(
        watch: Arc<CollectiveWatch>,
        comm: Arc<dyn DeviceComm>,
        timeout: Duration,
        interval: Duration,
        report: impl FnOnce(&Verdict) + Send + 'static,
        end: impl FnOnce() + Send + 'static,
    ) -> std::io::Result<Self> {
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = stop.clone();
        std::thread::Builder::new()
            .name("ddpjob-nccl-watchdog".into())
            .spawn(move || {
                while !stopped.load(Ordering::Relaxed) {
                    let verdict = watch.check(Instant::now(), timeout, comm.async_error());
                    if verdict != Verdict::Fine {
                        report(&verdict);
                        comm.abort();
                        end();
                        return;
                    }
                    std::thread::sleep(interval);
                }
            })?;
        Ok(Watchdog { stop })
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;
    use std::sync::mpsc;

    #[test]
    fn completed_collectives_are_forgotten_and_the_oldest_pending_one_is_judged() {
        let watch = CollectiveWatch::default();
        let t0 = Instant::now();
        let second_done = Arc::new(AtomicBool::new(false));
        let flag = second_done.clone();
        watch.queued_at(0, "all_reduce", t0, || Ok(true));
        watch.queued_at(1, "broadcast", t0, move || Ok(flag.load(Ordering::Relaxed)));
        watch.queued_at(2, "all_reduce", t0 + Duration::from_secs(5), || Ok(false));
        let timeout = Duration::from_secs(3);
        assert_eq!(
            watch.check(t0 + Duration::from_secs(2), timeout, None),
            Verdict::Fine
        );
        assert_eq!(watch.len(), 2, "#0 completed and is forgotten");
        let verdict = watch.check(t0 + Duration::from_secs(4), timeout, None);
        assert_eq!(
            verdict,
            Verdict::Hung {
                seq: 1,
                op: "broadcast",
                waited: Duration::from_secs(4)
            }
        );
        assert!(
            verdict
                .describe(2, timeout)
                .starts_with("rank 2: NCCL collective `broadcast` #1 did not complete within 3 s")
        );
        // #1 completes; #2 was queued later and has not waited long enough yet.
        second_done.store(true, Ordering::Relaxed);
        assert_eq!(
            watch.check(t0 + Duration::from_secs(7), timeout, None),
            Verdict::Fine
        );
        assert_eq!(
            watch
                .check(t0 + Duration::from_secs(9), timeout, None)
                .hung_seq(),
            Some(2)
        );
    }

    #[test]
    fn an_asynchronous_error_fails_at_once() {
        let watch = CollectiveWatch::default();
        let verdict = watch.check(
            Instant::now(),
            Duration::from_secs(300),
            Some("a remote rank failed".into()),
        );
        assert_eq!(verdict, Verdict::Failed("a remote rank failed".into()));
    }

    #[test]
    fn a_device_error_fails_at_once_naming_the_collective() {
        let watch = CollectiveWatch::default();
        let t0 = Instant::now();
        watch.queued_at(3, "all_reduce", t0, || Ok(true));
        watch.queued_at(4, "broadcast", t0, || {
            Err("CUDA_ERROR_ILLEGAL_ADDRESS".into())
        });
        watch.queued_at(5, "all_reduce", t0, || Ok(false));
        let verdict = watch.check(t0, Duration::from_secs(300), None);
        assert_eq!(
            verdict,
            Verdict::DeviceError {
                seq: 4,
                op: "broadcast",
                error: "CUDA_ERROR_ILLEGAL_ADDRESS".into()
            }
        );
        assert!(
            verdict.describe(1, Duration::from_secs(300)).starts_with(
                "rank 1: the GPU reported CUDA_ERROR_ILLEGAL_ADDRESS while NCCL collective \
                 `broadcast` #4"
            ),
            "{}",
            verdict.describe(1, Duration::from_secs(300))
        );
    }

    struct FakeComm {
        aborts: AtomicUsize,
        error: Mutex<Option<String>>,
    }

    impl DeviceComm for FakeComm {
        fn async_error(&self) -> Option<String> {
            self.error.lock().unwrap().clone()
        }
        fn abort(&self) {
            self.aborts.fetch_add(1, Ordering::SeqCst);
        }
    }

    #[test]
    fn the_thread_reports_then_aborts_the_communicator_once_then_ends() {
        let watch = Arc::new(CollectiveWatch::default());
        let comm = Arc::new(FakeComm {
            aborts: AtomicUsize::new(0),
            error: Mutex::new(None),
        });
        let (tx, rx) = mpsc::channel();
        let (ended_tx, ended) = mpsc::channel();
        let seen = comm.clone();
        let _dog = Watchdog::spawn(
            watch.clone(),
            comm.clone(),
            Duration::from_millis(100),
            Duration::from_millis(10),
            // The record is written before the abort, which may block or crash.
            move |v| {
                let aborts = seen.aborts.load(Ordering::SeqCst);
                tx.send((v.clone(), aborts)).unwrap()
            },
            move || ended_tx.send(()).unwrap(),
        )
        .unwrap();
        watch.queued(7, "all_reduce", || Ok(true));
        watch.queued(8, "all_reduce", || Ok(false));
        let started = Instant::now();
        let (verdict, aborts_then) = rx.recv_timeout(Duration::from_secs(5)).expect("no verdict");
        assert_eq!(verdict.hung_seq(), Some(8));
        assert_eq!(aborts_then, 0, "reported before the abort");
        assert!(started.elapsed() >= Duration::from_millis(100));
        ended
            .recv_timeout(Duration::from_secs(5))
            .expect("never ended");
        assert!(
            rx.recv_timeout(Duration::from_millis(100)).is_err(),
            "one verdict only"
        );
        assert_eq!(comm.aborts.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn a_watchdog_dropped_with_its_communicator_judges_nothing_after() {
        let watch = Arc::new(CollectiveWatch::default());
        let comm = Arc::new(FakeComm {
            aborts: AtomicUsize::new(0),
            error: Mutex::new(None),
        });
        let (tx, rx) = mpsc::channel::<Verdict>();
        let dog = Watchdog::spawn(
            watch.clone(),
            comm.clone(),
            Duration::from_millis(50),
            Duration::from_millis(10),
            move |v| tx.send(v.clone()).unwrap(),
            || {},
        )
        .unwrap();
        drop(dog);
        std::thread::sleep(Duration::from_millis(30));
        watch.queued(1, "all_reduce", || Ok(false));
        assert!(rx.recv_timeout(Duration::from_millis(300)).is_err());
        assert_eq!(comm.aborts.load(Ordering::SeqCst), 0);
    }
}
