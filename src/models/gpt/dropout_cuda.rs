//! The dropout mask drawn on a GPU: one thread per element computes what
//! [`super::dropout::MaskOp`]'s host implementation computes, from the same 64-bit integer
//! arithmetic (SplitMix64 of the row's key plus the element's word, a 16-bit lane of it against
//! the threshold), so the masks are equal bit for bit and a step uploads only the rows' keys.
//! The kernel is compiled by NVRTC the first time a worker needs it, then kept.

use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::{CudaDevice, CudaStorage, WrapErr};
use candle_core::{Error, Result};

/// `out[i]` for row `i / row_len`, element `i % row_len`: 0 or `keep`, as the host draws it.
const SOURCE: &str = r#"
__device__ unsigned long long splitmix64(unsigned long long x) {
    unsigned long long z = x + 0x9E3779B97F4A7C15ULL;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

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
    unsigned long long row = i / row_len;
    unsigned long long col = i % row_len;
    unsigned long long bits = splitmix64(keys[row] + col / 4);
    unsigned long long draw = (bits >> (16 * (col % 4))) & 0xffff;
    out[i] = draw < threshold ? 0.0f : keep;
}
"#;

const FUNCTION: &str = "ddpjob_dropout_mask";

pub(super) fn ptx() -> Result<&'static str> {
    static PTX: crate::kernels::nvrtc::Compiled = crate::kernels::nvrtc::Compiled::new();
    PTX.get(&[SOURCE], "the dropout kernel")
}

/// The f32 mask of `n` elements (rows of `row_len`, one key each) on `device`.
pub(super) fn draw(
    device: &CudaDevice,
    keys: &[u64],
    row_len: usize,
    threshold: u64,
    keep: f32,
    n: usize,
) -> Result<CudaStorage> {
    if n == 0 {
        // No launch of zero blocks: an empty mask.
        return Ok(CudaStorage::wrap_cuda_slice(
            device.alloc_zeros::<f32>(0)?,
            device.clone(),
        ));
    }
    let func = device.get_or_load_custom_func(FUNCTION, "ddpjob_dropout", ptx()?)?;
    let keys = device.clone_htod(keys)?;
    // SAFETY: every one of the `n` elements is written by the kernel before any read.
    let mut out = unsafe { device.alloc::<f32>(n)? };
    let (row_len, count) = (row_len as u64, n as u64);
    let mut launch = func.builder();
    launch.arg(&keys);
    launch.arg(&row_len);
    launch.arg(&count);
    launch.arg(&threshold);
    launch.arg(&keep);
    launch.arg(&mut out);
    let config = LaunchConfig::for_num_elems(u32::try_from(n).map_err(|_| {
        Error::Msg(format!(
            "dropout mask of {n} elements: more than a launch holds"
        ))
    })?);
    // SAFETY: the arguments match the kernel's parameters in order and type; `keys` holds a
    // key per row of `out`, which has `n` elements.
    unsafe { launch.launch(config) }.w()?;
    Ok(CudaStorage::wrap_cuda_slice(out, device.clone()))
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device, Tensor};

    use super::super::dropout::{MaskOp, mask};

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
}
