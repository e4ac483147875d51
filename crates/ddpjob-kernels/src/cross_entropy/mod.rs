//! Cross-entropy per row as one op with its own backward, for the GPU: candle's
//! `log_softmax` + `gather` (or the one-hot product of the ignoring path) read and write the
//! [rows, vocabulary] logits about ten times each way in f32, the head of a 49k-token
//! vocabulary's step its largest cost (ncu on an H200, 2026-11-26: ~40 ms of a SmolLM2-shaped
//! step's ~180 ms of kernels). Here a block per row finds the row's log-sum-exp in one pass
//! (an online maximum and sum), the loss is that minus the target's logit, and the backward
//! writes `(softmax − one-hot) · g` in the logits' dtype in one more pass, recomputing the
//! log-sum-exp rather than keeping it. The host version is the reference the kernels are held
//! to.

#[cfg(feature = "cuda")]
pub(crate) mod cuda;

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp2, CustomOp3, DType, Layout, Result, Shape, Tensor, bail};

/// A target that scores nothing: its position has no loss, no gradient, and is not counted in
/// a mean or an accuracy (a prompt's tokens in instruction data, padding). PyTorch's
/// `ignore_index = -100` as an unsigned id.
pub const IGNORE_TARGET: u32 = u32::MAX;
/// −log softmax(`logits` [rows, classes])`[target]` per row, f32 `[rows]`: 0 where the target is
/// [`IGNORE_TARGET`], NaN where it is out of range. `logits` f32 or bf16 (read in f32);
/// differentiable in `logits`.
pub fn row_cross_entropy(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    let targets = targets.flatten_all()?.to_dtype(DType::U32)?.contiguous()?;
    logits.contiguous()?.apply_op2(&targets, RowLosses)
}

/// Whether [`row_cross_entropy`] takes these logits (a GPU's, f32 or bf16, [rows, classes]).
pub fn applies(logits: &Tensor) -> bool {
    logits.device().is_cuda()
        && matches!(logits.dtype(), DType::F32 | DType::BF16)
        && logits.rank() == 2
}

struct RowLosses;

/// The backward: from the logits, the targets and the rows' gradients, the logits' gradient.
struct RowLossesGrad;

/// The rows' logits as f32, checked against the targets: (values, rows, classes).
fn rows_of(
    logits: &CpuStorage,
    l: &Layout,
    targets: &CpuStorage,
    lt: &Layout,
) -> Result<(Vec<f32>, Vec<u32>, usize)> {
    let Some((ts, te)) = lt.contiguous_offsets() else {
        bail!("cross_entropy: contiguous targets");
    };
    let &[rows, classes] = l.dims() else {
        bail!("cross_entropy: logits [rows, classes], not {:?}", l.dims());
    };
    let (x, _) = crate::host::widened(logits, l, "cross_entropy's logits")?;
    let targets = targets.as_slice::<u32>()?[ts..te].to_vec();
    if targets.len() != rows {
        bail!("cross_entropy: {} targets for {rows} rows", targets.len());
    }
    Ok((x, targets, classes))
}

/// log Σ exp over one row.
fn log_sum_exp(row: &[f32]) -> f32 {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    max + row.iter().map(|v| (v - max).exp()).sum::<f32>().ln()
}

/// The kernels' launch checks: [rows, classes] logits of a supported dtype, [rows] targets.
#[cfg(feature = "cuda")]
fn check(l: &Layout, lt: &Layout) -> Result<(usize, usize)> {
    match l.dims() {
        &[rows, classes] if lt.dims() == [rows] && l.is_contiguous() && lt.is_contiguous() => {
            Ok((rows, classes))
        }
        dims => bail!(
            "cross_entropy: logits [rows, classes] and [rows] targets, not {dims:?} and {:?}",
            lt.dims()
        ),
    }
}

impl CustomOp2 for RowLosses {
    fn name(&self) -> &'static str {
        "ddpjob-row-cross-entropy"
    }

    fn cpu_fwd(
        &self,
        logits: &CpuStorage,
        l: &Layout,
        targets: &CpuStorage,
        lt: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (x, targets, classes) = rows_of(logits, l, targets, lt)?;
        let losses = x
            .chunks_exact(classes)
            .zip(&targets)
            .map(|(row, &t)| match t {
                IGNORE_TARGET => 0.0,
                t if (t as usize) < classes => log_sum_exp(row) - row[t as usize],
                _ => f32::NAN,
            })
            .collect::<Vec<f32>>();
        let rows = losses.len();
        Ok((CpuStorage::F32(losses), Shape::from(rows)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        logits: &candle_core::CudaStorage,
        l: &Layout,
        targets: &candle_core::CudaStorage,
        lt: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (rows, classes) = check(l, lt)?;
        let out = cuda::run((logits, l), (targets, lt), None, rows, classes)?;
        Ok((out, Shape::from(rows)))
    }

    fn bwd(
        &self,
        logits: &Tensor,
        targets: &Tensor,
        _losses: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let grad = grad.to_dtype(DType::F32)?.contiguous()?;
        let dx = logits.apply_op3_no_bwd(targets, &grad, &RowLossesGrad)?;
        Ok((Some(dx), None))
    }
}

impl CustomOp3 for RowLossesGrad {
    fn name(&self) -> &'static str {
        "ddpjob-row-cross-entropy-grad"
    }

    /// (softmax(row) − one-hot(target)) · g, 0 for an ignored row.
    fn cpu_fwd(
        &self,
        logits: &CpuStorage,
        l: &Layout,
        targets: &CpuStorage,
        lt: &Layout,
        grad: &CpuStorage,
        lg: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (x, targets, classes) = rows_of(logits, l, targets, lt)?;
        let g = crate::host::values(grad, lg)?;
        let mut dx = vec![0f32; x.len()];
        for (((row, d), &t), &g) in x
            .chunks_exact(classes)
            .zip(dx.chunks_exact_mut(classes))
            .zip(&targets)
            .zip(g)
        {
            if t == IGNORE_TARGET {
                continue;
            }
            let lse = log_sum_exp(row);
            for (j, (d, v)) in d.iter_mut().zip(row).enumerate() {
                let hot = if j as u32 == t { 1.0 } else { 0.0 };
                *d = ((v - lse).exp() - hot) * g;
            }
        }
        let dx = crate::host::narrowed(dx, BackendStorage::dtype(logits));
        Ok((dx, l.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        logits: &candle_core::CudaStorage,
        l: &Layout,
        targets: &candle_core::CudaStorage,
        lt: &Layout,
        grad: &candle_core::CudaStorage,
        lg: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (rows, classes) = check(l, lt)?;
        if lg.dims() != [rows] || !lg.is_contiguous() {
            bail!("cross_entropy gradient: {:?} for {rows} rows", lg.dims());
        }
        let dx = cuda::run((logits, l), (targets, lt), Some((grad, lg)), rows, classes)?;
        Ok((dx, l.shape().clone()))
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device, Tensor, Var};

    use super::row_cross_entropy;
    use crate::loss::IGNORE_TARGET;

    /// The mean loss over the scored rows and the logits' gradient, for fixed [9, 1031] logits
    /// (one row ignored) on `device` in `dtype`, by the op or by candle's log-softmax.
    fn run(device: &Device, dtype: DType, fused: bool) -> (f32, Vec<f32>) {
        let (rows, classes) = (9, 1031);
        let v: Vec<f32> = (0..rows * classes)
            .map(|i| (i as f32 * 0.173).sin() * 6.0)
            .collect();
        let logits = Tensor::from_vec(v, (rows, classes), device).unwrap();
        let logits = Var::from_tensor(&logits.to_dtype(dtype).unwrap()).unwrap();
        let mut t: Vec<u32> = (0..rows as u32).map(|r| r * 113 % classes as u32).collect();
        t[4] = IGNORE_TARGET;
        let targets = Tensor::new(t.as_slice(), device).unwrap();
        let loss = if fused {
            (row_cross_entropy(&logits, &targets)
                .unwrap()
                .sum_all()
                .unwrap()
                / 8.0)
                .unwrap()
        } else {
            crate::loss::cross_entropy(&logits.to_dtype(DType::F32).unwrap(), &targets).unwrap()
        };
        let grads = loss.backward().unwrap();
        let host = |t: &Tensor| -> Vec<f32> {
            let t = t
                .to_dtype(DType::F32)
                .unwrap()
                .to_device(&Device::Cpu)
                .unwrap();
            t.flatten_all().unwrap().to_vec1().unwrap()
        };
        (
            loss.to_dtype(DType::F32).unwrap().to_scalar().unwrap(),
            host(grads.get(&logits).unwrap()),
        )
    }

    fn worst(a: &[f32], b: &[f32]) -> f32 {
        crate::worst_relative(a, b, 1e-3)
    }

    /// On the host the op gives the mean cross-entropy of candle's ops and its gradient.
    #[test]
    fn equals_candles_cross_entropy() {
        for (dtype, tolerance) in [(DType::F32, 1e-4), (DType::BF16, 1e-2)] {
            let (fused, ops) = (
                run(&Device::Cpu, dtype, true),
                run(&Device::Cpu, dtype, false),
            );
            assert!(
                (fused.0 - ops.0).abs() < 1e-5 * ops.0.abs(),
                "{dtype:?}: {fused:?} vs {ops:?}"
            );
            assert!(
                worst(&fused.1, &ops.1) <= tolerance,
                "{dtype:?}: {}",
                worst(&fused.1, &ops.1)
            );
        }
    }

    /// An out-of-range target gives NaN, not a read past the row.
    #[test]
    fn an_out_of_range_target_is_nan() {
        let logits = Tensor::zeros((2, 5), DType::F32, &Device::Cpu).unwrap();
        let targets = Tensor::new(&[1u32, 5], &Device::Cpu).unwrap();
        let losses: Vec<f32> = row_cross_entropy(&logits, &targets)
            .unwrap()
            .to_vec1()
            .unwrap();
        assert!(
            (losses[0] - 5f32.ln()).abs() < 1e-6 && losses[1].is_nan(),
            "{losses:?}"
        );
    }

    /// Runs where a GPU is: the kernels give the host's loss and gradient.
    #[test]
    fn the_gpu_kernels_give_the_host_values() {
        let Ok(gpu) = Device::new_cuda(0) else {
            eprintln!("skipping: no GPU");
            return;
        };
        for (dtype, tolerance) in [(DType::F32, 1e-4), (DType::BF16, 1e-2)] {
            let (device, host) = (run(&gpu, dtype, true), run(&Device::Cpu, dtype, true));
            assert!(
                (device.0 - host.0).abs() < 1e-5 * host.0.abs(),
                "{dtype:?}: {device:?} vs {host:?}"
            );
            assert!(
                worst(&device.1, &host.1) <= tolerance,
                "{dtype:?}: {}",
                worst(&device.1, &host.1)
            );
        }
    }
}
