//! The client side of the store: what workers and other nodes' launchers use to meet.

use std::io::{BufReader, BufWriter, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::StoreError;
use super::protocol::{
    Decoder, Encoder, MAGIC, OP_ADD, OP_GET, OP_SET, OP_WAIT, read_frame, write_frame,
};

/// Extra time a reply may take beyond a wait's own deadline before the store counts as gone.
const REPLY_MARGIN: Duration = Duration::from_secs(30);

struct Conn {
    reader: BufReader<TcpStream>,
    writer: BufWriter<TcpStream>,
}

/// A connection to the store. Calls are serialised; it can be shared between threads.
pub struct StoreClient {
    addr: String,
    local: SocketAddr,
    conn: Mutex<Conn>,
}

impl StoreClient {
    /// Connects to `addr` and presents `token`, retrying refused connections until `patience`
    /// runs out (another node's launcher may not have started its store yet).
    pub fn connect(addr: &str, token: &str, patience: Duration) -> Result<Self, StoreError> {
        let started = Instant::now();
        let stream = loop {
            // Every address the name resolves to (localhost may be ::1 first, the store IPv4).
            let attempt = addr.to_socket_addrs().and_then(|addrs| {
                let mut last = std::io::Error::new(std::io::ErrorKind::NotFound, "no address");
                for sa in addrs {
                    match TcpStream::connect_timeout(&sa, Duration::from_secs(5)) {
                        Ok(s) => return Ok(s),
                        Err(e) => last = e,
                    }
                }
                Err(last)
            });
            match attempt {
                Ok(s) => break s,
                Err(cause) if started.elapsed() >= patience => {
                    return Err(StoreError::Connect {
                        addr: addr.into(),
                        waited_s: started.elapsed().as_secs_f64(),
                        cause,
                    });
                }
                Err(_) => std::thread::sleep(Duration::from_millis(100)),
            }
        };
        let io = |cause| StoreError::Io {
            addr: addr.into(),
            op: "handshake",
            cause,
        };
        stream.set_nodelay(true).map_err(io)?;
        stream
            .set_read_timeout(Some(Duration::from_secs(30)))
            .map_err(io)?;
        let local = stream.local_addr().map_err(io)?;
        let mut writer = BufWriter::new(stream.try_clone().map_err(io)?);
        let mut reader = BufReader::new(stream);
        writer.write_all(MAGIC).map_err(io)?;
        write_frame(&mut writer, token.as_bytes()).map_err(io)?;
        let reply = read_frame(&mut reader).map_err(io)?;
        if reply != b"OK" {
            return Err(StoreError::Refused {
                addr: addr.into(),
                reason: String::from_utf8_lossy(&reply).into_owned(),
            });
        }
        Ok(StoreClient {
            addr: addr.into(),
            local,
            conn: Mutex::new(Conn { reader, writer }),
        })
    }

    /// This end's address: the interface through which the store (node 0) is reached, hence
    /// one other nodes can reach too.
    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }

    fn call(
        &self,
        op: &'static str,
        request: &[u8],
        reply_within: Duration,
    ) -> Result<Vec<u8>, StoreError> {
        let io = |cause| StoreError::Io {
            addr: self.addr.clone(),
            op,
            cause,
        };
        let mut conn = self.conn.lock().unwrap_or_else(|p| p.into_inner());
        conn.reader
            .get_ref()
            .set_read_timeout(Some(reply_within))
            .map_err(io)?;
        write_frame(&mut conn.writer, request).map_err(io)?;
        read_frame(&mut conn.reader).map_err(io)
    }

    pub fn set(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        let req = Encoder::op(OP_SET).bytes(key.as_bytes()).bytes(value);
        self.call("set", &req.0, REPLY_MARGIN).map(|_| ())
    }

    /// The value of `key`, or `None` if nobody set it yet.
    pub fn get(&self, key: &str) -> Result<Option<Vec<u8>>, StoreError> {
        let reply = self.call(
            "get",
            &Encoder::op(OP_GET).bytes(key.as_bytes()).0,
            REPLY_MARGIN,
        )?;
        let mut d = Decoder::new(&reply);
        match d.u8().map_err(|e| self.protocol(e))? {
            0 => Ok(None),
            _ => Ok(Some(d.bytes().map_err(|e| self.protocol(e))?.to_vec())),
        }
    }

    /// Adds `delta` to the counter `key` (0 if unset) and returns the new value.
    pub fn add(&self, key: &str, delta: i64) -> Result<i64, StoreError> {
        let req = Encoder::op(OP_ADD).bytes(key.as_bytes()).i64(delta);
        let reply = self.call("add", &req.0, REPLY_MARGIN)?;
        Decoder::new(&reply).i64().map_err(|e| self.protocol(e))
    }

    /// Blocks until every key is set, or fails after `timeout` naming the keys still missing.
    pub fn wait(&self, keys: &[String], timeout: Duration) -> Result<(), StoreError> {
        let mut req = Encoder::op(OP_WAIT).u64(timeout.as_millis() as u64);
        for k in keys {
            req = req.bytes(k.as_bytes());
        }
        let reply = self.call("wait", &req.0, timeout + REPLY_MARGIN)?;
        let mut d = Decoder::new(&reply);
        if d.u8().map_err(|e| self.protocol(e))? == 0 {
            return Ok(());
        }
        let mut missing = Vec::new();
        while !d.is_empty() {
            missing.push(d.string().map_err(|e| self.protocol(e))?);
        }
        Err(StoreError::Timeout {
            missing,
            waited_s: timeout.as_secs_f64(),
        })
    }

    /// [`wait`](Self::wait) then [`get`](Self::get) of one key.
    pub fn wait_get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>, StoreError> {
        self.wait(&[key.to_string()], timeout)?;
        self.get(key)?.ok_or_else(|| StoreError::Timeout {
            missing: vec![key.into()],
            waited_s: timeout.as_secs_f64(),
        })
    }

    fn protocol(&self, cause: std::io::Error) -> StoreError {
        StoreError::Io {
            addr: self.addr.clone(),
            op: "reply",
            cause,
        }
    }
}
