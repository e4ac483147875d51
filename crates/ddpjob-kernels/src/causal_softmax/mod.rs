//! Attention's causal softmax as one op with its own backward, for the GPU. From candle's ops
//! it is nine passes over the [b, tq, tk] scores forward (casts, scale, mask, max, subtract,
//! exp, sum, divide) and about twenty in backward, most of them slow strided broadcasts (ncu
//! on an H200, 2026-11-26: 100 to 420 µs each for the shakespeare-char recipe's scores); here
//! one pass each way reads and writes what it must (`cuda`). With the GPU
//! LayerNorm and GELU it took that recipe's step from 112 to 38 ms. The host version here
//! is the reference the GPU's is held to; on the CPU the model keeps its fused attention (f32)
//! and candle's ops (bf16, cached decoding).

#[cfg(feature = "cuda")]
pub(crate) mod cuda;

use candle_core::{
    CpuStorage, CustomOp1, CustomOp2, D, DType, Layout, Result, Shape, Tensor, bail,
};
use half::bf16;

/// `softmax(scale · scores)` over the last dimension of contiguous `scores` [b, tq, tk], where
/// query row i sits at position `offset + i` and sees keys 0..=offset + i (the rest get 0),
/// computed in f32 and returned in the dtype of `scores` (f32 or bf16); differentiable.
pub fn causal_softmax(scores: &Tensor, scale: f64, offset: usize) -> Result<Tensor> {
    scores.contiguous()?.apply_op1(CausalSoftmax {
        scale: scale as f32,
        offset,
    })
}

/// `softmax(scale · att + causal mask)` over the last dimension of `att` [b, tq, tk], where
/// query row i sits at position `offset + i` and sees keys 0..=offset + i, from candle's ops
/// (the fused CPU attention has its own; on a GPU one op, `causal_softmax`). Computed in f32,
/// returned in the dtype of `att`.
/// `mask` is the [block, block] additive mask: 0 on and below the diagonal, -inf above.
pub fn causal_softmax_with_ops(
    att: &Tensor,
    scale: f64,
    offset: usize,
    mask: &Tensor,
) -> Result<Tensor> {
    if att.device().is_cuda() {
        return causal_softmax(att, scale, offset);
    }
    let (_, tq, tk) = att.dims3()?;
    let mask = mask.narrow(0, offset, tq)?.narrow(1, 0, tk)?;
    let scores = (att.to_dtype(DType::F32)? * scale)?.broadcast_add(&mask)?;
    candle_nn::ops::softmax(&scores, D::Minus1)?.to_dtype(att.dtype())
}

/// The softmax (forward); its backward is [`CausalSoftmaxGrad`].
#[derive(Debug, Clone, Copy)]
pub(super) struct CausalSoftmax {
    pub(super) scale: f32,
    pub(super) offset: usize,
}

/// The gradient of the scores from the probabilities `p` and their gradient `g`:
/// `scale · p · (g − Σ p·g)` per row.
#[derive(Debug, Clone, Copy)]
pub(super) struct CausalSoftmaxGrad {
    pub(super) scale: f32,
    pub(super) offset: usize,
}

/// The rows of a contiguous [b, tq, tk] tensor: (rows, tq, tk).
#[derive(Debug, Clone, Copy)]
pub(super) struct Rows {
    pub(super) rows: usize,
    pub(super) tq: usize,
    pub(super) tk: usize,
}

impl Rows {
    pub(super) fn of(layout: &Layout) -> Result<Self> {
        let (b, tq, tk) = layout.shape().dims3()?;
        if !layout.is_contiguous() {
            bail!("causal softmax: the scores must be contiguous")
        }
        Ok(Rows {
            rows: b * tq,
            tk,
            tq,
        })
    }

    /// The keys query row `row` sees.
    fn visible(&self, row: usize, offset: usize) -> usize {
        (offset + row % self.tq + 1).min(self.tk)
    }
}

/// A contiguous tensor's values, from its first element.
fn values<'a, T>(v: &'a [T], layout: &Layout) -> &'a [T] {
    &v[layout.start_offset()..]
}

/// f32 or bf16 values read as f32, and f32 written back as the same dtype (round to nearest).
trait Element: Copy + Send + Sync {
    fn get(self) -> f32;
    fn put(v: f32) -> Self;
}

impl Element for f32 {
    fn get(self) -> f32 {
        self
    }
    fn put(v: f32) -> Self {
        v
    }
}

impl Element for bf16 {
    fn get(self) -> f32 {
        self.to_f32()
    }
    fn put(v: f32) -> Self {
        bf16::from_f32(v)
    }
}

/// The host softmax: the order of operations the GPU kernel follows per row.
fn forward_rows<T: Element>(x: &[T], rows: Rows, offset: usize, scale: f32) -> Vec<T> {
    let mut out = vec![T::put(0.0); rows.rows * rows.tk];
    for (row, (x, y)) in x
        .chunks_exact(rows.tk)
        .zip(out.chunks_exact_mut(rows.tk))
        .enumerate()
    {
        let visible = &x[..rows.visible(row, offset)];
        let max = visible
            .iter()
            .fold(f32::NEG_INFINITY, |m, v| m.max(v.get() * scale));
        let sum: f32 = visible.iter().map(|v| (v.get() * scale - max).exp()).sum();
        for (y, v) in y.iter_mut().zip(visible) {
            *y = T::put((v.get() * scale - max).exp() / sum);
        }
    }
    out
}

/// The host backward of [`forward_rows`].
fn backward_rows<T: Element>(p: &[T], g: &[T], rows: Rows, offset: usize, scale: f32) -> Vec<T> {
    let mut out = vec![T::put(0.0); rows.rows * rows.tk];
    for (row, ((p, g), dx)) in p
        .chunks_exact(rows.tk)
        .zip(g.chunks_exact(rows.tk))
        .zip(out.chunks_exact_mut(rows.tk))
        .enumerate()
    {
        let n = rows.visible(row, offset);
        let dot: f32 = p[..n]
            .iter()
            .zip(&g[..n])
            .map(|(p, g)| p.get() * g.get())
            .sum();
        for ((dx, p), g) in dx.iter_mut().zip(&p[..n]).zip(&g[..n]) {
            *dx = T::put(scale * p.get() * (g.get() - dot));
        }
    }
    out
}

impl CustomOp1 for CausalSoftmax {
    fn name(&self) -> &'static str {
        "causal-softmax"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        let rows = Rows::of(layout)?;
        let (offset, scale) = (self.offset, self.scale);
        let out = match storage {
            CpuStorage::F32(v) => {
                CpuStorage::F32(forward_rows(values(v, layout), rows, offset, scale))
            }
            CpuStorage::BF16(v) => {
                CpuStorage::BF16(forward_rows(values(v, layout), rows, offset, scale))
            }
            other => bail!("causal softmax: f32 or bf16 scores, not {:?}", {
                use candle_core::backend::BackendStorage;
                other.dtype()
            }),
        };
        Ok((out, layout.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        storage: &candle_core::CudaStorage,
        layout: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let rows = Rows::of(layout)?;
        let out = cuda::forward(storage, layout, rows, *self)?;
        Ok((out, layout.shape().clone()))
    }

    fn bwd(&self, _scores: &Tensor, probs: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let grad = grad.to_dtype(probs.dtype())?.contiguous()?;
        let op = CausalSoftmaxGrad {
            scale: self.scale,
            offset: self.offset,
        };
        Ok(Some(probs.apply_op2_no_bwd(&grad, &op)?))
    }
}

impl CustomOp2 for CausalSoftmaxGrad {
    fn name(&self) -> &'static str {
        "causal-softmax-grad"
    }

    fn cpu_fwd(
        &self,
        p: &CpuStorage,
        lp: &Layout,
        g: &CpuStorage,
        lg: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let rows = Rows::of(lp)?;
        if lg.shape() != lp.shape() {
            bail!(
                "causal softmax gradient: {:?} for {:?}",
                lg.shape(),
                lp.shape()
            )
        }
        let (offset, scale) = (self.offset, self.scale);
        let out = match (p, g) {
            (CpuStorage::F32(p), CpuStorage::F32(g)) => CpuStorage::F32(backward_rows(
                values(p, lp),
                values(g, lg),
                rows,
                offset,
                scale,
            )),
            (CpuStorage::BF16(p), CpuStorage::BF16(g)) => CpuStorage::BF16(backward_rows(
                values(p, lp),
                values(g, lg),
                rows,
                offset,
                scale,
            )),
            _ => bail!("causal softmax gradient: f32 or bf16, the probabilities' dtype"),
        };
        Ok((out, lp.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        p: &candle_core::CudaStorage,
        lp: &Layout,
        g: &candle_core::CudaStorage,
        lg: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let rows = Rows::of(lp)?;
        if lg.shape() != lp.shape() || !lg.is_contiguous() {
            bail!(
                "causal softmax gradient: {:?} for {:?}",
                lg.shape(),
                lp.shape()
            )
        }
        let out = cuda::backward(p, lp, g, lg, rows, *self)?;
        Ok((out, lp.shape().clone()))
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device, Tensor, Var};

    use crate::testing::max_difference;

    use super::causal_softmax;
    use super::causal_softmax_with_ops;

    fn mask(t: usize) -> Tensor {
        let values: Vec<f32> = (0..t * t)
            .map(|k| {
                if k % t > k / t {
                    f32::NEG_INFINITY
                } else {
                    0.0
                }
            })
            .collect();
        Tensor::from_vec(values, (t, t), &Device::Cpu).unwrap()
    }

    /// Forward and backward equal those of candle's ops (the model's CPU path), with and
    /// without an offset (cached decoding), in f32 and bf16.
    #[test]
    fn matches_candles_ops_forward_and_backward() {
        let (b, t, block) = (3, 7, 9);
        for (dtype, tolerance) in [(DType::F32, 1e-6), (DType::BF16, 1e-2)] {
            for offset in [0, 2] {
                let tk = offset + t;
                let x = Tensor::randn(0f32, 2.0, (b, t, tk), &Device::Cpu).unwrap();
                let g = Tensor::randn(0f32, 1.0, (b, t, tk), &Device::Cpu).unwrap();
                let x = Var::from_tensor(&x.to_dtype(dtype).unwrap()).unwrap();
                let g = g.to_dtype(dtype).unwrap();
                let fused = causal_softmax(&x, 0.3, offset).unwrap();
                let composed = causal_softmax_with_ops(&x, 0.3, offset, &mask(block)).unwrap();
                assert_eq!(fused.dtype(), dtype);
                assert!(
                    max_difference(&fused, &composed) <= tolerance,
                    "{dtype:?} {offset}"
                );
                let grad = |y: &Tensor| {
                    let loss = (y.to_dtype(DType::F32).unwrap() * g.to_dtype(DType::F32))
                        .unwrap()
                        .sum_all()
                        .unwrap();
                    loss.backward().unwrap().get(&x).unwrap().clone()
                };
                let (gf, gc) = (grad(&fused), grad(&composed));
                assert!(
                    max_difference(&gf, &gc) <= tolerance,
                    "{dtype:?} {offset} grad"
                );
                // The keys row 0 cannot see: probability and gradient exactly 0.
                for t in [&fused, &gf] {
                    let row0: Vec<f32> = t
                        .to_dtype(DType::F32)
                        .unwrap()
                        .get(0)
                        .unwrap()
                        .get(0)
                        .unwrap()
                        .to_vec1()
                        .unwrap();
                    assert!(
                        row0[offset + 1..].iter().all(|&v| v == 0.0),
                        "{dtype:?} {offset}"
                    );
                }
            }
        }
    }

    /// Runs where a GPU is: the kernels give the host's values, to f32 rounding (the GPU's
    /// `expf` and its sums in another order).
    #[test]
    fn the_gpu_kernels_give_the_host_values() {
        let Ok(gpu) = Device::new_cuda(0) else {
            eprintln!("skipping: no GPU");
            return;
        };
        let (b, t) = (5, 300);
        for (dtype, tolerance) in [(DType::F32, 1e-6), (DType::BF16, 8e-3)] {
            let x = Tensor::randn(0f32, 3.0, (b, t, t), &Device::Cpu).unwrap();
            let g = Tensor::randn(0f32, 1.0, (b, t, t), &Device::Cpu).unwrap();
            let (x, g) = (x.to_dtype(dtype).unwrap(), g.to_dtype(dtype).unwrap());
            let on_host = causal_softmax(&x, 0.125, 0).unwrap();
            let on_gpu = causal_softmax(&x.to_device(&gpu).unwrap(), 0.125, 0).unwrap();
            let on_gpu = on_gpu.to_device(&Device::Cpu).unwrap();
            assert!(max_difference(&on_host, &on_gpu) <= tolerance, "{dtype:?}");
            let op = super::CausalSoftmaxGrad {
                scale: 0.125,
                offset: 0,
            };
            let host_grad = on_host.apply_op2_no_bwd(&g, &op).unwrap();
            let gpu_grad = on_host
                .to_device(&gpu)
                .unwrap()
                .apply_op2_no_bwd(&g.to_device(&gpu).unwrap(), &op)
                .unwrap()
                .to_device(&Device::Cpu)
                .unwrap();
            assert!(
                max_difference(&host_grad, &gpu_grad) <= tolerance,
                "{dtype:?} grad"
            );
        }
    }
}
