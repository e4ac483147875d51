//! torch's `DistributedSampler`, exactly: the permutation depends only on (seed, epoch, length);
//! the index list is padded by wrapping around to a multiple of the world size (or truncated with
//! `drop_last`); rank r takes indices r, r + world, r + 2·world, ...

use ddpjob_rng::Mt19937;

pub use ddpjob_spec::samples_per_rank;

#[derive(Debug, Clone)]
pub struct DistributedSampler {
    len: usize,
    world: usize,
    rank: usize,
    seed: u64,
    shuffle: bool,
    drop_last: bool,
    epoch: u64,
}

impl DistributedSampler {
    pub fn new(len: usize, world: usize, rank: usize, seed: u64) -> Self {
        assert!(rank < world, "rank {rank} outside world of {world}");
        DistributedSampler {
            len,
            world,
            rank,
            seed,
            shuffle: true,
            drop_last: false,
            epoch: 0,
        }
    }

    #[cfg(test)]
    pub fn with_shuffle(mut self, shuffle: bool) -> Self {
        self.shuffle = shuffle;
        self
    }

    pub fn with_drop_last(mut self, drop_last: bool) -> Self {
        self.drop_last = drop_last;
        self
    }

    /// As torch: call at the top of every epoch so each epoch has its own order.
    pub fn set_epoch(&mut self, epoch: u64) {
        self.epoch = epoch;
    }

    /// Samples this rank sees per epoch.
    #[cfg(test)]
    pub fn num_samples(&self) -> usize {
        samples_per_rank(self.len, self.world, self.drop_last)
    }

    /// This rank's indices for the current epoch.
    pub fn indices(&self) -> Vec<usize> {
        self.shard(self.permutation())
    }

    /// This rank's share of what is left of the current epoch after its first `consumed`
    /// samples (counted over all ranks, in the epoch's permutation, as they were taken on any
    /// world size): the rest is padded or truncated and dealt out as [`indices`](Self::indices)
    /// deals a whole epoch. Resuming on a new world size continues here.
    pub fn indices_after(&self, consumed: usize) -> Vec<usize> {
        let all = self.permutation();
        let rest = all[consumed.min(all.len())..].to_vec();
        self.shard(rest)
    }

    fn permutation(&self) -> Vec<usize> {
        if self.shuffle {
            Mt19937::new(self.seed.wrapping_add(self.epoch)).randperm(self.len)
        } else {
            (0..self.len).collect()
        }
    }

    fn shard(&self, mut all: Vec<usize>) -> Vec<usize> {
        let total = samples_per_rank(all.len(), self.world, self.drop_last) * self.world;
        if all.is_empty() {
            return all;
        }
        if all.len() < total {
            let original = all.clone();
            while all.len() < total {
                let take = (total - all.len()).min(original.len());
                all.extend_from_slice(&original[..take]);
            }
        } else {
            all.truncate(total);
        }
        all.into_iter()
            .skip(self.rank)
            .step_by(self.world)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_partition_the_padded_permutation() {
        let mut all = Vec::new();
        for rank in 0..3 {
            let mut s = DistributedSampler::new(10, 3, rank, 0);
            s.set_epoch(2);
            let idx = s.indices();
            assert_eq!(idx.len(), 4);
            all.extend(idx);
        }
        all.sort_unstable();
        // 12 slots for 10 samples: exactly two samples appear twice (the wrap-around padding).
        let mut counts = [0; 10];
        all.iter().for_each(|&i| counts[i] += 1);
        assert!(counts.iter().all(|&c| c >= 1));
        assert_eq!(counts.iter().filter(|&&c| c == 2).count(), 2);
    }

    #[test]
    fn one_worker_sees_the_interleaving_of_two() {
        let one = DistributedSampler::new(9, 1, 0, 5).indices();
        let r0 = DistributedSampler::new(9, 2, 0, 5).indices();
        let r1 = DistributedSampler::new(9, 2, 1, 5).indices();
        for (i, &x) in one.iter().enumerate() {
            let from_two = if i % 2 == 0 { r0[i / 2] } else { r1[i / 2] };
            assert_eq!(x, from_two);
        }
    }

    #[test]
    fn epoch_changes_the_order_and_drop_last_truncates() {
        let mut s = DistributedSampler::new(100, 1, 0, 0);
        let e0 = s.indices();
        s.set_epoch(1);
        assert_ne!(e0, s.indices());
        let d = DistributedSampler::new(10, 3, 0, 0).with_drop_last(true);
        assert_eq!(d.num_samples(), 3);
        assert_eq!(d.indices().len(), 3);
        assert_eq!(
            DistributedSampler::new(5, 1, 0, 0)
                .with_shuffle(false)
                .indices(),
            vec![0, 1, 2, 3, 4]
        );
    }

    /// The epoch's permutation as one worker sees it (no padding when world = 1).
    fn permutation(len: usize, seed: u64, epoch: u64) -> Vec<usize> {
        let mut s = DistributedSampler::new(len, 1, 0, seed);
        s.set_epoch(epoch);
        s.indices()
    }

    fn shards(len: usize, world: usize, seed: u64, epoch: u64, drop_last: bool) -> Vec<Vec<usize>> {
        (0..world)
            .map(|rank| {
                let mut s =
                    DistributedSampler::new(len, world, rank, seed).with_drop_last(drop_last);
                s.set_epoch(epoch);
                s.indices()
            })
            .collect()
    }

    #[test]
    fn padding_and_drop_last_follow_torch_index_for_index() {
        // torch: padded = perm + perm[:total - len] (repeated while short); rank r takes
        // padded[r::world]. drop_last: num_samples = ceil((len - world) / world), truncated.
        let perm = permutation(10, 7, 3);
        let padded: Vec<usize> = perm.iter().chain(&perm[..2]).copied().collect();
        for (rank, shard) in shards(10, 4, 7, 3, false).iter().enumerate() {
            let want: Vec<usize> = padded.iter().skip(rank).step_by(4).copied().collect();
            assert_eq!(shard, &want, "rank {rank}");
        }
        for (rank, shard) in shards(10, 4, 7, 3, true).iter().enumerate() {
            assert_eq!(shard, &vec![perm[rank], perm[rank + 4]], "rank {rank}");
        }
        // Printed by torch 2.x: [list(DistributedSampler(range(10), num_replicas=4, rank=r,
        // seed=7, drop_last=d)) for r in range(4)] after set_epoch(3), d = False and True.
        assert_eq!(
            shards(10, 4, 7, 3, false),
            vec![vec![7, 3, 2], vec![4, 5, 0], vec![6, 9, 7], vec![1, 8, 4]]
        );
        assert_eq!(
            shards(10, 4, 7, 3, true),
            vec![vec![7, 3], vec![4, 5], vec![6, 9], vec![1, 8]]
        );
        // Padding longer than the data set wraps around more than once.
        let tiny = permutation(2, 0, 0);
        let all: Vec<usize> = shards(2, 5, 0, 0, false).into_iter().flatten().collect();
        assert_eq!(all, vec![tiny[0], tiny[1], tiny[0], tiny[1], tiny[0]]);
    }

    #[test]
    fn shards_are_disjoint_and_cover_the_permutation_whatever_the_world_size() {
        for world in 1..=5 {
            let perm = permutation(101, 11, 4);
            let shards = shards(101, world, 11, 4, false);
            // Interleaving the shards gives back the permutation (plus its padding).
            let interleaved: Vec<usize> = (0..shards[0].len())
                .flat_map(|i| shards.iter().map(move |s| s[i]))
                .collect();
            assert_eq!(&interleaved[..101], &perm[..], "world {world}");
            let mut seen: Vec<usize> = interleaved[..101].to_vec();
            seen.sort_unstable();
            assert_eq!(seen, (0..101).collect::<Vec<_>>());
        }
    }

    #[test]
    fn order_depends_on_seed_and_epoch_only() {
        assert_eq!(permutation(50, 1, 2), permutation(50, 1, 2));
        assert_ne!(permutation(50, 1, 2), permutation(50, 2, 2));
        assert_ne!(permutation(50, 1, 2), permutation(50, 1, 3));
    }

    #[test]
    fn the_rest_of_an_epoch_is_dealt_out_again_on_a_new_world_size() {
        // 2 ranks took 3 steps of 4 samples each (24 samples); 3 ranks share the other 76.
        let (len, consumed) = (100, 24);
        let mut whole = DistributedSampler::new(len, 1, 0, 9);
        whole.set_epoch(4);
        let permutation = whole.indices();
        let mut seen = Vec::new();
        for rank in 0..4 {
            let mut s = DistributedSampler::new(len, 4, rank, 9);
            s.set_epoch(4);
            let idx = s.indices_after(consumed);
            assert_eq!(idx.len(), 19);
            seen.extend(idx);
        }
        seen.sort_unstable();
        let mut rest = permutation[consumed..].to_vec();
        rest.sort_unstable();
        assert_eq!(seen, rest, "every remaining sample exactly once");
        // Uneven: 76 over 3 ranks pads by wrapping around the rest, as torch pads an epoch.
        let mut s = DistributedSampler::new(len, 3, 2, 9);
        s.set_epoch(4);
        assert_eq!(s.indices_after(consumed).len(), 26);
        assert!(s.indices_after(len).is_empty());
        assert_eq!(s.indices_after(0), s.indices());
    }
}
