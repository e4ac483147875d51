//! Spawning and watching the worker processes of one node: each in its own process group (so a
//! terminal's Ctrl-C reaches only the launcher, which then asks them to checkpoint and stop),
//! each killed by the kernel if the launcher dies. The first failure, or a rank whose
//! heartbeats stop, ends the rest within seconds.

use std::fs::File;
use std::io::{BufRead, BufReader};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use super::watch::Watchdog;
use crate::worker::{EXIT_PEER_LOST, EXIT_STOPPED};

const POLL: Duration = Duration::from_millis(50);
/// After the first failure, how long to let the others fail on their own before stopping them.
const SETTLE: Duration = Duration::from_millis(500);
/// How often a launcher asks the store whether another node's workers failed.
const PEER_POLL: Duration = Duration::from_millis(250);

/// One spawned worker.
pub struct Worker {
    pub rank: usize,
    pub log: PathBuf,
    child: Child,
    status: Option<ExitStatus>,
}

/// How a node's workers ended.
pub enum Outcome {
    Finished,
    /// `report`: the rank blamed (a signal death preferred over an error exit, since the others
    /// usually fail because of it), its status and step, the others that failed, its log tail.
    Failed {
        summary: String,
        report: String,
        /// The rank blamed only lost a peer: the cause is elsewhere (another node, perhaps).
        lost_peer: bool,
        /// The rank blamed failed before training with an error a restart would meet again.
        repeats: bool,
    },
    /// The launcher got SIGINT or SIGTERM (`signal`), or the workers were told to stop by
    /// someone else; `clean`: every worker stopped after its checkpoint.
    Interrupted {
        signal: i32,
        clean: bool,
    },
    /// Another node's workers failed first (`summary` says where and how); this node's were
    /// stopped.
    PeerFailed {
        summary: String,
    },
}

/// Spawns `command` for `rank`; stdout and stderr go to `log` unless `inherit_output`.
pub fn spawn(
    mut command: Command,
    rank: usize,
    log: &Path,
    inherit_output: bool,
) -> std::io::Result<Worker> {
    if !inherit_output {
        let file = File::options().create(true).append(true).open(log)?;
        command.stdout(file.try_clone()?).stderr(file);
    }
    command.stdin(Stdio::null());
    // SAFETY: prctl, getppid, setpgid and _exit are async-signal-safe.
    let launcher = std::process::id() as libc::pid_t;
    unsafe {
        command.pre_exec(move || {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0);
            if libc::getppid() != launcher {
                libc::_exit(1);
            }
            libc::setpgid(0, 0);
            Ok(())
        });
    }
    let child = command.spawn()?;
    Ok(Worker {
        rank,
        log: log.to_path_buf(),
        child,
        status: None,
    })
}

/// Waits for every worker. On the first failure, or a rank whose heartbeats stop, kills the
/// others. On SIGINT or SIGTERM, asks every worker to finish its step and checkpoint (SIGTERM),
/// waiting up to `grace`; a second signal kills them at once. `peer_failure` is asked now and
/// then whether another node's workers failed (multi-node jobs), which stops these at once.
pub fn supervise(
    workers: &mut [Worker],
    watch: &mut Watchdog,
    grace: Duration,
    peer_failure: &dyn Fn() -> Option<String>,
) -> Outcome {
    let mut asked_peers = Instant::now();
    loop {
        if crate::signals::received() > 0 {
            let signal = crate::signals::last();
            let clean = stop_gracefully(workers, grace);
            // Workers that all completed before the request reached them finished the job.
            if workers
                .iter()
                .all(|w| w.status.is_some_and(|s| s.success()))
            {
                errln!(
                    "note: {} came after the last training step: the workers finished the job \
                     (its final evaluation and weights) instead of stopping; nothing is left \
                     to resume",
                    signal_name(signal)
                );
                return Outcome::Finished;
            }
            return Outcome::Interrupted { signal, clean };
        }
        reap(workers);
        if workers.iter().any(|w| w.stopped_on_request()) {
            // Told to stop by someone else (a scheduler signalling the workers directly).
            return Outcome::Interrupted {
                signal: libc::SIGTERM,
                clean: stop_gracefully(workers, grace),
            };
        }
        if workers.iter().any(Worker::failed) {
            // The others usually fail within moments because of the first; let them, so the
            // report can tell the cause from the consequences.
            let settle = Instant::now() + SETTLE;
            while Instant::now() < settle && workers.iter().any(|w| w.status.is_none()) {
                std::thread::sleep(POLL);
                reap(workers);
            }
            // Reported before the stop, whose kills would count as failures of their own.
            let (mut summary, mut report, lost_peer, repeats) = failure_report(workers, watch);
            // A rank whose heartbeats stopped while it is still there (stopped, or stuck in the
            // kernel) is what the failed one waited for in its collective: named first.
            let running: Vec<(usize, u32)> = workers
                .iter()
                .filter(|w| w.status.is_none())
                .map(|w| (w.rank, w.child.id()))
                .collect();
            if let Some((rank, pid, silent, beat)) = watch.stalled(&running) {
                let head = format!(
                    "rank {rank} (pid {pid}) stopped sending heartbeats {:.1} s ago (its last \
                     one said step {}); its process is still there but not running (stopped, or stuck \
                     in the kernel), so the ranks waiting for it failed",
                    silent.as_secs_f64(),
                    beat.step
                );
                summary = format!("{head}: {summary}");
                report = format!("{head}: {report}");
            }
            stop(workers, true);
            return Outcome::Failed {
                summary,
                report,
                lost_peer,
                repeats,
            };
        }
        if workers.iter().all(|w| w.status.is_some()) {
            return Outcome::Finished;
        }
        let running: Vec<(usize, u32)> = workers
            .iter()
            .filter(|w| w.status.is_none())
            .map(|w| (w.rank, w.child.id()))
            .collect();
        if let Some(report) = watch.check(&running) {
            stop(workers, true);
            let summary = report.clone();
            return Outcome::Failed {
                summary,
                report,
                lost_peer: false,
                repeats: false,
            };
        }
        if asked_peers.elapsed() >= PEER_POLL {
            asked_peers = Instant::now();
            if let Some(summary) = peer_failure() {
                stop(workers, true);
                return Outcome::PeerFailed { summary };
            }
        }
        std::thread::sleep(POLL);
    }
}

/// SIGTERM to every running worker, then waits up to `grace` (SIGKILL after it, or at a second
/// interrupt). True if every worker stopped cleanly after its checkpoint.
fn stop_gracefully(workers: &mut [Worker], grace: Duration) -> bool {
    signal_running(workers, libc::SIGTERM);
    let deadline = Instant::now() + grace;
    while workers.iter().any(|w| w.status.is_none()) {
        reap(workers);
        if Instant::now() >= deadline || crate::signals::received() > 1 {
            stop(workers, true);
        }
        std::thread::sleep(POLL);
    }
    workers
        .iter()
        .all(|w| w.stopped_on_request() || w.status.is_some_and(|s| s.success()))
}

fn signal_running(workers: &[Worker], signal: libc::c_int) {
    for w in workers.iter().filter(|w| w.status.is_none()) {
        // SAFETY: kill with a pid we spawned and have not reaped.
        unsafe { libc::kill(w.child.id() as libc::pid_t, signal) };
    }
}

fn reap(workers: &mut [Worker]) {
    for w in workers.iter_mut().filter(|w| w.status.is_none()) {
        if let Ok(Some(status)) = w.child.try_wait() {
            w.status = Some(status);
        }
    }
}

impl Worker {
    fn failed(&self) -> bool {
        self.status.is_some_and(|s| !s.success()) && !self.stopped_on_request()
    }

    fn stopped_on_request(&self) -> bool {
        self.status
            .is_some_and(|s| s.code() == Some(i32::from(EXIT_STOPPED)))
    }

    /// Which failure explains the others best: a death by signal, then an error of its own,
    /// then a worker that only lost a peer.
    fn blame_order(&self) -> u8 {
        match self.status.map(|s| (s.signal(), s.code())) {
            Some((Some(_), _)) => 0,
            Some((None, Some(code))) if code != i32::from(EXIT_PEER_LOST) => 1,
            _ => 2,
        }
    }
}

/// Kills every running worker (SIGKILL at once, or SIGTERM first with a 5 s grace) and reaps all.
pub fn stop(workers: &mut [Worker], at_once: bool) {
    if !at_once {
        signal_running(workers, libc::SIGTERM);
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline && workers.iter().any(|w| w.status.is_none()) {
            reap(workers);
            std::thread::sleep(POLL);
        }
    }
    for w in workers.iter_mut().filter(|w| w.status.is_none()) {
        let _ = w.child.kill();
        w.status = w.child.wait().ok();
    }
}

/// A one-line summary (rank, pid, status, step), the full report with the log tail, whether
/// the rank blamed only lost a peer, and whether its error would repeat on a restart.
fn failure_report(workers: &[Worker], watch: &Watchdog) -> (String, String, bool, bool) {
    let mut failed: Vec<&Worker> = workers.iter().filter(|w| w.failed()).collect();
    failed.sort_by_key(|w| (w.blame_order(), w.rank));
    let Some(w) = failed.first() else {
        return (
            "a worker failed".into(),
            "a worker failed".into(),
            false,
            false,
        );
    };
    let step = watch.last_step(w.rank).map_or(String::new(), |s| {
        format!(" (at step {s} or later, by its last heartbeat)")
    });
    let tail = log_tail(&w.log, 12);
    // Its failure record says why (a hang names the ranks that never arrived; a panic its
    // message and where).
    let record = crate::worker::failure::read_beside(&w.log);
    let repeats = record
        .as_ref()
        .is_some_and(|r| r.kind == crate::worker::failure::FailureKind::Setup);
    let why = record.map_or(String::new(), |r| format!(": {}", shorten(&r.message, 400)));
    let head = format!(
        "rank {} (pid {}) {}{step}",
        w.rank,
        w.child.id(),
        describe(w.status)
    );
    let summary = format!("{head}{why}");
    let mut text = format!("{summary}; the other workers were stopped");
    let others: Vec<String> = failed[1..]
        .iter()
        .map(|o| format!("rank {}", o.rank))
        .collect();
    if !others.is_empty() {
        text += &format!(" ({} failed too)", others.join(", "));
    }
    if !w.log.exists() {
        text += &format!("; it ended before writing its log `{}`", w.log.display());
    } else if tail.is_empty() {
        text += &format!("; its log `{}` is empty", w.log.display());
    } else {
        text += &format!(
            "\nlast lines of `{}`:\n    {}",
            w.log.display(),
            tail.join("\n    ")
        );
    }
    (summary, text, w.blame_order() == 2, repeats)
}

fn shorten(text: &str, max: usize) -> String {
    match text.char_indices().nth(max) {
        Some((i, _)) => format!("{}...", &text[..i]),
        None => text.to_string(),
    }
}

/// "exited with status 1" / "was killed by signal 9 (SIGKILL)".
pub fn describe(status: Option<ExitStatus>) -> String {
    match status {
        Some(s) => match (s.code(), s.signal()) {
            (Some(code), _) => format!("exited with status {code}"),
            (None, Some(sig)) => format!("was killed by signal {sig} ({})", signal_name(sig)),
            _ => "ended".into(),
        },
        None => "is still running".into(),
    }
}

pub fn signal_name(sig: i32) -> &'static str {
    match sig {
        libc::SIGKILL => "SIGKILL: by hand, or the out-of-memory killer",
        libc::SIGTERM => "SIGTERM",
        libc::SIGINT => "SIGINT",
        libc::SIGUSR1 => "SIGUSR1, a scheduler's warning before its time limit",
        libc::SIGHUP => "SIGHUP, its terminal or session closed",
        libc::SIGQUIT => "SIGQUIT",
        libc::SIGSEGV => "SIGSEGV, a crash",
        libc::SIGABRT => "SIGABRT, an abort",
        libc::SIGBUS => "SIGBUS",
        _ => "signal",
    }
}

/// The last `n` lines of a log file (empty if it cannot be read).
pub fn log_tail(path: &Path, n: usize) -> Vec<String> {
    let Ok(file) = File::open(path) else {
        return Vec::new();
    };
    let lines: Vec<String> = BufReader::new(file).lines().map_while(Result::ok).collect();
    lines[lines.len().saturating_sub(n)..].to_vec()
}
