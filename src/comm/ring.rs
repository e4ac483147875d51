//! Ring collectives over a pair of byte streams per rank (to the next rank, from the previous):
//! all-reduce as reduce-scatter then all-gather (each rank sends 2·(W-1)/W of the buffer, the
//! bandwidth optimum), and a pipelined broadcast. Segments stream in bounded chunks; sending
//! and receiving overlap, so no rank waits on a full socket buffer.
//!
//! Reduction order is fixed: segment `c` (of W, split as evenly as the length allows) starts
//! at rank `c` and collects ranks c+1, c+2, ... in ring order, so it equals
//! `((x_c + x_{c+1}) + x_{c+2}) + ... + x_{c-1}` exactly, on every rank and every run.

use std::io::{self, Read, Write};
use std::ops::Range;

use bytemuck::Pod;

#[cfg(target_endian = "big")]
compile_error!("the ring wire format is little-endian; big-endian targets are not supported");

/// Elements per read while reducing: bounds the scratch buffer whatever the message size.
const CHUNK_ELEMS: usize = 64 * 1024;

/// What the ring can add: plain numbers with a bit-exact wire form.
pub trait Element: Pod + Send + Sync + std::ops::AddAssign {}
impl Element for f32 {}
impl Element for f64 {}

/// The streams of one rank: `send` to rank+1, `recv` from rank-1 (mod world).
pub struct RingLinks<S, R> {
    pub rank: usize,
    pub world: usize,
    pub send: S,
    pub recv: R,
}

/// Which part of an io failure it was, for messages that say which neighbour stalled.
#[derive(Debug)]
pub enum LinkError {
    Send(io::Error),
    Recv(io::Error),
}

/// Segment `i` of `n` elements split `world` ways (empty segments when n < world).
pub fn segment(n: usize, world: usize, i: usize) -> Range<usize> {
    (i * n / world)..((i + 1) * n / world)
}

impl<S: Write + Send, R: Read> RingLinks<S, R> {
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
        let (w, r, n) = (self.world, self.rank, buf.len());
        if w == 1 {
            return Ok(());
        }
        self.reduce_scatter(buf)?;
        let scale = w as f32;
        buf[segment(n, w, (r + 1) % w)]
            .iter_mut()
            .for_each(|x| *x /= scale);
        self.all_gather_owned(buf)
    }

    /// At step s, send segment r-s and add the received segment r-s-1 into place; afterwards
    /// rank r holds the complete sum of segment r+1.
    fn reduce_scatter<T: Element>(&mut self, buf: &mut [T]) -> Result<(), LinkError> {
        let (w, r, n) = (self.world, self.rank, buf.len());
        let seg = |i: usize| segment(n, w, i % w);
        let mut scratch: Vec<T> = vec![T::zeroed(); CHUNK_ELEMS.min(n.div_ceil(w))];
        for s in 0..w - 1 {
            let (out, into) = (seg(r + w - s), seg(r + 2 * w - s - 1));
            let recv = &mut self.recv;
            exchange(&mut self.send, buf, out, into, |dst| {
                for part in dst.chunks_mut(CHUNK_ELEMS) {
                    let tmp = &mut scratch[..part.len()];
                    recv.read_exact(bytemuck::cast_slice_mut(tmp))?;
                    for (d, x) in part.iter_mut().zip(tmp.iter()) {
                        // Commutative, so `mine + running` is the same bits as `running + mine`.
                        *d += *x;
                    }
                }
                Ok(())
            })?;
        }
        Ok(())
    }

    /// Passes every owned segment around the ring until each rank has all of them.
    fn all_gather_owned<T: Element>(&mut self, buf: &mut [T]) -> Result<(), LinkError> {
        let (w, r, n) = (self.world, self.rank, buf.len());
        let seg = |i: usize| segment(n, w, i % w);
        for s in 0..w - 1 {
            let (out, into) = (seg(r + 1 + w - s), seg(r + w - s));
            let recv = &mut self.recv;
            exchange(&mut self.send, buf, out, into, |dst| {
                recv.read_exact(bytemuck::cast_slice_mut(dst))
            })?;
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
                self.recv
                    .read_exact(bytemuck::cast_slice_mut(part))
                    .map_err(LinkError::Recv)?;
            }
            if self.rank != last {
                self.send
                    .write_all(bytemuck::cast_slice(part))
                    .map_err(LinkError::Send)?;
            }
        }
        self.send.flush().map_err(LinkError::Send)
    }
}

/// Sends `buf[out]` on a helper thread while `receive` fills `buf[into]`; the two ranges are
/// disjoint, so both run at once without copying the outgoing segment.
fn exchange<T: Element, S: Write + Send>(
    send: &mut S,
    buf: &mut [T],
    out: Range<usize>,
    into: Range<usize>,
    receive: impl FnOnce(&mut [T]) -> io::Result<()>,
) -> Result<(), LinkError> {
    let (outgoing, incoming) = disjoint(buf, out, into);
    std::thread::scope(|scope| {
        let sender = scope.spawn(move || {
            send.write_all(bytemuck::cast_slice(outgoing))?;
            send.flush()
        });
        let received = receive(incoming).map_err(LinkError::Recv);
        let sent = sender
            .join()
            .unwrap_or_else(|_| Err(io::Error::other("sender thread panicked")))
            .map_err(LinkError::Send);
        received.and(sent)
    })
}

/// `(&buf[a], &mut buf[b])` for non-overlapping ranges.
fn disjoint<T>(buf: &mut [T], a: Range<usize>, b: Range<usize>) -> (&[T], &mut [T]) {
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
