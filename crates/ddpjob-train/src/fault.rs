//! Test-only fault injection, so the failure paths (restart, hang diagnosis, preemption) can
//! be exercised deterministically: `DDPJOB_FAULT="rank=1,step=5,kind=kill"` makes rank 1 fail
//! as it begins optimizer step 5, on the first attempt only (`attempt=N` picks another,
//! `attempt=any` fails every attempt).
//! Not for production use; documented in docs/src/resume.md, "Testing failure paths".

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

/// The environment variable that arms a fault.
pub const ENV: &str = "DDPJOB_FAULT";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultKind {
    /// SIGKILL to itself: what `kill -9` or the out-of-memory killer does.
    Kill,
    /// abort(): a crash (SIGABRT).
    Crash,
    /// A Rust panic in the training loop (as a model's `forward` might panic).
    Panic,
    /// Returns an error: a worker that fails with a message and exit status 1.
    Exit,
    /// The training thread sleeps forever; heartbeats go on (a deadlock in user code).
    Hang,
    /// SIGSTOP to itself: the whole process stops, heartbeats too.
    Freeze,
    /// SIGTERM to the launcher, as a cluster scheduler's preemption would send; the rank then
    /// waits (up to 10 s) for the launcher's stop request, so the job stops after this step.
    Preempt,
    /// SIGUSR1 to the launcher, as Slurm's `--signal=USR1@N` warning before a time limit;
    /// otherwise as `Preempt`.
    Warn,
    /// SIGHUP to the launcher, as a closed terminal or ssh session sends; otherwise as
    /// `Preempt`.
    Hangup,
    /// A world-size-invariant step that sums this rank's pieces left to right instead of in
    /// the fixed tree: the bug `verify` must catch and name.
    PieceOrder,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fault {
    pub rank: usize,
    pub step: usize,
    pub kind: FaultKind,
    /// The restart attempt it fires in (`None`: every attempt).
    pub attempt: Option<usize>,
}

impl Fault {
    /// Parses `rank=R,step=S,kind=K[,attempt=A|any]`.
    pub fn parse(text: &str) -> Result<Fault, String> {
        let mut rank = None;
        let mut step = None;
        let mut kind = None;
        let mut attempt = Some(0);
        for part in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (key, value) = part
                .split_once('=')
                .ok_or_else(|| format!("`{part}` is not key=value"))?;
            let number = || {
                value
                    .parse::<usize>()
                    .map_err(|_| format!("{key}={value} is not a number"))
            };
            match key {
                "rank" => rank = Some(number()?),
                "step" => step = Some(number()?),
                "attempt" if value == "any" => attempt = None,
                "attempt" => attempt = Some(number()?),
                "kind" => {
                    kind = Some(match value {
                        "kill" => FaultKind::Kill,
                        "crash" => FaultKind::Crash,
                        "panic" => FaultKind::Panic,
                        "exit" => FaultKind::Exit,
                        "hang" => FaultKind::Hang,
                        "freeze" => FaultKind::Freeze,
                        "preempt" => FaultKind::Preempt,
                        "usr1" => FaultKind::Warn,
                        "hup" => FaultKind::Hangup,
                        "piece-order" => FaultKind::PieceOrder,
                        other => {
                            return Err(format!(
                                "kind={other} is unknown; use kill, crash, panic, exit, hang, freeze, preempt, usr1, hup or piece-order"
                            ));
                        }
                    })
                }
                other => return Err(format!("unknown key `{other}`")),
            }
        }
        let missing = |what: &str| format!("{what}= is missing");
        Ok(Fault {
            rank: rank.ok_or_else(|| missing("rank"))?,
            step: step.ok_or_else(|| missing("step"))?,
            kind: kind.ok_or_else(|| missing("kind"))?,
            attempt,
        })
    }

    /// The fault armed for this rank and attempt, if any.
    pub fn from_env(rank: usize, attempt: usize) -> Result<Option<Fault>, String> {
        let Ok(text) = std::env::var(ENV) else {
            return Ok(None);
        };
        let fault = Fault::parse(&text).map_err(|e| format!("{ENV}={text:?}: {e}"))?;
        let now = fault.attempt.is_none_or(|a| a == attempt);
        Ok((fault.rank == rank && now).then_some(fault))
    }

    /// Whether optimizer step `step` is to sum this rank's pieces out of order.
    pub fn scrambles_pieces(&self, step: usize) -> bool {
        self.kind == FaultKind::PieceOrder && step == self.step
    }

    /// Called as optimizer step `step` (1-based) begins; fires once, at its step. `stop`: the
    /// worker's stop-request flag.
    pub fn before_step(&self, step: usize, stop: &AtomicBool) -> Result<(), String> {
        if step != self.step {
            return Ok(());
        }
        errln!(
            "{ENV}: injecting {:?} into rank {} at step {step}",
            self.kind,
            self.rank
        );
        // SAFETY: plain signal calls on this process or its parent.
        unsafe {
            match self.kind {
                FaultKind::Kill => {
                    libc::raise(libc::SIGKILL);
                }
                FaultKind::Crash => libc::abort(),
                FaultKind::Panic => panic!("{ENV}: injected panic at step {step}"),
                FaultKind::Freeze => {
                    libc::raise(libc::SIGSTOP);
                }
                FaultKind::Preempt | FaultKind::Warn | FaultKind::Hangup => {
                    let signal = match self.kind {
                        FaultKind::Warn => libc::SIGUSR1,
                        FaultKind::Hangup => libc::SIGHUP,
                        _ => libc::SIGTERM,
                    };
                    libc::kill(libc::getppid(), signal);
                    let deadline = std::time::Instant::now() + Duration::from_secs(10);
                    while !stop.load(Ordering::SeqCst) && std::time::Instant::now() < deadline {
                        std::thread::sleep(Duration::from_millis(5));
                    }
                }
                FaultKind::Hang => loop {
                    std::thread::sleep(Duration::from_secs(3600));
                },
                FaultKind::Exit => {
                    return Err(format!("{ENV}: injected failure at step {step}"));
                }
                // The step itself sums out of order (see `scrambles_pieces`).
                FaultKind::PieceOrder => {}
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_names_what_is_wrong() {
        assert_eq!(
            Fault::parse("rank=1, step=5, kind=kill").unwrap(),
            Fault {
                rank: 1,
                step: 5,
                kind: FaultKind::Kill,
                attempt: Some(0)
            }
        );
        assert_eq!(
            Fault::parse("kind=hang,step=2,rank=0,attempt=1")
                .unwrap()
                .attempt,
            Some(1)
        );
        assert_eq!(
            Fault::parse("rank=0,step=1,kind=exit,attempt=any")
                .unwrap()
                .attempt,
            None
        );
        assert!(Fault::parse("rank=1,step=5").unwrap_err().contains("kind="));
        assert!(
            Fault::parse("rank=1,step=x,kind=kill")
                .unwrap_err()
                .contains("step=x")
        );
        assert!(
            Fault::parse("rank=1,step=2,kind=explode")
                .unwrap_err()
                .contains("explode")
        );
    }
}
