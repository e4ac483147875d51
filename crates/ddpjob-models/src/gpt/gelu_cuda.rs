//! GELU and its gradient on a GPU, one elementwise kernel each (f32 or bf16 values, f32
//! arithmetic): candle's GELU backward is a dozen tensor ops over the MLP's widest tensor
//! (ncu on an H200, 2026-11-26: ~100 µs each for the shakespeare-char recipe's).

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{
    CudaSlice, CudaView, DeviceRepr, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::{CudaDType, CudaStorage, CudaStorageSlice, WrapErr};
use candle_core::{Error, Layout, Result};
use half::bf16;

use super::ops::Activation;
use ddpjob_kernels::nvrtc;

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

const MODULE: &str = "ddpjob_gelu";

pub(super) fn ptx() -> Result<&'static str> {
    static PTX: nvrtc::Compiled = nvrtc::Compiled::new();
    PTX.get(&[nvrtc::ELEMENTS, SOURCE], "the GELU kernels")
}

/// GELU of `x` (contiguous, f32 or bf16) when `grad` is `None`; else its gradient: `grad`
/// (same shape and dtype) times GELU's slope at `x`.
pub(super) fn apply(
    activation: Activation,
    x: (&CudaStorage, &Layout),
    grad: Option<(&CudaStorage, &Layout)>,
) -> Result<CudaStorage> {
    let (name, device) = (activation.name(), &x.0.device);
    let kernel = |dtype: &str| match grad {
        None => format!("ddpjob_{}_{dtype}", name),
        Some(_) => format!("ddpjob_{}_grad_{dtype}", name),
    };
    match (&x.0.slice, grad.map(|g| &g.0.slice)) {
        (CudaStorageSlice::F32(_), None | Some(CudaStorageSlice::F32(_))) => {
            let out = launch::<f32>(&kernel("f32"), x, grad)?;
            Ok(CudaStorage::wrap_cuda_slice(out, device.clone()))
        }
        (CudaStorageSlice::BF16(_), None | Some(CudaStorageSlice::BF16(_))) => {
            let out = launch::<bf16>(&kernel("bf16"), x, grad)?;
            Ok(CudaStorage::wrap_cuda_slice(out, device.clone()))
        }
        _ => Err(Error::Msg(format!(
            "gelu on a GPU: f32 or bf16 values (and a gradient of the same dtype), not {:?}",
            x.0.dtype()
        ))),
    }
}

/// `n` contiguous values of `s` from its layout's first element.
fn view<'a, T: CudaDType>(s: &'a CudaStorage, l: &Layout, n: usize) -> Result<CudaView<'a, T>> {
    if !l.is_contiguous() || l.shape().elem_count() != n {
        return Err(Error::Msg(
            "gelu on a GPU: contiguous values of one shape".into(),
        ));
    }
    let start = l.start_offset();
    Ok(s.as_cuda_slice::<T>()?.slice(start..start + n))
}

fn launch<T: DeviceRepr + CudaDType>(
    kernel: &str,
    (x, lx): (&CudaStorage, &Layout),
    grad: Option<(&CudaStorage, &Layout)>,
) -> Result<CudaSlice<T>> {
    let device = &x.device;
    let n = lx.shape().elem_count();
    let func = device.get_or_load_custom_func(kernel, MODULE, ptx()?)?;
    let x = view::<T>(x, lx, n)?;
    let g = grad.map(|(s, l)| view::<T>(s, l, n)).transpose()?;
    // SAFETY: the kernel writes each of the `n` elements.
    let mut out = unsafe { device.alloc::<T>(n)? };
    let count = n as u64;
    let mut builder = func.builder();
    builder.arg(&x);
    if let Some(g) = &g {
        builder.arg(g);
    }
    builder.arg(&mut out);
    builder.arg(&count);
    let config = LaunchConfig::for_num_elems(
        u32::try_from(n).map_err(|_| Error::Msg("gelu on a GPU: too many values".into()))?,
    );
    // SAFETY: the arguments match the kernel's parameters in order and type; `x`, `g` and
    // `out` hold `n` elements each.
    unsafe { builder.launch(config) }.w()?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device, Tensor, Var};

    use super::super::ops::{Activation, gelu};

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
