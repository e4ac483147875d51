//! What the tests of the families here and of `ddpjob` compare tensors with; not part of the
//! API.

use candle_core::{DType, Tensor};

/// The largest |a − b| of two tensors of one shape, in f32 (whatever their dtype).
pub fn max_difference(a: &Tensor, b: &Tensor) -> f32 {
    let d = (a.to_dtype(DType::F32).unwrap() - b.to_dtype(DType::F32).unwrap()).unwrap();
    let d = d.abs().unwrap().flatten_all().unwrap();
    d.max(0).unwrap().to_scalar().unwrap()
}
