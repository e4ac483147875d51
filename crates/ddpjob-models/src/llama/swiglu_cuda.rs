//! The GPU SwiGLU's kernels (see `swiglu_gpu`): one thread per value, f32 arithmetic over f32 or
//! bf16 values.

use candle_core::cuda_backend::cudarc::driver::{
    CudaSlice, CudaView, DeviceRepr, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::{CudaDType, CudaStorage, WrapErr};
use candle_core::{Error, Layout, Result};
use half::bf16;

use ddpjob_kernels::nvrtc;

const SOURCE: &str = r#"
__device__ __forceinline__ float sigmoid(float a) { return 1.0f / (1.0f + expf(-a)); }
#define SWIGLU(NAME, T) \
extern "C" __global__ void ddpjob_swiglu_##NAME(const T* gate, const T* up, T* y, \
        unsigned long long n) { \
    unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; \
    if (i >= n) return; \
    float a = load(gate, i); \
    store(y, i, a * sigmoid(a) * load(up, i)); \
} \
extern "C" __global__ void ddpjob_swiglu_grad_##NAME(const T* gate, const T* up, const T* g, \
        T* out, unsigned long long n) { \
    unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; \
    if (i >= n) return; \
    float a = load(gate, i), b = load(up, i), gy = load(g, i), s = sigmoid(a); \
    store(out, i, gy * b * s * (1.0f + a * (1.0f - s))); \
    store(out, n + i, gy * a * s); \
}
SWIGLU(f32, float)
SWIGLU(bf16, unsigned short)
"#;

const MODULE: &str = "ddpjob_swiglu";

pub(super) fn ptx() -> Result<&'static str> {
    static PTX: nvrtc::Compiled = nvrtc::Compiled::new();
    PTX.get(&[nvrtc::ELEMENTS, SOURCE], "the SwiGLU kernels")
}

/// `silu(gate) · up` (no gradient), or the backward's [2, ..] (the gate's gradient, then up's),
/// given the output's gradient; all contiguous, of one shape and dtype (f32 or bf16).
pub(super) fn run(
    gate: (&CudaStorage, &Layout),
    up: (&CudaStorage, &Layout),
    grad: Option<(&CudaStorage, &Layout)>,
) -> Result<CudaStorage> {
    nvrtc::f32_or_bf16(
        gate.0,
        "swiglu",
        || launch::<f32>("f32", gate, up, grad),
        || launch::<bf16>("bf16", gate, up, grad),
    )
}

fn launch<T: DeviceRepr + CudaDType>(
    dtype: &str,
    (gate, lgate): (&CudaStorage, &Layout),
    up: (&CudaStorage, &Layout),
    grad: Option<(&CudaStorage, &Layout)>,
) -> Result<CudaSlice<T>> {
    let device = &gate.device;
    let n = lgate.shape().elem_count();
    let kernel = match grad {
        None => format!("ddpjob_swiglu_{dtype}"),
        Some(_) => format!("ddpjob_swiglu_grad_{dtype}"),
    };
    let func = device.get_or_load_custom_func(&kernel, MODULE, ptx()?)?;
    let inputs = [Some((gate, lgate)), Some(up), grad]
        .into_iter()
        .flatten()
        .map(|(s, l)| view::<T>(s, l, lgate))
        .collect::<Result<Vec<_>>>()?;
    let out_len = if grad.is_some() { 2 * n } else { n };
    // SAFETY: the kernel writes each of the `out_len` elements.
    let mut out = unsafe { device.alloc::<T>(out_len)? };
    let count = n as u64;
    let mut builder = func.builder();
    for input in &inputs {
        builder.arg(input);
    }
    builder.arg(&mut out);
    builder.arg(&count);
    let config = LaunchConfig::for_num_elems(
        u32::try_from(n).map_err(|_| Error::Msg("swiglu on a GPU: too many values".into()))?,
    );
    // SAFETY: the arguments match the kernel's parameters in order and type; the inputs hold
    // `n` values each, `out` `out_len`.
    unsafe { builder.launch(config) }.w()?;
    Ok(out)
}

/// The values of `s` laid out as `like`, contiguous.
fn view<'a, T: CudaDType>(
    s: &'a CudaStorage,
    l: &Layout,
    like: &Layout,
) -> Result<CudaView<'a, T>> {
    if !l.is_contiguous() || l.shape() != like.shape() {
        return Err(Error::Msg(
            "swiglu on a GPU: contiguous values of one shape".into(),
        ));
    }
    let (start, n) = (l.start_offset(), l.shape().elem_count());
    Ok(s.as_cuda_slice::<T>()?.slice(start..start + n))
}

#[cfg(test)]
mod tests {
    /// NVRTC compiles the kernels (it needs no GPU, only its library).
    #[test]
    fn the_kernels_compile() {
        assert!(super::ptx().is_ok(), "{:?}", super::ptx().err());
    }
}
