//! The convolution layer (+ bias, ReLU, 2×2 max-pool) on a GPU. Candle's CUDA convolution has
//! no cuDNN here: its forward is im2col, a product and a layout copy, and its backward an
//! input gradient by a naive transposed-convolution kernel (each thread loops over every
//! output channel and tap) and a weight gradient by a second convolution of transposed
//! copies; the bias, ReLU and pooling add a broadcast, a reduction and a comparison each way.
//! Here: the input unfolded once into [n·oh·ow, c·k·k], one product with the weights (cuBLAS),
//! bias + ReLU + pooling in one kernel; backward: one kernel back through them, the two
//! products, the column sums for the bias, and the fold back onto the input as a gather (no
//! atomics: the same sums in the same order every time).
//!
//! Each kernel is an op whose host version is its reference, index for index, so the whole
//! layer also runs on the CPU, where the tests hold it to the fused CPU kernel (`conv`).

use candle_core::{CpuStorage, CustomOp1, CustomOp2, CustomOp3, DType, Layout, Result, Shape};
use candle_core::{Tensor, bail};

use super::{ConvGeometry, Dims, Pooling};

/// The kernels (one thread per output value; f32 arithmetic over f32 or bf16 values, no fused
/// multiply-adds: only sums, so they round as the host references do).
#[cfg(any(feature = "cuda", test))]
pub(super) const SOURCE: &str = include_str!("kernels.cu");

/// Whether [`conv2d_unfolded`] is how a layer runs on `x`'s device: a GPU, f32 or bf16.
pub fn applies(x: &Tensor) -> bool {
    x.device().is_cuda() && matches!(x.dtype(), DType::F32 | DType::BF16)
}

/// `pool(relu(conv2d(x, weight) + bias))` for `x` [n, c, h, w], `weight` [o, c, k, k] and
/// `bias` `[o]`, all of one dtype (f32 or bf16), differentiable in all three.
pub fn conv2d_unfolded(
    x: &Tensor,
    weight: &Tensor,
    bias: &Tensor,
    geometry: ConvGeometry,
    relu: bool,
    pooling: Pooling,
) -> Result<Tensor> {
    let d = Dims::new(x.shape(), weight.shape(), geometry, pooling)?;
    if bias.dims1()? != d.o || x.dtype() != weight.dtype() || x.dtype() != bias.dtype() {
        bail!(
            "conv2d: bias {:?} ({:?}) for {} channels of {:?} weights and {:?} inputs",
            bias.shape(),
            bias.dtype(),
            d.o,
            weight.dtype(),
            x.dtype()
        );
    }
    let cols = x.contiguous()?.apply_op1(Unfold(d))?;
    let z = cols.matmul(&weight.reshape((d.o, d.ckk))?.t()?)?;
    let finish = Finish { d, relu, pooling };
    z.apply_op2(&bias.contiguous()?, finish)
}

/// `relu(z + bias)` (`z + bias` without `relu`) for a linear layer's product `z` [n, o] and
/// `bias` `[o]` of its dtype on a GPU: the convolution's finishing kernel on 1×1 images. One
/// kernel forward where candle's broadcast addition and ReLU take two; back, one kernel and
/// the bias's column sums where candle's ReLU takes a fill, a comparison, a cast and a product
/// before its sum.
pub fn bias_relu(z: &Tensor, bias: &Tensor, relu: bool) -> Result<Tensor> {
    let Ok((n, o)) = z.dims2() else {
        bail!(
            "linear: products [n, outputs] expected, not {:?}",
            z.shape()
        );
    };
    if bias.dims1()? != o || z.dtype() != bias.dtype() {
        bail!(
            "linear: bias {:?} ({:?}) for {o} outputs of {:?} products",
            bias.shape(),
            bias.dtype(),
            z.dtype()
        );
    }
    let one_by_one = ConvGeometry {
        stride: 1,
        padding: 0,
    };
    let d = Dims::new(
        &Shape::from((n, 1, 1, 1)),
        &Shape::from((o, 1, 1, 1)),
        one_by_one,
        Pooling::None,
    )?;
    let finish = Finish {
        d,
        relu,
        pooling: Pooling::None,
    };
    z.contiguous()?
        .apply_op2(&bias.contiguous()?, finish)?
        .reshape((n, o))
}

/// x [n, c, h, w] → its windows as rows: [n·oh·ow, c·k·k] (zeros where a window is padding).
struct Unfold(Dims);

/// The adjoint of [`Unfold`]: each input place sums the window entries that read it.
struct Fold(Dims);

/// z [n·oh·ow, o] (the product) → `pool(relu(z + bias))` as [n, o, oh', ow'].
#[derive(Clone, Copy)]
pub(super) struct Finish {
    d: Dims,
    relu: bool,
    pooling: Pooling,
}

/// [`Finish`]'s gradient at z from z, the bias and the output's gradient: a pooled output's
/// gradient goes to the first maximum of its window where the ReLU passed it.
struct FinishGrad(Finish);

impl Finish {
    fn pooled(&self) -> bool {
        self.pooling == Pooling::Max2
    }

    /// The output's spatial size.
    fn out_hw(&self) -> (usize, usize) {
        self.d.out_hw(self.pooling)
    }

    /// The scalars the kernels take after their buffers and count: o, oh, ow, pooled, relu.
    #[cfg(any(feature = "cuda", test))]
    pub(super) fn scalars(&self) -> [u32; 5] {
        let d = &self.d;
        let flag = u32::from;
        [
            d.o as u32,
            d.oh as u32,
            d.ow as u32,
            flag(self.pooled()),
            flag(self.relu),
        ]
    }

    /// The window of pooled output (s, oc, py, px): its four values plus the bias, in
    /// row-major order.
    fn window(&self, z: &[f32], bias: f32, s: usize, oc: usize, py: usize, px: usize) -> [f32; 4] {
        let d = &self.d;
        let r = (s * d.oh + 2 * py) * d.ow + 2 * px;
        [r, r + 1, r + d.ow, r + d.ow + 1].map(|r| z[r * d.o + oc] + bias)
    }
}

impl Dims {
    /// The input's dims, [n, c, h, w].
    fn image(&self) -> [usize; 4] {
        [self.n, self.c, self.h, self.w]
    }

    /// The unfolded windows' dims, [n·oh·ow, c·k·k].
    fn windows(&self) -> [usize; 2] {
        [self.n * self.l, self.ckk]
    }
}

/// The scalars the unfold and fold kernels take after their buffers and count: c, h, w, k,
/// stride, pad, oh, ow.
#[cfg(any(feature = "cuda", test))]
pub(super) fn geometry_scalars(d: &Dims) -> [u32; 8] {
    [d.c, d.h, d.w, d.k, d.stride, d.pad, d.oh, d.ow].map(|v| v as u32)
}

/// Host references, value `i` of each op's output computed as its kernel's thread `i` does.
mod host {
    use super::{Dims, Finish};
    use crate::pool::pool_window;

    pub(super) fn unfolded(x: &[f32], d: &Dims, i: usize) -> f32 {
        let (row, col) = (i / d.ckk, i % d.ckk);
        let (kx, ky, ci) = (col % d.k, col / d.k % d.k, col / (d.k * d.k));
        let (ox, oy, s) = (row % d.ow, row / d.ow % d.oh, row / d.ow / d.oh);
        let iy = (oy * d.stride + ky).checked_sub(d.pad).filter(|&y| y < d.h);
        let ix = (ox * d.stride + kx).checked_sub(d.pad).filter(|&x| x < d.w);
        match (iy, ix) {
            (Some(iy), Some(ix)) => x[((s * d.c + ci) * d.h + iy) * d.w + ix],
            _ => 0.0,
        }
    }

    /// The output place a tap `k` reads input place `at` from, if any.
    fn source(at: usize, k: usize, d: &Dims, out: usize) -> Option<usize> {
        let t = (at + d.pad).checked_sub(k)?;
        (t % d.stride == 0 && t / d.stride < out).then_some(t / d.stride)
    }

    pub(super) fn folded(cols: &[f32], d: &Dims, i: usize) -> f32 {
        let (ix, iy, ci, s) = (
            i % d.w,
            i / d.w % d.h,
            i / d.w / d.h % d.c,
            i / d.w / d.h / d.c,
        );
        let mut sum = 0.0f32;
        for ky in 0..d.k {
            let Some(oy) = source(iy, ky, d, d.oh) else {
                continue;
            };
            for kx in 0..d.k {
                let Some(ox) = source(ix, kx, d, d.ow) else {
                    continue;
                };
                sum += cols[((s * d.oh + oy) * d.ow + ox) * d.ckk + (ci * d.k + ky) * d.k + kx];
            }
        }
        sum
    }

    pub(super) fn finished(f: &Finish, z: &[f32], b: &[f32], i: usize) -> f32 {
        let (d, (ph, pw)) = (&f.d, f.out_hw());
        let (px, py, oc, s) = (i % pw, i / pw % ph, i / pw / ph % d.o, i / pw / ph / d.o);
        if f.pooled() {
            return pool_window(f.window(z, b[oc], s, oc, py, px), f.relu).0;
        }
        let v = z[((s * d.oh + py) * d.ow + px) * d.o + oc] + b[oc];
        if f.relu && v < 0.0 { 0.0 } else { v }
    }

    pub(super) fn finish_grad(f: &Finish, z: &[f32], b: &[f32], g: &[f32], i: usize) -> f32 {
        let d = &f.d;
        let (oc, row) = (i % d.o, i / d.o);
        let (ox, oy, s) = (row % d.ow, row / d.ow % d.oh, row / d.ow / d.oh);
        if !f.pooled() {
            let v = z[i] + b[oc];
            let passes = !f.relu || v > 0.0;
            return if passes {
                g[((s * d.o + oc) * d.oh + oy) * d.ow + ox]
            } else {
                0.0
            };
        }
        let ((ph, pw), (py, px)) = (f.out_hw(), (oy / 2, ox / 2));
        if py >= ph || px >= pw {
            return 0.0;
        }
        // After a ReLU the output is positive exactly where the window's maximum is.
        let (y, first) = pool_window(f.window(z, b[oc], s, oc, py, px), f.relu);
        let mine = (oy - 2 * py) * 2 + (ox - 2 * px);
        if usize::from(first) == mine && (!f.relu || y > 0.0) {
            g[((s * d.o + oc) * ph + py) * pw + px]
        } else {
            0.0
        }
    }
}

/// `count` values made by `value` (f32), stored in `dtype`.
fn host_made(count: usize, dtype: DType, value: impl Fn(usize) -> f32) -> CpuStorage {
    crate::narrowed((0..count).map(value).collect(), dtype)
}

/// Checks that a layout holds `shape`, contiguously.
fn expect_shape(l: &Layout, shape: &[usize], what: &str) -> Result<()> {
    if l.dims() != shape || l.contiguous_offsets().is_none() {
        bail!("{what}: contiguous {shape:?} expected, not {:?}", l.dims());
    }
    Ok(())
}

impl CustomOp1 for Unfold {
    fn name(&self) -> &'static str {
        "ddpjob-unfold"
    }

    fn cpu_fwd(&self, x: &CpuStorage, lx: &Layout) -> Result<(CpuStorage, Shape)> {
        let d = &self.0;
        expect_shape(lx, &d.image(), "unfold")?;
        let (x, dtype) = crate::widened(x, lx, "unfold")?;
        let cols = host_made(d.n * d.l * d.ckk, dtype, |i| host::unfolded(&x, d, i));
        Ok((cols, Shape::from(&d.windows()[..])))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        lx: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let d = &self.0;
        expect_shape(lx, &d.image(), "unfold")?;
        let cols = super::cuda::unfold(x, lx, d)?;
        Ok((cols, Shape::from(&d.windows()[..])))
    }

    fn bwd(&self, _x: &Tensor, _cols: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(grad.contiguous()?.apply_op1_no_bwd(&Fold(self.0))?))
    }
}

impl CustomOp1 for Fold {
    fn name(&self) -> &'static str {
        "ddpjob-fold"
    }

    fn cpu_fwd(&self, cols: &CpuStorage, lc: &Layout) -> Result<(CpuStorage, Shape)> {
        let d = &self.0;
        expect_shape(lc, &d.windows(), "fold")?;
        let (cols, dtype) = crate::widened(cols, lc, "fold")?;
        let x = host_made(d.n * d.input(), dtype, |i| host::folded(&cols, d, i));
        Ok((x, Shape::from(&d.image()[..])))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        cols: &candle_core::CudaStorage,
        lc: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let d = &self.0;
        expect_shape(lc, &d.windows(), "fold")?;
        let x = super::cuda::fold(cols, lc, d)?;
        Ok((x, Shape::from(&d.image()[..])))
    }
}

impl Finish {
    fn check(&self, lz: &Layout, lb: &Layout) -> Result<Shape> {
        let d = &self.d;
        expect_shape(lz, &[d.n * d.l, d.o], "conv2d's bias, ReLU and pooling")?;
        expect_shape(lb, &[d.o], "conv2d's bias")?;
        Ok(d.out_shape(self.pooling))
    }
}

impl CustomOp2 for Finish {
    fn name(&self) -> &'static str {
        "ddpjob-conv-finish"
    }

    fn cpu_fwd(
        &self,
        z: &CpuStorage,
        lz: &Layout,
        b: &CpuStorage,
        lb: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let shape = self.check(lz, lb)?;
        let ((z, dtype), (b, _)) = (
            crate::widened(z, lz, "conv2d")?,
            crate::widened(b, lb, "conv2d")?,
        );
        let y = host_made(shape.elem_count(), dtype, |i| {
            host::finished(self, &z, &b, i)
        });
        Ok((y, shape))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        z: &candle_core::CudaStorage,
        lz: &Layout,
        b: &candle_core::CudaStorage,
        lb: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let shape = self.check(lz, lb)?;
        let y = super::cuda::finish(self, (z, lz), (b, lb), shape.elem_count())?;
        Ok((y, shape))
    }

    fn bwd(
        &self,
        z: &Tensor,
        b: &Tensor,
        _y: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let gz = z.apply_op3_no_bwd(b, &grad.contiguous()?, &FinishGrad(*self))?;
        let gb = crate::column_sums(&gz, self.d.o)?;
        Ok((Some(gz), Some(gb)))
    }
}

impl CustomOp3 for FinishGrad {
    fn name(&self) -> &'static str {
        "ddpjob-conv-finish-grad"
    }

    fn cpu_fwd(
        &self,
        z: &CpuStorage,
        lz: &Layout,
        b: &CpuStorage,
        lb: &Layout,
        g: &CpuStorage,
        lg: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let f = &self.0;
        let out = f.check(lz, lb)?;
        expect_shape(lg, out.dims(), "conv2d's output gradient")?;
        let (z, dtype) = crate::widened(z, lz, "conv2d backward")?;
        let ((b, _), (g, _)) = (
            crate::widened(b, lb, "conv2d")?,
            crate::widened(g, lg, "conv2d")?,
        );
        let gz = host_made(z.len(), dtype, |i| host::finish_grad(f, &z, &b, &g, i));
        Ok((gz, lz.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        z: &candle_core::CudaStorage,
        lz: &Layout,
        b: &candle_core::CudaStorage,
        lb: &Layout,
        g: &candle_core::CudaStorage,
        lg: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let out = self.0.check(lz, lb)?;
        expect_shape(lg, out.dims(), "conv2d's output gradient")?;
        let gz = super::cuda::finish_grad(&self.0, (z, lz), (b, lb), (g, lg))?;
        Ok((gz, lz.shape().clone()))
    }
}

#[cfg(test)]
mod tests;
