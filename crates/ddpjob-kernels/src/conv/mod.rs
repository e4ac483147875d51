//! 2-D convolution (+ bias, optional ReLU, optional 2×2 max-pool) as im2col + GEMM, one sample
//! per GEMM and one contiguous range of samples per thread, so each thread's column buffer stays
//! in its cache. Backward: the weight gradient is gz·colsᵀ summed over samples, the input
//! gradient Wᵀ·gz folded back with col2im, and skipped when the input is data.

#[cfg(feature = "cuda")]
pub(crate) mod cuda;
pub(crate) mod unfolded;

use std::sync::Mutex;

use candle_core::{CpuStorage, CustomOp3, Layout, Result, Shape, Tensor, bail};

use crate::host::{Mat, gemm, per_sample, sum_parts, values, with_values};
use crate::pool::{Maps, bias_relu_pool, pool_grad};
use crate::{scratch, transpose};

/// Stride and zero padding, the same along both spatial axes (dilation 1, one group).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConvGeometry {
    pub stride: usize,
    pub padding: usize,
}

/// What follows the convolution (and its ReLU, if any).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pooling {
    None,
    /// `max_pool2d(2)`: 2×2 windows, stride 2, an odd last row or column dropped (as torch).
    Max2,
}

/// `pool(relu(conv2d(x, weight) + bias))` for `x` [n, c, h, w], `weight` [o, c, k, k], `bias` `[o]`.
pub fn conv2d(
    x: &Tensor,
    weight: &Tensor,
    bias: &Tensor,
    geometry: ConvGeometry,
    relu: bool,
    pooling: Pooling,
) -> Result<Tensor> {
    let op = ConvOp {
        geometry,
        relu,
        pooling,
        argmax: Mutex::new(Vec::new()),
    };
    x.contiguous()?
        .apply_op3(&weight.contiguous()?, &bias.contiguous()?, op)
}

/// One convolution layer (with its ReLU and pooling) on f32 values, for hand-written
/// training passes (`models::chain`): the same computation as [`conv2d`]'s op.
#[derive(Debug, Clone, Copy)]
pub struct ConvLayer {
    pub geometry: ConvGeometry,
    pub relu: bool,
    pub pooling: Pooling,
}

/// A [`ConvLayer`]'s output and what its backward needs besides.
pub struct ConvOutput {
    pub values: Vec<f32>,
    /// [n, o, oh, ow] (after pooling).
    pub dims: [usize; 4],
    argmax: Vec<u8>,
}

impl ConvLayer {
    fn dims(&self, x_dims: [usize; 4], w_dims: [usize; 4]) -> Result<Dims> {
        let (x, w) = (Shape::from(&x_dims), Shape::from(&w_dims));
        Dims::new(&x, &w, self.geometry, self.pooling)
    }

    fn op(&self) -> ConvOp {
        ConvOp {
            geometry: self.geometry,
            relu: self.relu,
            pooling: self.pooling,
            argmax: Mutex::new(Vec::new()),
        }
    }

    /// The layer on `x` [n, c, h, w] (`x_dims`) with `w` [o, c, k, k] (`w_dims`) and `b` `[o]`.
    pub fn forward(
        &self,
        x: &[f32],
        x_dims: [usize; 4],
        (w, w_dims): (&[f32], [usize; 4]),
        b: &[f32],
    ) -> Result<ConvOutput> {
        let d = self.dims(x_dims, w_dims)?;
        if x.len() != d.n * d.input() || w.len() != d.o * d.ckk || b.len() != d.o {
            bail!(
                "conv2d: {} inputs, {} weights, {} biases for {d:?}",
                x.len(),
                w.len(),
                b.len()
            );
        }
        let (values, argmax) = self.op().forward_values(x, w, b, &d);
        let dims = d.out_shape(self.pooling).dims4()?;
        Ok(ConvOutput {
            values,
            dims: [dims.0, dims.1, dims.2, dims.3],
            argmax,
        })
    }

    /// The backward of [`ConvLayer::forward`] given the output's gradient `g`: the input's
    /// (when `need_gx`), the weight's and the bias's gradients.
    pub fn backward(
        &self,
        x: &[f32],
        x_dims: [usize; 4],
        (w, w_dims): (&[f32], [usize; 4]),
        out: &ConvOutput,
        g: &[f32],
        need_gx: bool,
    ) -> Result<super::LayerGrads> {
        let d = self.dims(x_dims, w_dims)?;
        if g.len() != out.values.len() {
            bail!(
                "conv2d backward: {} gradients for {} outputs",
                g.len(),
                out.values.len()
            );
        }
        Ok(self
            .op()
            .backward_values(x, w, g, &out.values, &out.argmax, &d, need_gx))
    }
}

struct ConvOp {
    geometry: ConvGeometry,
    relu: bool,
    pooling: Pooling,
    /// Which of its 2×2 window each pooled output came from (forward → backward).
    argmax: Mutex<Vec<u8>>,
}

/// Sizes of one call; `l` = output pixels per channel, `ckk` = rows of a sample's column matrix.
#[derive(Debug, Clone, Copy)]
pub(super) struct Dims {
    pub(super) n: usize,
    pub(super) c: usize,
    pub(super) h: usize,
    pub(super) w: usize,
    pub(super) o: usize,
    pub(super) k: usize,
    pub(super) stride: usize,
    pub(super) pad: usize,
    pub(super) oh: usize,
    pub(super) ow: usize,
    pub(super) l: usize,
    pub(super) ckk: usize,
    /// Output values per sample (after pooling).
    pub(super) out: usize,
}

impl Dims {
    pub(super) fn new(
        x: &Shape,
        w: &Shape,
        geometry: ConvGeometry,
        pooling: Pooling,
    ) -> Result<Self> {
        let (n, c, h, wd) = x.dims4()?;
        let (o, wc, k, k2) = w.dims4()?;
        let ConvGeometry { stride, padding } = geometry;
        if wc != c || k != k2 || stride == 0 || h + 2 * padding < k || wd + 2 * padding < k {
            bail!(
                "conv2d: input {x:?} does not fit weight {w:?} with stride {stride}, padding {padding}"
            );
        }
        let oh = (h + 2 * padding - k) / stride + 1;
        let ow = (wd + 2 * padding - k) / stride + 1;
        let (out_h, out_w) = pooled_size(oh, ow, pooling);
        Ok(Dims {
            n,
            c,
            h,
            w: wd,
            o,
            k,
            stride,
            pad: padding,
            oh,
            ow,
            l: oh * ow,
            ckk: c * k * k,
            out: o * out_h * out_w,
        })
    }

    pub(super) fn input(&self) -> usize {
        self.c * self.h * self.w
    }

    /// The output maps of one sample before pooling.
    fn maps(&self) -> Maps {
        Maps {
            channels: self.o,
            rows: self.oh,
            cols: self.ow,
        }
    }

    /// The output's spatial size after `pooling`.
    pub(super) fn out_hw(&self, pooling: Pooling) -> (usize, usize) {
        pooled_size(self.oh, self.ow, pooling)
    }

    pub(super) fn out_shape(&self, pooling: Pooling) -> Shape {
        let (h, w) = self.out_hw(pooling);
        (self.n, self.o, h, w).into()
    }

    /// The output columns `ox` whose input column `ox·stride + kx - pad` lies inside the image.
    fn inside(&self, kx: usize) -> std::ops::Range<usize> {
        let first = self.pad.saturating_sub(kx).div_ceil(self.stride);
        let end = (self.w + self.pad)
            .saturating_sub(kx)
            .div_ceil(self.stride)
            .min(self.ow);
        first.min(end)..end
    }
}

/// A map of `h` × `w` after `pooling` (an odd last row or column dropped).
fn pooled_size(h: usize, w: usize, pooling: Pooling) -> (usize, usize) {
    match pooling {
        Pooling::None => (h, w),
        Pooling::Max2 => (h / 2, w / 2),
    }
}

/// Unfolds one sample [c, h, w] into `cols` [c·k·k, oh·ow] (zeros where the window is padding).
fn im2col(x: &[f32], d: &Dims, cols: &mut [f32]) {
    for c in 0..d.c {
        let plane = &x[c * d.h * d.w..][..d.h * d.w];
        for ky in 0..d.k {
            for kx in 0..d.k {
                let row = &mut cols[((c * d.k + ky) * d.k + kx) * d.l..][..d.l];
                let inside = d.inside(kx);
                for (oy, out) in row.chunks_exact_mut(d.ow).enumerate() {
                    let iy = (oy * d.stride + ky).wrapping_sub(d.pad);
                    if iy >= d.h {
                        out.fill(0.0);
                        continue;
                    }
                    let line = &plane[iy * d.w..][..d.w];
                    out[..inside.start].fill(0.0);
                    out[inside.end..].fill(0.0);
                    if inside.is_empty() {
                        continue;
                    }
                    let x0 = inside.start * d.stride + kx - d.pad;
                    if d.stride == 1 {
                        copy_short(&mut out[inside.clone()], &line[x0..]);
                    } else {
                        for (v, src) in out[inside.clone()]
                            .iter_mut()
                            .zip(line[x0..].iter().step_by(d.stride))
                        {
                            *v = *src;
                        }
                    }
                }
            }
        }
    }
}

/// `dst` = the first `dst.len()` values of `src`, in 8-value blocks the compiler copies with
/// vector moves: im2col copies thousands of rows of a few dozen values per sample, and a
/// `memcpy` call for each (what `copy_from_slice` becomes) cost as much as the copy.
#[inline(always)]
fn copy_short(dst: &mut [f32], src: &[f32]) {
    let src = &src[..dst.len()];
    let mut blocks = dst.chunks_exact_mut(8);
    let mut from = src.chunks_exact(8);
    for (d, s) in (&mut blocks).zip(&mut from) {
        let block: [f32; 8] = s.try_into().expect("8 values");
        d.copy_from_slice(&block);
    }
    for (d, s) in blocks.into_remainder().iter_mut().zip(from.remainder()) {
        *d = *s;
    }
}

/// The adjoint of [`im2col`]: adds `cols` back onto the sample gradient `gx` [c, h, w].
fn col2im(cols: &[f32], d: &Dims, gx: &mut [f32]) {
    for c in 0..d.c {
        let plane = &mut gx[c * d.h * d.w..][..d.h * d.w];
        for ky in 0..d.k {
            for kx in 0..d.k {
                let row = &cols[((c * d.k + ky) * d.k + kx) * d.l..][..d.l];
                let inside = d.inside(kx);
                for (oy, src) in row.chunks_exact(d.ow).enumerate() {
                    let iy = (oy * d.stride + ky).wrapping_sub(d.pad);
                    if iy >= d.h || inside.is_empty() {
                        continue;
                    }
                    let line = &mut plane[iy * d.w..][..d.w];
                    let x0 = inside.start * d.stride + kx - d.pad;
                    let src = &src[inside.clone()];
                    if d.stride == 1 {
                        for (dst, v) in line[x0..x0 + src.len()].iter_mut().zip(src) {
                            *dst += v;
                        }
                    } else {
                        for (dst, v) in line[x0..].iter_mut().step_by(d.stride).zip(src) {
                            *dst += v;
                        }
                    }
                }
            }
        }
    }
}

impl ConvOp {
    /// The forward of `n` samples `x` (see [`Dims`]): the outputs and, when pooled, which
    /// place of its window each output came from.
    fn forward_values(&self, x: &[f32], w: &[f32], b: &[f32], d: &Dims) -> (Vec<f32>, Vec<u8>) {
        let d = *d;
        // Every output is written: by the product, or by the pooling.
        let mut out = scratch::take(d.n * d.out);
        let pooled = self.pooling == Pooling::Max2;
        let mut argmax = vec![0u8; if pooled { d.n * d.out } else { 0 }];
        let per_arg = if pooled { d.out } else { 0 };
        per_sample(
            d.n,
            ((&mut out, d.out), (&mut argmax, per_arg)),
            |range, out, argmax| {
                let mut cols = scratch::take(d.ckk * d.l);
                let mut z = scratch::take(if pooled { d.o * d.l } else { 0 });
                for (i, s) in range.enumerate() {
                    let xs = &x[s * d.input()..][..d.input()];
                    let dst = &mut out[i * d.out..][..d.out];
                    if pooled {
                        self.product(xs, w, &d, &mut cols, &mut z);
                        let argmax = &mut argmax[i * d.out..][..d.out];
                        bias_relu_pool(&z, b, self.relu, d.maps(), dst, argmax);
                    } else {
                        self.product(xs, w, &d, &mut cols, dst);
                        self.bias_relu(b, &d, dst);
                    }
                }
                scratch::give([cols, z]);
            },
        );
        (out, argmax)
    }

    /// The backward of [`ConvOp::forward_values`] given the outputs `y`, their gradient `g`
    /// and the pooling record: the input's gradient (when `need_gx`), the weight's and the
    /// bias's.
    #[allow(clippy::too_many_arguments)]
    fn backward_values(
        &self,
        x: &[f32],
        w: &[f32],
        g: &[f32],
        y: &[f32],
        argmax: &[u8],
        d: &Dims,
        need_gx: bool,
    ) -> super::LayerGrads {
        let d = *d;
        let mut gx = vec![0f32; if need_gx { d.n * d.input() } else { 0 }];
        let per_gx = if need_gx { d.input() } else { 0 };
        let parts = per_sample(
            d.n,
            ((&mut gx, per_gx), (&mut [0u8; 0][..], 0)),
            |range, gx, _| {
                let mut cols = scratch::take(d.ckk * d.l);
                let mut gcols = scratch::take(if need_gx { d.ckk * d.l } else { 0 });
                let mut gz = scratch::take(d.o * d.l);
                // Its transpose [c·k·k, o]: gemm then reads the columns in place instead of
                // copying them for every sample.
                let mut gw_t = vec![0f32; d.ckk * d.o];
                let mut gb = vec![0f32; d.o];
                for (i, s) in range.enumerate() {
                    let at = s * d.out..(s + 1) * d.out;
                    let arg = argmax.get(at.clone()).unwrap_or_default();
                    self.grad_at_conv(&g[at.clone()], &y[at], arg, &d, &mut gz);
                    for (acc, row) in gb.iter_mut().zip(gz.chunks_exact(d.l)) {
                        *acc += crate::host::sum_map(row, |v| v);
                    }
                    im2col(&x[s * d.input()..][..d.input()], &d, &mut cols);
                    gemm(
                        &mut gw_t,
                        Mat::new(&cols, d.ckk, d.l),
                        Mat::new(&gz, d.o, d.l).t(),
                        true,
                        1,
                    );
                    if need_gx {
                        gemm(
                            &mut gcols,
                            Mat::new(w, d.o, d.ckk).t(),
                            Mat::new(&gz, d.o, d.l),
                            false,
                            1,
                        );
                        col2im(&gcols, &d, &mut gx[i * d.input()..][..d.input()]);
                    }
                }
                scratch::give([cols, gcols, gz]);
                let mut gw = vec![0f32; d.o * d.ckk];
                transpose(&gw_t, d.o, d.ckk, d.o, &mut gw, d.ckk);
                (gw, gb)
            },
        );
        let (gws, gbs): (Vec<_>, Vec<_>) = parts.into_iter().unzip();
        (need_gx.then_some(gx), sum_parts(gws), sum_parts(gbs))
    }

    /// W·cols for one sample `x` into `z` [o, l].
    fn product(&self, x: &[f32], w: &[f32], d: &Dims, cols: &mut [f32], z: &mut [f32]) {
        im2col(x, d, cols);
        gemm(
            z,
            Mat::new(w, d.o, d.ckk),
            Mat::new(cols, d.ckk, d.l),
            false,
            1,
        );
    }

    /// z = relu(z + b) for one sample's `z` [o, l] (NaN kept, as `relu_in_place`).
    fn bias_relu(&self, b: &[f32], d: &Dims, z: &mut [f32]) {
        for (row, &bias) in z.chunks_exact_mut(d.l).zip(b) {
            if self.relu {
                for v in row {
                    let biased = *v + bias;
                    *v = if biased < 0.0 { 0.0 } else { biased };
                }
            } else {
                for v in row {
                    *v += bias;
                }
            }
        }
    }

    /// The gradient at the convolution's output (before ReLU and pooling) for one sample.
    fn grad_at_conv(&self, g: &[f32], y: &[f32], argmax: &[u8], d: &Dims, gz: &mut [f32]) {
        let passes = |y: f32| !self.relu || y > 0.0;
        match self.pooling {
            Pooling::None => {
                for ((dst, &g), &y) in gz.iter_mut().zip(g).zip(y) {
                    *dst = if passes(y) { g } else { 0.0 };
                }
            }
            Pooling::Max2 => pool_grad(g, y, argmax, self.relu, d.maps(), gz),
        }
    }
}

impl CustomOp3 for ConvOp {
    fn name(&self) -> &'static str {
        "ddpjob-conv2d"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        x_layout: &Layout,
        w: &CpuStorage,
        w_layout: &Layout,
        b: &CpuStorage,
        b_layout: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let d = Dims::new(
            x_layout.shape(),
            w_layout.shape(),
            self.geometry,
            self.pooling,
        )?;
        if b_layout.shape().dims1()? != d.o {
            bail!("conv2d: bias {:?} for {} channels", b_layout.shape(), d.o);
        }
        let (x, w, b) = (
            values(x, x_layout)?,
            values(w, w_layout)?,
            values(b, b_layout)?,
        );
        let (out, argmax) = self.forward_values(x, w, b, &d);
        *self.argmax.lock().unwrap_or_else(|e| e.into_inner()) = argmax;
        Ok((CpuStorage::F32(out), d.out_shape(self.pooling)))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _b: &Tensor,
        out: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let d = Dims::new(x.shape(), w.shape(), self.geometry, self.pooling)?;
        let need_gx = x.track_op();
        let argmax = self.argmax.lock().unwrap_or_else(|e| e.into_inner());
        if self.pooling == Pooling::Max2 && argmax.len() != d.n * d.out {
            bail!("conv2d backward: the forward's pooling record is missing");
        }
        let (gx, gw, gb) = with_values(x, |x| {
            with_values(w, |w| {
                with_values(grad, |g| {
                    with_values(out, |y| {
                        Ok(self.backward_values(x, w, g, y, &argmax, &d, need_gx))
                    })
                })
            })
        })?;
        let device = x.device();
        let gx = match gx {
            Some(gx) => Some(Tensor::from_vec(gx, x.shape(), device)?),
            None => None,
        };
        Ok((
            gx,
            Some(Tensor::from_vec(gw, w.shape(), device)?),
            Some(Tensor::from_vec(gb, d.o, device)?),
        ))
    }
}
