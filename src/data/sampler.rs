//! torch's `DistributedSampler`, exactly: the permutation depends only on (seed, epoch, length);
//! the index list is padded by wrapping around to a multiple of the world size (or truncated with
//! `drop_last`); rank r takes indices r, r + world, r + 2·world, ...

use crate::rng::Mt19937;

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
    pub fn num_samples(&self) -> usize {
        if self.drop_last && self.len % self.world != 0 {
            (self.len - self.world).div_ceil(self.world)
        } else {
            self.len.div_ceil(self.world)
        }
    }

    /// This rank's indices for the current epoch.
    pub fn indices(&self) -> Vec<usize> {
        let mut all = if self.shuffle {
            Mt19937::new(self.seed.wrapping_add(self.epoch)).randperm(self.len)
        } else {
            (0..self.len).collect()
        };
        let total = self.num_samples() * self.world;
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
}
