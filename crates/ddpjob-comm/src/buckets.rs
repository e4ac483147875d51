//! How gradients travel: the trainable tensors grouped into buckets of about `bucket_bytes`
//! in parameter order (the last bucket carrying the stop vote), and, when the optimizer state
//! is sharded (`distributed.sharding`), which part of each bucket a rank owns and updates.
//!
//! Ownership follows the communicator's reduce-scatter ([`Communicator::owned_segment`] of
//! each bucket): a rank owns one contiguous segment of every bucket, the segments balanced to
//! within one element, so the elements a rank updates are exactly those its reduce-scatter
//! completes and no value moves twice. With the same buckets as the unsharded all-reduce, each
//! element is summed in the same order, which is what makes a sharded job's weights
//! bit-identical to an unsharded one's (see `train::sharded`).

use std::ops::Range;

use super::Communicator;

/// Consecutive tensors of `sizes` (elements) grouped so each group holds at most
/// `bucket_bytes` of f32, a tensor larger than that alone.
pub fn bucket_ranges(sizes: &[usize], bucket_bytes: usize) -> Vec<Range<usize>> {
    let mut out = Vec::new();
    let mut start = 0;
    while start < sizes.len() {
        let mut end = start;
        let mut bytes = 0;
        while end < sizes.len() && (end == start || bytes + sizes[end] * 4 <= bucket_bytes) {
            bytes += sizes[end] * 4;
            end += 1;
        }
        out.push(start..end);
        start = end;
    }
    out
}

/// Chunk `rank` of W equal chunks of `n` elements rounded up (NCCL's reduce-scatter and
/// all-gather, on a buffer padded to W chunks), cut to the unpadded `n`.
#[cfg(any(test, feature = "cuda"))]
pub fn equal_chunk(n: usize, world: usize, rank: usize) -> Range<usize> {
    let chunk = n.div_ceil(world);
    (rank * chunk).min(n)..((rank + 1) * chunk).min(n)
}

/// One bucket as sharding sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bucket {
    /// Positions of its tensors among the trainable ones.
    pub tensors: Range<usize>,
    /// Elements, the stop vote's included on the last bucket.
    pub len: usize,
    /// This rank's segment of the bucket.
    pub owned: Range<usize>,
}

/// A part of one trainable tensor that this rank owns.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Piece {
    /// Position of the tensor among the trainable ones.
    pub tensor: usize,
    /// Its elements (of the flattened tensor) that this rank owns.
    pub within: Range<usize>,
    /// The bucket it travels in, and where in the bucket its first element is.
    pub bucket: usize,
    pub at: usize,
}

/// Buckets and this rank's pieces of them, in parameter order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardPlan {
    pub buckets: Vec<Bucket>,
    pub pieces: Vec<Piece>,
}

impl ShardPlan {
    /// The plan for trainable tensors of `sizes` elements on `comm`'s rank.
    pub fn new(sizes: &[usize], bucket_bytes: usize, comm: &dyn Communicator) -> ShardPlan {
        Self::with_owner(sizes, bucket_bytes, |n| comm.owned_segment(n))
    }

    fn with_owner(
        sizes: &[usize],
        bucket_bytes: usize,
        owned: impl Fn(usize) -> Range<usize>,
    ) -> ShardPlan {
        let ranges = bucket_ranges(sizes, bucket_bytes);
        let last = ranges.len().saturating_sub(1);
        let mut buckets = Vec::with_capacity(ranges.len());
        let mut pieces = Vec::new();
        for (b, tensors) in ranges.into_iter().enumerate() {
            let len = sizes[tensors.clone()].iter().sum::<usize>() + usize::from(b == last);
            let mine = owned(len);
            let mut offset = 0;
            for tensor in tensors.clone() {
                let span = offset..offset + sizes[tensor];
                let start = span.start.max(mine.start);
                let end = span.end.min(mine.end);
                if start < end {
                    pieces.push(Piece {
                        tensor,
                        within: start - offset..end - offset,
                        bucket: b,
                        at: start,
                    });
                }
                offset = span.end;
            }
            buckets.push(Bucket {
                tensors,
                len,
                owned: mine,
            });
        }
        ShardPlan { buckets, pieces }
    }

    /// Elements this rank owns (its share of the optimizer state, per state buffer).
    pub fn owned_elements(&self) -> usize {
        self.pieces.iter().map(|p| p.within.len()).sum()
    }

    /// Whether the stop vote (the last element of the last bucket) is this rank's.
    pub fn owns_vote(&self) -> bool {
        self.buckets
            .last()
            .is_some_and(|b| b.owned.contains(&(b.len - 1)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ring::segment;

    #[test]
    fn buckets_fill_to_the_byte_budget_and_a_large_tensor_goes_alone() {
        assert_eq!(bucket_ranges(&[6, 2, 6], 32), vec![0..2, 2..3]);
        assert_eq!(bucket_ranges(&[6, 2, 6], 4), vec![0..1, 1..2, 2..3]);
        assert!(bucket_ranges(&[], 4).is_empty());
    }

    /// With the ring's segments and with NCCL's chunks alike, every element of every trainable
    /// tensor is owned by exactly one rank, the shares balanced, the vote owned by one rank.
    #[test]
    fn the_ranks_pieces_cover_every_element_once_and_balance() {
        let sizes = [7, 1, 300, 5, 64, 3];
        for world in 1..=5 {
            let ring: Vec<ShardPlan> = (0..world)
                .map(|r| ShardPlan::with_owner(&sizes, 256, |n| segment(n, world, (r + 1) % world)))
                .collect();
            // The ring's segments differ by at most one element a bucket; NCCL's chunks by the
            // rounding up, at most W - 1 elements a bucket (the last rank's chunk is short).
            check(&sizes, world, &ring, 1);
            let nccl: Vec<ShardPlan> = (0..world)
                .map(|r| ShardPlan::with_owner(&sizes, 256, |n| equal_chunk(n, world, r)))
                .collect();
            check(&sizes, world, &nccl, world);
        }
    }

    fn check(sizes: &[usize], world: usize, plans: &[ShardPlan], slack: usize) {
        let mut owners: Vec<Vec<usize>> = sizes.iter().map(|&n| vec![0; n]).collect();
        for plan in plans {
            for p in &plan.pieces {
                let bucket = &plan.buckets[p.bucket];
                assert!(bucket.tensors.contains(&p.tensor));
                assert!(bucket.owned.start <= p.at && p.at < bucket.owned.end);
                p.within.clone().for_each(|i| owners[p.tensor][i] += 1);
            }
        }
        assert!(owners.iter().flatten().all(|&n| n == 1), "world {world}");
        let shares: Vec<usize> = plans.iter().map(ShardPlan::owned_elements).collect();
        let buckets = plans[0].buckets.len();
        let (min, max) = (shares.iter().min().unwrap(), shares.iter().max().unwrap());
        assert!(max - min <= slack * buckets, "world {world}: {shares:?}");
        assert_eq!(plans.iter().filter(|p| p.owns_vote()).count(), 1);
        let total: usize = sizes.iter().sum();
        let with_vote: usize = plans[0].buckets.iter().map(|b| b.len).sum();
        assert_eq!(with_vote, total + 1);
    }
}
