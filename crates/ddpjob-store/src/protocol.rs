//! The store's wire format: a magic line and the job token, then length-prefixed frames. Small
//! and strict, so a stray connection (a port scanner, another job) is refused, not misread.

use std::io::{self, Read, Write};

/// Sent first by every client; a peer that does not start with it is not a ddpjob store client.
pub const MAGIC: &[u8] = b"DDPJOB-STORE/1\n";
/// Largest frame either side accepts (values are small: addresses, ids, counters).
pub const MAX_FRAME: usize = 64 << 20;

pub const OP_SET: u8 = 1;
pub const OP_GET: u8 = 2;
pub const OP_WAIT: u8 = 3;
pub const OP_ADD: u8 = 4;

pub fn write_frame(w: &mut impl Write, payload: &[u8]) -> io::Result<()> {
    let len = u32::try_from(payload.len())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "frame too large"))?;
    w.write_all(&len.to_le_bytes())?;
    w.write_all(payload)?;
    w.flush()
}

pub fn read_frame(r: &mut impl Read) -> io::Result<Vec<u8>> {
    let mut len = [0u8; 4];
    r.read_exact(&mut len)?;
    let len = u32::from_le_bytes(len) as usize;
    if len > MAX_FRAME {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("frame of {len} bytes exceeds the {MAX_FRAME}-byte limit"),
        ));
    }
    let mut buf = vec![0u8; len];
    r.read_exact(&mut buf)?;
    Ok(buf)
}

/// Builds a request or reply: an op byte, then length-prefixed byte strings and integers.
#[derive(Default)]
pub struct Encoder(pub Vec<u8>);

impl Encoder {
    pub fn op(op: u8) -> Self {
        Encoder(vec![op])
    }

    pub fn bytes(mut self, b: &[u8]) -> Self {
        self.0.extend_from_slice(&(b.len() as u32).to_le_bytes());
        self.0.extend_from_slice(b);
        self
    }

    pub fn u64(mut self, v: u64) -> Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }

    pub fn i64(mut self, v: i64) -> Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
}

/// Reads what [`Encoder`] wrote; every read is bounds-checked.
pub struct Decoder<'a> {
    buf: &'a [u8],
}

fn short() -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, "truncated message")
}

impl<'a> Decoder<'a> {
    pub fn new(buf: &'a [u8]) -> Self {
        Decoder { buf }
    }

    pub fn is_empty(&self) -> bool {
        self.buf.is_empty()
    }

    pub fn u8(&mut self) -> io::Result<u8> {
        let (&b, rest) = self.buf.split_first().ok_or_else(short)?;
        self.buf = rest;
        Ok(b)
    }

    fn take(&mut self, n: usize) -> io::Result<&'a [u8]> {
        if self.buf.len() < n {
            return Err(short());
        }
        let (head, rest) = self.buf.split_at(n);
        self.buf = rest;
        Ok(head)
    }

    pub fn u64(&mut self) -> io::Result<u64> {
        let b = self.take(8)?;
        Ok(u64::from_le_bytes(b.try_into().map_err(|_| short())?))
    }

    pub fn i64(&mut self) -> io::Result<i64> {
        Ok(self.u64()? as i64)
    }

    pub fn bytes(&mut self) -> io::Result<&'a [u8]> {
        let b = self.take(4)?;
        let len = u32::from_le_bytes(b.try_into().map_err(|_| short())?) as usize;
        self.take(len)
    }

    pub fn string(&mut self) -> io::Result<String> {
        String::from_utf8(self.bytes()?.to_vec())
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidData, "key is not UTF-8"))
    }
}
