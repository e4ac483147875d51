//! The signals that stop a job, handled in one place for the launcher and the workers: SIGINT,
//! SIGTERM, SIGUSR1 (Slurm's `--signal=USR1@N` warning before a time limit), and SIGHUP (the
//! terminal or ssh session closed) and SIGQUIT, which torchrun's agent stops on too. The handler,
//! installed with `sigaction`, only stores to atomics (async-signal-safe); the supervision loop
//! and the training loop read them.

use std::sync::atomic::{AtomicBool, AtomicI32, AtomicUsize, Ordering};

static RECEIVED: AtomicUsize = AtomicUsize::new(0);
static LAST: AtomicI32 = AtomicI32::new(0);
static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(sig: libc::c_int) {
    // A closed session may deliver SIGHUP more than once (the kernel, then the shell): only a
    // second request of another kind means "now".
    if sig == libc::SIGHUP && STOP.load(Ordering::SeqCst) {
        return;
    }
    LAST.store(sig, Ordering::SeqCst);
    RECEIVED.fetch_add(1, Ordering::SeqCst);
    STOP.store(true, Ordering::SeqCst);
}

/// The signals that stop a job gracefully.
pub const STOP_SIGNALS: [libc::c_int; 5] = [
    libc::SIGINT,
    libc::SIGTERM,
    libc::SIGUSR1,
    libc::SIGHUP,
    libc::SIGQUIT,
];

/// Routes [`STOP_SIGNALS`] to this module's counters. Interrupted system calls are
/// restarted (SA_RESTART), as with BSD `signal`.
pub fn install() {
    for sig in STOP_SIGNALS {
        // SAFETY: a zeroed sigaction with a handler that only touches atomics; sigaction is
        // called with valid pointers.
        unsafe {
            // `nohup ddpjob run ...` ignores SIGHUP so the job outlives its session: kept.
            let mut current: libc::sigaction = std::mem::zeroed();
            libc::sigaction(sig, std::ptr::null(), &mut current);
            if sig == libc::SIGHUP && current.sa_sigaction == libc::SIG_IGN {
                continue;
            }
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
            action.sa_flags = libc::SA_RESTART;
            libc::sigemptyset(&mut action.sa_mask);
            libc::sigaction(sig, &action, std::ptr::null_mut());
        }
    }
}

/// How many stop signals arrived so far (a second one means "now").
pub fn received() -> usize {
    RECEIVED.load(Ordering::SeqCst)
}

/// The last one that arrived (0: none).
pub fn last() -> libc::c_int {
    LAST.load(Ordering::SeqCst)
}

/// Set by the first stop signal: a worker finishes its step, checkpoints and exits.
pub fn stop_flag() -> &'static AtomicBool {
    &STOP
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_signal_sets_the_flag_and_the_count() {
        install();
        let before = received();
        // SAFETY: raising a signal whose handler is installed above.
        unsafe { libc::raise(libc::SIGUSR1) };
        assert_eq!(received(), before + 1);
        assert_eq!(last(), libc::SIGUSR1);
        assert!(stop_flag().load(Ordering::SeqCst));
        // A closed terminal stops a job as SIGTERM does, rather than killing it unsaved; the
        // flag is up already, so this one does not count as a second request.
        unsafe { libc::raise(libc::SIGHUP) };
        assert_eq!((received(), last()), (before + 1, libc::SIGUSR1));
    }
}
