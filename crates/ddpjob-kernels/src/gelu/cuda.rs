//! GELU and its gradient on a GPU, one elementwise kernel each (f32 or bf16 values, f32
//! arithmetic): candle's GELU backward is a dozen tensor ops over the MLP's widest tensor
//! (ncu on an H200, 2026-11-26: ~100 µs each for the shakespeare-char recipe's).

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::CudaStorage;
use candle_core::{Error, Layout, Result};

use super::Activation;
use crate::launch::Module;
use crate::nvrtc;

const SOURCE: &str = r#"
#define SQRT_HALF 0.70710678118654752f
#define INV_SQRT_2PI 0.39894228040143268f
#define SQRT_2_OVER_PI 0.79788456080286536f
__device__ __forceinline__ float gelu(float x) { return 0.5f * x * (1.0f + erff(x * SQRT_HALF)); }
__device__ __forceinline__ float gelu_slope(float x) {
    return 0.5f * (1.0f + erff(x * SQRT_HALF)) + x * expf(-0.5f * x * x) * INV_SQRT_2PI;
}
__device__ __forceinline__ float gelu_new(float x) {
    return 0.5f * x * (1.0f + tanhf(SQRT_2_OVER_PI * (x + 0.044715f * x * x * x)));
}
__device__ __forceinline__ float gelu_new_slope(float x) {
    float t = tanhf(SQRT_2_OVER_PI * (x + 0.044715f * x * x * x));
    return 0.5f * (1.0f + t)
        + 0.5f * x * (1.0f - t * t) * SQRT_2_OVER_PI * (1.0f + 3.0f * 0.044715f * x * x);
}
#define KERNELS(F, NAME, T) \
extern "C" __global__ void ddpjob_##F##_##NAME(const T* x, T* y, unsigned long long n) { \
    unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; \
    if (i < n) store(y, i, F(load(x, i))); \
} \
extern "C" __global__ void ddpjob_##F##_grad_##NAME(const T* x, const T* g, T* dx, \
        unsigned long long n) { \
    unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; \
    if (i < n) store(dx, i, load(g, i) * F##_slope(load(x, i))); \
}
KERNELS(gelu, f32, float)
KERNELS(gelu, bf16, unsigned short)
KERNELS(gelu_new, f32, float)
KERNELS(gelu_new, bf16, unsigned short)
"#;

static MODULE: Module = Module::new(
    "ddpjob_gelu",
    "the GELU kernels",
    &[nvrtc::ELEMENTS, SOURCE],
);

pub(crate) fn ptx() -> Result<&'static str> {
    MODULE.ptx()
}

/// GELU of `x` (contiguous, f32 or bf16) when `grad` is `None`; else its gradient: `grad`
/// (same shape and dtype) times GELU's slope at `x`.
pub(super) fn apply(
    activation: Activation,
    x: (&CudaStorage, &Layout),
    grad: Option<(&CudaStorage, &Layout)>,
) -> Result<CudaStorage> {
    let n = x.1.shape().elem_count();
    let one_shape = |l: &Layout| l.is_contiguous() && l.shape().elem_count() == n;
    if !one_shape(x.1) || grad.is_some_and(|(g, lg)| !one_shape(lg) || g.dtype() != x.0.dtype()) {
        return Err(Error::Msg(
            "gelu on a GPU: contiguous values (and a gradient) of one shape and dtype".into(),
        ));
    }
    let name = match grad {
        None => format!("ddpjob_{}", activation.name()),
        Some(_) => format!("ddpjob_{}_grad", activation.name()),
    };
    let mut call = MODULE.call(&name, "gelu").values(x);
    if let Some(g) = grad {
        call = call.values(g);
    }
    let call = call.output(n).u64(n as u64).per_value(n);
    // SAFETY: the arguments match the kernel's parameters in order and type; `x`, the
    // gradient and the output hold `n` values each.
    unsafe { call.run(x.0) }
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device, Tensor, Var};

    use crate::gelu::{Activation, gelu};

    /// Runs where a GPU is: GELU and its gradient on the GPU equal the host's fused op (f32) to
    /// f32 rounding, and to bf16's from bf16 values.
    #[test]
    fn the_gpu_kernels_give_the_host_values() {
        let Ok(gpu) = Device::new_cuda(0) else {
            eprintln!("skipping: no GPU");
            return;
        };
        let x: Vec<f32> = (0..4099).map(|i| (i as f32 - 2049.0) / 300.0).collect();
        let g: Vec<f32> = (0..4099)
            .map(|i| ((i * 7 % 13) as f32 - 6.0) / 3.0)
            .collect();
        for activation in [Activation::Gelu, Activation::GeluNew] {
            let run = |device: &Device, dtype: DType| {
                let x = Tensor::new(x.as_slice(), device)
                    .unwrap()
                    .to_dtype(dtype)
                    .unwrap();
                let x = Var::from_tensor(&x).unwrap();
                let g = Tensor::new(g.as_slice(), device)
                    .unwrap()
                    .to_dtype(dtype)
                    .unwrap();
                let y = gelu(&x, activation).unwrap();
                let dx = (&y * &g).unwrap().sum_all().unwrap().backward().unwrap();
                let host = |t: &Tensor| -> Vec<f32> {
                    t.to_dtype(DType::F32)
                        .unwrap()
                        .to_device(&Device::Cpu)
                        .unwrap()
                        .to_vec1()
                        .unwrap()
                };
                (host(&y), host(dx.get(&x).unwrap()))
            };
            let (y, dx) = run(&Device::Cpu, DType::F32);
            for (dtype, tolerance) in [(DType::F32, 1e-5), (DType::BF16, 4e-2)] {
                let (gy, gdx) = run(&gpu, dtype);
                let worst = |a: &[f32], b: &[f32]| {
                    a.iter()
                        .zip(b)
                        .map(|(a, b)| (a - b).abs() / a.abs().max(1.0))
                        .fold(0f32, f32::max)
                };
                assert!(worst(&y, &gy) <= tolerance, "{activation:?} {dtype:?} y");
                assert!(worst(&dx, &gdx) <= tolerance, "{activation:?} {dtype:?} dx");
            }
        }
    }
}
