//! A server on 127.0.0.1 that answers as the Hugging Face Hub does, for the tests of Hub ids
//! (models in `hub`, datasets in `hub_data`): files at `/{org}/{name}/resolve/{revision}/{file}`
//! (datasets under `/datasets/`), with ranges, `X-Repo-Commit` and `ETag`; a repository's file
//! list at `/api/{models|datasets}/{org}/{name}/revision/{revision}` (`sha`, `siblings`);
//! revisions with a `/` (`refs/convert/parquet`) sent as `%2F`; 401 for a gated repository
//! without the token and for one that does not exist, 404 for what is not there. It records
//! every request, and can cut a file's download short.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::net::TcpListener;
use std::sync::{Arc, Mutex};

/// The token a gated repository takes.
pub const TOKEN: &str = "hf_secret";

/// A repository: its branches' commits and each commit's files.
#[derive(Default)]
pub struct Repo {
    pub branches: HashMap<String, String>,
    pub commits: HashMap<String, HashMap<String, Vec<u8>>>,
    pub gated: bool,
}

#[derive(Default)]
pub struct Hub {
    /// Models by `org/name`, datasets by `datasets/org/name`.
    pub repos: HashMap<String, Repo>,
    /// Every request's path, in order.
    pub requests: Vec<String>,
    /// A file whose downloads break off halfway (the connection closes early).
    pub cut: Option<String>,
}

/// Serves `hub` until the test process ends; returns its URL.
pub fn serve(hub: Arc<Mutex<Hub>>) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { continue };
            let mut reader = BufReader::new(stream.try_clone().unwrap());
            let mut request = String::new();
            reader.read_line(&mut request).ok();
            let (mut range, mut auth) = (None, None);
            let mut line = String::new();
            while reader.read_line(&mut line).map(|n| n > 2).unwrap_or(false) {
                let lower = line.to_ascii_lowercase();
                if let Some(v) = lower.strip_prefix("range: bytes=") {
                    range = Some(v.trim().to_string());
                }
                if lower.starts_with("authorization:") {
                    auth = Some(line["authorization:".len()..].trim().to_string());
                }
                line.clear();
            }
            let path = request.split_whitespace().nth(1).unwrap_or("/").to_string();
            let reply = answer(&mut hub.lock().unwrap(), &path, range, auth);
            let _ = stream.write_all(&reply);
        }
    });
    url
}

/// The bytes of the reply to GET `path`.
fn answer(hub: &mut Hub, path: &str, range: Option<String>, auth: Option<String>) -> Vec<u8> {
    hub.requests.push(path.to_string());
    let status = |code: &str| {
        format!("HTTP/1.1 {code}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n").into_bytes()
    };
    let path = path.trim_start_matches('/');
    // The file list: `/api/datasets/{org}/{name}/revision/{revision}`.
    if let Some(api) = path.strip_prefix("api/") {
        let parts: Vec<&str> = api.splitn(5, '/').collect();
        let [kind, org, name, "revision", revision] = parts[..] else {
            return status("404 Not Found");
        };
        let key = match kind {
            "models" => format!("{org}/{name}"),
            _ => format!("{kind}/{org}/{name}"),
        };
        let Some(repo) = hub.repos.get(&key) else {
            return status("401 Unauthorized");
        };
        if repo.gated && auth.as_deref() != Some(&format!("Bearer {TOKEN}")) {
            return status("401 Unauthorized");
        }
        let revision = revision.replace("%2F", "/");
        let commit = repo.branches.get(&revision).unwrap_or(&revision);
        let Some(files) = repo.commits.get(commit) else {
            return status("404 Not Found");
        };
        let mut names: Vec<&String> = files.keys().collect();
        names.sort();
        let siblings: Vec<serde_json::Value> = (names.iter())
            .map(|f| serde_json::json!({ "rfilename": f }))
            .collect();
        let body = serde_json::json!({ "id": key, "sha": commit, "siblings": siblings });
        let body = body.to_string();
        let mut reply = format!(
            "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\
             Connection: close\r\n\r\n",
            body.len()
        )
        .into_bytes();
        reply.extend_from_slice(body.as_bytes());
        return reply;
    }
    // A file: `/{org}/{name}/resolve/…` (a model), `/datasets/{org}/{name}/resolve/…`.
    let (kind, path) = match path.strip_prefix("datasets/") {
        Some(rest) => ("datasets/", rest),
        None => ("", path),
    };
    let parts: Vec<&str> = path.splitn(5, '/').collect();
    let [org, name, "resolve", revision, file] = parts[..] else {
        return status("404 Not Found");
    };
    let Some(repo) = hub.repos.get(&format!("{kind}{org}/{name}")) else {
        return status("401 Unauthorized");
    };
    if repo.gated && auth.as_deref() != Some(&format!("Bearer {TOKEN}")) {
        return status("401 Unauthorized");
    }
    let revision = revision.replace("%2F", "/");
    let commit = repo.branches.get(&revision).unwrap_or(&revision).clone();
    let commit = commit.as_str();
    let Some(body) = repo.commits.get(commit).and_then(|files| files.get(file)) else {
        return status("404 Not Found");
    };
    let size = body.len();
    let (start, end) = match range.as_deref().and_then(|r| r.split_once('-')) {
        Some((a, b)) => (
            a.parse().unwrap_or(0),
            b.parse::<usize>()
                .map_or(size.saturating_sub(1), |b| b.min(size - 1)),
        ),
        None => (0, size.saturating_sub(1)),
    };
    let chunk = &body[start.min(size)..(end + 1).min(size)];
    // A broken download: the length promised, half of it sent.
    let sent = match hub.cut.as_deref() == Some(file) && chunk.len() > 1 {
        true => &chunk[..chunk.len() / 2],
        false => chunk,
    };
    let etag: String = format!("{:x}", md5ish(body));
    let mut reply = format!(
        "HTTP/1.1 206 Partial Content\r\nContent-Length: {}\r\nContent-Range: bytes {start}-{end}/{size}\r\n\
         X-Repo-Commit: {commit}\r\nETag: \"{etag}\"\r\nConnection: close\r\n\r\n",
        chunk.len()
    )
    .into_bytes();
    reply.extend_from_slice(sent);
    reply
}

/// A content hash for the ETag (any function of the bytes serves: the cache names blobs by it).
fn md5ish(bytes: &[u8]) -> u128 {
    bytes
        .iter()
        .fold(0x6c62272e07bb014262b821756295c58d, |h, &b| {
            (h ^ b as u128).wrapping_mul(0x0000000001000000000000000000013b)
        })
}
