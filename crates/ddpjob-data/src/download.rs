//! Fetches a file from a list of mirrors into a temp file beside its destination, checks its
//! SHA-256 while streaming, and renames it into place only when it verifies: a failed or corrupt
//! download leaves nothing behind (and one cut short by a kill is removed by the next).

use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};

use super::DataError;

/// Prints a line of the download's progress; a closed stdout drops it (the download goes on).
fn say(line: std::fmt::Arguments) {
    let _ = writeln!(std::io::stdout(), "{line}");
}

/// Downloads `file_name` from the first mirror that serves it with digest `sha256` (lowercase
/// hex; `None` skips the check) to `dest`. Every mirror's failure is reported if all fail.
pub fn download(
    mirrors: &[String],
    file_name: &str,
    sha256: Option<&str>,
    dest: &Path,
) -> Result<(), DataError> {
    let dir = ddpjob_storage::jobdir::directory_of(dest);
    let dir_existed = dir.exists();
    // A directory that cannot take the file is the config's to fix, not the network's.
    let unwritable = |cause: std::io::Error| {
        DataError::Mismatch(format!(
            "cannot download {file_name} into `{}`: {cause}; set the data's directory \
             (data.root, data.path) to a writable directory, or put the file there by hand",
            dir.display()
        ))
    };
    std::fs::create_dir_all(dir).map_err(unwritable)?;
    let probe = dir.join(format!(".{file_name}.part-{}", std::process::id()));
    File::create(&probe).map_err(unwritable)?;
    let _ = std::fs::remove_file(&probe);
    remove_abandoned_parts(dir, file_name);
    let mut failures = Vec::new();
    for (i, mirror) in mirrors.iter().enumerate() {
        let url = format!("{}/{file_name}", mirror.trim_end_matches('/'));
        let tmp = dir.join(format!(".{file_name}.part-{}", std::process::id()));
        say(format_args!("downloading {file_name} from {url} ..."));
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
                if i + 1 < mirrors.len() {
                    say(format_args!("  {url}: {problem}; trying the next mirror"));
                }
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

/// Temp files of this name that a download killed on the way left: their process is gone from
/// this host and nothing has written them for 10 minutes (a download on another host or in
/// another container sharing the directory writes to its own, which stays fresh).
fn remove_abandoned_parts(dir: &Path, file_name: &str) {
    let prefix = format!(".{file_name}.part-");
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.filter_map(Result::ok) {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(pid) = name
            .strip_prefix(&prefix)
            .and_then(|p| p.parse::<i32>().ok())
        else {
            continue;
        };
        // SAFETY: signal 0 only asks whether the process exists (EPERM: it does).
        let gone = pid > 0
            && unsafe { libc::kill(pid, 0) } != 0
            && std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH);
        let stale = entry
            .metadata()
            .and_then(|m| m.modified())
            .is_ok_and(|t| t.elapsed().is_ok_and(|age| age >= ABANDONED_AFTER));
        if gone && stale {
            let _ = std::fs::remove_file(entry.path());
        }
    }
}

/// How long a dead process's part file stays untouched before it is taken as abandoned.
const ABANDONED_AFTER: Duration = Duration::from_secs(600);

/// How often a download in progress says how far it is.
const PROGRESS_EVERY: Duration = Duration::from_secs(10);

/// The longest a download may take in all (a day: a slow but steady link finishes).
const BODY_AT_MOST: Duration = Duration::from_secs(24 * 3600);

/// How long a mirror may send nothing, mid-body, before the next one is tried.
const STALLED_AFTER: Duration = Duration::from_secs(30);

fn fetch_verified(url: &str, sha256: Option<&str>, tmp: &Path) -> Result<(), String> {
    fetch_within(url, sha256, tmp, STALLED_AFTER)
}

/// [`fetch_verified`], giving up on a mirror that sends nothing for `stalled_after`. The body
/// has a day in all (a slow but steady link finishes), so each read is bounded instead: a
/// thread reads, this one waits for each piece at most that long.
fn fetch_within(
    url: &str,
    sha256: Option<&str>,
    tmp: &Path,
    stalled_after: Duration,
) -> Result<(), String> {
    // The body's own bound only ends the reading thread of a mirror given up as stalled
    // (one that never closes its connection); the stall limit below is what the user waits.
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .timeout_connect(Some(Duration::from_secs(15)))
        .timeout_recv_response(Some(stalled_after))
        .timeout_recv_body(Some(BODY_AT_MOST))
        .build()
        .into();
    let response = agent.get(url).call().map_err(|e| e.to_string())?;
    let total = response.body().content_length();
    let pieces = read_in_background(response.into_body().into_reader());
    let (mut got, mut said) = (0u64, Instant::now());
    let mut out = File::create(tmp).map_err(|e| format!("cannot create {}: {e}", tmp.display()))?;
    let mut hasher = Sha256::new();
    loop {
        let piece = match pieces.recv_timeout(stalled_after) {
            Ok(piece) => piece.map_err(|e| format!("connection failed mid-download: {e}"))?,
            Err(mpsc::RecvTimeoutError::Timeout) => {
                return Err(format!(
                    "stalled: nothing received for {} s after {:.1} MB",
                    stalled_after.as_secs_f64(),
                    got as f64 / 1e6
                ));
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
        };
        hasher.update(&piece);
        out.write_all(&piece)
            .map_err(|e| format!("cannot write {}: {e}", tmp.display()))?;
        got += piece.len() as u64;
        if said.elapsed() >= PROGRESS_EVERY {
            said = Instant::now();
            let mb = |b: u64| b as f64 / 1e6;
            match total {
                Some(t) => say(format_args!("  {:.1} of {:.1} MB", mb(got), mb(t))),
                None => say(format_args!("  {:.1} MB", mb(got))),
            }
        }
    }
    if let Some(total) = total.filter(|&t| t != got) {
        return Err(format!(
            "the mirror sent {got} of the {total} bytes it announced"
        ));
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

/// Reads `body` on its own thread, sending each piece (or the error that ended it); the
/// channel closes at the end of the body. A stalled read keeps only that thread waiting: it
/// ends when the connection does (or at the body's time limit), its pieces unread.
fn read_in_background(
    mut body: impl Read + Send + 'static,
) -> mpsc::Receiver<std::io::Result<Vec<u8>>> {
    let (send, pieces) = mpsc::sync_channel(4);
    std::thread::spawn(move || {
        loop {
            let mut buf = vec![0u8; 1 << 16];
            match body.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => {
                    buf.truncate(n);
                    if send.send(Ok(buf)).is_err() {
                        break;
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => {
                    let _ = send.send(Err(e));
                    break;
                }
            }
        }
    });
    pieces
}

use ddpjob_storage::jobdir::hex;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_part_file_of_a_process_that_is_gone_is_removed_and_a_live_ones_kept() {
        let tmp = tempfile::tempdir().unwrap();
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let gone = child.id();
        child.wait().unwrap();
        let (abandoned, live, other) = (
            tmp.path().join(format!(".t10k.gz.part-{gone}")),
            tmp.path()
                .join(format!(".t10k.gz.part-{}", std::process::id())),
            tmp.path().join(format!(".train.gz.part-{gone}")),
        );
        let hour_ago = std::time::SystemTime::now() - Duration::from_secs(3600);
        for f in [&abandoned, &live, &other] {
            std::fs::write(f, b"half").unwrap();
            let file = File::options().write(true).open(f).unwrap();
            file.set_modified(hour_ago).unwrap();
        }
        // Freshly written, a dead process's part may be another host's live download: kept.
        let fresh = tmp
            .path()
            .join(format!(".t10k.gz.part-{}", gone + 1_000_000));
        std::fs::write(&fresh, b"new").unwrap();
        remove_abandoned_parts(tmp.path(), "t10k.gz");
        assert!(!abandoned.exists());
        assert!(live.exists() && other.exists() && fresh.exists());
    }

    /// The URL of a server on 127.0.0.1 that reads one request and answers it with `answer`.
    fn serve_once(answer: impl FnOnce(&mut std::net::TcpStream) + Send + 'static) -> String {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}/f.bin", listener.local_addr().unwrap());
        std::thread::spawn(move || {
            let (mut stream, _) = listener.accept().unwrap();
            let _ = stream.read(&mut [0u8; 1024]);
            answer(&mut stream);
        });
        url
    }

    #[test]
    fn a_mirror_that_stops_sending_mid_body_is_given_up_after_the_stall_limit() {
        let tmp = tempfile::tempdir().unwrap();
        let url = serve_once(|stream| {
            stream
                .write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n0123456789")
                .unwrap();
            std::thread::sleep(Duration::from_secs(20));
        });
        let started = Instant::now();
        let err = fetch_within(
            &url,
            None,
            &tmp.path().join("f"),
            Duration::from_millis(400),
        )
        .unwrap_err();
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "gave up only after {:?}",
            started.elapsed()
        );
        assert!(
            err.starts_with("stalled: nothing received for 0.4 s"),
            "{err}"
        );
    }

    #[test]
    fn a_slow_body_that_keeps_coming_is_downloaded_whole() {
        let tmp = tempfile::tempdir().unwrap();
        let url = serve_once(|stream| {
            stream
                .write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 6\r\n\r\n")
                .unwrap();
            // Longer in all than the stall limit, never silent that long.
            for byte in b"abcdef" {
                std::thread::sleep(Duration::from_millis(150));
                stream.write_all(&[*byte]).unwrap();
            }
        });
        let dest = tmp.path().join("f");
        fetch_within(&url, None, &dest, Duration::from_millis(400)).unwrap();
        assert_eq!(std::fs::read(&dest).unwrap(), b"abcdef");
    }

    #[test]
    fn a_directory_that_cannot_take_the_file_is_named_before_any_mirror_is_tried() {
        let tmp = tempfile::tempdir().unwrap();
        let file = tmp.path().join("afile");
        std::fs::write(&file, b"").unwrap();
        let mirrors = ["http://127.0.0.1:9/never".to_string()];
        let err = download(&mirrors, "x.gz", None, &file.join("x.gz")).unwrap_err();
        assert!(matches!(err, DataError::Mismatch(_)), "{err:?}");
        let err = err.to_string();
        assert!(
            err.contains(&format!("cannot download x.gz into `{}`", file.display()))
                && err.contains("set the data's directory (data.root, data.path) to a writable"),
            "{err}"
        );
    }
}
