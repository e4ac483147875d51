//! The norms and the residual addition the families share: LayerNorm with a gain and an
//! optional bias (GPT-2, nanoGPT), and a residual branch added to the f32 stream. RMSNorm's
//! weight is a plain parameter; the op is `ddpjob_kernels::rms_norm`.

use candle_core::{Result, Tensor, Var};

use crate::FrozenSet;
use ddpjob_kernels::{self as kernels, dropout};

/// `x + (y as f32)`: a residual branch `y` added to the f32 stream `x`, one kernel each way on
/// a GPU (see `ddpjob_kernels::dropout`), bit for bit the cast and the addition.
pub(crate) fn add_residual(x: &Tensor, y: &Tensor) -> Result<Tensor> {
    dropout::add_dropped(x, y, None, 0)
}

/// LayerNorm (eps 1e-5) over the channels, in f32; without bias, a constant zero vector.
pub(crate) struct LayerNorm {
    pub(crate) weight: Var,
    pub(crate) bias: Option<Var>,
    pub(crate) zeros: Tensor,
    pub(crate) frozen: FrozenSet,
}

impl LayerNorm {
    pub(crate) fn bias_or_zeros(&self) -> &Tensor {
        self.bias.as_ref().map_or(&self.zeros, |b| b.as_tensor())
    }

    pub(crate) fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let bias = match &self.bias {
            Some(b) => self.frozen.as_input(b),
            None => self.zeros.clone(),
        };
        kernels::layer_norm(x, &self.frozen.as_input(&self.weight), &bias, 1e-5)
    }
}
