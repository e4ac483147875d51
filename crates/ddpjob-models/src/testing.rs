//! What the tests of the families here and of `ddpjob` compare tensors with (the kernels
//! crate's, so every crate's tests compare alike); not part of the API.

pub use ddpjob_kernels::testing::max_difference;
