//! `distributed.deterministic = "world-size-invariant"`: one optimizer step whose gradients
//! are the same bits on any number of workers that divides `distributed.virtual_shards` (V, a
//! power of two).
//!
//! The step's global batch of B samples (positions 0..B of the step's slice of the epoch's
//! permutation) is cut into V fixed pieces: piece k holds the positions ≡ k (mod V), in order.
//! The sampler deals position j to rank j mod W (torch's DistributedSampler), so rank r holds
//! the pieces k ≡ r (mod W), each a stride of its own rows. Each piece's gradient is computed
//! alone, its kernels on one thread (theirs split sums by the thread count, which changes with
//! the world size), scaled by 1/V (exact: a power of two). The pieces are summed in one fixed
//! binary tree over k, halving: k with k + V/2, then k + V/4, ... The first levels pair pieces
//! of one rank (the same residue mod W), so each rank sums its own subtree, computing its
//! pieces in the order that lets it add siblings as soon as both exist (keeping log2(V/W)
//! partial sums, not every piece's gradient); the last log2(W) levels pair rank r's sum with
//! rank r + W/2's, ..., the same bits on every rank ([`Communicator::tree_sum`]: recursive
//! halving between partners on `tcp`, at the ring's bandwidth). Clipping and the optimizer
//! then see the same gradients whatever W was.

use std::sync::OnceLock;

use candle_core::{DType, Tensor};

use super::step::{MicroBatch, StepContext, StepError, StepResult, shard_forward_backward};
use crate::models::Mode;
use crate::optim::{Optimizer, clip_grad_norm};
use ddpjob_comm::{Communicator, StopVote};

/// One step of `virtual_shards` pieces over this rank's `batch` (the step's one micro-batch).
pub(super) fn optimizer_step(
    cx: &StepContext,
    optimizer: &mut Optimizer,
    batch: &MicroBatch,
    virtual_shards: usize,
    lr: f64,
    stop_vote: bool,
) -> Result<StepResult, StepError> {
    let params = cx.model.params();
    ddpjob_comm::broadcast_vars(cx.comm, params.buffers().map(|(_, var)| var))?;
    let world = cx.comm.world_size();
    let rows = batch.targets.dims().first().copied().unwrap_or(1);
    let local = virtual_shards / world;
    if local == 0 || rows % local != 0 {
        return Err(candle_core::Error::Msg(format!(
            "world-size-invariant step: {rows} rows on each of {world} ranks do not cut into \
             {virtual_shards} pieces"
        ))
        .into());
    }
    let scale = 1.0 / virtual_shards as f64;
    let piece = |m: usize| {
        let part = batch.stride(m, local)?;
        let n = rows / local;
        shard_forward_backward(cx.model, &part, (scale, n as f64), (false, false), None)
    };
    // The tree's leaves in bit-reversed order make siblings neighbours, so partial sums can be
    // added as soon as both halves exist: at most log2(V/W) of them are kept, beside the
    // pieces in flight (one per thread), instead of every piece's gradient.
    let order: Vec<usize> = match cx.scrambled_pieces {
        // A deliberate bug (`DDPJOB_FAULT kind=piece-order`): the pieces added left to right.
        true => (0..local).collect(),
        false => bit_reversed(local),
    };
    let cpu = cx.device.is_cpu();
    let in_flight = if cpu { rayon::current_num_threads() } else { 1 };
    let mut partial = PartialSums::default();
    let mut losses: Vec<Option<Tensor>> = vec![None; local];
    for group in order.chunks(in_flight.max(1)) {
        let results = one_thread_each(group.len(), cpu, |i| piece(group[i]));
        for (&m, result) in group.iter().zip(results) {
            let result = result?;
            let grads = params
                .trainable()
                .map(|(i, var)| result.grads[i].clone().map_or_else(|| var.zeros_like(), Ok))
                .collect::<Result<Vec<_>, _>>()?;
            losses[m] = Some(result.loss_sum);
            match cx.scrambled_pieces {
                true => partial.fold(grads)?,
                false => partial.push(grads)?,
            }
        }
    }
    let mine = partial.finish()?;
    let mut loss_sum: Option<Tensor> = None;
    for loss in losses.into_iter().flatten() {
        loss_sum = Some(match loss_sum {
            Some(sum) => (sum + loss)?,
            None => loss,
        });
    }
    let (mut grads, stop) = if cx.comm.skips_collectives() {
        (mine, StopVote::Known(stop_vote))
    } else {
        let (grads, votes) = across_ranks(cx.comm, mine, stop_vote)?;
        (grads, StopVote::Reduced(votes))
    };
    let grad_norm = match cx.grad_clip_norm {
        Some(max_norm) => Some(clip_grad_norm(&mut grads, max_norm)?),
        None => None,
    };
    optimizer.step(params, &grads, lr)?;
    let loss_sum = loss_sum.map_or_else(|| super::step::no_loss(cx), Ok)?;
    Ok(StepResult {
        loss_sum,
        samples: rows,
        stop,
        grad_norm,
    })
}

/// Σ of `parts` (each a list of gradients) in the fixed tree: part m with m + len/2, then
/// m + len/4, ..., down to part 0 (`parts.len()` a power of two). What [`PartialSums`] computes
/// from the parts in [`bit_reversed`] order, kept whole.
#[cfg(test)]
pub(super) fn tree_sum(mut parts: Vec<Vec<Tensor>>) -> candle_core::Result<Vec<Tensor>> {
    let mut half = parts.len() / 2;
    while half > 0 {
        let upper = parts.split_off(half);
        for (low, high) in parts.iter_mut().zip(upper) {
            *low = add_lists(low, &high)?;
        }
        half /= 2;
    }
    parts
        .pop()
        .ok_or_else(|| candle_core::Error::Msg("no piece to sum".into()))
}

/// 0..n (a power of two) in bit-reversed order: 0, n/2, n/4, 3n/4, ... In it the tree's
/// siblings (m and m + n/2, then the sums of m and m + n/4, ...) come side by side.
fn bit_reversed(n: usize) -> Vec<usize> {
    let bits = n.trailing_zeros();
    (0..n)
        .map(|i| match bits {
            0 => i,
            b => i.reverse_bits() >> (usize::BITS - b),
        })
        .collect()
}

/// The tree's sum of pieces fed in [`bit_reversed`] order, as a binary counter: an entry at
/// level l is the sum of 2^l consecutive pieces, and a new one is added to the entry before it
/// while their levels agree; so at most log2(n) sums are kept between pieces.
#[derive(Default)]
struct PartialSums {
    stack: Vec<(u32, Vec<Tensor>)>,
}

impl PartialSums {
    fn push(&mut self, mut grads: Vec<Tensor>) -> candle_core::Result<()> {
        let mut level = 0;
        while let Some((top, _)) = self.stack.last()
            && *top == level
        {
            if let Some((_, earlier)) = self.stack.pop() {
                grads = add_lists(&earlier, &grads)?;
            }
            level += 1;
        }
        self.stack.push((level, grads));
        Ok(())
    }

    /// Left to right instead (the piece-order fault).
    fn fold(&mut self, grads: Vec<Tensor>) -> candle_core::Result<()> {
        let sum = match self.stack.pop() {
            Some((_, earlier)) => add_lists(&earlier, &grads)?,
            None => grads,
        };
        self.stack.push((0, sum));
        Ok(())
    }

    /// The sum of every piece pushed (a power of two of them).
    fn finish(mut self) -> candle_core::Result<Vec<Tensor>> {
        match (self.stack.pop(), self.stack.is_empty()) {
            (Some((_, sum)), true) => Ok(sum),
            _ => Err(candle_core::Error::Msg(
                "world-size-invariant step: the pieces do not make one tree".into(),
            )),
        }
    }
}

/// `a + b`, tensor by tensor (one parallel pass on the CPU: element-wise, the same bits
/// however it is cut).
fn add_lists(a: &[Tensor], b: &[Tensor]) -> candle_core::Result<Vec<Tensor>> {
    if a.iter()
        .chain(b)
        .all(|t| ddpjob_kernels::applies(t) && t.is_contiguous())
    {
        let pairs: Vec<(&Tensor, &Tensor)> = a.iter().zip(b).collect();
        return ddpjob_kernels::add_pairs(&pairs);
    }
    a.iter().zip(b).map(|(a, b)| a + b).collect()
}

/// Every rank's subtree sum, then the tree's last levels over ranks: the sums flattened into
/// one f32 buffer for [`Communicator::tree_sum`] (the partners' recursive halving on `tcp`, at
/// the ring's bandwidth; all-gather then the tree on other backends), with this rank's stop
/// vote after them (a sum of 0s and 1s: exact in any order); the summed gradients and votes.
fn across_ranks(
    comm: &dyn Communicator,
    mine: Vec<Tensor>,
    stop_vote: bool,
) -> Result<(Vec<Tensor>, Tensor), StepError> {
    let mut summed = mine
        .iter()
        .map(|t| t.to_dtype(DType::F32))
        .collect::<candle_core::Result<Vec<_>>>()?;
    let vote = if stop_vote { 1.0 } else { 0.0 };
    let mut flat = ddpjob_comm::flat_bucket(&summed, Some(vote))?;
    comm.tree_sum(&mut flat)?;
    ddpjob_comm::unflatten_into(&flat, &mut summed)?;
    let summed = summed
        .iter()
        .zip(&mine)
        .map(|(t, like)| t.to_dtype(like.dtype()))
        .collect::<candle_core::Result<Vec<_>>>()?;
    Ok((summed, flat.narrow(0, flat.elem_count() - 1, 1)?))
}

/// `f(0..parts)`, each on one thread whose kernels see a pool of one (so they never split a
/// sum by the thread count), side by side over the worker's threads on the CPU; in turn on an
/// accelerator.
pub(super) fn one_thread_each<R: Send>(
    parts: usize,
    cpu: bool,
    f: impl Fn(usize) -> R + Sync,
) -> Vec<R> {
    static SOLO: OnceLock<Vec<rayon::ThreadPool>> = OnceLock::new();
    let pools = SOLO.get_or_init(|| {
        (0..rayon::current_num_threads().max(1))
            .filter_map(|_| rayon::ThreadPoolBuilder::new().num_threads(1).build().ok())
            .collect()
    });
    if !cpu || pools.is_empty() {
        return (0..parts).map(f).collect();
    }
    super::shards::side_by_side(parts, |thread, i| {
        pools[thread % pools.len()].install(|| f(i))
    })
}

impl MicroBatch {
    /// Rows m, m + every, m + 2·every, ... (a piece of the step's batch), copied.
    fn stride(&self, m: usize, every: usize) -> candle_core::Result<MicroBatch> {
        let rows = self.targets.dims().first().copied().unwrap_or(1);
        let picked: Vec<u32> = (m..rows).step_by(every).map(|i| i as u32).collect();
        let index = Tensor::new(picked.as_slice(), self.inputs.device())?;
        let mode = match &self.mode {
            Mode::Train { row_seeds } => Mode::Train {
                row_seeds: picked.iter().map(|&i| row_seeds[i as usize]).collect(),
            },
            Mode::Eval => Mode::Eval,
        };
        let (inputs, targets) = trimmed(
            self.inputs.index_select(&index, 0)?,
            self.targets.index_select(&index, 0)?,
        )?;
        Ok(MicroBatch {
            inputs,
            targets,
            mode,
        })
    }
}

/// A piece of rows of examples (targets [.., t], instruction data's or preference pairs')
/// cut to its own longest row: positions past every row's last scored target are padding of
/// the rank's batch, whose length depends on which rows the rank got. Causal, they change no
/// loss; cut, a piece is the same tensor on any world size, so its kernels give the same bits.
fn trimmed(inputs: Tensor, targets: Tensor) -> candle_core::Result<(Tensor, Tensor)> {
    let ignore = crate::task::IGNORE_TARGET;
    let dims = targets.dims().to_vec();
    let (Some(&t), true) = (
        dims.last(),
        dims.len() >= 2 && targets.dtype() == DType::U32,
    ) else {
        return Ok((inputs, targets));
    };
    let flat = targets.flatten_all()?.to_vec1::<u32>()?;
    let used = (flat.chunks(t.max(1)))
        .filter_map(|row| row.iter().rposition(|&y| y != ignore))
        .max()
        .map_or(1, |p| p + 1);
    let dim = dims.len() - 1;
    if used == t || inputs.dims().get(dim) != Some(&t) {
        return Ok((inputs, targets));
    }
    Ok((inputs.narrow(dim, 0, used)?, targets.narrow(dim, 0, used)?))
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Tensor};

    use super::{across_ranks, tree_sum};

    /// Rank r's subtree sums: values whose sum depends on the order they are added in.
    fn sums_of(rank: usize) -> Vec<Tensor> {
        let big = [1e8f32, 1.0, -1e8, 1.0, 3e7, -0.5, -3e7, 0.25];
        let v = big[rank];
        vec![
            Tensor::new(&[v, v * 0.5 + 1.0], &Device::Cpu).unwrap(),
            Tensor::new(&[[v - 3.0], [1.0 / (rank as f32 + 1.0)]], &Device::Cpu).unwrap(),
        ]
    }

    /// Over real sockets between 1, 2, 4 and 8 ranks, by all-gather over the ring and by the
    /// partners' recursive halving, every rank gets the tree's sum of all ranks' sums, bit for
    /// bit what one process computes (and not what a left-to-right sum gives).
    #[test]
    fn the_ranks_sum_in_the_trees_order_at_every_world_size() {
        for world in [1, 2, 4, 8] {
            let reference = tree_sum((0..world).map(sums_of).collect()).unwrap();
            let bits = |list: &[Tensor]| -> Vec<u32> {
                list.iter().flat_map(ddpjob_kernels::f32_bits).collect()
            };
            for tree in [false, true] {
                // Rank 1 alone votes to stop: every rank hears of it.
                let results = ddpjob_comm::tcp::ranks_joined(world, tree, |rank, comm| {
                    let (sums, votes) = across_ranks(&comm, sums_of(rank), rank == 1).unwrap();
                    (bits(&sums), votes.to_vec1::<f32>().unwrap())
                });
                let stop = if world > 1 { 1.0 } else { 0.0 };
                for (rank, (got, votes)) in results.iter().enumerate() {
                    assert_eq!(got, &bits(&reference), "world {world}, rank {rank}, {tree}");
                    assert_eq!(votes, &[stop], "world {world}, rank {rank}, {tree}");
                }
            }
            if world >= 4 {
                let mut left = sums_of(0);
                for r in 1..world {
                    left = super::add_lists(&left, &sums_of(r)).unwrap();
                }
                assert_ne!(
                    bits(&left),
                    bits(&reference),
                    "world {world}: the test cannot tell"
                );
            }
        }
    }

    /// Fed in bit-reversed order, the partial sums give the tree's sum bit for bit, keeping at
    /// most log2(n) sums between pieces; fed left to right (the fault), another sum.
    #[test]
    fn partial_sums_of_bit_reversed_pieces_are_the_tree() {
        assert_eq!(super::bit_reversed(8), vec![0, 4, 2, 6, 1, 5, 3, 7]);
        assert_eq!(super::bit_reversed(1), vec![0]);
        let parts: Vec<Vec<Tensor>> = (0..8).map(sums_of).collect();
        let bits = |list: &[Tensor]| -> Vec<u32> {
            list.iter().flat_map(ddpjob_kernels::f32_bits).collect()
        };
        let want = bits(&tree_sum(parts.clone()).unwrap());
        let mut partial = super::PartialSums::default();
        for m in super::bit_reversed(8) {
            partial.push(parts[m].clone()).unwrap();
            assert!(partial.stack.len() <= 3);
        }
        assert_eq!(bits(&partial.finish().unwrap()), want);
        let mut left = super::PartialSums::default();
        for part in parts {
            left.fold(part).unwrap();
        }
        assert_ne!(bits(&left.finish().unwrap()), want);
    }

    /// The tree pairs m with m + len/2 first: for 4 parts, (p0 + p2) + (p1 + p3), which differs
    /// from the left-to-right sum for these values.
    #[test]
    fn the_tree_pairs_halves_first() {
        let values = [1e8f32, 1.0, -1e8, 1.0];
        let parts: Vec<Vec<Tensor>> = values
            .iter()
            .map(|&v| vec![Tensor::new(&[v], &Device::Cpu).unwrap()])
            .collect();
        let sum: Vec<f32> = tree_sum(parts).unwrap()[0].to_vec1().unwrap();
        // (1e8 + -1e8) + (1 + 1) = 2; left to right: ((1e8 + 1) - 1e8) + 1 = 1.
        assert_eq!(sum, vec![2.0]);
        let left_to_right = ((values[0] + values[1]) + values[2]) + values[3];
        assert_eq!(left_to_right, 1.0);
    }
}
