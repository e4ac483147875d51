//! The rendezvous store: a small TCP key-value service (set, get, wait with a deadline, add)
//! hosted by node 0's launcher. Workers register there, exchange ring addresses and wait on
//! each other; every wait has a deadline whose error names what never arrived.
//!
//! A leaf of the workspace: std and `thiserror` only. What is stored under which key is
//! declared once in [`Key`], for every writer and waiter.

mod client;
mod keys;
mod protocol;
mod server;

use std::net::SocketAddr;

use thiserror::Error;

pub use client::StoreClient;
pub use keys::{Key, LAUNCH_PREFIX, REGISTERED_PREFIX, RING_ADDR_PREFIX};
pub use server::StoreServer;

#[derive(Debug, Error)]
pub enum StoreError {
    #[error(
        "cannot listen on {addr} for the rendezvous store: {cause}; \
         if the port is taken (another job?), choose another with --master-port (or \
         MASTER_PORT), or leave both out on a single node to get a free one"
    )]
    Bind {
        addr: SocketAddr,
        cause: std::io::Error,
    },
    #[error(
        "cannot reach the rendezvous store at {addr} after {waited_s:.0} s: {cause}; \
         check --master-addr/--master-port and that node 0's launcher is running"
    )]
    Connect {
        addr: String,
        waited_s: f64,
        cause: std::io::Error,
    },
    #[error("the rendezvous store at {addr} refused this connection: {reason}")]
    Refused { addr: String, reason: String },
    #[error("rendezvous store at {addr}: `{op}` failed: {cause} (did node 0's launcher stop?)")]
    Io {
        addr: String,
        op: &'static str,
        cause: std::io::Error,
    },
    #[error("waited {waited_s:.0} s for {}; still missing: {}", plural(.missing.len()), .missing.join(", "))]
    Timeout { missing: Vec<String>, waited_s: f64 },
}

fn plural(n: usize) -> String {
    if n == 1 {
        "a store key".into()
    } else {
        format!("{n} store keys")
    }
}

impl StoreError {
    /// For a timeout on keys named `<prefix><rank>`: the ranks that never arrived.
    pub fn missing_ranks(&self, prefix: &str) -> Vec<usize> {
        match self {
            StoreError::Timeout { missing, .. } => missing
                .iter()
                .filter_map(|k| k.strip_prefix(prefix)?.parse().ok())
                .collect(),
            _ => Vec::new(),
        }
    }
}

/// A fresh random job token (hex), for single-node jobs.
pub fn random_token() -> String {
    let mut bytes = [0u8; 16];
    let read = std::fs::File::open("/dev/urandom")
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut bytes));
    if read.is_err() {
        // No /dev/urandom: time and pid still make a token no other job shares.
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        bytes = (now ^ (u128::from(std::process::id()) << 64)).to_le_bytes();
    }
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use std::io::{Read, Write};
    use std::net::TcpStream;
    use std::time::{Duration, Instant};

    use super::*;

    fn server() -> StoreServer {
        StoreServer::bind("127.0.0.1:0".parse().unwrap(), "secret").unwrap()
    }

    #[test]
    fn set_get_add_and_wait_across_clients() {
        let s = server();
        let addr = s.addr().to_string();
        let a = StoreClient::connect(&addr, "secret", Duration::from_secs(5)).unwrap();
        let b = StoreClient::connect(&addr, "secret", Duration::from_secs(5)).unwrap();
        assert_eq!(a.get("k").unwrap(), None);
        let waiter = std::thread::spawn(move || {
            b.wait(&["k".into(), "j".into()], Duration::from_secs(10))
                .map(|()| b.get("k").unwrap())
        });
        std::thread::sleep(Duration::from_millis(100));
        a.set("k", b"value").unwrap();
        a.set("j", b"").unwrap();
        assert_eq!(waiter.join().unwrap().unwrap(), Some(b"value".to_vec()));
        assert_eq!(a.add("n", 2).unwrap(), 2);
        assert_eq!(a.add("n", -5).unwrap(), -3);
    }

    #[test]
    fn a_wait_that_times_out_names_the_missing_keys() {
        let s = server();
        let c =
            StoreClient::connect(&s.addr().to_string(), "secret", Duration::from_secs(5)).unwrap();
        c.set("rank/0", b"x").unwrap();
        let started = Instant::now();
        let keys: Vec<String> = (0..4).map(|r| format!("rank/{r}")).collect();
        let err = c.wait(&keys, Duration::from_millis(300)).unwrap_err();
        assert!(started.elapsed() < Duration::from_secs(5));
        assert_eq!(err.missing_ranks("rank/"), vec![1, 2, 3]);
        let text = err.to_string();
        assert!(text.contains("rank/1, rank/2, rank/3"), "{text}");
        assert!(!text.contains("rank/0"), "{text}");
    }

    #[test]
    fn a_wrong_token_or_a_foreign_client_is_refused() {
        let s = server();
        let addr = s.addr().to_string();
        let err = StoreClient::connect(&addr, "guess", Duration::from_secs(5))
            .err()
            .unwrap()
            .to_string();
        assert!(
            err.contains("refused") && err.contains("wrong job token"),
            "{err}"
        );
        // Something that is not a ddpjob client at all gets a refusal and a closed connection.
        let mut raw = TcpStream::connect(&addr).unwrap();
        raw.write_all(b"GET / HTTP/1.1\r\n\r\n").unwrap();
        let mut reply = Vec::new();
        raw.read_to_end(&mut reply).unwrap();
        assert!(String::from_utf8_lossy(&reply).contains("REFUSED"));
        // The store still serves its own clients.
        let ok = StoreClient::connect(&addr, "secret", Duration::from_secs(5)).unwrap();
        ok.set("still", b"up").unwrap();
    }

    #[test]
    fn a_taken_port_is_a_clear_error() {
        let s = server();
        let err = StoreServer::bind(s.addr(), "t").err().unwrap().to_string();
        assert!(
            err.contains(&s.addr().to_string()) && err.contains("--master-port"),
            "{err}"
        );
    }

    #[test]
    fn tokens_are_fresh() {
        assert_ne!(random_token(), random_token());
        assert_eq!(random_token().len(), 32);
    }
}
