//! The rotary position embedding's rotation, `x · cos + rotate_half(x) · sin`, given the
//! tables (the model kit's `RopeTables` owns them and the composed form): one op on the CPU
//! in f32 (`RopeOp`, also with a table row per token for packed rows), one op with its own
//! kernel on a GPU (`device`, `cuda`).

#[cfg(feature = "cuda")]
pub(crate) mod cuda;
mod device;
mod tables;

pub use tables::{Llama3Scaling, RopeTables, inverse_frequencies};

use candle_core::{CpuStorage, CustomOp1, Layout, Result, Shape, Tensor, bail};
use rayon::prelude::*;

use crate::host::{self as kernels, values, with_values};

/// `x · cos + rotate_half(x) · sin` for `x` [n, t, heads, head_dim] with the tables' rows
/// `offset..offset + t`: one op for f32 on the CPU and on a GPU; `None` elsewhere, for the
/// composed form.
pub fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor, offset: usize) -> Option<Result<Tensor>> {
    if device::applies(x) {
        return Some(device::rope(x, cos, sin, offset));
    }
    kernels::applies(x).then(|| {
        let (_, t, _, hd) = x.dims4()?;
        let table =
            |m: &Tensor| -> Result<Vec<f32>> { m.narrow(0, offset, t)?.flatten_all()?.to_vec1() };
        let op = RopeOp {
            cos: table(cos)?,
            sin: table(sin)?,
            t,
            hd,
        };
        x.contiguous()?.apply_op1(op)
    })
}

struct RopeOp {
    /// [t, head_dim] each: the positions' cos and sin (or one row per token of the input,
    /// `t` = n·t, for packed rows whose positions restart).
    cos: Vec<f32>,
    sin: Vec<f32>,
    t: usize,
    hd: usize,
}

/// [`rope`] of `x` [n, t, heads, head_dim] with a table row per token (`cos`, `sin`:
/// [n·t, head_dim], the rows of each token's own position): packed rows (see
/// `models::packed`). f32 on the CPU; `None` elsewhere.
pub fn rope_per_token(x: &Tensor, cos: Vec<f32>, sin: Vec<f32>) -> Option<Result<Tensor>> {
    kernels::applies(x).then(|| {
        let (n, t, _, hd) = x.dims4()?;
        let op = RopeOp {
            cos,
            sin,
            t: n * t,
            hd,
        };
        x.contiguous()?.apply_op1(op)
    })
}

impl RopeOp {
    /// Rotates (`sign` 1) or rotates back (`sign` −1, the backward: the transpose of the
    /// rotation) every head of `x` [n, t, heads, hd] into `y`.
    fn rotate(&self, x: &[f32], y: &mut [f32], heads: usize, sign: f32) {
        let (hd, half) = (self.hd, self.hd / 2);
        y.par_chunks_mut(heads * hd)
            .zip(x.par_chunks(heads * hd))
            .enumerate()
            .for_each(|(row, (y, x))| {
                let p = row % self.t;
                let (cos, sin) = (&self.cos[p * hd..][..hd], &self.sin[p * hd..][..hd]);
                for (y, x) in y.chunks_exact_mut(hd).zip(x.chunks_exact(hd)) {
                    for i in 0..half {
                        let (a, b) = (x[i], x[i + half]);
                        // Forward: y1 = a·c1 − b·s1, y2 = b·c2 + a·s2. Backward (transpose):
                        // dx1 = g1·c1 + g2·s2, dx2 = g2·c2 − g1·s1.
                        if sign > 0.0 {
                            y[i] = a * cos[i] - b * sin[i];
                            y[i + half] = b * cos[i + half] + a * sin[i + half];
                        } else {
                            y[i] = a * cos[i] + b * sin[i + half];
                            y[i + half] = b * cos[i + half] - a * sin[i];
                        }
                    }
                }
            });
    }
}

impl CustomOp1 for RopeOp {
    fn name(&self) -> &'static str {
        "ddpjob-llama-rope"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        let dims = layout.shape().dims();
        let fits = dims.len() == 4 && (dims[1] == self.t || dims[0] * dims[1] == self.t);
        if !fits
            || dims[3] != self.hd
            || !self.hd.is_multiple_of(2)
            || self.cos.len() != self.t * self.hd
        {
            bail!(
                "rope: input {:?}, tables of {} positions x {}",
                layout.shape(),
                self.t,
                self.hd
            );
        }
        let x = values(storage, layout)?;
        let mut y = vec![0f32; x.len()];
        self.rotate(x, &mut y, dims[2], 1.0);
        Ok((CpuStorage::F32(y), layout.shape().clone()))
    }

    fn bwd(&self, x: &Tensor, _y: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let mut dx = vec![0f32; x.elem_count()];
        let heads = x.dims4()?.2;
        with_values(grad, |g| {
            self.rotate(g, &mut dx, heads, -1.0);
            Ok(())
        })?;
        Ok(Some(Tensor::from_vec(dx, x.shape(), x.device())?))
    }
}
