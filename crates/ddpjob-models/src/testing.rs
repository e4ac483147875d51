//! What the tests of the families here and of `ddpjob` compare tensors with (the kernels
//! crate's, so every crate's tests compare alike); not part of the API.

pub use ddpjob_kernels::testing::max_difference;

use candle_core::Tensor;

/// A tensor's f32 values, flattened.
pub fn values(t: &Tensor) -> Vec<f32> {
    t.flatten_all().unwrap().to_vec1::<f32>().unwrap()
}

/// The largest absolute difference of two equally long value lists.
pub fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}
