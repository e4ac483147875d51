//! Collectives between workers behind one trait, so the trainer is the same for one worker
//! (`local`), CPU worker processes (`tcp`) and GPUs (`nccl`, with `--features cuda`). Also the
//! DDP pieces built on them: the broadcast of rank 0's variables, bucketed gradient averaging,
//! and hang diagnosis ([`heartbeat`]).
//!
//! It depends on candle and the rendezvous store (`ddpjob-store`) only: it knows tensors and
//! variables, never a model, a config or a job directory, so the trainer, the launcher and the
//! benches all reach the collectives through it.

pub mod buckets;
mod butterfly;
mod connect;
pub mod heartbeat;
mod local;
#[cfg(feature = "cuda")]
mod nccl;
pub mod ring;
pub mod tcp;
pub mod watchdog;

use std::ops::Range;

use candle_core::{Tensor, Var};
use thiserror::Error;

pub use connect::{BACKENDS, Options, Placement, Rendezvous, choose, connect};
pub use local::{Exercised, LocalCommunicator};
#[cfg(feature = "cuda")]
pub use nccl::NcclCommunicator;
#[doc(hidden)]
pub use tcp::ranks as tcp_ranks;
pub use tcp::{TcpCommunicator, spin_for};

/// Why a collective failed. `op` is the collective (`all_reduce`, `broadcast`, ...), `rank`
/// the rank that saw the failure, `problem` what it saw.
#[allow(missing_docs)] // the fields are named by the type's doc above
#[derive(Debug, Error)]
pub enum CommError {
    /// The backend reported an error.
    #[error("collective `{op}` failed: {problem}")]
    Failed {
        op: &'static str,
        rank: usize,
        problem: String,
    },
    /// A neighbour vanished mid-collective: a consequence of another rank's failure.
    #[error("collective `{op}` failed: {problem}")]
    PeerLost {
        op: &'static str,
        rank: usize,
        problem: String,
    },
    /// No progress within `distributed.timeout_s`: some rank never arrived (see `heartbeat`);
    /// `seq` counts the collectives, `waited_s` is how long this one waited.
    #[error(
        "collective `{op}` #{seq} did not complete within {waited_s} s (distributed.timeout_s): {problem}"
    )]
    Timeout {
        op: &'static str,
        rank: usize,
        seq: u64,
        waited_s: u64,
        problem: String,
    },
    /// The ranks could not connect to each other.
    #[error("rank {rank} could not join the worker ring: {problem}")]
    Setup { rank: usize, problem: String },
    /// The rendezvous store failed.
    #[error(transparent)]
    Store(#[from] ddpjob_store::StoreError),
    /// A tensor operation failed.
    #[error(transparent)]
    Tensor(#[from] candle_core::Error),
}

/// What every backend provides. Every rank must call the same collectives in the same order.
pub trait Communicator {
    /// This process's rank, 0..world_size.
    fn rank(&self) -> usize;
    /// The number of ranks.
    fn world_size(&self) -> usize;
    /// Replaces `flat` (1-D) with the element-wise mean over ranks.
    fn all_reduce_mean(&self, flat: &mut Tensor) -> Result<(), CommError>;
    /// The part of an `n`-element buffer this rank holds reduced after
    /// [`Communicator::reduce_scatter_mean`] and gives to the others in
    /// [`Communicator::all_gather`]: the ranks' parts are disjoint, cover the buffer and
    /// differ in length by at most one element (the ring's: segment rank+1 of W).
    fn owned_segment(&self, n: usize) -> Range<usize> {
        self.segment_of(n, self.rank())
    }
    /// Rank `rank`'s [`Communicator::owned_segment`] of an `n`-element buffer: where every
    /// other rank's part lies after an all-gather.
    fn segment_of(&self, n: usize, rank: usize) -> Range<usize> {
        let w = self.world_size();
        ring::segment(n, w, (rank + 1) % w)
    }
    /// Leaves in this rank's [`Communicator::owned_segment`] of `flat` (1-D) the element-wise
    /// mean over ranks, the same bits there as [`Communicator::all_reduce_mean`] gives; the
    /// rest of `flat` is left unspecified. Half the all-reduce's traffic.
    fn reduce_scatter_mean(&self, flat: &mut Tensor) -> Result<(), CommError>;
    /// Replaces every rank's part of `flat` (1-D) with that rank's
    /// [`Communicator::owned_segment`]: the other half of an all-reduce.
    fn all_gather(&self, flat: &mut Tensor) -> Result<(), CommError>;
    /// Replaces `values` with their element-wise sum over ranks (metrics: loss sums, counts).
    fn all_reduce_sum_f64(&self, values: &mut [f64]) -> Result<(), CommError>;
    /// Replaces `t` on every rank with `root`'s, in storage of its own (`t` may be a
    /// variable's value, which is then set from it).
    fn broadcast(&self, t: &mut Tensor, root: usize) -> Result<(), CommError>;
    /// Returns once every rank has called it.
    fn barrier(&self) -> Result<(), CommError>;
    /// Replaces `flat` (1-D, f32) with the element-wise sum over ranks in one fixed binary tree
    /// (rank r's values with rank r + W/2's first, then r + W/4's, ...; W a power of two):
    /// the same bits on every rank, every run and every backend. World-size-invariant
    /// training's last levels. By default through [`Communicator::all_gather`] (W times an
    /// all-reduce's traffic); the tcp backend's partners do it at the ring's bandwidth.
    fn tree_sum(&self, flat: &mut Tensor) -> Result<(), CommError> {
        tree_sum_by_all_gather(self, flat)
    }
    /// Whether the trainer may skip the collectives because they would change nothing (a
    /// single rank), as it does unless the job asks for them (`distributed.collectives`).
    fn skips_collectives(&self) -> bool {
        self.world_size() == 1
    }
    /// This communicator, for another thread to run collectives on while the one that holds it
    /// computes (`distributed.overlap_comm`); `None` where it cannot be shared (those
    /// collectives then run inline).
    fn shared(&self) -> Option<&(dyn Communicator + Sync)> {
        None
    }
}

/// [`Communicator::tree_sum`] for any backend: every rank's values side by side in one buffer,
/// each in its rank's segment, all-gathered, then summed in the tree locally.
pub fn tree_sum_by_all_gather<C: Communicator + ?Sized>(
    comm: &C,
    flat: &mut Tensor,
) -> Result<(), CommError> {
    // At world size 1 too: a communicator whose collectives are exercised there
    // (`distributed.collectives = "always"`) runs its all-gather.
    let (world, rank) = (comm.world_size(), comm.rank());
    if !world.is_power_of_two() {
        return Err(CommError::Failed {
            op: "tree_sum",
            rank,
            problem: format!("a tree over ranks needs a power-of-two world size, not {world}"),
        });
    }
    let n = flat.elem_count();
    let segments: Vec<_> = (0..world).map(|r| comm.segment_of(world * n, r)).collect();
    if segments.iter().any(|s| s.len() != n) {
        return Err(CommError::Failed {
            op: "tree_sum",
            rank,
            problem: format!("the backend splits {world} x {n} values unevenly"),
        });
    }
    // No empty tensor (a device may refuse a zero-byte allocation).
    let zeros = |len: usize| Tensor::zeros(len, flat.dtype(), flat.device());
    let at = &segments[rank];
    let mut parts = Vec::with_capacity(3);
    if at.start > 0 {
        parts.push(zeros(at.start)?);
    }
    parts.push(flat.flatten_all()?);
    if at.end < world * n {
        parts.push(zeros(world * n - at.end)?);
    }
    let mut side_by_side = Tensor::cat(&parts, 0)?;
    comm.all_gather(&mut side_by_side)?;
    let mut sums = segments
        .iter()
        .map(|s| side_by_side.narrow(0, s.start, n))
        .collect::<candle_core::Result<Vec<_>>>()?;
    while sums.len() > 1 {
        let upper = sums.split_off(sums.len() / 2);
        for (low, high) in sums.iter_mut().zip(upper) {
            *low = (&*low + high)?;
        }
    }
    if let Some(sum) = sums.pop() {
        *flat = sum.reshape(flat.shape())?;
    }
    Ok(())
}

/// Makes every rank's `vars` rank 0's: the parameters at the start, as DDP does at
/// construction, and the buffers (BatchNorm statistics) before each forward pass, as DDP's
/// `broadcast_buffers` does, so every rank trains and evaluates with the same state and the
/// state rank 0 checkpoints is the one every rank used.
pub fn broadcast_vars<'a>(
    comm: &dyn Communicator,
    vars: impl IntoIterator<Item = &'a Var>,
) -> Result<(), CommError> {
    if comm.skips_collectives() {
        return Ok(());
    }
    for var in vars {
        let mut t = var.as_tensor().clone();
        comm.broadcast(&mut t, 0)?;
        var.set(&t)?;
    }
    Ok(())
}

/// Whether any rank voted to stop in a step's gradient average.
#[derive(Debug, Clone)]
pub enum StopVote {
    /// Known on the host (a single rank: its own vote).
    Known(bool),
    /// The ranks' mean vote, still on the device: reading it is a host round trip, which on a
    /// GPU waits for every kernel queued so far, so the trainer reads it only every few steps.
    Reduced(Tensor),
}

impl StopVote {
    /// Whether any rank voted to stop (waits for the device when the vote is still there).
    pub fn read(&self) -> Result<bool, CommError> {
        match self {
            StopVote::Known(stop) => Ok(*stop),
            StopVote::Reduced(votes) => {
                Ok(votes.to_dtype(candle_core::DType::F32)?.to_vec1::<f32>()?[0] > 0.0)
            }
        }
    }
}

/// Averages `grads` over ranks: flattened into buckets of about `bucket_bytes` (in parameter
/// order), one all-reduce per bucket, written back in place. Called once per optimizer step,
/// never per micro-batch (torch's `no_sync` during accumulation).
///
/// The last bucket also carries this rank's `stop` vote, so every rank gets, in the same step
/// and at no extra cost, whether any rank was asked to stop: returned still on the device, to
/// be read only when the caller decides (reading it waits for the device; see [`StopVote`]).
pub fn average_gradients(
    comm: &dyn Communicator,
    grads: &mut [Tensor],
    bucket_bytes: usize,
    stop: bool,
) -> Result<StopVote, CommError> {
    if comm.skips_collectives() {
        return Ok(StopVote::Known(stop));
    }
    let mut verdict = StopVote::Known(false);
    let sizes: Vec<usize> = grads.iter().map(Tensor::elem_count).collect();
    let ranges = buckets::bucket_ranges(&sizes, bucket_bytes);
    let last = ranges.len().saturating_sub(1);
    for (b, range) in ranges.into_iter().enumerate() {
        let vote = (b == last).then_some(u8::from(stop) as f32);
        let mut bucket = flat_bucket(&grads[range.clone()], vote)?;
        comm.all_reduce_mean(&mut bucket)?;
        if b == last {
            verdict = StopVote::Reduced(bucket.narrow(0, bucket.elem_count() - 1, 1)?);
        }
        unflatten_into(&bucket, &mut grads[range])?;
    }
    Ok(verdict)
}

/// `tensors` flattened into one 1-D bucket, followed by `vote` when given (the stop vote: 1 to
/// stop): a new tensor, except for one tensor and no vote, whose own storage it then is (a
/// collective run in place on it writes that tensor).
pub fn flat_bucket(tensors: &[Tensor], vote: Option<f32>) -> Result<Tensor, CommError> {
    let mut flats = tensors
        .iter()
        .map(|g| g.flatten_all())
        .collect::<Result<Vec<_>, _>>()?;
    if let Some(vote) = vote {
        let Some(first) = flats.first() else {
            return Err(CommError::Tensor(candle_core::Error::Msg(
                "no gradient to carry the stop vote: the model has no trainable parameter".into(),
            )));
        };
        let (device, dtype) = (first.device().clone(), first.dtype());
        flats.push(Tensor::new(&[vote], &device)?.to_dtype(dtype)?);
    }
    Ok(Tensor::cat(&flats, 0)?)
}

/// Replaces each of `tensors` with its part of `bucket` (in order, shapes kept).
pub fn unflatten_into(bucket: &Tensor, tensors: &mut [Tensor]) -> Result<(), CommError> {
    let mut offset = 0;
    for t in tensors {
        let n = t.elem_count();
        *t = bucket.narrow(0, offset, n)?.reshape(t.shape())?;
        offset += n;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::cell::RefCell;

    use candle_core::Device;

    use super::*;

    /// Pretends to be rank 0 of 2 whose peer's gradients are all zero, so the mean halves every
    /// value; records the length of each bucket it is given.
    struct HalfOfTwo {
        buckets: RefCell<Vec<usize>>,
    }

    impl Communicator for HalfOfTwo {
        fn rank(&self) -> usize {
            0
        }
        fn world_size(&self) -> usize {
            2
        }
        fn all_reduce_mean(&self, flat: &mut Tensor) -> Result<(), CommError> {
            self.buckets.borrow_mut().push(flat.elem_count());
            *flat = (&*flat * 0.5)?;
            Ok(())
        }
        fn reduce_scatter_mean(&self, _flat: &mut Tensor) -> Result<(), CommError> {
            unreachable!("not sharded")
        }
        fn all_gather(&self, _flat: &mut Tensor) -> Result<(), CommError> {
            unreachable!("not sharded")
        }
        fn all_reduce_sum_f64(&self, _values: &mut [f64]) -> Result<(), CommError> {
            Ok(())
        }
        fn broadcast(&self, _t: &mut Tensor, _root: usize) -> Result<(), CommError> {
            Ok(())
        }
        fn barrier(&self) -> Result<(), CommError> {
            Ok(())
        }
    }

    #[test]
    fn gradients_are_bucketed_in_order_and_written_back_in_shape() {
        let dev = Device::Cpu;
        let mut grads = vec![
            Tensor::ones((2, 3), candle_core::DType::F32, &dev).unwrap(),
            Tensor::new(&[2f32, 4.0], &dev).unwrap(),
            Tensor::ones((5, 1), candle_core::DType::F32, &dev).unwrap(),
        ];
        let comm = HalfOfTwo {
            buckets: RefCell::new(Vec::new()),
        };
        // 8 elements (32 bytes) fit the first two tensors; the third gets its own bucket.
        // The last bucket carries the stop vote: 1 of 2 ranks voting still stops both.
        let vote = average_gradients(&comm, &mut grads, 32, true).unwrap();
        assert!(matches!(vote, StopVote::Reduced(_)));
        assert!(vote.read().unwrap());
        assert_eq!(*comm.buckets.borrow(), vec![8, 6]);
        assert_eq!(grads[0].dims(), &[2, 3]);
        assert_eq!(grads[1].to_vec1::<f32>().unwrap(), vec![1.0, 2.0]);
        assert_eq!(grads[2].dims(), &[5, 1]);
        assert_eq!(
            grads[2].flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            vec![0.5; 5]
        );
        // A tensor larger than the bucket still goes, alone.
        comm.buckets.borrow_mut().clear();
        let vote = average_gradients(&comm, &mut grads, 4, false).unwrap();
        assert!(!vote.read().unwrap());
        assert_eq!(*comm.buckets.borrow(), vec![6, 2, 6]);
    }

    /// A single rank's collectives are skipped, unless exercised: then the gradients go
    /// through the buckets and come back unchanged, the vote through the device, and the
    /// parameters through a broadcast.
    #[test]
    fn a_single_rank_skips_its_collectives_unless_they_are_exercised() {
        let grads = || {
            vec![
                Tensor::new(&[1.5f32, -2.0, 3.25], &Device::Cpu).unwrap(),
                Tensor::new(&[[0.5f32, 7.0]], &Device::Cpu).unwrap(),
            ]
        };
        let values = |g: &[Tensor]| -> Vec<f32> {
            g.iter()
                .flat_map(|t| t.flatten_all().unwrap().to_vec1::<f32>().unwrap())
                .collect()
        };
        let mut skipped = grads();
        let vote = average_gradients(&LocalCommunicator, &mut skipped, 8, true).unwrap();
        assert!(matches!(vote, StopVote::Known(true)));
        let mut exercised = grads();
        let comm = Exercised(LocalCommunicator);
        assert!(LocalCommunicator.skips_collectives() && !comm.skips_collectives());
        let vote = average_gradients(&comm, &mut exercised, 8, true).unwrap();
        assert!(matches!(vote, StopVote::Reduced(_)), "{vote:?}");
        assert!(vote.read().unwrap());
        assert_eq!(values(&exercised), values(&grads()));
    }

    /// A single rank's broadcast, when exercised, hands back a tensor of its own, so the
    /// variables are set from it (`Var::set` refuses a variable's own storage).
    #[test]
    fn an_exercised_single_rank_broadcasts_into_storage_of_its_own() {
        let vars = [
            Var::from_vec(vec![1f32, -2.0, 3.5], 3, &Device::Cpu).unwrap(),
            Var::from_vec(vec![0.25f32; 4], (2, 2), &Device::Cpu).unwrap(),
        ];
        let values = |vars: &[Var]| -> Vec<Vec<f32>> {
            vars.iter()
                .map(|v| v.as_tensor().flatten_all().unwrap().to_vec1().unwrap())
                .collect()
        };
        let before = values(&vars);
        broadcast_vars(&Exercised(LocalCommunicator), &vars).unwrap();
        assert_eq!(values(&vars), before);
    }
}
