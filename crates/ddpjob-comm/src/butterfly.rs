//! The all-reduce of world-size-invariant training: recursive halving then recursive doubling
//! (Rabenseifner) over one TCP connection per partner, rank r ^ d for d = W/2, W/4, ..., 1.
//! It sums the ranks' buffers in one fixed binary tree (rank r with rank r + W/2 first, then
//! r + W/4, ...: the order of `train::invariant`'s tree over pieces) with the ring's bandwidth:
//! each rank sends 2·(W − 1)/W of the buffer, in 2·log2(W) exchanges instead of the ring's
//! 2·(W − 1).
//!
//! Halving: at distance d each pair holds the same range; the rank without bit d keeps its
//! lower half, its partner the upper, each sends the other's half and adds what it receives
//! into its own. Both partners add the same two numbers (addition is commutative), so after
//! the stage at distance d every element of a rank's range is the sum over the ranks that
//! agree with it above bit d, in tree order. Doubling gives each rank's finished range back,
//! partner by partner, in the reverse order.

use std::net::{IpAddr, SocketAddr, TcpListener};
use std::ops::Range;
use std::time::Duration;

use super::ring::{Element, LinkError, RingLinks, disjoint};
use super::tcp::{accept_each, dial};
use ddpjob_store::{Key, StoreClient};

/// One rank's links to its log2(W) partners.
pub struct Butterfly {
    rank: usize,
    world: usize,
    /// `partners[i]`: the link to rank ^ (W >> (i + 1)), the partner of the i-th halving.
    partners: Vec<RingLinks>,
}

impl Butterfly {
    /// Connects rank `rank` of `world` (a power of two) to its partners through the store:
    /// listens on `bind_ip`, publishes the address, dials every partner (the connection it
    /// writes to) and accepts one connection from each (the one it reads from), all within
    /// `timeout`. `spin`: see [`RingLinks`].
    pub fn connect(
        store: &StoreClient,
        token: &str,
        (rank, world): (usize, usize),
        bind_ip: IpAddr,
        timeout: Duration,
        spin: Duration,
    ) -> Result<Self, String> {
        if !world.is_power_of_two() {
            return Err(format!(
                "the tree-ordered all-reduce needs a power-of-two world size, not {world}"
            ));
        }
        let listener = TcpListener::bind(SocketAddr::new(bind_ip, 0))
            .map_err(|e| format!("cannot listen on {bind_ip}: {e}"))?;
        let addr = listener
            .local_addr()
            .map_err(|e| format!("no local address: {e}"))?;
        store
            .set(
                &Key::PairAddr { rank }.to_string(),
                addr.to_string().as_bytes(),
            )
            .map_err(|e| e.to_string())?;
        let order: Vec<usize> = (0..world.trailing_zeros())
            .map(|i| rank ^ (world >> (i + 1)))
            .collect();
        // A connection each way, as the ring has: the socket this rank writes is not the one
        // it reads.
        let mut sends = Vec::with_capacity(order.len());
        for &peer in &order {
            let at = store
                .wait_get(&Key::PairAddr { rank: peer }.to_string(), timeout)
                .map_err(|e| format!("rank {peer} never published its tree address: {e}"))?;
            let at = String::from_utf8_lossy(&at).into_owned();
            sends.push(dial(&at, token, (rank, peer), timeout)?);
        }
        let recvs = accept_each(&listener, token, &order, timeout)?;
        let mut partners = Vec::with_capacity(order.len());
        for ((peer, send), recv) in order.into_iter().zip(sends).zip(recvs) {
            let link = RingLinks::new(rank, world, send, recv, timeout, spin)
                .map_err(|e| format!("cannot configure the sockets to rank {peer}: {e}"))?;
            partners.push(link);
        }
        Ok(Butterfly {
            rank,
            world,
            partners,
        })
    }

    /// The partner of halving stage `stage` (and of the doubling stage that mirrors it).
    pub fn partner(&self, stage: usize) -> usize {
        self.rank ^ (self.world >> (stage + 1))
    }

    /// Replaces `buf` on every rank with the sum over ranks in the tree order the module
    /// describes. On failure, the partner it happened with.
    pub fn tree_sum<T: Element>(&mut self, buf: &mut [T]) -> Result<(), (usize, LinkError)> {
        let mut range = 0..buf.len();
        let mut parents: Vec<Range<usize>> = Vec::with_capacity(self.partners.len());
        for stage in 0..self.partners.len() {
            let (mine, theirs) = halves(&range, self.rank & (self.world >> (stage + 1)) != 0);
            let (out, into) = disjoint(buf, theirs, mine.clone());
            self.partners[stage]
                .exchange_adding(out, into)
                .map_err(|e| (self.partner(stage), e))?;
            parents.push(std::mem::replace(&mut range, mine));
        }
        for stage in (0..self.partners.len()).rev() {
            let parent = parents.pop().unwrap_or(0..buf.len());
            let upper = self.rank & (self.world >> (stage + 1)) != 0;
            let (_, theirs) = halves(&parent, upper);
            let (out, into) = disjoint(buf, range.clone(), theirs);
            self.partners[stage]
                .exchange_bytes(bytemuck::cast_slice(out), bytemuck::cast_slice_mut(into))
                .map_err(|e| (self.partner(stage), e))?;
            range = parent;
        }
        Ok(())
    }

    /// Payload bytes sent to all partners since these links were made.
    #[cfg(test)]
    pub fn bytes_sent(&self) -> u64 {
        self.partners.iter().map(RingLinks::bytes_sent).sum()
    }
}

/// (what this rank keeps, what its partner keeps) of `range`: the upper half when `upper`.
fn halves(range: &Range<usize>, upper: bool) -> (Range<usize>, Range<usize>) {
    let mid = range.start + range.len() / 2;
    let (lower, higher) = (range.start..mid, mid..range.end);
    if upper {
        (higher, lower)
    } else {
        (lower, higher)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs `f(rank, butterfly)` for `world` ranks joined over a real store and real sockets.
    fn joined<T: Send>(world: usize, f: impl Fn(usize, Butterfly) -> T + Sync) -> Vec<T> {
        crate::tcp::on_one_store(world, |rank, store, ip| {
            let timeout = Duration::from_secs(5);
            let tree = Butterfly::connect(store, "tok", (rank, world), ip, timeout, Duration::ZERO)
                .unwrap();
            f(rank, tree)
        })
    }

    /// Rank r's buffer: values of very different sizes, so the order they are added in shows.
    fn values(rank: usize, n: usize) -> Vec<f32> {
        let big = [1e8f32, 3.0, -1e8, 0.75, 3e7, -0.5, -3e7, 0.25];
        (0..n)
            .map(|i| big[(rank + i) % 8] * (1.0 + (i % 5) as f32 / 7.0))
            .collect()
    }

    /// The tree's sum computed in one place: rank r with rank r + W/2 first, then r + W/4, ...
    fn reference(world: usize, n: usize) -> Vec<f32> {
        let mut sums: Vec<Vec<f32>> = (0..world).map(|r| values(r, n)).collect();
        while sums.len() > 1 {
            let upper = sums.split_off(sums.len() / 2);
            for (low, high) in sums.iter_mut().zip(upper) {
                low.iter_mut().zip(high).for_each(|(a, b)| *a += b);
            }
        }
        sums.pop().unwrap()
    }

    #[test]
    fn every_rank_gets_the_trees_sum_bit_for_bit_at_every_length() {
        for world in [2, 4, 8] {
            for n in [0, 1, 3, 7, 8, 1000, 70_001] {
                let want: Vec<u32> = reference(world, n).iter().map(|x| x.to_bits()).collect();
                let got = joined(world, |rank, mut tree| {
                    let mut buf = values(rank, n);
                    tree.tree_sum(&mut buf).unwrap();
                    buf.iter().map(|x| x.to_bits()).collect::<Vec<u32>>()
                });
                for (rank, bits) in got.iter().enumerate() {
                    assert_eq!(bits, &want, "world {world}, n {n}, rank {rank}");
                }
            }
        }
        // The test can tell the tree from the ring's order (and from left to right).
        let n = 64;
        let mut left = values(0, n);
        for r in 1..4 {
            left.iter_mut().zip(values(r, n)).for_each(|(a, b)| *a += b);
        }
        assert_ne!(left, reference(4, n));
    }

    /// Each rank sends 2·(W − 1)/W of the buffer, as the ring does: bandwidth-optimal.
    #[test]
    fn each_rank_sends_what_a_ring_sends() {
        let n = 4096;
        for world in [2, 4, 8] {
            let sent = joined(world, |rank, mut tree| {
                let mut buf = values(rank, n);
                tree.tree_sum(&mut buf).unwrap();
                tree.bytes_sent()
            });
            let ring = (2 * (world - 1) * n / world * 4) as u64;
            assert!(
                sent.iter().all(|&s| s == ring),
                "world {world}: {sent:?} vs {ring}"
            );
        }
    }

    #[test]
    fn a_vanished_partner_is_named() {
        let errors = joined(4, |rank, mut tree| {
            if rank == 2 {
                drop(tree);
                return None;
            }
            let mut buf = values(rank, 1000);
            Some(tree.tree_sum(&mut buf).map_err(|(peer, _)| peer))
        });
        // Rank 0 meets rank 2 first (W/2 apart); rank 2's own first partner is rank 0.
        assert_eq!(errors[0], Some(Err(2)));
    }
}
