//! `y = x·Wᵀ + b`, optionally followed by ReLU, as one op: one GEMM forward, two (or one, when
//! `x` needs no gradient) backward, the bias and ReLU folded into them.

use candle_core::{CpuStorage, CustomOp3, Layout, Result, Shape, Tensor};

use crate::host::{Mat, gemm, product, threads, values, with_values};

/// `relu(x·Wᵀ + b)` (or without the ReLU) for `x` [n, in], `weight` [out, in], `bias` `[out]`.
pub fn linear(x: &Tensor, weight: &Tensor, bias: &Tensor, relu: bool) -> Result<Tensor> {
    x.contiguous()?.apply_op3(
        &weight.contiguous()?,
        &bias.contiguous()?,
        LinearOp { relu },
    )
}

struct LinearOp {
    relu: bool,
}

impl CustomOp3 for LinearOp {
    fn name(&self) -> &'static str {
        "ddpjob-linear"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        x_layout: &Layout,
        w: &CpuStorage,
        w_layout: &Layout,
        b: &CpuStorage,
        b_layout: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (n, inputs) = x_layout.shape().dims2()?;
        let (outputs, w_inputs) = w_layout.shape().dims2()?;
        if w_inputs != inputs || b_layout.shape().dims1()? != outputs {
            candle_core::bail!(
                "linear: input [{n}, {inputs}] does not fit weight [{outputs}, {w_inputs}]"
            );
        }
        let (x, w, b) = (
            values(x, x_layout)?,
            values(w, w_layout)?,
            values(b, b_layout)?,
        );
        let mut y = forward(x, w, b, n);
        if self.relu {
            relu_in_place(&mut y);
        }
        Ok((CpuStorage::F32(y), Shape::from((n, outputs))))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        b: &Tensor,
        out: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (n, inputs) = x.dims2()?;
        let outputs = w.dim(0)?;
        let device = x.device();
        // Without a ReLU the output gradient is used as it is, not copied.
        let masked = match self.relu {
            true => Some(with_values(grad, |g| {
                with_values(out, |y| Ok(relu_grad(g, y)))
            })?),
            false => None,
        };
        // A frozen weight or bias comes detached (see `ddpjob_seam::freeze`): no gradient for it.
        let wanted = Wanted {
            input: x.track_op(),
            weight: w.track_op(),
            bias: b.track_op(),
        };
        let (gx, gw, gb) = with_gz(grad, masked.as_deref(), |gz| {
            with_values(x, |x| {
                with_values(w, |w| Ok(backward(x, w, gz, outputs, wanted)))
            })
        })?;
        // The first layer's input is data: nothing needs its gradient.
        let gx = match gx {
            Some(gx) => Some(Tensor::from_vec(gx, (n, inputs), device)?),
            None => None,
        };
        let gw = match wanted.weight {
            true => Some(Tensor::from_vec(gw, (outputs, inputs), device)?),
            false => None,
        };
        let gb = match wanted.bias {
            true => Some(Tensor::from_vec(gb, outputs, device)?),
            false => None,
        };
        Ok((gx, gw, gb))
    }
}

/// `x·Wᵀ + b` for the rows `x` (`n` of them), `w` [out, in], `b` `[out]`: [n, out].
pub fn forward(x: &[f32], w: &[f32], b: &[f32], n: usize) -> Vec<f32> {
    let outputs = b.len();
    let inputs = w.len() / outputs.max(1);
    // gemm copies (packs) the weight before multiplying it into a row-major y. For a few
    // rows against a large weight (the cnn's fc1: 32 rows, 9216 × 128 weights) it is
    // cheaper to form yᵀ = W·xᵀ, where it copies x instead, and transpose the small yᵀ.
    if n * (inputs + outputs) < outputs * inputs {
        let yt = product(
            Mat::new(w, outputs, inputs),
            Mat::new(x, n, inputs).t(),
            threads(),
        );
        let mut y = super::scratch::take(n * outputs);
        // SAFETY: yt is outputs × n, read as its transpose (n × outputs, by columns); y holds
        // n rows of `outputs` values.
        unsafe {
            crate::host::gather_rows((yt.as_ptr(), 1, n), (n, outputs), (y.as_mut_ptr(), outputs))
        };
        if b.iter().any(|&v| v != 0.0) {
            for row in y.chunks_exact_mut(outputs.max(1)) {
                row.iter_mut().zip(b).for_each(|(y, b)| *y += b);
            }
        }
        y
    } else {
        // A layer without a bias (the GPT's with `bias = false`) is given zeros: its product
        // is written as it is, not added to a copy of them.
        let has_bias = b.iter().any(|&v| v != 0.0);
        let mut y = super::scratch::take(n * outputs);
        if has_bias {
            for row in y.chunks_exact_mut(outputs.max(1)) {
                row.copy_from_slice(b);
            }
        }
        gemm(
            &mut y,
            Mat::new(x, n, inputs),
            Mat::new(w, outputs, inputs).t(),
            has_bias,
            threads(),
        );
        y
    }
}

/// Which gradients of a layer [`backward`] computes.
#[derive(Clone, Copy)]
pub struct Wanted {
    /// The input's: not for a layer whose input is data.
    pub input: bool,
    /// The weight's: not for a frozen weight (`model.freeze`).
    pub weight: bool,
    /// The bias's: not for a layer without one, or a frozen one.
    pub bias: bool,
}

/// The gradients of [`forward`] given `gz`, the output's gradient [n, out] (`outputs` =
/// out): the input's (gz·W, when wanted), the weight's (gzᵀ·x) and the bias's (Σ gz over the
/// rows, when wanted; else empty).
pub fn backward(
    x: &[f32],
    w: &[f32],
    gz: &[f32],
    outputs: usize,
    wanted: Wanted,
) -> super::LayerGrads {
    let n = gz.len() / outputs.max(1);
    let inputs = w.len() / outputs.max(1);
    // A frozen weight's gradient is never formed: the input's gradient alone flows on.
    let gw = match wanted.weight {
        true => product(
            Mat::new(gz, n, outputs).t(),
            Mat::new(x, n, inputs),
            threads(),
        ),
        false => Vec::new(),
    };
    let mut gb = vec![0f32; if wanted.bias { outputs } else { 0 }];
    if wanted.bias {
        for row in gz.chunks_exact(outputs) {
            for (acc, g) in gb.iter_mut().zip(row) {
                *acc += g;
            }
        }
    }
    let gx = wanted.input.then(|| {
        let mut gx = super::scratch::take(n * inputs);
        gemm(
            &mut gx,
            Mat::new(gz, n, outputs),
            Mat::new(w, outputs, inputs),
            false,
            threads(),
        );
        gx
    });
    (gx, gw, gb)
}

/// Runs `f` on the gradient of the pre-activation: `masked` when the ReLU masked it, else the
/// output gradient `grad` itself.
fn with_gz<R>(
    grad: &Tensor,
    masked: Option<&[f32]>,
    f: impl FnOnce(&[f32]) -> Result<R>,
) -> Result<R> {
    match masked {
        Some(gz) => f(gz),
        None => with_values(grad, f),
    }
}

/// max(0, v), keeping NaN (so a diverging loss is still seen as one).
pub fn relu_in_place(values: &mut [f32]) {
    for v in values {
        *v = if *v < 0.0 { 0.0 } else { *v };
    }
}

/// The gradient through a ReLU whose output was `y`: `g` where `y > 0`, else 0 (as torch).
pub fn relu_grad(g: &[f32], y: &[f32]) -> Vec<f32> {
    g.iter()
        .zip(y)
        .map(|(&g, &y)| if y > 0.0 { g } else { 0.0 })
        .collect()
}
