//! Subnormal floats flushed to zero in CPU workers (`train.flush_denormals`, on by default).
//!
//! Late in a job whose learning rate has decayed, L2 weight decay shrinks dead units' weights
//! and their Adam moments toward zero until they are subnormal (below 1.2e-38 in f32), and x86
//! arithmetic on subnormals takes microcode assists, tens of times slower than on normal
//! numbers: the shipped Fashion-MNIST recipe ran 4.5× slower from epoch 8 on. Flush-to-zero
//! (results that would be subnormal become 0) and denormals-are-zero (subnormal inputs read as
//! 0) remove the cost, as `torch.set_flush_denormal(True)` does; values that small change no
//! f32 weight a step could still move.
//!
//! The mode is a per-thread register (MXCSR on x86, FPCR on AArch64). A thread inherits its
//! creator's mode (pthread_create copies the floating-point environment), so a worker sets it
//! on its main thread before it starts any thread, and [`on_pool_threads`] checks that every
//! pool thread that runs kernels has it.

/// Whether this CPU architecture has a flush-to-zero mode ddpjob can set.
pub const SUPPORTED: bool = cfg!(any(target_arch = "x86_64", target_arch = "aarch64"));

/// Sets (`true`) or clears flush-to-zero and denormals-are-zero for the calling thread and the
/// threads it starts from now on. Returns whether the mode is now as asked (false where the
/// architecture has no such mode and `flush` is true).
pub fn set_for_this_thread(flush: bool) -> bool {
    arch::set(flush);
    flushing() == flush
}

/// Whether the calling thread flushes subnormals to zero.
pub fn flushing() -> bool {
    arch::get()
}

/// How many threads of rayon's global pool (which runs every kernel and row shard) flush
/// subnormals, out of how many; `(flushing, total)`. Every pool thread is asked (rayon's
/// broadcast).
pub fn on_pool_threads() -> (usize, usize) {
    let modes = rayon::broadcast(|_| flushing());
    (modes.iter().filter(|&&m| m).count(), modes.len())
}

/// A line for a worker's log: the mode asked for and how many of its threads (the calling one
/// and rayon's global pool) have it.
pub fn report(asked: bool) -> String {
    let (pooled, pool_threads) = on_pool_threads();
    // The calling thread, unless it is one of the global pool's (a worker with one thread).
    let caller = usize::from(rayon::current_thread_index().is_none());
    let (yes, all) = (
        pooled + caller * usize::from(flushing()),
        pool_threads + caller,
    );
    match (asked, SUPPORTED) {
        (true, true) if yes == all && all == 1 => {
            "subnormal floats flushed to zero on all threads (one) (train.flush_denormals)".into()
        }
        (true, true) if yes == all => {
            format!("subnormal floats flushed to zero on all {all} threads (train.flush_denormals)")
        }
        (true, true) => format!(
            "warning: subnormal floats flushed to zero on only {yes} of {all} threads \
             (train.flush_denormals); the others may slow down late in training"
        ),
        (true, false) => "subnormal floats kept: ddpjob cannot set a flush-to-zero mode on this \
                          CPU architecture (train.flush_denormals)"
            .into(),
        (false, _) => format!(
            "subnormal floats kept as IEEE subnormals on {} of {all} threads \
             (train.flush_denormals = false)",
            all - yes
        ),
    }
}

#[cfg(target_arch = "x86_64")]
mod arch {
    /// MXCSR bits: DAZ (denormals are zero) and FTZ (flush to zero).
    const DAZ: u32 = 1 << 6;
    const FTZ: u32 = 1 << 15;

    pub fn get() -> bool {
        read() & (DAZ | FTZ) == DAZ | FTZ
    }

    pub fn set(flush: bool) {
        let csr = read();
        write(if flush {
            csr | DAZ | FTZ
        } else {
            csr & !(DAZ | FTZ)
        });
    }

    fn read() -> u32 {
        let mut csr: u32 = 0;
        // SAFETY: stmxcsr stores the 32-bit MXCSR register at the given address, a live local.
        unsafe {
            std::arch::asm!("stmxcsr [{}]", in(reg) &mut csr, options(nostack, preserves_flags))
        };
        csr
    }

    fn write(csr: u32) {
        // SAFETY: ldmxcsr loads MXCSR from a live local; only the DAZ and FTZ bits differ from
        // the value just read, and neither can fault (exception masks are left as they were).
        unsafe { std::arch::asm!("ldmxcsr [{}]", in(reg) &csr, options(nostack, preserves_flags)) };
    }
}

#[cfg(target_arch = "aarch64")]
mod arch {
    /// FPCR.FZ: flush subnormal inputs and results to zero (AArch64 has one bit for both).
    const FZ: u64 = 1 << 24;

    pub fn get() -> bool {
        read() & FZ != 0
    }

    pub fn set(flush: bool) {
        let fpcr = read();
        write(if flush { fpcr | FZ } else { fpcr & !FZ });
    }

    fn read() -> u64 {
        let fpcr: u64;
        // SAFETY: reading FPCR has no side effects.
        unsafe { std::arch::asm!("mrs {}, fpcr", out(reg) fpcr, options(nomem, nostack)) };
        fpcr
    }

    fn write(fpcr: u64) {
        // SAFETY: only the FZ bit differs from the value just read; it enables no trap.
        unsafe { std::arch::asm!("msr fpcr, {}", in(reg) fpcr, options(nomem, nostack)) };
    }
}

#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
mod arch {
    pub fn get() -> bool {
        false
    }

    pub fn set(_flush: bool) {}
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::hint::black_box;

    /// The smallest positive normal f32 times a half: subnormal unless flushed.
    fn product() -> f32 {
        black_box(f32::MIN_POSITIVE) * black_box(0.5)
    }

    /// A subnormal input plus zero: itself, unless read as zero.
    fn subnormal_input() -> f32 {
        black_box(f32::from_bits(1)) + black_box(0.0)
    }

    // Each test runs on a thread of its own (libtest), so the mode set here stays here.
    #[test]
    fn flushing_zeroes_subnormal_results_and_inputs() {
        assert!(set_for_this_thread(false));
        assert!(product() > 0.0 && subnormal_input() > 0.0);
        if !SUPPORTED {
            assert!(!set_for_this_thread(true));
            return;
        }
        assert!(set_for_this_thread(true));
        assert!(flushing());
        assert_eq!(product(), 0.0);
        assert_eq!(subnormal_input(), 0.0);
        // Normal numbers are untouched.
        assert_eq!(black_box(1.5f32) * black_box(2.0), 3.0);
        assert!(set_for_this_thread(false));
        assert!(product() > 0.0);
    }

    #[test]
    fn threads_inherit_the_mode_of_the_thread_that_starts_them() {
        if !SUPPORTED {
            return;
        }
        let spawn_and_report = |flush: bool| {
            std::thread::spawn(move || {
                set_for_this_thread(flush);
                let pool = rayon::ThreadPoolBuilder::new()
                    .num_threads(3)
                    .build()
                    .unwrap();
                let modes = pool.broadcast(|_| (flushing(), product() == 0.0));
                (modes, std::thread::spawn(flushing).join().unwrap())
            })
            .join()
            .unwrap()
        };
        let (modes, child) = spawn_and_report(true);
        assert_eq!(modes, vec![(true, true); 3]);
        assert!(child);
        let (modes, child) = spawn_and_report(false);
        assert_eq!(modes, vec![(false, false); 3]);
        assert!(!child);
    }
}
