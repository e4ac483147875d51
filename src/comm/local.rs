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

    fn all_reduce_sum_f64(&self, _values: &mut [f64]) -> Result<(), CommError> {
        Ok(())
    }

    fn broadcast(&self, _t: &mut Tensor, root: usize) -> Result<(), CommError> {
        if root != 0 {
            return Err(CommError::Failed {
                op: "broadcast",
                rank: 0,
                problem: format!("root {root} outside world of 1"),
            });
        }
        Ok(())
    }

    fn barrier(&self) -> Result<(), CommError> {
        Ok(())
    }
}
