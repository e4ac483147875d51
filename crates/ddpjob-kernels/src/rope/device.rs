//! The rotary embedding as one op with its own backward, for the GPU: from candle's ops it is
//! a cast, `rotate_half`'s two slices, negation and concatenation, two broadcast products, a
//! sum and a cast back forward, and about as many backward, on q and k of every layer (ncu on
//! an H200, 2026-11-26: most of a SmolLM2-shaped step's f32 products and casts). One kernel
//! each way here; the backward is the same rotation by the negated angles, since both halves of
//! a head share their frequencies. The host version is the reference the kernel is held to, bit
//! for bit; on the CPU in f32 the model keeps its own fused op (`ops::rope`).

use candle_core::{CpuStorage, CustomOp3, DType, Layout, Result, Shape, Tensor, bail};
use half::bf16;

/// Where the values sit: x is [.., t, heads, head_dim], at positions offset..offset + t of
/// tables of `positions` rows.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Geometry {
    pub(super) t: usize,
    pub(super) heads: usize,
    pub(super) head_dim: usize,
    pub(super) offset: usize,
}

impl Geometry {
    /// Checks x's and the tables' layouts (contiguous, an even head_dim, enough positions).
    fn of(lx: &Layout, lcos: &Layout, lsin: &Layout, offset: usize) -> Result<Geometry> {
        let dims = lx.dims();
        let (tables, rows) = (lcos.dims(), lcos.dims().first().copied().unwrap_or(0));
        if dims.len() < 3 || !lx.is_contiguous() {
            bail!("rope: contiguous values [.., t, heads, head_dim], not {dims:?}");
        }
        let (t, heads, head_dim) = (
            dims[dims.len() - 3],
            dims[dims.len() - 2],
            dims[dims.len() - 1],
        );
        if head_dim % 2 != 0
            || tables != [rows, head_dim]
            || lsin.dims() != tables
            || !lcos.is_contiguous()
            || !lsin.is_contiguous()
            || offset + t > rows
        {
            bail!(
                "rope: tables {tables:?} and {:?} for positions {offset}..{} of head_dim {head_dim}",
                lsin.dims(),
                offset + t
            );
        }
        Ok(Geometry {
            t,
            heads,
            head_dim,
            offset,
        })
    }
}

/// `x · cos + rotate_half(x) · sin` for `x` [.., t, heads, head_dim] (f32 or bf16, computed in
/// f32, the result in x's dtype) at positions `offset..`, with the tables' rows; differentiable
/// in x.
pub fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor, offset: usize) -> Result<Tensor> {
    x.contiguous()?
        .apply_op3(cos, sin, Rope { offset, sign: 1.0 })
}

/// The rotation by the tables' angles (`sign` 1) or their negatives (−1, the backward).
#[derive(Debug, Clone, Copy)]
struct Rope {
    offset: usize,
    sign: f32,
}

impl CustomOp3 for Rope {
    fn name(&self) -> &'static str {
        "ddpjob-gpu-rope"
    }

    /// The kernel's arithmetic, value by value.
    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        lx: &Layout,
        cos: &CpuStorage,
        lcos: &Layout,
        sin: &CpuStorage,
        lsin: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let g = Geometry::of(lx, lcos, lsin, self.offset)?;
        let (cos, sin) = (
            crate::host::values(cos, lcos)?,
            crate::host::values(sin, lsin)?,
        );
        let rotate = |x: &[f32]| -> Vec<f32> {
            let (hd, half) = (g.head_dim, g.head_dim / 2);
            (0..x.len())
                .map(|i| {
                    let j = i % hd;
                    let at = ((i / hd / g.heads) % g.t + g.offset) * hd + j;
                    let r = if j < half { -x[i + half] } else { x[i - half] };
                    x[i] * cos[at] + (self.sign * r) * sin[at]
                })
                .collect()
        };
        let span = lx.start_offset()..lx.start_offset() + lx.shape().elem_count();
        let out = match x {
            CpuStorage::F32(v) => CpuStorage::F32(rotate(&v[span])),
            CpuStorage::BF16(v) => {
                let x: Vec<f32> = v[span].iter().map(|v| v.to_f32()).collect();
                CpuStorage::BF16(rotate(&x).into_iter().map(bf16::from_f32).collect())
            }
            other => bail!(
                "rope: f32 or bf16 values, not {:?}",
                candle_core::backend::BackendStorage::dtype(other)
            ),
        };
        Ok((out, lx.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        lx: &Layout,
        cos: &candle_core::CudaStorage,
        lcos: &Layout,
        sin: &candle_core::CudaStorage,
        lsin: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let g = Geometry::of(lx, lcos, lsin, self.offset)?;
        let y = super::cuda::run((x, lx), (cos, lcos), (sin, lsin), &g, self.sign)?;
        Ok((y, lx.shape().clone()))
    }

    fn bwd(
        &self,
        _x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        _out: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let back = Rope {
            offset: self.offset,
            sign: -self.sign,
        };
        let dx = grad.contiguous()?.apply_op3_no_bwd(cos, sin, &back)?;
        Ok((Some(dx), None, None))
    }
}

/// Whether the op takes `x` (a GPU's f32 or bf16 values of an even head_dim).
pub(super) fn applies(x: &Tensor) -> bool {
    x.device().is_cuda()
        && matches!(x.dtype(), DType::F32 | DType::BF16)
        && x.dims().last().is_some_and(|d| d % 2 == 0)
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device, Tensor, Var};

    use super::rope;
    use crate::host::f32_bits;
    use crate::rope::{RopeTables, inverse_frequencies};

    /// The rotation of fixed values [2, 5, 3, 8] at positions 3.. and x's gradient under an
    /// uneven weighting, on `device` in `dtype`, by the op or by candle's ops. The weights are
    /// made on the host (a GPU's `sin` differs from the host's in the last bit, and the
    /// output's gradient is the weights).
    fn run(device: &Device, dtype: DType, fused: bool) -> (Vec<u32>, Vec<u32>) {
        let tables = RopeTables::new(&inverse_frequencies(8, 10_000.0, None), 12, device).unwrap();
        let v: Vec<f32> = (0..240).map(|i| (i as f32 * 0.37).sin() * 3.1).collect();
        let x = Tensor::from_vec(v, (2, 5, 3, 8), device)
            .unwrap()
            .to_dtype(dtype)
            .unwrap();
        let x = Var::from_tensor(&x).unwrap();
        let y = match fused {
            true => rope(&x, &tables.cos, &tables.sin, 3).unwrap(),
            false => tables.apply_with_ops(&x, 3).unwrap(),
        };
        let w: Vec<f32> = (0..240).map(|i| (i as f32 * 1.3).sin()).collect();
        let w = Tensor::from_vec(w, (2, 5, 3, 8), device).unwrap();
        let weighted = (y.to_dtype(DType::F32).unwrap() * w).unwrap();
        let grads = weighted.sum_all().unwrap().backward().unwrap();
        (f32_bits(&y), f32_bits(grads.get(&x).unwrap()))
    }

    /// On the host the op gives candle's ops' values and gradient bit for bit, in f32 and bf16.
    #[test]
    fn equals_candles_ops_bit_for_bit() {
        for dtype in [DType::F32, DType::BF16] {
            assert_eq!(
                run(&Device::Cpu, dtype, true),
                run(&Device::Cpu, dtype, false),
                "{dtype:?}"
            );
        }
    }

    /// Runs where a GPU is: the kernel gives the host's values and gradient bit for bit.
    #[test]
    fn the_gpu_kernel_gives_the_host_values() {
        let Ok(gpu) = Device::new_cuda(0) else {
            eprintln!("skipping: no GPU");
            return;
        };
        for dtype in [DType::F32, DType::BF16] {
            assert_eq!(
                run(&gpu, dtype, true),
                run(&Device::Cpu, dtype, true),
                "{dtype:?}"
            );
        }
    }
}
