//! What this machine can hold: the data sets check their size against it before they are
//! drawn or read, as the launcher checks a job's estimate; and what this process has held at
//! most, which the trainer reports.

/// This machine's memory a new process can have, in bytes: `MemAvailable` plus `SwapFree`
/// from `/proc/meminfo` (`None` where it does not say, e.g. not Linux).
pub fn available_host_memory() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kib = |key: &str| -> Option<u64> {
        let line = info.lines().find(|l| l.starts_with(key))?;
        line[key.len()..]
            .trim()
            .trim_end_matches("kB")
            .trim()
            .parse()
            .ok()
    };
    Some((kib("MemAvailable:")? + kib("SwapFree:").unwrap_or(0)) * 1024)
}

/// `bytes` in decimal gigabytes, two decimals: `1.98 GB`.
pub fn gb(bytes: u64) -> String {
    format!("{:.2} GB", bytes as f64 / 1e9)
}

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
    use super::*;

    #[test]
    fn the_peak_grows_with_what_the_process_touches() {
        let before = peak_rss_bytes();
        assert!(
            before > 1 << 20,
            "a test process uses more than 1 MB: {before}"
        );
        // More than any other test uses beside it, written so every page is resident.
        let touched = std::hint::black_box(vec![1u8; 512 << 20]);
        let after = peak_rss_bytes();
        assert!(std::hint::black_box(&touched).iter().all(|&b| b == 1));
        assert!(after >= 512 << 20, "{before} -> {after}");
    }
}
