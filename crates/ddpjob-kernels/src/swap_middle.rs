//! [a, b, c, d] → [a, c, b, d] as one op each way: how attention moves between tokens with
//! their heads side by side ([n, t, heads, head_dim]) and heads with their tokens
//! ([n, heads, t, head_dim]). Candle's `transpose(1, 2)?.contiguous()` runs a generic strided
//! copy, and its backward a second one (the strided gradient made contiguous): ~66 µs each for
//! the shakespeare-char recipe's [64, 256, 6, 64] bf16 on an H200, 54 of them a step (ncu,
//! 2026-11-26). Rows of d values move whole, so the GPU kernel's reads and writes are both
//! coalesced. Values are moved, never computed: any dtype, bit for bit.

use candle_core::{CpuStorage, CustomOp1, Layout, Result, Shape, Tensor, bail};

/// `x` [a, b, c, d] as [a, c, b, d], contiguous, with its backward (the same op on the gradient).
pub fn swap_middle(x: &Tensor) -> Result<Tensor> {
    let (a, b, c, d) = x.dims4()?;
    x.contiguous()?.apply_op1(SwapMiddle { a, b, c, d })
}

#[derive(Clone, Copy)]
struct SwapMiddle {
    a: usize,
    b: usize,
    c: usize,
    d: usize,
}

impl SwapMiddle {
    fn check(&self, layout: &Layout) -> Result<usize> {
        let SwapMiddle { a, b, c, d } = *self;
        if !layout.is_contiguous() || layout.dims() != [a, b, c, d] {
            bail!(
                "swap_middle: contiguous [{a}, {b}, {c}, {d}] expected, not {:?}",
                layout.shape()
            );
        }
        Ok(layout.start_offset())
    }

    fn out_shape(&self) -> Shape {
        Shape::from((self.a, self.c, self.b, self.d))
    }

    /// Row (i, j, k) of the output [a, c, b] rows comes from row (i, k, j) of the input.
    fn host<T: Copy>(&self, x: &[T]) -> Vec<T> {
        let SwapMiddle { a, b, c, d } = *self;
        let mut out = Vec::with_capacity(x.len());
        for i in 0..a {
            for j in 0..c {
                for k in 0..b {
                    let from = ((i * b + k) * c + j) * d;
                    out.extend_from_slice(&x[from..from + d]);
                }
            }
        }
        out
    }
}

impl CustomOp1 for SwapMiddle {
    fn name(&self) -> &'static str {
        "swap-middle"
    }

    fn cpu_fwd(&self, s: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        let start = self.check(layout)?;
        let n = layout.shape().elem_count();
        let out = match s {
            CpuStorage::F32(v) => CpuStorage::F32(self.host(&v[start..start + n])),
            CpuStorage::BF16(v) => CpuStorage::BF16(self.host(&v[start..start + n])),
            CpuStorage::F16(v) => CpuStorage::F16(self.host(&v[start..start + n])),
            CpuStorage::F64(v) => CpuStorage::F64(self.host(&v[start..start + n])),
            _ => bail!("swap_middle: float values expected"),
        };
        Ok((out, self.out_shape()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        layout: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let start = self.check(layout)?;
        let out = cuda::launch(s, start, *self)?;
        Ok((out, self.out_shape()))
    }

    fn bwd(&self, _x: &Tensor, _y: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(swap_middle(grad)?))
    }
}

#[cfg(feature = "cuda")]
pub(super) mod cuda {
    use candle_core::cuda_backend::cudarc::driver::{
        CudaSlice, DeviceRepr, LaunchConfig, PushKernelArg,
    };
    use candle_core::cuda_backend::{
        CudaDType, CudaDevice, CudaStorage, CudaStorageSlice, WrapErr,
    };
    use candle_core::{Error, Result};

    use super::SwapMiddle;
    use crate::launch::Module;

    /// One thread per word (2 to 16 bytes of a row), in output order; `T` only moves bits.
    const SOURCE: &str = r#"
#define SWAP(NAME, T) \
extern "C" __global__ void ddpjob_swap_middle_##NAME(const T* x, T* y, unsigned int a, \
            unsigned int b, unsigned int c, unsigned int d) { \
        unsigned int o = blockIdx.x * blockDim.x + threadIdx.x; \
        if (o >= a * b * c * d) return; \
        unsigned int l = o % d, row = o / d; \
        unsigned int k = row % b, ij = row / b; \
        unsigned int j = ij % c, i = ij / c; \
        y[o] = x[((i * b + k) * c + j) * d + l]; \
    }
    SWAP(b16, unsigned short)
    SWAP(b32, unsigned int)
    SWAP(b64, unsigned long long)
    SWAP(b128, uint4)
    "#;

    static MODULE: Module = Module::new("ddpjob_swap_middle", "the head-swap kernel", &[SOURCE]);

    pub(crate) fn ptx() -> Result<&'static str> {
        MODULE.ptx()
    }

    pub(super) fn launch(s: &CudaStorage, start: usize, op: SwapMiddle) -> Result<CudaStorage> {
        let device = &s.device;
        let out = match &s.slice {
            CudaStorageSlice::BF16(v) => {
                CudaStorage::wrap_cuda_slice(run(device, v, start, op)?, device.clone())
            }
            CudaStorageSlice::F16(v) => {
                CudaStorage::wrap_cuda_slice(run(device, v, start, op)?, device.clone())
            }
            CudaStorageSlice::F32(v) => {
                CudaStorage::wrap_cuda_slice(run(device, v, start, op)?, device.clone())
            }
            _ => {
                return Err(Error::Msg(
                    "swap_middle on a GPU: f32, bf16 or f16 values".into(),
                ));
            }
        };
        Ok(out)
    }

    /// Each row of `d` values moves as the widest words (up to 16 bytes) that divide it and
    /// its start's alignment: fewer, wider moves per thread.
    fn run<T: DeviceRepr + CudaDType>(
        device: &CudaDevice,
        x: &CudaSlice<T>,
        start: usize,
        SwapMiddle { a, b, c, d }: SwapMiddle,
    ) -> Result<CudaSlice<T>> {
        let n = a * b * c * d;
        let size = std::mem::size_of::<T>();
        let word = [16, 8, 4, 2]
            .into_iter()
            .find(|&w| {
                w >= size && (d * size).is_multiple_of(w) && (start * size).is_multiple_of(w)
            })
            .unwrap_or(size);
        let words = d * size / word;
        let too_many = || {
            Error::Msg(format!(
                "swap_middle on a GPU: {n} values in {}-byte words, more than 2³² words",
                word
            ))
        };
        let count = u32::try_from(a * b * c * words).map_err(|_| too_many())?;
        let dims = [a, b, c, words].map(|v| v as u32);
        let bits = word * 8;
        // Words of any type: not an f32-or-bf16 launch (`Call`), so its own arguments.
        let kernel = format!("ddpjob_swap_middle_b{bits}");
        let func = device.get_or_load_custom_func(&kernel, MODULE.name(), ptx()?)?;
        let x = x.slice(start..start + n);
        // SAFETY: the kernel writes each of the `n` elements.
        let mut y = unsafe { device.alloc::<T>(n.max(1))? };
        let mut launch = func.builder();
        launch.arg(&x);
        launch.arg(&mut y);
        for v in &dims {
            launch.arg(v);
        }
        // SAFETY: the arguments match the kernel's parameters in order and type; `x` and `y`
        // hold the `n` = a·b·c·d elements the kernel reads and writes as a·b·c·words words,
        // `x`'s start aligned to a word (checked above) and `y` freshly allocated (aligned).
        unsafe { launch.launch(LaunchConfig::for_num_elems(count.max(1))) }.w()?;
        Ok(y)
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device, Tensor, Var};

    use super::swap_middle;
    use crate::{f32_bits, uneven_sum};

    /// On `device`: the op's values and gradient are candle's transpose's, bit for bit.
    fn matches_transpose(
        device: &Device,
        dtype: DType,
        (a, b, c, d): (usize, usize, usize, usize),
    ) {
        let x = Tensor::arange(0f32, (a * b * c * d) as f32, &Device::Cpu)
            .unwrap()
            .reshape((a, b, c, d))
            .unwrap()
            .sin()
            .unwrap()
            .to_dtype(dtype)
            .unwrap()
            .to_device(device)
            .unwrap();
        let x = Var::from_tensor(&x).unwrap();
        let ours = swap_middle(x.as_tensor()).unwrap();
        let theirs = x.as_tensor().transpose(1, 2).unwrap().contiguous().unwrap();
        assert_eq!(ours.dims(), [a, c, b, d]);
        assert_eq!(f32_bits(&ours), f32_bits(&theirs));
        let weigh = |y: &Tensor| {
            uneven_sum(
                &y.to_dtype(DType::F32)
                    .unwrap()
                    .to_device(&Device::Cpu)
                    .unwrap(),
            )
        };
        let ours = weigh(&ours).backward().unwrap();
        let theirs = weigh(&theirs).backward().unwrap();
        assert_eq!(
            f32_bits(ours.get(&x).unwrap()),
            f32_bits(theirs.get(&x).unwrap())
        );
    }

    #[test]
    fn swapping_the_middle_dims_is_a_transpose_forward_and_backward() {
        for dtype in [DType::F32, DType::BF16] {
            matches_transpose(&Device::Cpu, dtype, (2, 5, 3, 7));
        }
        let wrong = Tensor::zeros((2, 3, 4), DType::F32, &Device::Cpu).unwrap();
        assert!(swap_middle(&wrong).is_err());
    }

    /// Runs where a GPU is: the kernel's values and gradients are the host's.
    #[cfg(feature = "cuda")]
    #[test]
    fn the_gpu_swaps_as_the_host() {
        let Ok(gpu) = Device::new_cuda(0) else {
            eprintln!("skipping: no GPU");
            return;
        };
        // Rows of 7 values move as 2- or 4-byte words, of 6 f32 as 8-byte ones, of 64 (a
        // head's) as 16-byte ones.
        for dtype in [DType::F32, DType::BF16] {
            for dims in [(2, 5, 3, 7), (2, 5, 3, 6), (3, 17, 6, 64)] {
                matches_transpose(&gpu, dtype, dims);
            }
        }
    }

    #[cfg(feature = "cuda")]
    #[test]
    fn the_kernel_compiles() {
        let ptx = super::cuda::ptx();
        assert!(ptx.is_ok(), "{}", ptx.err().unwrap());
    }
}
