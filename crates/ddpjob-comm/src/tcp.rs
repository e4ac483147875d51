//! The `tcp` backend: CPU worker processes joined in a ring of TCP connections found through the
//! rendezvous store. Every collective starts with a small header (operation, sequence number,
//! length) checked against the previous rank's, so ranks that disagree fail with a message
//! instead of exchanging garbage; every read and write has the job's timeout.

use std::cell::RefCell;
use std::io::{ErrorKind, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use candle_core::Tensor;

use super::butterfly::Butterfly;
use super::ring::{Element, LinkError, RingLinks};
use super::{CommError, Communicator};
use crate::heartbeat::Beacon;
use ddpjob_store::{Key, StoreClient};

const HELLO: &[u8] = b"DDPJOB-RING/1\n";

/// Operation, sequence number and length, before every collective.
const HEADER_BYTES: usize = 17;

/// Identifies a collective on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
enum Op {
    AllReduceMean = 1,
    AllReduceSum = 2,
    Broadcast = 3,
    Barrier = 4,
    ReduceScatterMean = 5,
    AllGather = 6,
    TreeSum = 7,
}

impl Op {
    fn name(self) -> &'static str {
        match self {
            Op::AllReduceMean => "all_reduce_mean",
            Op::AllReduceSum => "all_reduce_sum",
            Op::Broadcast => "broadcast",
            Op::Barrier => "barrier",
            Op::ReduceScatterMean => "reduce_scatter_mean",
            Op::AllGather => "all_gather",
            Op::TreeSum => "tree_sum",
        }
    }

    fn from_byte(b: u8) -> Option<Op> {
        [
            Op::AllReduceMean,
            Op::AllReduceSum,
            Op::Broadcast,
            Op::Barrier,
            Op::ReduceScatterMean,
            Op::AllGather,
            Op::TreeSum,
        ]
        .into_iter()
        .find(|op| *op as u8 == b)
    }
}

struct State {
    links: RingLinks,
    /// The partners of the tree-ordered all-reduce, once joined ([`TcpCommunicator::with_tree`]).
    tree: Option<Butterfly>,
    /// Collectives started so far; the next one's sequence number.
    seq: u64,
}

pub struct TcpCommunicator {
    rank: usize,
    world: usize,
    timeout: Duration,
    /// Behind a lock so that the communicator may be lent to another thread
    /// ([`Communicator::shared`]); one collective at a time holds it.
    state: Mutex<State>,
    beacon: Arc<Beacon>,
    /// Workers per node (0: not known), so that messages say which node a peer is on.
    per_node: usize,
}

/// A collective run on a CPU tensor's own storage, through candle's in-place op: candle
/// hands over the values mutably, the collective's outcome is kept for the caller.
struct InPlace<F> {
    run: RefCell<Option<F>>,
    outcome: RefCell<Option<Result<(), CommError>>>,
}

impl<F: FnOnce(&mut [f32]) -> Result<(), CommError>> candle_core::InplaceOp1 for InPlace<F> {
    fn name(&self) -> &'static str {
        "ddpjob-ring"
    }

    fn cpu_fwd(
        &self,
        storage: &mut candle_core::CpuStorage,
        layout: &candle_core::Layout,
    ) -> candle_core::Result<()> {
        let (Some((start, end)), candle_core::CpuStorage::F32(values)) =
            (layout.contiguous_offsets(), storage)
        else {
            candle_core::bail!("ring collectives in place need a contiguous f32 tensor");
        };
        if let Some(run) = self.run.borrow_mut().take() {
            *self.outcome.borrow_mut() = Some(run(&mut values[start..end]));
        }
        Ok(())
    }
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
        store.set(
            &Key::RingAddr { rank }.to_string(),
            addr.to_string().as_bytes(),
        )?;
        let (next, prev) = ((rank + 1) % world, (rank + world - 1) % world);
        let next_addr = store
            .wait_get(&Key::RingAddr { rank: next }.to_string(), timeout)
            .map_err(
                |e| match e.missing_ranks(ddpjob_store::RING_ADDR_PREFIX).as_slice() {
                    [] => CommError::from(e),
                    missing => setup(format!(
                        "rank {} never joined the ring within {} s (distributed.timeout_s); \
                     it may have failed to start: see its log",
                        missing[0],
                        timeout.as_secs()
                    )),
                },
            )?;
        let next_addr = String::from_utf8_lossy(&next_addr).into_owned();
        let send = dial(&next_addr, token, (rank, next), timeout).map_err(setup)?;
        let recv = accept_from(&listener, token, prev, timeout).map_err(setup)?;
        let links = RingLinks::new(rank, world, send, recv, timeout, spin)
            .map_err(|e| setup(format!("cannot configure a ring socket: {e}")))?;
        Ok(TcpCommunicator {
            rank,
            world,
            timeout,
            state: Mutex::new(State {
                links,
                tree: None,
                seq: 0,
            }),
            beacon: Arc::default(),
            per_node: 0,
        })
    }

    /// Also connects this rank to its partners of the tree-ordered all-reduce (a power-of-two
    /// world), which [`Communicator::tree_sum`] then runs over at the ring's bandwidth; without
    /// them it all-gathers (W times the traffic).
    pub fn with_tree(
        self,
        store: &StoreClient,
        token: &str,
        bind_ip: IpAddr,
        spin: Duration,
    ) -> Result<Self, CommError> {
        if self.world > 1 {
            let tree = Butterfly::connect(
                store,
                token,
                (self.rank, self.world),
                bind_ip,
                self.timeout,
                spin,
            )
            .map_err(|problem| CommError::Setup {
                rank: self.rank,
                problem,
            })?;
            self.state().tree = Some(tree);
        }
        Ok(self)
    }

    /// Reports every collective's start and end to `beacon` (published as heartbeats).
    pub fn with_beacon(mut self, beacon: Arc<Beacon>) -> Self {
        self.beacon = beacon;
        self
    }

    /// With `per_node` workers on each node, messages name the node of a rank on another node.
    pub fn with_ranks_per_node(mut self, per_node: usize) -> Self {
        self.per_node = per_node;
        self
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// "rank 3", or "rank 3 (node 1)" when the rank is on another node than this one.
    fn who(&self, rank: usize) -> String {
        match self.per_node {
            0 => format!("rank {rank}"),
            n if rank / n == self.rank / n => format!("rank {rank}"),
            n => format!("rank {rank} (node {})", rank / n),
        }
    }

    /// Runs one collective over the ring: header exchange, then `body`; io failures become
    /// messages naming the neighbour and the collective.
    fn collective(
        &self,
        op: Op,
        len: usize,
        body: impl FnOnce(&mut RingLinks) -> Result<(), LinkError>,
    ) -> Result<(), CommError> {
        self.collective_on(op, len, |state, seq| {
            body(&mut state.links).map_err(|e| self.link_failure(op, seq, e, None))
        })
    }

    /// Runs one collective: the header checked with the previous rank over the ring, then
    /// `body` with the links and the collective's sequence number.
    fn collective_on(
        &self,
        op: Op,
        len: usize,
        body: impl FnOnce(&mut State, u64) -> Result<(), CommError>,
    ) -> Result<(), CommError> {
        if self.world == 1 {
            return Ok(());
        }
        let mut state = self.state();
        let seq = state.seq;
        state.seq += 1;
        self.beacon.enter(seq, op.name());
        let result = self
            .check_header(&mut state.links, op, seq, len)
            .and_then(|()| body(&mut state, seq));
        self.beacon.leave();
        result
    }

    fn check_header(
        &self,
        links: &mut RingLinks,
        op: Op,
        seq: u64,
        len: usize,
    ) -> Result<(), CommError> {
        let mut header = [0u8; HEADER_BYTES];
        header[0] = op as u8;
        header[1..9].copy_from_slice(&seq.to_le_bytes());
        header[9..].copy_from_slice(&(len as u64).to_le_bytes());
        let mut theirs = [0u8; HEADER_BYTES];
        links
            .exchange_bytes(&header, &mut theirs)
            .map_err(|e| self.link_failure(op, seq, e, None))?;
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
        Ok(())
    }

    /// The tree-ordered sum of `buf` over the partners' links (see [`Butterfly`]).
    fn tree_collective(&self, buf: &mut [f32]) -> Result<(), CommError> {
        self.collective_on(Op::TreeSum, buf.len(), |state, seq| {
            match state.tree.as_mut() {
                Some(tree) => tree
                    .tree_sum(buf)
                    .map_err(|(partner, e)| self.link_failure(Op::TreeSum, seq, e, Some(partner))),
                None => Err(CommError::Failed {
                    op: Op::TreeSum.name(),
                    rank: self.rank,
                    problem: "this rank never joined the tree's partners (with_tree)".into(),
                }),
            }
        })
    }

    /// Sums a plain buffer in place, with no tensor conversion (the f64 sums and the barrier).
    pub fn all_reduce_sum<T: Element>(&self, buf: &mut [T]) -> Result<(), CommError> {
        self.collective(Op::AllReduceSum, buf.len(), |l| l.all_reduce_sum(buf))
    }

    /// Payload bytes this rank has sent to the next (collective headers not counted).
    #[doc(hidden)]
    pub fn bytes_sent(&self) -> u64 {
        let state = self.state();
        state.links.bytes_sent() - state.seq * HEADER_BYTES as u64
    }

    /// Runs `collective` over `t`'s f32 values: in place when `t` is a contiguous CPU f32
    /// tensor (a bucket made for the collective: no copy of it is made, which at 25 MB a
    /// bucket shows in a worker's peak memory), else on a copy that then replaces `t`.
    fn on_values(
        &self,
        t: &mut Tensor,
        collective: impl FnOnce(&mut [f32]) -> Result<(), CommError>,
    ) -> Result<(), CommError> {
        if t.device().is_cpu() && t.dtype() == candle_core::DType::F32 && t.is_contiguous() {
            let in_place = InPlace {
                run: RefCell::new(Some(collective)),
                outcome: RefCell::new(None),
            };
            t.inplace_op1(&in_place)?;
            return in_place.outcome.into_inner().unwrap_or(Ok(()));
        }
        let mut buf = t.flatten_all()?.to_vec1::<f32>()?;
        collective(&mut buf)?;
        *t = Tensor::from_vec(buf, t.shape(), t.device())?;
        Ok(())
    }

    fn prev(&self) -> usize {
        (self.rank + self.world - 1) % self.world
    }

    /// `e` as a message naming the peer: the ring's neighbours, or `partner` of the tree.
    fn link_failure(&self, op: Op, seq: u64, e: LinkError, partner: Option<usize>) -> CommError {
        let (peer, role, cause) = match e {
            LinkError::Recv(c) => (partner.unwrap_or(self.prev()), "receiving from", c),
            LinkError::Send(c) => (
                partner.unwrap_or((self.rank + 1) % self.world),
                "sending to",
                c,
            ),
        };
        let problem = match cause.kind() {
            ErrorKind::UnexpectedEof
            | ErrorKind::ConnectionReset
            | ErrorKind::ConnectionAborted
            | ErrorKind::BrokenPipe => {
                return CommError::PeerLost {
                    op: op.name(),
                    rank: self.rank,
                    problem: format!(
                        "collective #{seq}: {} closed its connection while {role} it \
                         (that worker exited or crashed, or its node's launcher did; see its \
                         log)",
                        self.who(peer)
                    ),
                };
            }
            ErrorKind::WouldBlock | ErrorKind::TimedOut => {
                return CommError::Timeout {
                    op: op.name(),
                    rank: self.rank,
                    seq,
                    waited_s: self.timeout.as_secs(),
                    problem: format!("no progress {role} {}", self.who(peer)),
                };
            }
            _ => format!("collective #{seq}: {role} rank {peer}: {cause}"),
        };
        CommError::Failed {
            op: op.name(),
            rank: self.rank,
            problem,
        }
    }
}

/// Accepts connections until one from `prev` with the right token arrives (others are dropped,
/// and named in the error if `prev` never comes).
fn accept_from(
    listener: &TcpListener,
    token: &str,
    prev: usize,
    timeout: Duration,
) -> Result<TcpStream, String> {
    let mut from = accept_each(listener, token, &[prev], timeout)?;
    from.pop()
        .ok_or_else(|| format!("rank {prev} did not connect"))
}

/// Accepts connections until one from each rank of `expected` with the right token has arrived
/// (others are dropped, and named in the error if some never come); the streams in the order
/// of `expected`.
pub(super) fn accept_each(
    listener: &TcpListener,
    token: &str,
    expected: &[usize],
    timeout: Duration,
) -> Result<Vec<TcpStream>, String> {
    let deadline = Instant::now() + timeout;
    listener
        .set_nonblocking(true)
        .map_err(|e| format!("cannot poll the listener: {e}"))?;
    let mut refused = Vec::new();
    let mut arrived: Vec<Option<TcpStream>> = expected.iter().map(|_| None).collect();
    while arrived.iter().any(Option::is_none) {
        let waiting: Vec<usize> = expected
            .iter()
            .zip(&arrived)
            .filter(|(_, s)| s.is_none())
            .map(|(&r, _)| r)
            .collect();
        match listener.accept() {
            Ok((conn, from)) => match greeting(conn, token, &waiting, deadline) {
                Ok((conn, rank)) => {
                    if let Some(i) = expected.iter().position(|&r| r == rank) {
                        arrived[i] = Some(conn);
                    }
                }
                Err(why) => refused.push(format!("{from} ({why})")),
            },
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    let others = if refused.is_empty() {
                        String::new()
                    } else {
                        format!("; refused: {}", refused.join(", "))
                    };
                    let names: Vec<String> = waiting.iter().map(|r| format!("rank {r}")).collect();
                    return Err(format!(
                        "{} did not connect within {} s{others}",
                        names.join(", "),
                        timeout.as_secs()
                    ));
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(e) => return Err(format!("accepting {waiting:?}: {e}")),
        }
    }
    Ok(arrived.into_iter().flatten().collect())
}

/// Connects to `rank` `peer` at `addr` within `timeout` (an address that never answers fails
/// then, not after the system's minutes) and greets it as `rank` of the job `token`.
pub(super) fn dial(
    addr: &str,
    token: &str,
    (rank, peer): (usize, usize),
    timeout: Duration,
) -> Result<TcpStream, String> {
    let at: SocketAddr = addr
        .parse()
        .map_err(|e| format!("rank {peer} published {addr:?}, not an address: {e}"))?;
    let mut conn = TcpStream::connect_timeout(&at, timeout.max(Duration::from_millis(1)))
        .map_err(|e| format!("cannot connect to rank {peer} at {addr}: {e}"))?;
    let mut hello = HELLO.to_vec();
    hello.extend_from_slice(token.as_bytes());
    hello.extend_from_slice(&(rank as u32).to_le_bytes());
    conn.write_all(&hello)
        .map_err(|e| format!("cannot greet rank {peer} at {addr}: {e}"))?;
    Ok(conn)
}

/// Checks a new connection's greeting: the ring magic, the job token, and a rank of `expected`;
/// the connection and that rank.
fn greeting(
    mut conn: TcpStream,
    token: &str,
    expected: &[usize],
    deadline: Instant,
) -> Result<(TcpStream, usize), String> {
    let left = deadline
        .saturating_duration_since(Instant::now())
        .clamp(Duration::from_millis(100), Duration::from_secs(10));
    conn.set_nonblocking(false)
        .and_then(|()| conn.set_read_timeout(Some(left)))
        .map_err(|e| e.to_string())?;
    let mut hello = vec![0u8; HELLO.len() + token.len() + 4];
    conn.read_exact(&mut hello)
        .map_err(|_| "no ddpjob greeting".to_string())?;
    if !hello.starts_with(HELLO)
        || &hello[HELLO.len()..HELLO.len() + token.len()] != token.as_bytes()
    {
        return Err("not this job's token".into());
    }
    let claimed = u32::from_le_bytes(hello[hello.len() - 4..].try_into().unwrap_or_default());
    match expected {
        [one] if claimed as usize != *one => {
            Err(format!("claims rank {claimed}, expected rank {one}"))
        }
        _ if !expected.contains(&(claimed as usize)) => Err(format!(
            "claims rank {claimed}, expected one of ranks {expected:?}"
        )),
        _ => Ok((conn, claimed as usize)),
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
        self.on_values(flat, |buf| {
            self.collective(Op::AllReduceMean, buf.len(), |l| l.all_reduce_mean(buf))
        })
    }

    fn reduce_scatter_mean(&self, flat: &mut Tensor) -> Result<(), CommError> {
        self.on_values(flat, |buf| {
            self.collective(Op::ReduceScatterMean, buf.len(), |l| {
                l.reduce_scatter_mean(buf)
            })
        })
    }

    fn all_gather(&self, flat: &mut Tensor) -> Result<(), CommError> {
        self.on_values(flat, |buf| {
            self.collective(Op::AllGather, buf.len(), |l| l.all_gather(buf))
        })
    }

    /// Over the partners' links when joined ([`TcpCommunicator::with_tree`]), else by
    /// all-gather.
    fn tree_sum(&self, flat: &mut Tensor) -> Result<(), CommError> {
        if self.world > 1 && self.state().tree.is_none() {
            return super::tree_sum_by_all_gather(self, flat);
        }
        self.on_values(flat, |buf| self.tree_collective(buf))
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

    fn shared(&self) -> Option<&(dyn Communicator + Sync)> {
        Some(self)
    }
}

/// Runs `f(rank, communicator)` for a `world`-rank ring over a real store and real sockets, a
/// thread per rank (tests of what sits on top of the collectives).
#[doc(hidden)]
pub fn ranks<T: Send>(world: usize, f: impl Fn(usize, TcpCommunicator) -> T + Sync) -> Vec<T> {
    ranks_joined(world, false, f)
}

/// [`ranks`], the ranks also joined to their tree partners when `tree`.
#[doc(hidden)]
pub fn ranks_joined<T: Send>(
    world: usize,
    tree: bool,
    f: impl Fn(usize, TcpCommunicator) -> T + Sync,
) -> Vec<T> {
    on_one_store(world, |rank, store, ip| {
        let timeout = Duration::from_secs(5);
        let comm = TcpCommunicator::connect(store, "tok", rank, world, ip, timeout, Duration::ZERO)
            .unwrap();
        let comm = match tree {
            true => comm.with_tree(store, "tok", ip, Duration::ZERO).unwrap(),
            false => comm,
        };
        f(rank, comm)
    })
}

/// `f(rank, store, loopback)` for `world` ranks, a thread each, all clients of one real store
/// (job token `tok`): what the collectives' tests connect through.
#[doc(hidden)]
pub fn on_one_store<T: Send>(
    world: usize,
    f: impl Fn(usize, &StoreClient, IpAddr) -> T + Sync,
) -> Vec<T> {
    use std::net::Ipv4Addr;
    let server = ddpjob_store::StoreServer::bind("127.0.0.1:0".parse().unwrap(), "tok").unwrap();
    let addr = server.addr().to_string();
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..world)
            .map(|rank| {
                let (addr, f) = (&addr, &f);
                s.spawn(move || {
                    let store = StoreClient::connect(addr, "tok", Duration::from_secs(5)).unwrap();
                    f(rank, &store, IpAddr::from(Ipv4Addr::LOCALHOST))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_in_different_collectives_fail_with_a_message_not_garbage() {
        let errors = ranks(2, |rank, comm| {
            comm.barrier().unwrap();
            let err = if rank == 0 {
                comm.barrier().unwrap_err()
            } else {
                comm.all_reduce_sum(&mut [1f64; 5]).unwrap_err()
            };
            err.to_string()
        });
        assert!(
            errors[0].contains("collective #1 is barrier(2 elements) here")
                && errors[0].contains("rank 1 called all_reduce_sum #1 (5 elements)"),
            "{}",
            errors[0]
        );
        assert!(errors[1].contains("every rank must run the same collectives"));
    }

    #[test]
    fn a_vanished_peer_is_named_and_classed_as_lost() {
        let errors = ranks(2, |rank, comm| {
            if rank == 1 {
                drop(comm);
                return None;
            }
            Some(comm.barrier().unwrap_err())
        });
        let err = errors[0].as_ref().unwrap();
        assert!(matches!(err, CommError::PeerLost { .. }), "{err:?}");
        assert!(
            err.to_string().contains("rank 1 closed its connection"),
            "{err}"
        );
    }

    #[test]
    fn the_ring_listener_checks_token_and_rank() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let deadline = Instant::now() + Duration::from_secs(5);
        let hello = |token: &str, rank: u32| {
            let mut c = TcpStream::connect(addr).unwrap();
            let mut msg = HELLO.to_vec();
            msg.extend_from_slice(token.as_bytes());
            msg.extend_from_slice(&rank.to_le_bytes());
            c.write_all(&msg).unwrap();
            let (conn, _) = listener.accept().unwrap();
            (c, greeting(conn, "tok", &[3], deadline).map(|(_, r)| r))
        };
        assert_eq!(hello("bad", 3).1.err().unwrap(), "not this job's token");
        assert_eq!(
            hello("tok", 2).1.err().unwrap(),
            "claims rank 2, expected rank 3"
        );
        assert!(hello("tok", 3).1.is_ok());
    }
}
