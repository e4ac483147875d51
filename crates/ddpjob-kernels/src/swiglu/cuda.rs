//! The GPU SwiGLU's kernels (see `device`): one thread per value, f32 arithmetic over f32 or
//! bf16 values.

use candle_core::cuda_backend::CudaStorage;
use candle_core::{Error, Layout, Result};

use crate::launch::Module;
use crate::nvrtc;

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

static MODULE: Module = Module::new(
    "ddpjob_swiglu",
    "the SwiGLU kernels",
    &[nvrtc::ELEMENTS, SOURCE],
);

pub(crate) fn ptx() -> Result<&'static str> {
    MODULE.ptx()
}

/// `silu(gate) · up` (no gradient), or the backward's [2, ..] (the gate's gradient, then up's),
/// given the output's gradient; all contiguous, of one shape and dtype (f32 or bf16).
pub(super) fn run(
    gate: (&CudaStorage, &Layout),
    up: (&CudaStorage, &Layout),
    grad: Option<(&CudaStorage, &Layout)>,
) -> Result<CudaStorage> {
    let n = gate.1.shape().elem_count();
    let inputs = [Some(gate), Some(up), grad];
    if inputs
        .iter()
        .flatten()
        .any(|(_, l)| !l.is_contiguous() || l.shape() != gate.1.shape())
    {
        return Err(Error::Msg(
            "swiglu on a GPU: contiguous values of one shape".into(),
        ));
    }
    let (name, out_len) = match grad {
        None => ("ddpjob_swiglu", n),
        Some(_) => ("ddpjob_swiglu_grad", 2 * n),
    };
    let mut call = MODULE.call(name, "swiglu");
    for input in inputs.into_iter().flatten() {
        call = call.values(input);
    }
    let call = call.output(out_len).u64(n as u64).per_value(n);
    // SAFETY: the arguments match the kernel's parameters in order and type; the inputs hold
    // `n` values each, the output `out_len`.
    unsafe { call.run(gate.0) }
}

#[cfg(test)]
mod tests {
    /// NVRTC compiles the kernels (it needs no GPU, only its library).
    #[test]
    fn the_kernels_compile() {
        assert!(super::ptx().is_ok(), "{:?}", super::ptx().err());
    }
}
