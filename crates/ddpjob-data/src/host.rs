//! What this machine can hold: the data sets check their size against it before they are
//! drawn or read, as the launcher checks a job's estimate.

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
