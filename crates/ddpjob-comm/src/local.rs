//! The world-size-1 communicator: every collective is the identity.

use candle_core::Tensor;

use super::{CommError, Communicator};

#[derive(Debug, Default, Clone, Copy)]
pub struct LocalCommunicator;

impl Communicator for LocalCommunicator {
    fn rank(&self) -> usize {
        0
    }

    fn world_size(&self) -> usize {
        1
    }

    fn all_reduce_mean(&self, _flat: &mut Tensor) -> Result<(), CommError> {
        Ok(())
    }

    fn reduce_scatter_mean(&self, _flat: &mut Tensor) -> Result<(), CommError> {
        Ok(())
    }

    fn all_gather(&self, _flat: &mut Tensor) -> Result<(), CommError> {
        Ok(())
    }

    fn all_reduce_sum_f64(&self, _values: &mut [f64]) -> Result<(), CommError> {
        Ok(())
    }

    fn broadcast(&self, t: &mut Tensor, root: usize) -> Result<(), CommError> {
        if root != 0 {
            return Err(CommError::Failed {
                op: "broadcast",
                rank: 0,
                problem: format!("root {root} outside world of 1"),
            });
        }
        // In storage of its own, as every backend's (the trainer skips this call unless a
        // single rank's collectives are exercised).
        *t = t.copy()?;
        Ok(())
    }

    fn barrier(&self) -> Result<(), CommError> {
        Ok(())
    }

    fn shared(&self) -> Option<&(dyn Communicator + Sync)> {
        Some(self)
    }
}

/// A communicator whose collectives run even at world size 1 (`distributed.collectives =
/// "always"`): the trainer then buckets, reduces and broadcasts through `C` as a multi-rank job
/// does, so one device checks the path (NCCL's, on a GPU) that skipping would leave unrun.
#[derive(Debug, Clone, Copy)]
pub struct Exercised<C>(pub C);

impl<C: Communicator> Communicator for Exercised<C> {
    fn rank(&self) -> usize {
        self.0.rank()
    }

    fn world_size(&self) -> usize {
        self.0.world_size()
    }

    fn all_reduce_mean(&self, flat: &mut Tensor) -> Result<(), CommError> {
        self.0.all_reduce_mean(flat)
    }

    fn owned_segment(&self, n: usize) -> std::ops::Range<usize> {
        self.0.owned_segment(n)
    }

    fn segment_of(&self, n: usize, rank: usize) -> std::ops::Range<usize> {
        self.0.segment_of(n, rank)
    }

    fn reduce_scatter_mean(&self, flat: &mut Tensor) -> Result<(), CommError> {
        self.0.reduce_scatter_mean(flat)
    }

    fn all_gather(&self, flat: &mut Tensor) -> Result<(), CommError> {
        self.0.all_gather(flat)
    }

    fn all_reduce_sum_f64(&self, values: &mut [f64]) -> Result<(), CommError> {
        self.0.all_reduce_sum_f64(values)
    }

    fn broadcast(&self, t: &mut Tensor, root: usize) -> Result<(), CommError> {
        self.0.broadcast(t, root)
    }

    fn barrier(&self) -> Result<(), CommError> {
        self.0.barrier()
    }

    fn tree_sum(&self, flat: &mut Tensor) -> Result<(), CommError> {
        self.0.tree_sum(flat)
    }

    fn skips_collectives(&self) -> bool {
        false
    }
}
