//! Fetches a file from a list of mirrors into a temp file beside its destination, checks its
//! SHA-256 while streaming, and renames it into place only when it verifies: a failed or corrupt
//! download leaves nothing behind.

use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::Duration;

use sha2::{Digest, Sha256};

use super::DataError;

/// Downloads `file_name` from the first mirror that serves it with digest `sha256` (lowercase
/// hex; `None` skips the check) to `dest`. Every mirror's failure is reported if all fail.
pub fn download(
    mirrors: &[String],
    file_name: &str,
    sha256: Option<&str>,
    dest: &Path,
) -> Result<(), DataError> {
    let dir = dest.parent().unwrap_or(Path::new("."));
    let dir_existed = dir.exists();
    std::fs::create_dir_all(dir).map_err(|cause| DataError::Io {
        path: dir.into(),
        cause,
    })?;
    let mut failures = Vec::new();
    for mirror in mirrors {
        let url = format!("{}/{file_name}", mirror.trim_end_matches('/'));
        let tmp = dir.join(format!(".{file_name}.part-{}", std::process::id()));
        match fetch_verified(&url, sha256, &tmp) {
            Ok(()) => {
                return std::fs::rename(&tmp, dest).map_err(|cause| {
                    let _ = std::fs::remove_file(&tmp);
                    DataError::Io {
                        path: dest.into(),
                        cause,
                    }
                });
            }
            Err(problem) => {
                let _ = std::fs::remove_file(&tmp);
                failures.push(format!("{url}: {problem}"));
            }
        }
    }
    if !dir_existed {
        // Only removes it if still empty: nothing of ours is left behind, nothing else is touched.
        let _ = std::fs::remove_dir(dir);
    }
    Err(DataError::Download {
        file: file_name.into(),
        dest: PathBuf::from(dest),
        failures,
    })
}

fn fetch_verified(url: &str, sha256: Option<&str>, tmp: &Path) -> Result<(), String> {
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .timeout_connect(Some(Duration::from_secs(15)))
        .timeout_recv_body(Some(Duration::from_secs(300)))
        .build()
        .into();
    let response = agent.get(url).call().map_err(|e| e.to_string())?;
    let mut body = response.into_body().into_reader();
    let mut out = File::create(tmp).map_err(|e| format!("cannot create {}: {e}", tmp.display()))?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 16];
    loop {
        let n = body
            .read(&mut buf)
            .map_err(|e| format!("connection failed mid-download: {e}"))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        out.write_all(&buf[..n])
            .map_err(|e| format!("cannot write {}: {e}", tmp.display()))?;
    }
    out.sync_all()
        .map_err(|e| format!("cannot sync {}: {e}", tmp.display()))?;
    let actual = hex(&hasher.finalize());
    match sha256 {
        Some(expected) if !expected.eq_ignore_ascii_case(&actual) => Err(format!(
            "SHA-256 mismatch: expected {expected}, got {actual} (corrupt or different file)"
        )),
        _ => Ok(()),
    }
}

/// Lowercase hex of a digest.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
