//! SwiGLU, `silu(gate) · up`, as one op with its own backward, for the GPU: from candle's ops
//! it is two kernels forward and about eight backward (SiLU's gradient alone is a negation, an
//! exponential, an addition, a reciprocal and products) over the MLP's widest tensors (ncu on
//! an H200, 2026-11-26). One kernel each way here, in f32 arithmetic. The host version is the
//! reference the kernels are held to; on the CPU in f32 the model keeps its own fused op.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp2, CustomOp3, DType, Layout, Result, Shape, Tensor, bail};

use crate::host as kernels;

/// `silu(gate) · up` of a GPU's f32 or bf16 values; differentiable in both.
pub fn swiglu(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    gate.contiguous()?.apply_op2(&up.contiguous()?, SwiGlu)
}

/// Whether the op takes these values (a GPU's, f32 or bf16, of one shape and dtype).
pub(super) fn applies(gate: &Tensor, up: &Tensor) -> bool {
    gate.device().is_cuda()
        && matches!(gate.dtype(), DType::F32 | DType::BF16)
        && gate.dtype() == up.dtype()
        && gate.shape() == up.shape()
}

struct SwiGlu;

/// The backward's kernel: from gate, up and the output's gradient, [2, ..] holding the gate's
/// gradient and then up's.
struct SwiGluGrad;

fn sigmoid(a: f32) -> f32 {
    1.0 / (1.0 + (-a).exp())
}

/// `f` over the values of equally shaped f32 or bf16 storages, in f32, `outputs` results per
/// value (each a block of the result), in their dtype.
fn elementwise<const K: usize>(
    inputs: &[(&CpuStorage, &Layout)],
    f: impl Fn(&[f32]) -> [f32; K],
) -> Result<CpuStorage> {
    let shape = inputs[0].1.shape();
    let mut columns = Vec::new();
    for (s, l) in inputs {
        if l.shape() != shape {
            bail!("swiglu: shapes {:?} and {:?}", shape, l.shape());
        }
        columns.push(kernels::widened(s, l, "swiglu")?.0);
    }
    let n = shape.elem_count();
    let mut out = vec![0f32; K * n];
    let mut args = vec![0f32; columns.len()];
    for i in 0..n {
        for (a, c) in args.iter_mut().zip(&columns) {
            *a = c[i];
        }
        for (k, v) in f(&args).into_iter().enumerate() {
            out[k * n + i] = v;
        }
    }
    Ok(kernels::narrowed(out, BackendStorage::dtype(inputs[0].0)))
}

impl CustomOp2 for SwiGlu {
    fn name(&self) -> &'static str {
        "ddpjob-gpu-swiglu"
    }

    fn cpu_fwd(
        &self,
        gate: &CpuStorage,
        lg: &Layout,
        up: &CpuStorage,
        lu: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let y = elementwise(&[(gate, lg), (up, lu)], |v| [v[0] * sigmoid(v[0]) * v[1]])?;
        Ok((y, lg.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        gate: &candle_core::CudaStorage,
        lg: &Layout,
        up: &candle_core::CudaStorage,
        lu: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let y = super::cuda::run((gate, lg), (up, lu), None)?;
        Ok((y, lg.shape().clone()))
    }

    /// d gate = g·up·σ(a)(1 + a(1 − σ(a))), d up = g·silu(a).
    fn bwd(
        &self,
        gate: &Tensor,
        up: &Tensor,
        _y: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let grad = grad.to_dtype(gate.dtype())?.contiguous()?;
        let both = gate.apply_op3_no_bwd(up, &grad, &SwiGluGrad)?;
        Ok((Some(both.get(0)?), Some(both.get(1)?)))
    }
}

impl CustomOp3 for SwiGluGrad {
    fn name(&self) -> &'static str {
        "ddpjob-gpu-swiglu-grad"
    }

    fn cpu_fwd(
        &self,
        gate: &CpuStorage,
        lg: &Layout,
        up: &CpuStorage,
        lu: &Layout,
        grad: &CpuStorage,
        lgrad: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let both = elementwise(&[(gate, lg), (up, lu), (grad, lgrad)], |v| {
            let (a, b, g) = (v[0], v[1], v[2]);
            let s = sigmoid(a);
            [g * b * s * (1.0 + a * (1.0 - s)), g * a * s]
        })?;
        Ok((both, both_shape(lg)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        gate: &candle_core::CudaStorage,
        lg: &Layout,
        up: &candle_core::CudaStorage,
        lu: &Layout,
        grad: &candle_core::CudaStorage,
        lgrad: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let both = super::cuda::run((gate, lg), (up, lu), Some((grad, lgrad)))?;
        Ok((both, both_shape(lg)))
    }
}

/// [2, ..shape]: the two gradients one after the other.
fn both_shape(l: &Layout) -> Shape {
    let mut dims = vec![2];
    dims.extend_from_slice(l.dims());
    Shape::from(dims)
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device, Tensor, Var};

    use super::swiglu;
    use crate::host::uneven_sum;

    /// The output and both gradients (under an uneven weighting) of fixed [7, 131] values on
    /// `device` in `dtype`, by the op or by candle's ops, as f32.
    fn run(device: &Device, dtype: DType, fused: bool) -> Vec<Vec<f32>> {
        let values = |seed: f32| {
            let v: Vec<f32> = (0..917)
                .map(|i| (i as f32 * 0.61 + seed).sin() * 4.3)
                .collect();
            let t = Tensor::from_vec(v, (7, 131), device).unwrap();
            Var::from_tensor(&t.to_dtype(dtype).unwrap()).unwrap()
        };
        let (gate, up) = (values(0.3), values(1.7));
        let y = match fused {
            true => swiglu(&gate, &up).unwrap(),
            false => (gate.silu().unwrap() * up.as_tensor()).unwrap(),
        };
        let grads = uneven_sum(&y.to_dtype(DType::F32).unwrap())
            .backward()
            .unwrap();
        let host = |t: &Tensor| -> Vec<f32> {
            let t = t
                .to_dtype(DType::F32)
                .unwrap()
                .to_device(&Device::Cpu)
                .unwrap();
            t.flatten_all().unwrap().to_vec1().unwrap()
        };
        vec![
            host(&y),
            host(grads.get(&gate).unwrap()),
            host(grads.get(&up).unwrap()),
        ]
    }

    fn worst(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
        crate::host::worst_relative(&a.concat(), &b.concat(), 1.0)
    }

    /// On the host the op gives candle's ops' values and gradients: to f32 rounding in f32,
    /// within bf16's rounding in bf16 (candle rounds silu(gate) to bf16 before the product).
    #[test]
    fn equals_candles_ops() {
        for (dtype, tolerance) in [(DType::F32, 1e-5), (DType::BF16, 2e-2)] {
            let (fused, ops) = (
                run(&Device::Cpu, dtype, true),
                run(&Device::Cpu, dtype, false),
            );
            assert!(
                worst(&fused, &ops) <= tolerance,
                "{dtype:?}: {}",
                worst(&fused, &ops)
            );
        }
    }

    /// Runs where a GPU is: the kernels give the host's values and gradients (to f32 rounding;
    /// in bf16, to one bf16 rounding).
    #[test]
    fn the_gpu_kernels_give_the_host_values() {
        let Ok(gpu) = Device::new_cuda(0) else {
            eprintln!("skipping: no GPU");
            return;
        };
        for (dtype, tolerance) in [(DType::F32, 1e-5), (DType::BF16, 1e-2)] {
            let (device, host) = (run(&gpu, dtype, true), run(&Device::Cpu, dtype, true));
            assert!(
                worst(&device, &host) <= tolerance,
                "{dtype:?}: {}",
                worst(&device, &host)
            );
        }
    }
}
