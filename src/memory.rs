//! Memory per worker: what the kernel says a worker used at its peak, recorded in
//! `summary.json` so a job's real need sits beside what was expected of it.

/// This process's peak resident set size in bytes (`ru_maxrss`), 0 where the kernel does not
/// say.
pub fn peak_rss_bytes() -> u64 {
    let mut usage = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: getrusage fills the struct it is given; zeroed is a valid rusage.
    let usage = unsafe {
        if libc::getrusage(libc::RUSAGE_SELF, usage.as_mut_ptr()) != 0 {
            return 0;
        }
        usage.assume_init()
    };
    // Linux reports kilobytes.
    (usage.ru_maxrss.max(0) as u64) * 1024
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_peak_grows_with_what_the_process_touches() {
        let before = super::peak_rss_bytes();
        assert!(
            before > 1 << 20,
            "a running test uses more than 1 MB: {before}"
        );
        let touched = vec![1u8; 64 << 20];
        let after = super::peak_rss_bytes();
        assert!(touched.iter().all(|&b| b == 1));
        assert!(after >= before + (48 << 20), "{before} -> {after}");
    }
}
