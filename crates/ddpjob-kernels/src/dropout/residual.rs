//! A residual branch added to the f32 stream on a GPU, as one kernel each way:
//! `x + dropout(y as f32)`, where the trunk otherwise runs a cast, the dropout product and an
//! addition forward (57 + 27 + 38 µs for the shakespeare-char recipe's [16384, 384] on an H200,
//! ncu 2026-11-26) and a product and a cast backward, at 12 sites a step. Compiled without
//! fused multiply-add, so the product and the sum round as the separate ops do: bit for bit
//! the host's `x + (y as f32) · mask` (GPU test), the mask drawn as `cuda` draws it.

use candle_core::cuda_backend::CudaStorage;
use candle_core::{CpuStorage, CustomOp2, DType, Error, Layout, Result, Shape, Tensor};

use super::cuda::{KEPT, Masks, SPLITMIX, masked};
use crate::launch::Module;
use crate::nvrtc;

const SOURCE: &str = r#"
#define RESIDUAL(NAME, T) \
extern "C" __global__ void ddpjob_residual_##NAME(const unsigned long long* keys, \
        unsigned long long row_len, unsigned long long n, unsigned long long threshold, \
        float keep, const float* x, const T* y, float* out) { \
    unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; \
    if (i < n) out[i] = x[i] + load(y, i) * (kept(keys, row_len, threshold, i) ? keep : 0.0f); \
} \
extern "C" __global__ void ddpjob_residual_grad_##NAME(const unsigned long long* keys, \
        unsigned long long row_len, unsigned long long n, unsigned long long threshold, \
        float keep, const float* g, T* gy) { \
    unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; \
    if (i < n) store(gy, i, g[i] * (kept(keys, row_len, threshold, i) ? keep : 0.0f)); \
}
RESIDUAL(f32, float)
RESIDUAL(bf16, unsigned short)
"#;

static MODULE: Module = Module::rounding_as_the_host(
    "ddpjob_residual",
    "the residual kernels",
    &[nvrtc::ELEMENTS, SPLITMIX, KEPT, SOURCE],
);

pub(crate) fn ptx() -> Result<&'static str> {
    MODULE.ptx()
}

/// `x` (f32) plus the branch `y` (f32 or bf16, x's shape) cast to f32 and dropped out with
/// these masks (`Masks::keep_all` for no dropout).
#[derive(Clone)]
pub(super) struct ResidualOp(pub(super) Masks);

/// Whether [`ResidualOp`] takes this stream and branch.
pub(super) fn applies(x: &Tensor, y: &Tensor) -> bool {
    x.device().is_cuda()
        && x.dtype() == DType::F32
        && matches!(y.dtype(), DType::F32 | DType::BF16)
        && x.shape() == y.shape()
}

impl CustomOp2 for ResidualOp {
    fn name(&self) -> &'static str {
        "residual"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        Err(Error::Msg(
            "the fused residual runs on a GPU (the host adds the dropped-out branch)".into(),
        ))
    }

    fn cuda_fwd(
        &self,
        x: &CudaStorage,
        lx: &Layout,
        y: &CudaStorage,
        ly: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let n = self.0.check(lx, "residual")?;
        if self.0.check(ly, "residual")? != n {
            return Err(Error::Msg(
                "residual on a GPU: stream and branch differ".into(),
            ));
        }
        let call = masked(&MODULE, "ddpjob_residual", "residual", &self.0, n)
            .f32s((x, lx))
            .values((y, ly))
            .output_f32(n);
        // SAFETY: the arguments match the kernel's parameters in order and type; the stream,
        // the branch and the output hold `n` elements, `keys` a key per row of them.
        let out = unsafe { call.run(y) }?;
        Ok((out, lx.shape().clone()))
    }

    /// The stream's gradient passes; the branch's is it times the mask, in the branch's dtype.
    fn bwd(
        &self,
        _x: &Tensor,
        y: &Tensor,
        _out: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let op = BranchGrad {
            op: self.clone(),
            dtype: y.dtype(),
        };
        let gy = grad.contiguous()?.apply_op1_no_bwd(&op)?;
        Ok((Some(grad.clone()), Some(gy)))
    }
}

/// The branch's gradient of [`ResidualOp`] from the output's (f32).
struct BranchGrad {
    op: ResidualOp,
    dtype: DType,
}

impl candle_core::CustomOp1 for BranchGrad {
    fn name(&self) -> &'static str {
        "residual-grad"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        Err(Error::Msg("the fused residual runs on a GPU".into()))
    }

    fn cuda_fwd(&self, g: &CudaStorage, lg: &Layout) -> Result<(CudaStorage, Shape)> {
        let n = self.op.0.check(lg, "residual gradient")?;
        let call = masked(
            &MODULE,
            "ddpjob_residual_grad",
            "residual gradient",
            &self.op.0,
            n,
        )
        .f32s((g, lg))
        .output(n);
        // SAFETY: the arguments match the kernel's parameters in order and type; the
        // gradient and the output (in the branch's dtype) hold `n` elements.
        let out = unsafe { call.run_in(self.dtype, &g.device) }?;
        Ok((out, lg.shape().clone()))
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device, Tensor, Var};

    use crate::dropout::{Dropout, add_dropped};
    use crate::host::f32_bits;

    /// Runs where a GPU is: the fused residual gives the host's separate ops bit for bit:
    /// the sum, the stream's gradient and the branch's, with and without dropout, for an f32
    /// and a bf16 branch.
    #[test]
    fn the_gpu_adds_as_the_host() {
        let Ok(gpu) = Device::new_cuda(0) else {
            eprintln!("skipping: no GPU");
            return;
        };
        let (seeds, row_len) = ([5u64, 1 << 45], 3 * 1_003);
        let n = seeds.len() * row_len;
        let make = |k: usize| -> Tensor {
            let v: Vec<f32> = (0..n)
                .map(|i| (((i * k) % 97) as f32 - 48.0) / 11.0)
                .collect();
            Tensor::from_slice(&v, (seeds.len() * 3, 1_003), &Device::Cpu).unwrap()
        };
        let (x, y, w) = (make(7), make(13), make(29));
        for dtype in [DType::F32, DType::BF16] {
            for p in [0.0, 0.2] {
                let dropout = Dropout::new(&seeds, p, row_len);
                // On `device`: the sum, and the gradients of Σ sum·w.
                let run = |device: &Device| {
                    let x = Var::from_tensor(&x.to_device(device).unwrap()).unwrap();
                    let y =
                        Var::from_tensor(&y.to_dtype(dtype).unwrap().to_device(device).unwrap())
                            .unwrap();
                    let out =
                        add_dropped(x.as_tensor(), y.as_tensor(), dropout.as_ref(), 4).unwrap();
                    let grads = (&out * w.to_device(device).unwrap())
                        .unwrap()
                        .sum_all()
                        .unwrap()
                        .backward()
                        .unwrap();
                    let (gx, gy) = (
                        grads.get(&x).unwrap().clone(),
                        grads.get(&y).unwrap().clone(),
                    );
                    (f32_bits(&out), f32_bits(&gx), f32_bits(&gy))
                };
                let (host, gpu) = (run(&Device::Cpu), run(&gpu));
                assert!(host.0 == gpu.0, "{dtype:?}, p {p}: sum");
                assert!(host.1 == gpu.1, "{dtype:?}, p {p}: stream gradient");
                assert!(host.2 == gpu.2, "{dtype:?}, p {p}: branch gradient");
            }
        }
    }
}
