//! The `tcp` backend: CPU worker processes joined in a ring of TCP connections found through the
//! rendezvous store. Every collective starts with a small header (operation, sequence number,
//! length) checked against the previous rank's, so ranks that disagree fail with a message
//! instead of exchanging garbage; every read and write has the job's timeout.

use std::cell::RefCell;
use std::io::{ErrorKind, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use candle_core::Tensor;

use super::ring::{Element, LinkError, RingLinks};
use super::{CommError, Communicator};
use crate::store::StoreClient;

const HELLO: &[u8] = b"DDPJOB-RING/1\n";

/// Identifies a collective on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
enum Op {
    AllReduceMean = 1,
    AllReduceSum = 2,
    Broadcast = 3,
    Barrier = 4,
}

impl Op {
    fn name(self) -> &'static str {
        match self {
            Op::AllReduceMean => "all_reduce_mean",
            Op::AllReduceSum => "all_reduce_sum",
            Op::Broadcast => "broadcast",
            Op::Barrier => "barrier",
        }
    }

    fn from_byte(b: u8) -> Option<Op> {
        [
            Op::AllReduceMean,
            Op::AllReduceSum,
            Op::Broadcast,
            Op::Barrier,
        ]
        .into_iter()
        .find(|op| *op as u8 == b)
    }
}

struct State {
    links: RingLinks,
    /// Collectives started so far; the next one's sequence number.
    seq: u64,
}

pub struct TcpCommunicator {
    rank: usize,
    world: usize,
    timeout: Duration,
    state: RefCell<State>,
}

/// Busy-wait budget for a worker when `local_workers` share this machine: spinning only pays
/// while every worker has a core of its own.
pub fn spin_for(local_workers: usize) -> Duration {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    if local_workers <= cores {
        Duration::from_micros(500)
    } else {
        Duration::ZERO
    }
}

/// Store key under which `rank` publishes its ring address.
pub fn ring_key(rank: usize) -> String {
    format!("ring/addr/{rank}")
}

impl TcpCommunicator {
    /// Joins the ring: listens on `bind_ip`, publishes the address, connects to rank+1 and
    /// accepts rank-1 (checking the job token), all within `timeout`. `spin`: see
    /// [`RingLinks`]; [`spin_for`] picks it.
    pub fn connect(
        store: &StoreClient,
        token: &str,
        rank: usize,
        world: usize,
        bind_ip: IpAddr,
        timeout: Duration,
        spin: Duration,
    ) -> Result<Self, CommError> {
        let setup = |problem: String| CommError::Setup { rank, problem };
        let listener = TcpListener::bind(SocketAddr::new(bind_ip, 0))
            .map_err(|e| setup(format!("cannot listen on {bind_ip}: {e}")))?;
        let addr = listener
            .local_addr()
            .map_err(|e| setup(format!("no local address: {e}")))?;
        store.set(&ring_key(rank), addr.to_string().as_bytes())?;
        let (next, prev) = ((rank + 1) % world, (rank + world - 1) % world);
        let next_addr = store.wait_get(&ring_key(next), timeout).map_err(|e| {
            match e.missing_ranks("ring/addr/").as_slice() {
                [] => CommError::from(e),
                missing => setup(format!(
                    "rank {} never joined the ring within {} s (distributed.timeout_s); \
                     it may have failed to start: see its log",
                    missing[0],
                    timeout.as_secs()
                )),
            }
        })?;
        let next_addr = String::from_utf8_lossy(&next_addr).into_owned();
        let mut send = TcpStream::connect(&next_addr)
            .map_err(|e| setup(format!("cannot connect to rank {next} at {next_addr}: {e}")))?;
        let mut hello = HELLO.to_vec();
        hello.extend_from_slice(token.as_bytes());
        hello.extend_from_slice(&(rank as u32).to_le_bytes());
        send.write_all(&hello)
            .map_err(|e| setup(format!("cannot greet rank {next} at {next_addr}: {e}")))?;
        let recv = accept_from(&listener, token, prev, timeout).map_err(setup)?;
        let links = RingLinks::new(rank, world, send, recv, timeout, spin)
            .map_err(|e| setup(format!("cannot configure a ring socket: {e}")))?;
        Ok(TcpCommunicator {
            rank,
            world,
            timeout,
            state: RefCell::new(State { links, seq: 0 }),
        })
    }

    /// Runs one collective: header exchange, then `body`; io failures become messages naming
    /// the neighbour and the collective.
    fn collective(
        &self,
        op: Op,
        len: usize,
        body: impl FnOnce(&mut RingLinks) -> Result<(), LinkError>,
    ) -> Result<(), CommError> {
        if self.world == 1 {
            return Ok(());
        }
        let mut state = self.state.borrow_mut();
        let seq = state.seq;
        state.seq += 1;
        let fail = |e: LinkError| self.link_failure(op, seq, e);
        let mut header = [0u8; 17];
        header[0] = op as u8;
        header[1..9].copy_from_slice(&seq.to_le_bytes());
        header[9..].copy_from_slice(&(len as u64).to_le_bytes());
        let links = &mut state.links;
        let mut theirs = [0u8; 17];
        links.exchange_bytes(&header, &mut theirs).map_err(fail)?;
        if theirs != header {
            let their_op = Op::from_byte(theirs[0]).map_or("an unknown operation", Op::name);
            let their_seq = u64::from_le_bytes(theirs[1..9].try_into().unwrap_or_default());
            let their_len = u64::from_le_bytes(theirs[9..].try_into().unwrap_or_default());
            return Err(CommError::Failed {
                op: op.name(),
                rank: self.rank,
                problem: format!(
                    "collective #{seq} is {}({len} elements) here but rank {} called {their_op} \
                     #{their_seq} ({their_len} elements); every rank must run the same \
                     collectives in the same order",
                    op.name(),
                    self.prev()
                ),
            });
        }
        body(links).map_err(fail)
    }

    /// Sums a plain buffer in place, with no tensor conversion: what `ddpjob bench` times.
    pub fn all_reduce_sum<T: Element>(&self, buf: &mut [T]) -> Result<(), CommError> {
        self.collective(Op::AllReduceSum, buf.len(), |l| l.all_reduce_sum(buf))
    }

    fn prev(&self) -> usize {
        (self.rank + self.world - 1) % self.world
    }

    fn link_failure(&self, op: Op, seq: u64, e: LinkError) -> CommError {
        let (peer, role, cause) = match e {
            LinkError::Recv(c) => (self.prev(), "receiving from", c),
            LinkError::Send(c) => ((self.rank + 1) % self.world, "sending to", c),
        };
        let problem = match cause.kind() {
            ErrorKind::WouldBlock | ErrorKind::TimedOut => format!(
                "collective #{seq}: no progress {role} rank {peer} for {} s \
                 (distributed.timeout_s); that rank is stalled, dead, or in another collective",
                self.timeout.as_secs()
            ),
            ErrorKind::UnexpectedEof
            | ErrorKind::ConnectionReset
            | ErrorKind::ConnectionAborted
            | ErrorKind::BrokenPipe => format!(
                "collective #{seq}: rank {peer} closed its connection while {role} it \
                 (that worker exited or crashed; see its log)"
            ),
            _ => format!("collective #{seq}: {role} rank {peer}: {cause}"),
        };
        CommError::Failed {
            op: op.name(),
            rank: self.rank,
            problem,
        }
    }
}

/// Accepts connections until one from `prev` with the right token arrives (others are dropped).
fn accept_from(
    listener: &TcpListener,
    token: &str,
    prev: usize,
    timeout: Duration,
) -> Result<TcpStream, String> {
    let deadline = Instant::now() + timeout;
    listener
        .set_nonblocking(true)
        .map_err(|e| format!("cannot poll the ring listener: {e}"))?;
    let mut refused = Vec::new();
    loop {
        match listener.accept() {
            Ok((mut conn, from)) => {
                let _ = conn.set_nonblocking(false);
                let _ = conn.set_read_timeout(Some(Duration::from_secs(10)));
                let mut hello = vec![0u8; HELLO.len() + token.len() + 4];
                let ok = conn.read_exact(&mut hello).is_ok()
                    && hello.starts_with(HELLO)
                    && &hello[HELLO.len()..HELLO.len() + token.len()] == token.as_bytes();
                let claimed =
                    u32::from_le_bytes(hello[hello.len() - 4..].try_into().unwrap_or_default())
                        as usize;
                if ok && claimed == prev {
                    return Ok(conn);
                }
                refused.push(from.to_string());
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    return Err(format!(
                        "rank {prev} did not connect within {} s{}",
                        timeout.as_secs(),
                        if refused.is_empty() {
                            String::new()
                        } else {
                            format!(
                                " (refused connections without the job token from {})",
                                refused.join(", ")
                            )
                        }
                    ));
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(e) => return Err(format!("accepting rank {prev}: {e}")),
        }
    }
}

impl Communicator for TcpCommunicator {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world
    }

    fn all_reduce_mean(&self, flat: &mut Tensor) -> Result<(), CommError> {
        let mut buf = flat.flatten_all()?.to_vec1::<f32>()?;
        self.collective(Op::AllReduceMean, buf.len(), |l| {
            l.all_reduce_mean(&mut buf)
        })?;
        *flat = Tensor::from_vec(buf, flat.shape(), flat.device())?;
        Ok(())
    }

    fn all_reduce_sum_f64(&self, values: &mut [f64]) -> Result<(), CommError> {
        self.all_reduce_sum(values)
    }

    fn broadcast(&self, t: &mut Tensor, root: usize) -> Result<(), CommError> {
        if root >= self.world {
            return Err(CommError::Failed {
                op: "broadcast",
                rank: self.rank,
                problem: format!("root {root} outside a world of {}", self.world),
            });
        }
        let mut buf = t.flatten_all()?.to_vec1::<f32>()?;
        self.collective(Op::Broadcast, buf.len(), |l| l.broadcast(&mut buf, root))?;
        *t = Tensor::from_vec(buf, t.shape(), t.device())?;
        Ok(())
    }

    /// An all-reduce with a non-empty segment per rank: nobody leaves before everyone arrived.
    fn barrier(&self) -> Result<(), CommError> {
        let mut token = vec![0f64; self.world];
        self.collective(Op::Barrier, token.len(), |l| l.all_reduce_sum(&mut token))
    }
}
