//! The dropout mask drawn on a GPU: one thread per element computes what
//! [`super::dropout::MaskOp`]'s host implementation computes, from the same 64-bit integer
//! arithmetic (SplitMix64 of the row's key plus the element's word, a 16-bit lane of it against
//! the threshold), so the masks are equal bit for bit and a step uploads only the rows' keys.
//! The kernel is compiled by NVRTC the first time a worker needs it, then kept. On a GPU the
//! mask is not even stored: [`ApplyOp`] multiplies by it as it draws it, forward and backward
//! (candle's product by a stored mask also computed the mask's own, unused, gradient).

use candle_core::cuda_backend::{CudaDevice, CudaStorage};
use candle_core::{CpuStorage, CustomOp1, DType, Error, Layout, Result, Shape, Tensor};
use half::bf16;

use crate::launch::{Call, Module};
use crate::nvrtc;

/// `out[i]` for row `i / row_len`, element `i % row_len`: 0 or `keep`, as the host draws it.
pub(super) const SPLITMIX: &str = r#"
__device__ unsigned long long splitmix64(unsigned long long x) {
    unsigned long long z = x + 0x9E3779B97F4A7C15ULL;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}
"#;

const SOURCE: &str = r#"

extern "C" __global__ void ddpjob_dropout_mask(
    const unsigned long long* keys,
    unsigned long long row_len,
    unsigned long long n,
    unsigned long long threshold,
    float keep,
    float* out
) {
    unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    out[i] = kept(keys, row_len, threshold, i) ? keep : 0.0f;
}

// x times its mask element, as candle multiplies x by the mask cast to x's dtype: `keep` comes
// already rounded to that dtype, and a product of two bf16 values is exact in f32, so the one
// rounding of `store` is the product's.
#define APPLY(NAME, T) \
extern "C" __global__ void ddpjob_dropout_apply_##NAME(const unsigned long long* keys, \
        unsigned long long row_len, unsigned long long n, unsigned long long threshold, \
        float keep, const T* x, T* out) { \
    unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; \
    if (i < n) store(out, i, load(x, i) * (kept(keys, row_len, threshold, i) ? keep : 0.0f)); \
}
APPLY(f32, float)
APPLY(bf16, unsigned short)
"#;

/// Whether element `i` is kept: SplitMix64 of its row's key plus its word, one 16-bit lane of
/// it against the threshold.
pub(super) const KEPT: &str = r#"
__device__ __forceinline__ bool kept(const unsigned long long* keys, unsigned long long row_len,
        unsigned long long threshold, unsigned long long i) {
    unsigned long long row = i / row_len;
    unsigned long long col = i % row_len;
    unsigned long long bits = splitmix64(keys[row] + col / 4);
    return ((bits >> (16 * (col % 4))) & 0xffff) >= threshold;
}
"#;

static MODULE: Module = Module::new(
    "ddpjob_dropout",
    "the dropout kernels",
    &[nvrtc::ELEMENTS, SPLITMIX, KEPT, SOURCE],
);

pub(crate) fn ptx() -> Result<&'static str> {
    MODULE.ptx()
}

/// The dropout masks of one site on a GPU: a key per row of `row_len` elements (see
/// `dropout::MaskOp`), drawn against `threshold`, a kept element scaled by `keep`. Every
/// kernel over them takes these as its first arguments (see [`launch_masked`]).
#[derive(Clone)]
pub(super) struct Masks {
    pub(super) keys: Vec<u64>,
    pub(super) row_len: usize,
    pub(super) threshold: u64,
    pub(super) keep: f32,
}

impl Masks {
    /// No element dropped, none scaled, over `n` elements.
    pub(super) fn keep_all(n: usize) -> Masks {
        Masks {
            keys: vec![0],
            row_len: n,
            threshold: 0,
            keep: 1.0,
        }
    }

    /// With `keep` rounded to `dtype`, as the host casts the mask to the values' dtype.
    fn rounded_to(mut self, dtype: DType) -> Masks {
        if dtype == DType::BF16 {
            self.keep = bf16::from_f32(self.keep).to_f32();
        }
        self
    }

    /// The elements of contiguous values laid out by `layout`, checked to be the masks'
    /// (`what` names the op in an error).
    pub(super) fn check(&self, layout: &Layout, what: &str) -> Result<usize> {
        let n = layout.shape().elem_count();
        if !layout.is_contiguous() || n != self.keys.len() * self.row_len {
            return Err(Error::Msg(format!(
                "{what} on a GPU: {} contiguous rows of {} expected, not {:?}",
                self.keys.len(),
                self.row_len,
                layout.shape()
            )));
        }
        Ok(n)
    }
}

/// A launch of `kernel` over `n` elements, a thread each, that starts with `masks`' arguments
/// (keys, row length, count, threshold, keep), as every kernel over the masks does; the
/// caller adds its values and output.
pub(super) fn masked<'a>(
    module: &'static Module,
    kernel: &str,
    what: &'a str,
    masks: &'a Masks,
    n: usize,
) -> Call<'a> {
    module
        .call(kernel, what)
        .upload(&masks.keys)
        .u64(masks.row_len as u64)
        .u64(n as u64)
        .u64(masks.threshold)
        .f32(masks.keep)
        .per_value(n)
}

/// The f32 mask of `n` elements on `device`.
pub(super) fn draw(device: &CudaDevice, masks: &Masks, n: usize) -> Result<CudaStorage> {
    let call = masked(&MODULE, "ddpjob_dropout_mask", "dropout", masks, n).output_f32(n);
    // SAFETY: the arguments match the kernel's parameters in order and type; `keys` holds a
    // key per row of the `n` elements, the output `n`.
    unsafe { call.run_f32(device) }
}

/// `x` times its dropout mask, the mask drawn as it is applied: the same op scales the
/// gradient in backward, so the mask is never stored. Its values are the host's `x · mask`
/// with the mask cast to x's dtype, bit for bit.
#[derive(Clone)]
pub(super) struct ApplyOp(Masks);

impl ApplyOp {
    /// The op for values of `dtype` (f32 or bf16).
    pub(super) fn new(masks: Masks, dtype: DType) -> Self {
        ApplyOp(masks.rounded_to(dtype))
    }
}

impl CustomOp1 for ApplyOp {
    fn name(&self) -> &'static str {
        "dropout"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        Err(Error::Msg(
            "dropout's fused op runs on a GPU (the host multiplies by the drawn mask)".into(),
        ))
    }

    fn cuda_fwd(&self, x: &CudaStorage, layout: &Layout) -> Result<(CudaStorage, Shape)> {
        let n = self.0.check(layout, "dropout")?;
        let call = masked(&MODULE, "ddpjob_dropout_apply", "dropout", &self.0, n)
            .values((x, layout))
            .output(n);
        // SAFETY: the arguments match the kernel's parameters in order and type; the values
        // and the output hold `n` elements, `keys` a key per row of them.
        let out = unsafe { call.run(x) }?;
        Ok((out, layout.shape().clone()))
    }

    /// The gradient scaled by the same mask, drawn again.
    fn bwd(&self, _x: &Tensor, _y: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(grad.contiguous()?.apply_op1_no_bwd(self)?))
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device, Tensor};

    use crate::dropout::{MaskOp, mask};
    use crate::host::f32_bits;

    /// Runs where a GPU is: the device's mask is the host's, bit for bit.
    #[test]
    fn the_gpu_draws_the_host_mask_bit_for_bit() {
        let Ok(device) = Device::new_cuda(0) else {
            eprintln!("skipping: no GPU");
            return;
        };
        let (seeds, row_len, p) = ([7u64, 8, 1 << 40, u64::MAX], 1_003, 0.1);
        let x = Tensor::zeros((4, 17, 59), DType::F32, &device).unwrap();
        let drawn = x
            .apply_op1_no_bwd(&MaskOp::new(&seeds, 3, row_len, p))
            .unwrap();
        let drawn: Vec<f32> = drawn.flatten_all().unwrap().to_vec1().unwrap();
        let host = mask(&seeds, 3, row_len, p);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&drawn), bits(&host));
    }

    /// Runs where a GPU is: dropout applied as the mask is drawn gives the host's product by the
    /// mask (cast to the values' dtype) bit for bit, forward and backward, in f32 and bf16.
    #[test]
    fn the_gpu_applies_the_host_mask_bit_for_bit() {
        let Ok(gpu) = Device::new_cuda(0) else {
            eprintln!("skipping: no GPU");
            return;
        };
        let (seeds, row_len, p) = ([3u64, 1 << 50, 12], 2_011, 0.1);
        let values: Vec<f32> = (0..3 * row_len)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0)
            .collect();
        let dropout = crate::dropout::Dropout::new(&seeds, p, row_len).unwrap();
        for dtype in [DType::F32, DType::BF16] {
            let host = Tensor::from_slice(&values, (3, row_len), &Device::Cpu)
                .unwrap()
                .to_dtype(dtype)
                .unwrap();
            let mask = Tensor::from_slice(&mask(&seeds, 9, row_len, p), (3, row_len), &Device::Cpu)
                .unwrap()
                .to_dtype(dtype)
                .unwrap();
            let want = host.mul(&mask).unwrap();
            let x = candle_core::Var::from_tensor(&host.to_device(&gpu).unwrap()).unwrap();
            let got = dropout.apply(x.as_tensor(), 9).unwrap();
            assert_eq!(f32_bits(&got), f32_bits(&want), "{dtype:?} forward");
            // d/dx of Σ x·m·w for weights w is m·w: the same mask applied to the gradient.
            let reversed: Vec<f32> = values.iter().rev().copied().collect();
            let w = Tensor::from_slice(&reversed, (3, row_len), &Device::Cpu)
                .unwrap()
                .to_dtype(dtype)
                .unwrap();
            let grads = (&got * w.to_device(&gpu).unwrap())
                .unwrap()
                .sum_all()
                .unwrap()
                .backward()
                .unwrap();
            let want = w.mul(&mask).unwrap();
            assert_eq!(
                f32_bits(grads.get(&x).unwrap()),
                f32_bits(&want),
                "{dtype:?} backward"
            );
        }
    }
}
