//! The store server, hosted by node 0's launcher: a thread per connection over one shared map.
//! A client must present the job token first; anything else is answered with a refusal.

use std::collections::HashMap;
use std::io::{BufReader, BufWriter, Read};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use super::StoreError;
use super::protocol::{
    Decoder, Encoder, MAGIC, OP_ADD, OP_GET, OP_SET, OP_WAIT, read_frame, write_frame,
};

/// How long a new connection has to identify itself before it is dropped.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Default)]
struct Table {
    map: Mutex<HashMap<String, Vec<u8>>>,
    changed: Condvar,
}

/// A running store; stops accepting when dropped.
pub struct StoreServer {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    table: Arc<Table>,
}

impl StoreServer {
    /// Binds `addr` (port 0: any free port) and serves in background threads.
    pub fn bind(addr: SocketAddr, token: &str) -> Result<Self, StoreError> {
        let listener = TcpListener::bind(addr).map_err(|cause| StoreError::Bind { addr, cause })?;
        let addr = listener
            .local_addr()
            .map_err(|cause| StoreError::Bind { addr, cause })?;
        let stop = Arc::new(AtomicBool::new(false));
        let table = Arc::new(Table::default());
        let token = token.to_string();
        let stop_flag = stop.clone();
        let shared = table.clone();
        std::thread::Builder::new()
            .name("ddpjob-store".into())
            .spawn(move || {
                for conn in listener.incoming() {
                    if stop_flag.load(Ordering::SeqCst) {
                        break;
                    }
                    let Ok(conn) = conn else { continue };
                    let (table, token) = (table.clone(), token.clone());
                    let _ = std::thread::Builder::new()
                        .name("ddpjob-store-conn".into())
                        .spawn(move || serve(conn, &table, &token));
                }
            })
            .map_err(|cause| StoreError::Bind { addr, cause })?;
        Ok(StoreServer {
            addr,
            stop,
            table: shared,
        })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Forgets every key except those starting with `keep`: a restarted worker group meets
    /// afresh, with no address or heartbeat of the group before it.
    pub fn clear_except(&self, keep: &str) {
        let mut map = self.table.map.lock().unwrap_or_else(|p| p.into_inner());
        map.retain(|k, _| k.starts_with(keep));
        self.table.changed.notify_all();
    }
}

impl Drop for StoreServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Wakes the accept loop so it sees the flag.
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_millis(200));
    }
}

/// One client: handshake, then requests until it hangs up. Errors end the connection only.
fn serve(conn: TcpStream, table: &Table, token: &str) {
    let _ = conn.set_nodelay(true);
    let _ = conn.set_read_timeout(Some(HANDSHAKE_TIMEOUT));
    let Ok(write_half) = conn.try_clone() else {
        return;
    };
    let mut reader = BufReader::new(conn);
    let mut writer = BufWriter::new(write_half);
    let mut magic = vec![0u8; MAGIC.len()];
    if reader.read_exact(&mut magic).is_err() || magic != MAGIC {
        let _ = write_frame(&mut writer, b"REFUSED: not a ddpjob store client");
        return;
    }
    match read_frame(&mut reader) {
        Ok(t) if t == token.as_bytes() => {}
        _ => {
            let _ = write_frame(
                &mut writer,
                b"REFUSED: wrong job token (this store belongs to another job, or the nodes run different configs or job names)",
            );
            // Kept for the job's own ranks to name, should the refused one be missed.
            if let Ok(peer) = reader.get_ref().peer_addr() {
                let mut map = table.map.lock().unwrap_or_else(|p| p.into_inner());
                let host = peer.ip().to_string().into_bytes();
                map.insert(crate::Key::Refused.to_string(), host);
                table.changed.notify_all();
            }
            return;
        }
    }
    if write_frame(&mut writer, b"OK").is_err() {
        return;
    }
    let _ = reader.get_ref().set_read_timeout(None);
    while let Ok(request) = read_frame(&mut reader) {
        let reply = match handle(&request, table) {
            Ok(reply) => reply,
            Err(_) => return,
        };
        if write_frame(&mut writer, &reply).is_err() {
            return;
        }
    }
}

fn handle(request: &[u8], table: &Table) -> std::io::Result<Vec<u8>> {
    let mut d = Decoder::new(request);
    let op = d.u8()?;
    let mut map = table.map.lock().unwrap_or_else(|p| p.into_inner());
    Ok(match op {
        OP_SET => {
            let key = d.string()?;
            let value = d.bytes()?.to_vec();
            map.insert(key, value);
            table.changed.notify_all();
            Vec::new()
        }
        OP_GET => match map.get(&d.string()?) {
            Some(v) => Encoder::op(1).bytes(v).0,
            None => vec![0],
        },
        OP_ADD => {
            let key = d.string()?;
            let delta = d.i64()?;
            let slot = map
                .entry(key)
                .or_insert_with(|| 0i64.to_le_bytes().to_vec());
            let current = slot
                .as_slice()
                .try_into()
                .map(i64::from_le_bytes)
                .unwrap_or(0);
            let next = current.wrapping_add(delta);
            *slot = next.to_le_bytes().to_vec();
            table.changed.notify_all();
            Encoder::default().i64(next).0
        }
        OP_WAIT => {
            let timeout = Duration::from_millis(d.u64()?);
            let mut keys = Vec::new();
            while !d.is_empty() {
                keys.push(d.string()?);
            }
            let deadline = Instant::now() + timeout;
            loop {
                let missing: Vec<&String> = keys.iter().filter(|k| !map.contains_key(*k)).collect();
                let now = Instant::now();
                if missing.is_empty() || now >= deadline {
                    let mut e = Encoder::op(u8::from(!missing.is_empty()));
                    for k in missing {
                        e = e.bytes(k.as_bytes());
                    }
                    break e.0;
                }
                map = table
                    .changed
                    .wait_timeout(map, deadline - now)
                    .unwrap_or_else(|p| p.into_inner())
                    .0;
            }
        }
        _ => {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("unknown store op {op}"),
            ));
        }
    })
}
