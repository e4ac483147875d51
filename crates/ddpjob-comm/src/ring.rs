//! Ring collectives over a pair of sockets per rank (to the next rank, from the previous):
//! all-reduce as reduce-scatter then all-gather (each rank sends 2·(W-1)/W of the buffer, the
//! bandwidth optimum), and a pipelined broadcast. One thread drives both sockets, non-blocking,
//! so sending and receiving overlap without helper threads; incoming data is reduced in bounded
//! chunks as it arrives, so no message is ever copied whole.
//!
//! Reduction order is fixed: segment `c` (of W, split as evenly as the length allows) starts
//! at rank `c` and collects ranks c+1, c+2, ... in ring order, so it equals
//! `((x_c + x_{c+1}) + x_{c+2}) + ... + x_{c-1}` exactly, on every rank and every run.

use std::io::{self, ErrorKind, Read, Write};
use std::net::TcpStream;
use std::ops::Range;
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use bytemuck::Pod;

#[cfg(target_endian = "big")]
compile_error!("the ring wire format is little-endian; big-endian targets are not supported");

/// Elements per reduction chunk: bounds the scratch buffer whatever the message size.
const CHUNK_ELEMS: usize = 64 * 1024;

/// What the ring can add: plain numbers with a bit-exact wire form.
pub trait Element: Pod + Send + Sync + std::ops::AddAssign {}
impl Element for f32 {}
impl Element for f64 {}

/// Which side of a link failed, for messages that say which neighbour stalled.
#[derive(Debug)]
pub enum LinkError {
    Send(io::Error),
    Recv(io::Error),
}

/// Segment `i` of `n` elements split `world` ways (empty segments when n < world).
pub fn segment(n: usize, world: usize, i: usize) -> Range<usize> {
    (i * n / world)..((i + 1) * n / world)
}

/// One rank's links: `send` to rank+1, `recv` from rank-1 (mod world).
pub struct RingLinks {
    pub rank: usize,
    pub world: usize,
    send: TcpStream,
    recv: TcpStream,
    /// A collective fails when neither socket makes progress for this long.
    timeout: Duration,
    /// How long to busy-wait before sleeping in poll(2): waking a sleeping thread costs tens of
    /// microseconds per hand-off, which adds up over the many hand-offs of one all-reduce.
    /// Zero when workers outnumber cores, where spinning would steal a peer's core.
    spin: Duration,
    /// Bytes written to the next rank so far (what the sharding tests compare).
    sent: u64,
}

/// Where incoming bytes go: straight into place, or through a scratch chunk that is added in.
trait Sink {
    fn pending(&self) -> bool;
    fn space(&mut self) -> &mut [u8];
    fn advance(&mut self, n: usize);
}

struct Place<'a> {
    dst: &'a mut [u8],
    pos: usize,
}

impl Sink for Place<'_> {
    fn pending(&self) -> bool {
        self.pos < self.dst.len()
    }
    fn space(&mut self) -> &mut [u8] {
        &mut self.dst[self.pos..]
    }
    fn advance(&mut self, n: usize) {
        self.pos += n;
    }
}

struct AddInto<'a, T> {
    dst: &'a mut [T],
    scratch: &'a mut [T],
    /// Elements of `dst` already reduced; bytes of the current chunk received.
    done: usize,
    filled: usize,
}

impl<T: Element> AddInto<'_, T> {
    fn chunk(&self) -> usize {
        (self.dst.len() - self.done).min(self.scratch.len())
    }
}

impl<T: Element> Sink for AddInto<'_, T> {
    fn pending(&self) -> bool {
        self.done < self.dst.len()
    }
    fn space(&mut self) -> &mut [u8] {
        let chunk = self.chunk();
        &mut bytemuck::cast_slice_mut(&mut self.scratch[..chunk])[self.filled..]
    }
    fn advance(&mut self, n: usize) {
        self.filled += n;
        let chunk = self.chunk();
        if self.filled == chunk * std::mem::size_of::<T>() {
            let dst = &mut self.dst[self.done..self.done + chunk];
            for (d, x) in dst.iter_mut().zip(&self.scratch[..chunk]) {
                // Commutative, so `mine + running` is the same bits as `running + mine`.
                *d += *x;
            }
            self.done += chunk;
            self.filled = 0;
        }
    }
}

impl RingLinks {
    pub fn new(
        rank: usize,
        world: usize,
        send: TcpStream,
        recv: TcpStream,
        timeout: Duration,
        spin: Duration,
    ) -> io::Result<Self> {
        for s in [&send, &recv] {
            s.set_nodelay(true)?;
            s.set_nonblocking(true)?;
        }
        Ok(RingLinks {
            rank,
            world,
            send,
            recv,
            timeout,
            spin,
            sent: 0,
        })
    }

    /// Bytes sent to the next rank since these links were made.
    #[doc(hidden)]
    pub fn bytes_sent(&self) -> u64 {
        self.sent
    }

    /// The segment of an `n`-element buffer this rank holds complete after a reduce-scatter
    /// (segment rank+1 of W: where the ring's reduction order ends).
    pub fn owned(&self, n: usize) -> Range<usize> {
        segment(n, self.world, (self.rank + 1) % self.world)
    }

    /// Sends all of `out` while feeding incoming bytes to `sink` until it is satisfied.
    fn drive(&mut self, out: &[u8], sink: &mut dyn Sink) -> Result<(), LinkError> {
        let mut sent = 0;
        let mut last_progress = Instant::now();
        loop {
            let mut progressed = false;
            if sent < out.len() {
                match self.send.write(&out[sent..]) {
                    Ok(n) => {
                        sent += n;
                        self.sent += n as u64;
                        progressed = n > 0;
                    }
                    Err(e) if retry(&e) => {}
                    Err(e) => return Err(LinkError::Send(e)),
                }
            }
            if sink.pending() {
                match self.recv.read(sink.space()) {
                    Ok(0) => return Err(LinkError::Recv(ErrorKind::UnexpectedEof.into())),
                    Ok(n) => {
                        sink.advance(n);
                        progressed = true;
                    }
                    Err(e) if retry(&e) => {}
                    Err(e) => return Err(LinkError::Recv(e)),
                }
            }
            let (want_out, want_in) = (sent < out.len(), sink.pending());
            if !want_out && !want_in {
                return Ok(());
            }
            if progressed {
                last_progress = Instant::now();
            } else {
                self.idle(want_out, want_in, last_progress)?;
            }
        }
    }

    /// Nothing moved: spin a little, then sleep in poll(2) until a socket is ready; fail once
    /// nothing has moved for the whole timeout.
    fn idle(&self, want_out: bool, want_in: bool, since: Instant) -> Result<(), LinkError> {
        let waited = since.elapsed();
        if waited < self.spin {
            std::hint::spin_loop();
            return Ok(());
        }
        let Some(left) = self.timeout.checked_sub(waited).filter(|d| !d.is_zero()) else {
            let stalled = io::Error::from(ErrorKind::TimedOut);
            return Err(if want_in {
                LinkError::Recv(stalled)
            } else {
                LinkError::Send(stalled)
            });
        };
        let mut fds = [
            // A negative fd is ignored: an unwanted socket's hang-up must not wake us in a loop.
            libc::pollfd {
                fd: if want_out { self.send.as_raw_fd() } else { -1 },
                events: libc::POLLOUT,
                revents: 0,
            },
            libc::pollfd {
                fd: if want_in { self.recv.as_raw_fd() } else { -1 },
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        let ms = left.as_millis().clamp(1, i32::MAX as u128) as libc::c_int;
        // SAFETY: two valid pollfd entries on sockets this struct owns.
        unsafe { libc::poll(fds.as_mut_ptr(), 2, ms) };
        Ok(())
    }

    /// Sends `out` and receives exactly `into.len()` bytes, at once.
    pub fn exchange_bytes(&mut self, out: &[u8], into: &mut [u8]) -> Result<(), LinkError> {
        self.drive(out, &mut Place { dst: into, pos: 0 })
    }

    /// Sends `out` while receiving `into.len()` elements and adding them into `into` as they
    /// arrive: one step of a reduction between two partners (each sends the half the other
    /// keeps, so the lengths may differ by one).
    pub fn exchange_adding<T: Element>(
        &mut self,
        out: &[T],
        into: &mut [T],
    ) -> Result<(), LinkError> {
        let mut scratch: Vec<T> = vec![T::zeroed(); CHUNK_ELEMS.min(into.len())];
        let mut sink = AddInto {
            dst: into,
            scratch: &mut scratch,
            done: 0,
            filled: 0,
        };
        self.drive(bytemuck::cast_slice(out), &mut sink)
    }

    /// Replaces `buf` with the element-wise sum over ranks, in the order the module describes.
    pub fn all_reduce_sum<T: Element>(&mut self, buf: &mut [T]) -> Result<(), LinkError> {
        if self.world == 1 {
            return Ok(());
        }
        self.reduce_scatter(buf)?;
        self.all_gather_owned(buf)
    }

    /// Mean instead of sum: the owner of each segment divides once before the all-gather, so
    /// every rank ends with the same bits.
    pub fn all_reduce_mean(&mut self, buf: &mut [f32]) -> Result<(), LinkError> {
        if self.world == 1 {
            return Ok(());
        }
        self.reduce_scatter_mean(buf)?;
        self.all_gather_owned(buf)
    }

    /// The first half of [`RingLinks::all_reduce_mean`]: afterwards this rank's
    /// [`RingLinks::owned`] segment holds the mean over ranks (the other segments: partial
    /// sums, to be overwritten). A sharded optimizer updates that segment, then all-gathers.
    pub fn reduce_scatter_mean(&mut self, buf: &mut [f32]) -> Result<(), LinkError> {
        if self.world == 1 {
            return Ok(());
        }
        self.reduce_scatter(buf)?;
        let scale = self.world as f32;
        let owned = self.owned(buf.len());
        buf[owned].iter_mut().for_each(|x| *x /= scale);
        Ok(())
    }

    /// Gives every rank each rank's [`RingLinks::owned`] segment of `buf`.
    pub fn all_gather<T: Element>(&mut self, buf: &mut [T]) -> Result<(), LinkError> {
        if self.world == 1 {
            return Ok(());
        }
        self.all_gather_owned(buf)
    }

    /// At step s, send segment r-s and add the received segment r-s-1 into place; afterwards
    /// rank r holds the complete sum of segment r+1.
    fn reduce_scatter<T: Element>(&mut self, buf: &mut [T]) -> Result<(), LinkError> {
        let (w, r, n) = (self.world, self.rank, buf.len());
        let seg = |i: usize| segment(n, w, i % w);
        let mut scratch: Vec<T> = vec![T::zeroed(); CHUNK_ELEMS.min(n.div_ceil(w))];
        for s in 0..w - 1 {
            let (outgoing, incoming) = disjoint(buf, seg(r + w - s), seg(r + 2 * w - s - 1));
            let mut sink = AddInto {
                dst: incoming,
                scratch: &mut scratch,
                done: 0,
                filled: 0,
            };
            self.drive(bytemuck::cast_slice(outgoing), &mut sink)?;
        }
        Ok(())
    }

    /// Passes every owned segment around the ring until each rank has all of them.
    fn all_gather_owned<T: Element>(&mut self, buf: &mut [T]) -> Result<(), LinkError> {
        let (w, r, n) = (self.world, self.rank, buf.len());
        let seg = |i: usize| segment(n, w, i % w);
        for s in 0..w - 1 {
            let (outgoing, incoming) = disjoint(buf, seg(r + 1 + w - s), seg(r + w - s));
            self.exchange_bytes(
                bytemuck::cast_slice(outgoing),
                bytemuck::cast_slice_mut(incoming),
            )?;
        }
        Ok(())
    }

    /// Replaces `buf` on every rank with `root`'s, pipelined chunk by chunk along the ring.
    pub fn broadcast<T: Element>(&mut self, buf: &mut [T], root: usize) -> Result<(), LinkError> {
        let w = self.world;
        if w == 1 {
            return Ok(());
        }
        let last = (root + w - 1) % w;
        for part in buf.chunks_mut(CHUNK_ELEMS) {
            if self.rank != root {
                self.exchange_bytes(&[], bytemuck::cast_slice_mut(part))?;
            }
            if self.rank != last {
                self.exchange_bytes(bytemuck::cast_slice(part), &mut [])?;
            }
        }
        Ok(())
    }
}

fn retry(e: &io::Error) -> bool {
    matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::Interrupted)
}

/// `(&buf[a], &mut buf[b])` for non-overlapping ranges.
pub(super) fn disjoint<T>(buf: &mut [T], a: Range<usize>, b: Range<usize>) -> (&[T], &mut [T]) {
    debug_assert!(a.end <= b.start || b.end <= a.start || a.is_empty() || b.is_empty());
    if a.start <= b.start && a.end <= b.start {
        let (left, right) = buf.split_at_mut(b.start);
        (&left[a], &mut right[..b.end - b.start])
    } else {
        let (left, right) = buf.split_at_mut(a.start);
        let a_len = a.end - a.start;
        (&right[..a_len], &mut left[b])
    }
}

#[cfg(test)]
mod tests;
