//! The mean of the rows' losses over the rows whose target scores, as one op each way for the
//! GPU. Candle's ops took eight kernels forward (a fill, a comparison, a cast, two sums, a
//! maximum, a division and its broadcast) and about as many back (the division's backward forms
//! the count's gradient too) for a scalar every step; in a small model's step, such as the cnn's,
//! each launch costs about what the layers' own kernels do. Here one block sums the losses and
//! counts the scored targets, and the backward gives every row `g / count` in one more launch.
//! The host version, which sums in the kernel's order, is the reference it is held to bit for
//! bit.

#[cfg(feature = "cuda")]
pub(crate) mod cuda;

use candle_core::{CpuStorage, CustomOp2, DType, Layout, Result, Shape, Tensor, bail};

use crate::cross_entropy::IGNORE_TARGET;

/// Threads of the one block each kernel runs; the host sums in their order.
pub(super) const THREADS: usize = 256;

/// The kernels: one block of [`THREADS`] threads, each summing its strided share of the losses
/// and counting its scored targets, then the halves of the block's shares added in shared
/// memory, the order [`block_sum`] adds in.
#[cfg(any(feature = "cuda", test))]
pub(super) const SOURCE: &str = r#"
#define IGNORED 0xffffffffu
#define THREADS 256
// Σ of every thread's `v` and of its `n`, in every thread: halves added onto halves.
__device__ void block_sums(float& v, unsigned int& n) {
    __shared__ float sums[THREADS];
    __shared__ unsigned int counts[THREADS];
    sums[threadIdx.x] = v;
    counts[threadIdx.x] = n;
    __syncthreads();
    for (unsigned int half = THREADS / 2; half > 0; half /= 2) {
        if (threadIdx.x < half) {
            sums[threadIdx.x] += sums[threadIdx.x + half];
            counts[threadIdx.x] += counts[threadIdx.x + half];
        }
        __syncthreads();
    }
    v = sums[0];
    n = counts[0];
}
// mean[0] = Σ losses / max(scored targets, 1).
extern "C" __global__ void ddpjob_scored_mean(const float* losses, const unsigned int* targets,
        float* mean, unsigned int rows) {
    float s = 0.0f;
    unsigned int n = 0;
    for (unsigned int j = threadIdx.x; j < rows; j += THREADS) {
        s += losses[j];
        n += targets[j] != IGNORED;
    }
    block_sums(s, n);
    if (threadIdx.x == 0) mean[0] = s / fmaxf((float)n, 1.0f);
}
// Every row's gradient: g[0] / max(scored targets, 1).
extern "C" __global__ void ddpjob_scored_mean_grad(const float* g, const unsigned int* targets,
        float* rows_grad, unsigned int rows) {
    float unused = 0.0f;
    unsigned int n = 0;
    for (unsigned int j = threadIdx.x; j < rows; j += THREADS) n += targets[j] != IGNORED;
    block_sums(unused, n);
    float each = g[0] / fmaxf((float)n, 1.0f);
    for (unsigned int j = threadIdx.x; j < rows; j += THREADS) rows_grad[j] = each;
}
"#;

/// Σ `losses` `[rows]` (f32) / max(scored targets, 1), an f32 scalar: the mean cross-entropy of
/// the rows whose target is not [`IGNORE_TARGET`] (an ignored row's loss is 0). Differentiable
/// in `losses`.
pub fn scored_mean(losses: &Tensor, targets: &Tensor) -> Result<Tensor> {
    let targets = targets.flatten_all()?.to_dtype(DType::U32)?.contiguous()?;
    losses.contiguous()?.apply_op2(&targets, ScoredMean)
}

struct ScoredMean;

/// The backward: from the targets and the mean's gradient, every row's `g / count`.
struct ScoredMeanGrad;

/// Σ `values` in the kernels' order: thread t of [`THREADS`] adds values t, t + THREADS, …
/// one after another, then the upper half of the threads' sums is added onto the lower half
/// until one is left.
fn block_sum(values: &[f32]) -> f32 {
    let mut partial = [0f32; THREADS];
    for (i, v) in values.iter().enumerate() {
        partial[i % THREADS] += v;
    }
    let mut half = THREADS / 2;
    while half > 0 {
        for t in 0..half {
            partial[t] += partial[t + half];
        }
        half /= 2;
    }
    partial[0]
}

/// The scored targets, at least 1 (the divisor of the mean), as f32.
fn divisor(targets: &[u32]) -> f32 {
    let scored = targets.iter().filter(|&&t| t != IGNORE_TARGET).count();
    (scored as f32).max(1.0)
}

/// The contiguous u32 targets of a storage, `rows` of them.
fn targets_of<'a>(s: &'a CpuStorage, l: &Layout, rows: usize) -> Result<&'a [u32]> {
    let Some((start, end)) = l.contiguous_offsets() else {
        bail!("scored mean: contiguous targets expected");
    };
    if end - start != rows {
        bail!("scored mean: {} targets for {rows} rows", end - start);
    }
    Ok(&s.as_slice::<u32>()?[start..end])
}

/// The launch checks of both kernels: [rows] contiguous values and as many targets.
#[cfg(feature = "cuda")]
fn rows_of(l: &Layout, lt: &Layout) -> Result<usize> {
    match l.dims() {
        &[rows] if lt.dims() == [rows] && l.is_contiguous() && lt.is_contiguous() => Ok(rows),
        dims => bail!(
            "scored mean: [rows] losses and [rows] targets, not {dims:?} and {:?}",
            lt.dims()
        ),
    }
}

impl CustomOp2 for ScoredMean {
    fn name(&self) -> &'static str {
        "ddpjob-scored-mean"
    }

    fn cpu_fwd(
        &self,
        losses: &CpuStorage,
        l: &Layout,
        targets: &CpuStorage,
        lt: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let losses = crate::host::values(losses, l)?;
        let targets = targets_of(targets, lt, losses.len())?;
        let mean = block_sum(losses) / divisor(targets);
        Ok((CpuStorage::F32(vec![mean]), Shape::from(())))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        losses: &candle_core::CudaStorage,
        l: &Layout,
        targets: &candle_core::CudaStorage,
        lt: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let rows = rows_of(l, lt)?;
        let out = cuda::run((losses, l), (targets, lt), rows, false)?;
        Ok((out, Shape::from(())))
    }

    fn bwd(
        &self,
        _losses: &Tensor,
        targets: &Tensor,
        _mean: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let grad = grad.to_dtype(DType::F32)?.contiguous()?;
        let rows = targets.apply_op2_no_bwd(&grad, &ScoredMeanGrad)?;
        Ok((Some(rows), None))
    }
}

impl CustomOp2 for ScoredMeanGrad {
    fn name(&self) -> &'static str {
        "ddpjob-scored-mean-grad"
    }

    fn cpu_fwd(
        &self,
        targets: &CpuStorage,
        lt: &Layout,
        grad: &CpuStorage,
        lg: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let rows = lt.shape().elem_count();
        let targets = targets_of(targets, lt, rows)?;
        let &[g] = crate::host::values(grad, lg)? else {
            bail!(
                "scored mean gradient: one value expected, not {:?}",
                lg.dims()
            );
        };
        let each = g / divisor(targets);
        Ok((CpuStorage::F32(vec![each; rows]), Shape::from(rows)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        targets: &candle_core::CudaStorage,
        lt: &Layout,
        grad: &candle_core::CudaStorage,
        lg: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let rows = rows_of(lt, lt)?;
        if lg.shape().elem_count() != 1 || !lg.is_contiguous() {
            bail!(
                "scored mean gradient: one value expected, not {:?}",
                lg.dims()
            );
        }
        let out = cuda::run((grad, lg), (targets, lt), rows, true)?;
        Ok((out, Shape::from(rows)))
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Tensor, Var};

    use super::*;

    /// Losses of `rows` rows (every seventh ignored, its loss 0) and their targets.
    fn rows(rows: usize, device: &Device) -> (Var, Tensor) {
        let targets: Vec<u32> = (0..rows as u32)
            .map(|r| if r % 7 == 3 { IGNORE_TARGET } else { r % 10 })
            .collect();
        let losses: Vec<f32> = (0..rows)
            .map(|r| match targets[r] {
                IGNORE_TARGET => 0.0,
                _ => 2.3 + (r as f32 * 0.61).sin(),
            })
            .collect();
        let losses = Var::from_tensor(&Tensor::from_vec(losses, rows, device).unwrap()).unwrap();
        (losses, Tensor::from_vec(targets, rows, device).unwrap())
    }

    /// The mean and the losses' gradient of `scale` · mean.
    fn mean_and_grad(losses: &Var, targets: &Tensor, scale: f64) -> (f32, Vec<f32>) {
        let mean = scored_mean(losses, targets).unwrap();
        let grads = (&mean * scale).unwrap().backward().unwrap();
        let grad = grads.get(losses).unwrap().to_device(&Device::Cpu).unwrap();
        (mean.to_scalar().unwrap(), grad.to_vec1().unwrap())
    }

    /// The op gives what candle's ops gave in its place (sum, count, division) and their
    /// gradient, for fewer rows than the block has threads, more, and none.
    #[test]
    fn equals_the_sum_over_the_count_of_scored_targets() {
        for n in [0, 5, 256, 1000, 16_389] {
            let (losses, targets) = rows(n, &Device::Cpu);
            let (mean, grad) = mean_and_grad(&losses, &targets, 3.0);
            let scored = (0..n).filter(|r| r % 7 != 3).count();
            let sum: f64 = losses
                .to_vec1::<f32>()
                .unwrap()
                .iter()
                .map(|&v| v as f64)
                .sum();
            let expected = sum / scored.max(1) as f64;
            assert!(
                (mean as f64 - expected).abs() <= 1e-6 * expected.abs(),
                "{n} rows: {mean} vs {expected}"
            );
            let each = 3.0 / scored.max(1) as f32;
            assert_eq!(grad, vec![each; n], "{n} rows");
        }
    }

    /// The host sums in the kernel's order: thread shares first, then halves, which is not
    /// the order of a running sum (the GPU test holds the kernel to this bit for bit).
    #[test]
    fn the_host_sums_in_the_kernels_order() {
        let mut values = vec![1.0f32; 2 * THREADS];
        values[0] = 16_777_216.0;
        // Past 2^24 an f32 holds even integers only: a running sum drops every 1 added to it.
        let running = values.iter().fold(0f32, |s, v| s + v);
        assert_eq!(running, 16_777_216.0);
        // The block loses only the 1 that thread 0 adds to 2^24; its other threads' 2s are
        // added onto that exactly.
        assert_eq!(block_sum(&values), 16_777_216.0 + 510.0);
        assert_eq!(block_sum(&[]), 0.0);
    }

    #[test]
    fn mismatched_targets_are_named() {
        let losses = Tensor::zeros(4, DType::F32, &Device::Cpu).unwrap();
        let targets = Tensor::zeros(3, DType::U32, &Device::Cpu).unwrap();
        let err = scored_mean(&losses, &targets).unwrap_err().to_string();
        assert!(err.contains("3 targets for 4 rows"), "{err}");
    }

    /// The kernels' CUDA source, run on the host (the block's threads side by side, as on a
    /// GPU), gives the op's host values bit for bit: the mean and the rows' gradient.
    #[test]
    fn the_kernels_source_gives_the_host_values_bit_for_bit() {
        use crate::device_code::host::{Buffer, HostKernel};
        let (f32s, u32s) = (Buffer::F32(Vec::new()), Buffer::U32(Vec::new()));
        let Some(mean_kernel) = HostKernel::compile_block(
            &[SOURCE],
            "ddpjob_scored_mean(losses, targets, mean, (unsigned int)A(0))",
            &[("losses", &f32s), ("targets", &u32s), ("mean", &f32s)],
        ) else {
            return;
        };
        let grad_kernel = HostKernel::compile_block(
            &[SOURCE],
            "ddpjob_scored_mean_grad(g, targets, rows_grad, (unsigned int)A(0))",
            &[("g", &f32s), ("targets", &u32s), ("rows_grad", &f32s)],
        )
        .expect("the compiler that built the first kernel");
        for n in [0, 5, 256, 1000, 16_389] {
            let (losses, targets) = rows(n, &Device::Cpu);
            // The op's: the mean, and the rows' gradient of 0.7 · mean.
            let (mean, grad) = mean_and_grad(&losses, &targets, 0.7);
            let mut losses = Buffer::F32(losses.to_vec1().unwrap());
            let mut targets = Buffer::U32(targets.to_vec1().unwrap());
            let mut out = Buffer::F32(vec![f32::NAN]);
            let threads = THREADS as u64;
            let buffers = &mut [&mut losses, &mut targets, &mut out];
            mean_kernel.run(threads, &[n as u64], buffers);
            assert_eq!(out.bits(), [mean.to_bits()], "{n} rows: the mean");
            let mut g = Buffer::F32(vec![0.7]);
            let mut rows_grad = Buffer::F32(vec![f32::NAN; n]);
            let buffers = &mut [&mut g, &mut targets, &mut rows_grad];
            grad_kernel.run(threads, &[n as u64], buffers);
            let want: Vec<u32> = grad.iter().map(|v| v.to_bits()).collect();
            assert_eq!(rows_grad.bits(), want, "{n} rows: the gradient");
        }
    }

    /// Runs where a GPU is: the kernels give the host's mean and gradient bit for bit.
    #[test]
    fn the_gpu_scored_mean_is_the_hosts() {
        let Ok(gpu) = Device::new_cuda(0) else {
            eprintln!("skipping: no GPU");
            return;
        };
        // (No empty batch: a GPU's row losses are never made for none.)
        for n in [5, 256, 1000, 16_389] {
            let host = {
                let (losses, targets) = rows(n, &Device::Cpu);
                mean_and_grad(&losses, &targets, 0.7)
            };
            let (losses, targets) = rows(n, &gpu);
            let device = mean_and_grad(&losses, &targets, 0.7);
            assert_eq!(device.0.to_bits(), host.0.to_bits(), "{n} rows: {device:?}");
            assert_eq!(device.1, host.1, "{n} rows");
        }
    }
}
