//! LayerNorm, GELU and causal softmax with gradients. candle-nn 0.11's fused `layer_norm` and
//! `softmax_last_dim` have no backward (they are applied with `apply_op*_no_bwd`), and candle's
//! GELU backward is a dozen tensor ops. For f32 on the CPU, LayerNorm and GELU here are one op
//! each (forward and backward one pass over the values); elsewhere (GPU, bf16) they are
//! composed from candle's differentiable ops, which the tests check the fused ones against.

use candle_core::{
    CpuStorage, CustomOp1, CustomOp3, D, DType, Layout, Result, Shape, Tensor, bail,
};
use rayon::prelude::*;
use std::ops::Range;

use crate::kernels;

/// LayerNorm over the last dimension: `(x - mean) / sqrt(var + eps) · gain + bias`, computed
/// in f32 whatever the dtype of `x` (as torch's autocast does); the result is f32.
pub fn layer_norm(x: &Tensor, gain: &Tensor, bias: &Tensor, eps: f64) -> Result<Tensor> {
    if kernels::applies(x) {
        return x
            .contiguous()?
            .apply_op3(gain, bias, LayerNormOp { eps: eps as f32 });
    }
    layer_norm_with_ops(x, gain, bias, eps)
}

/// [`layer_norm`] from candle's differentiable ops, for any device and dtype.
pub fn layer_norm_with_ops(x: &Tensor, gain: &Tensor, bias: &Tensor, eps: f64) -> Result<Tensor> {
    let x = x.to_dtype(DType::F32)?;
    let centred = x.broadcast_sub(&x.mean_keepdim(D::Minus1)?)?;
    let var = centred.sqr()?.mean_keepdim(D::Minus1)?;
    centred
        .broadcast_div(&(var + eps)?.sqrt()?)?
        .broadcast_mul(gain)?
        .broadcast_add(bias)
}

/// `softmax(scale · att + causal mask)` over the last dimension of `att` [b, tq, tk], where
/// query row i sits at position `offset + i` and sees keys 0..=offset + i, from candle's ops
/// (the fused CPU attention has its own). Computed in f32, returned in the dtype of `att`.
/// `mask` is the [block, block] additive mask: 0 on and below the diagonal, -inf above.
pub fn causal_softmax_with_ops(
    att: &Tensor,
    scale: f64,
    offset: usize,
    mask: &Tensor,
) -> Result<Tensor> {
    let (_, tq, tk) = att.dims3()?;
    let mask = mask.narrow(0, offset, tq)?.narrow(1, 0, tk)?;
    let scores = (att.to_dtype(DType::F32)? * scale)?.broadcast_add(&mask)?;
    candle_nn::ops::softmax(&scores, D::Minus1)?.to_dtype(att.dtype())
}

/// Exact (erf) GELU, `x · Φ(x)`: fused on the CPU for f32, candle's `gelu_erf` elsewhere.
pub fn gelu(x: &Tensor) -> Result<Tensor> {
    if kernels::applies(x) {
        return x.contiguous()?.apply_op1(GeluOp);
    }
    x.gelu_erf()
}

/// The kernels' accessors of f32 CPU values, shared by the GPT's ops.
pub(super) use crate::kernels::{values, with_values};

/// Rows handed to one rayon task: below this a fork costs more than it saves.
pub(super) const ROWS_PER_TASK: usize = 64;

struct LayerNormOp {
    eps: f32,
}

/// Mean and 1/std of one row (two passes, as torch).
#[inline(always)]
fn moments(row: &[f32], eps: f32) -> (f32, f32) {
    let n = row.len() as f32;
    let mean = sum_map(row, |v| v) / n;
    let var = sum_map(row, |v| (v - mean) * (v - mean)) / n;
    (mean, 1.0 / (var + eps).sqrt())
}

/// Σ f(v) in eight interleaved partial sums: the compiler may not reorder a sequential f32
/// sum, so without the lanes these reductions would run one element at a time. Inlined, so
/// that inside the [`simd`] loops they run as 8-wide vectors.
#[inline(always)]
pub(super) fn sum_map(v: &[f32], f: impl Fn(f32) -> f32) -> f32 {
    let mut lanes = [0f32; 8];
    let chunks = v.chunks_exact(8);
    let tail: f32 = chunks.remainder().iter().map(|&x| f(x)).sum();
    for chunk in chunks {
        for (lane, &x) in lanes.iter_mut().zip(chunk) {
            *lane += f(x);
        }
    }
    lanes.iter().sum::<f32>() + tail
}

/// Σ a·b, in lanes as [`sum_map`].
#[inline(always)]
pub(super) fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut lanes = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (ca, cb) in ca.zip(cb) {
        for ((lane, x), y) in lanes.iter_mut().zip(ca).zip(cb) {
            *lane += x * y;
        }
    }
    lanes.iter().sum::<f32>() + tail
}

/// The largest value (-inf for none), in lanes as [`sum_map`].
#[inline(always)]
pub(super) fn max(v: &[f32]) -> f32 {
    let mut lanes = [f32::NEG_INFINITY; 8];
    let chunks = v.chunks_exact(8);
    let tail = chunks
        .remainder()
        .iter()
        .fold(f32::NEG_INFINITY, |m, &x| m.max(x));
    for chunk in chunks {
        for (lane, &x) in lanes.iter_mut().zip(chunk) {
            *lane = lane.max(x);
        }
    }
    lanes.iter().fold(tail, |m, &x| m.max(x))
}

/// LayerNorm of the rows `x` (`gain.len()` values each) into `y`.
#[inline(always)]
fn layer_norm_rows<const FMA: bool>(
    x: &[f32],
    gain: &[f32],
    bias: &[f32],
    eps: f32,
    y: &mut [f32],
) {
    let c = gain.len();
    for (y, x) in y.chunks_exact_mut(c).zip(x.chunks_exact(c)) {
        let (mean, rstd) = moments(x, eps);
        for (((y, x), g), b) in y.iter_mut().zip(x).zip(gain).zip(bias) {
            *y = madd::<FMA>((x - mean) * rstd, *g, *b);
        }
    }
}

/// The backward of LayerNorm over the rows `x` (output gradient `gy`): the input gradient into
/// `dx` (added to it when `accumulate`), and Σ gy · x̂ and Σ gy added to `sums` (the gain's
/// and the bias's gradients). dx = rstd · (ĝ - mean(ĝ) - x̂ · mean(ĝ · x̂)) with ĝ = gy · gain.
#[inline(always)]
fn layer_norm_rows_bwd<const FMA: bool>(
    x: &[f32],
    gy: &[f32],
    gain: &[f32],
    eps: f32,
    dx: &mut [f32],
    accumulate: bool,
    sums: (&mut [f32], &mut [f32]),
) {
    let (dgain, dbias) = sums;
    let c = gain.len();
    let (mut xhat, mut gh) = (vec![0f32; c], vec![0f32; c]);
    let rows = x.chunks_exact(c).zip(gy.chunks_exact(c));
    for ((x, gy), dx) in rows.zip(dx.chunks_exact_mut(c)) {
        let (mean, rstd) = moments(x, eps);
        for (xh, x) in xhat.iter_mut().zip(x) {
            *xh = (x - mean) * rstd;
        }
        for (((gh, gy), gain), db) in gh.iter_mut().zip(gy).zip(gain).zip(&mut *dbias) {
            *gh = gy * gain;
            *db += gy;
        }
        for ((dg, gy), xh) in dgain.iter_mut().zip(gy).zip(&xhat) {
            *dg = madd::<FMA>(*gy, *xh, *dg);
        }
        let mean_g = sum_map(&gh, |v| v) / c as f32;
        let mean_gx = dot(&gh, &xhat) / c as f32;
        let grads = gh
            .iter()
            .zip(&xhat)
            .map(|(gh, xh)| rstd * (gh - mean_g - xh * mean_gx));
        if accumulate {
            dx.iter_mut().zip(grads).for_each(|(d, g)| *d += g);
        } else {
            dx.iter_mut().zip(grads).for_each(|(d, g)| *d = g);
        }
    }
}

/// The rows `rows` of one head's scores, `t` values apart in `block`, made causal softmax
/// probabilities in place: row i's keys 0..=i scaled by `scale` and normalised to sum to 1,
/// its keys after i (up to `rows.end`) zeroed.
#[inline(always)]
fn causal_softmax_rows<const FMA: bool>(
    block: &mut [f32],
    rows: Range<usize>,
    t: usize,
    scale: f32,
) {
    for (i, row) in rows.clone().zip(block.chunks_mut(t)) {
        let (seen, future) = row[..rows.end].split_at_mut(i + 1);
        let max = max(seen);
        seen.iter_mut()
            .for_each(|v| *v = exp_with::<FMA>((*v - max) * scale));
        let inv = 1.0 / sum_map(seen, |v| v);
        seen.iter_mut().for_each(|v| *v *= inv);
        future.fill(0.0);
    }
}

/// The scores' gradient from the probabilities' for `rows` rows of `seen` keys, `t` values
/// apart: ds = p ⊙ (dp - Σ dp ⊙ p) · `scale`, in place of dp in `ds`.
#[inline(always)]
fn causal_softmax_bwd_rows<const FMA: bool>(
    ds: &mut [f32],
    p: &[f32],
    rows: usize,
    seen: usize,
    t: usize,
    scale: f32,
) {
    for (ds, p) in ds.chunks_mut(t).zip(p.chunks(t)).take(rows) {
        let (ds, p) = (&mut ds[..seen], &p[..seen]);
        let dot = dot(ds, p);
        for (d, p) in ds.iter_mut().zip(p) {
            *d = p * (*d - dot) * scale;
        }
    }
}

impl CustomOp3 for LayerNormOp {
    fn name(&self) -> &'static str {
        "ddpjob-gpt-layer-norm"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        x_layout: &Layout,
        g: &CpuStorage,
        g_layout: &Layout,
        b: &CpuStorage,
        b_layout: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let c = x_layout.shape().dims().last().copied().unwrap_or(0);
        if g_layout.shape().dims1()? != c || b_layout.shape().dims1()? != c || c == 0 {
            bail!(
                "layer_norm: input {:?}, gain {:?}",
                x_layout.shape(),
                g_layout.shape()
            );
        }
        let (x, g, b) = (
            values(x, x_layout)?,
            values(g, g_layout)?,
            values(b, b_layout)?,
        );
        let mut y = vec![0f32; x.len()];
        y.par_chunks_mut(c * ROWS_PER_TASK)
            .zip(x.par_chunks(c * ROWS_PER_TASK))
            .for_each(|(y, x)| simd::layer_norm(x, g, b, self.eps, y));
        Ok((CpuStorage::F32(y), x_layout.shape().clone()))
    }

    /// See [`layer_norm_rows_bwd`].
    fn bwd(
        &self,
        x: &Tensor,
        gain: &Tensor,
        _bias: &Tensor,
        _out: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let c = gain.dim(0)?;
        let mut dx = vec![0f32; x.elem_count()];
        let (mut dg, mut db) = (vec![0f32; c], vec![0f32; c]);
        with_values(x, |x| {
            with_values(gain, |gain| {
                with_values(grad, |grad| {
                    // Per-block partial sums of dgain and dbias, added up in block order: the
                    // same result whatever the number of threads.
                    let partials: Vec<(Vec<f32>, Vec<f32>)> = dx
                        .par_chunks_mut(c * ROWS_PER_TASK)
                        .zip(x.par_chunks(c * ROWS_PER_TASK))
                        .zip(grad.par_chunks(c * ROWS_PER_TASK))
                        .map(|((dx, x), gy)| {
                            let (mut dg, mut db) = (vec![0f32; c], vec![0f32; c]);
                            simd::layer_norm_bwd(
                                x,
                                gy,
                                gain,
                                self.eps,
                                dx,
                                false,
                                (&mut dg, &mut db),
                            );
                            (dg, db)
                        })
                        .collect();
                    for (pg, pb) in partials {
                        dg.iter_mut().zip(pg).for_each(|(d, p)| *d += p);
                        db.iter_mut().zip(pb).for_each(|(d, p)| *d += p);
                    }
                    Ok(())
                })
            })
        })?;
        let device = x.device();
        Ok((
            Some(Tensor::from_vec(dx, x.shape(), device)?),
            Some(Tensor::from_vec(dg, c, device)?),
            Some(Tensor::from_vec(db, c, device)?),
        ))
    }
}

struct GeluOp;

/// Elements handed to one rayon task by the elementwise ops.
const ELEMENTS_PER_TASK: usize = 1 << 14;

/// y = x·Φ(x); with `FMA`, multiply-adds fused (one rounding instead of two).
#[inline(always)]
fn gelu_rows<const FMA: bool>(x: &[f32], y: &mut [f32]) {
    for (y, &x) in y.iter_mut().zip(x) {
        *y = x * cdf_pdf::<FMA>(x).0;
    }
}

/// y = x·Φ(x), and x replaced by GELU's slope there, Φ(x) + x·φ(x): a backward that keeps the
/// slope multiplies by it instead of computing Φ and φ again.
#[inline(always)]
fn gelu_slope_rows<const FMA: bool>(x: &mut [f32], y: &mut [f32]) {
    for (y, x) in y.iter_mut().zip(x) {
        let (cdf, pdf) = cdf_pdf::<FMA>(*x);
        *y = *x * cdf;
        *x = madd::<FMA>(*x, pdf, cdf);
    }
}

/// dx = g·(Φ(x) + x·φ(x)).
#[inline(always)]
fn gelu_grad_rows<const FMA: bool>(x: &[f32], g: &[f32], dx: &mut [f32]) {
    for ((dx, &x), g) in dx.iter_mut().zip(x).zip(g) {
        let (cdf, pdf) = cdf_pdf::<FMA>(x);
        *dx = g * madd::<FMA>(x, pdf, cdf);
    }
}

/// a·b + c, fused when `FMA` (only instantiated inside functions compiled for FMA, where it is
/// one instruction; elsewhere `mul_add` would be a slow library call).
#[inline(always)]
fn madd<const FMA: bool>(a: f32, b: f32, c: f32) -> f32 {
    if FMA { a.mul_add(b, c) } else { a * b + c }
}

/// The elementwise loops, compiled for AVX2 and FMA (8-wide vectors, fused multiply-adds)
/// where the CPU has them, else for AVX2 alone, else for the baseline. The FMA build rounds
/// once where the others round twice, so its last bits differ; the others agree exactly.
pub(super) mod simd {
    use std::ops::Range;

    /// `pub fn $name(args)` running `super::$rows::<FMA>(args)` built for the best of the
    /// three targets this CPU has.
    macro_rules! dispatched {
        ($(#[$doc:meta])* $name:ident($($arg:ident: $ty:ty),*) => $rows:ident) => {
            $(#[$doc])*
            pub fn $name($($arg: $ty),*) {
                #[cfg(target_arch = "x86_64")]
                if std::arch::is_x86_feature_detected!("avx2") {
                    #[target_feature(enable = "avx2,fma")]
                    unsafe fn fused($($arg: $ty),*) {
                        super::$rows::<true>($($arg),*)
                    }
                    #[target_feature(enable = "avx2")]
                    unsafe fn run($($arg: $ty),*) {
                        super::$rows::<false>($($arg),*)
                    }
                    // SAFETY: the CPU has AVX2 (checked above), and FMA where `fused` runs.
                    return unsafe {
                        match std::arch::is_x86_feature_detected!("fma") {
                            true => fused($($arg),*),
                            false => run($($arg),*),
                        }
                    };
                }
                super::$rows::<false>($($arg),*)
            }
        };
    }

    dispatched!(
        /// y = GELU(x).
        gelu(x: &[f32], y: &mut [f32]) => gelu_rows
    );
    dispatched!(
        /// y = GELU(x), and x replaced by GELU's slope there.
        gelu_and_slope(x: &mut [f32], y: &mut [f32]) => gelu_slope_rows
    );
    dispatched!(
        /// dx = g · GELU'(x).
        gelu_grad(x: &[f32], g: &[f32], dx: &mut [f32]) => gelu_grad_rows
    );
    dispatched!(
        /// LayerNorm of the rows `x` into `y`.
        layer_norm(x: &[f32], gain: &[f32], bias: &[f32], eps: f32, y: &mut [f32])
            => layer_norm_rows
    );
    dispatched!(
        /// LayerNorm's backward over the rows `x`: dx, and the gain's and bias's gradients
        /// added to `sums`.
        layer_norm_bwd(
            x: &[f32],
            gy: &[f32],
            gain: &[f32],
            eps: f32,
            dx: &mut [f32],
            accumulate: bool,
            sums: (&mut [f32], &mut [f32])
        ) => layer_norm_rows_bwd
    );
    dispatched!(
        /// Rows `rows` of one head's scores made causal softmax probabilities, in place.
        causal_softmax(block: &mut [f32], rows: Range<usize>, t: usize, scale: f32)
            => causal_softmax_rows
    );
    dispatched!(
        /// The scores' gradient in place of the probabilities' (`ds`), for `rows` rows.
        causal_softmax_bwd(ds: &mut [f32], p: &[f32], rows: usize, seen: usize, t: usize, scale: f32)
            => causal_softmax_bwd_rows
    );
}

/// Φ(x) and φ(x) = exp(-x²/2)/√(2π), sharing the one exponential.
#[inline(always)]
fn cdf_pdf<const FMA: bool>(x: f32) -> (f32, f32) {
    let e = exp_with::<FMA>(-0.5 * x * x);
    (
        madd::<FMA>(
            0.5,
            erf_with_exp::<FMA>(x * std::f32::consts::FRAC_1_SQRT_2, e),
            0.5,
        ),
        e * 0.398_942_3,
    )
}

impl CustomOp1 for GeluOp {
    fn name(&self) -> &'static str {
        "ddpjob-gpt-gelu"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        let x = values(storage, layout)?;
        let mut y = vec![0f32; x.len()];
        y.par_chunks_mut(ELEMENTS_PER_TASK)
            .zip(x.par_chunks(ELEMENTS_PER_TASK))
            .for_each(|(y, x)| simd::gelu(x, y));
        Ok((CpuStorage::F32(y), layout.shape().clone()))
    }

    /// d(x·Φ(x))/dx = Φ(x) + x·φ(x).
    fn bwd(&self, x: &Tensor, _y: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let mut dx = vec![0f32; x.elem_count()];
        with_values(x, |x| {
            with_values(grad, |g| {
                dx.par_chunks_mut(ELEMENTS_PER_TASK)
                    .zip(x.par_chunks(ELEMENTS_PER_TASK))
                    .zip(g.par_chunks(ELEMENTS_PER_TASK))
                    .for_each(|((dx, x), g)| simd::gelu_grad(x, g, dx));
                Ok(())
            })
        })?;
        Ok(Some(Tensor::from_vec(dx, x.shape(), x.device())?))
    }
}

/// erf(z) given e = exp(-z²): Abramowitz & Stegun 7.1.26 (absolute error below 1.5e-7), the
/// formula torch's vectorised CPU `erf` uses. Branch-free, so loops over it vectorise.
#[inline(always)]
fn erf_with_exp<const FMA: bool>(z: f32, e: f32) -> f32 {
    let a = z.abs();
    let t = 1.0 / madd::<FMA>(0.327_591_1, a, 1.0);
    let poly = madd::<FMA>(t, 1.061_405_4, -1.453_152);
    let poly = madd::<FMA>(t, poly, 1.421_413_8);
    let poly = madd::<FMA>(t, poly, -0.284_496_74);
    let poly = madd::<FMA>(t, poly, 0.254_829_6);
    (1.0 - t * poly * e).copysign(z)
}

/// e^x to about 1 ulp (Cephes' `expf`: x = n·ln2 + r, a degree-6 polynomial for e^r, 2^n from
/// the exponent bits), branch-free so loops over it vectorise, unlike libm's `expf` calls.
/// Inputs are clamped to [-87, 88]: below, the result flushes to about 1.6e-38, not 0.
#[inline(always)]
pub(super) fn exp(x: f32) -> f32 {
    exp_with::<false>(x)
}

/// [`exp`], its multiply-adds fused when `FMA`.
#[inline(always)]
fn exp_with<const FMA: bool>(x: f32) -> f32 {
    // Adding 1.5 · 2^23 rounds to an integer, which then sits in the low mantissa bits: read
    // from there, not with `as i32` (a saturating conversion that does not vectorise).
    const ROUND: f32 = 12_582_912.0;
    let x = x.clamp(-87.0, 88.0);
    let shifted = madd::<FMA>(x, std::f32::consts::LOG2_E, ROUND);
    let n = shifted - ROUND;
    let r = madd::<FMA>(n, 2.121_944_4e-4, madd::<FMA>(-n, 0.693_359_4, x));
    let p = 1.987_569_1e-4;
    let p = madd::<FMA>(p, r, 1.398_199_9e-3);
    let p = madd::<FMA>(p, r, 8.333_452e-3);
    let p = madd::<FMA>(p, r, 4.166_579_6e-2);
    let p = madd::<FMA>(p, r, 0.166_666_65);
    let p = madd::<FMA>(p, r, 0.5);
    let er = madd::<FMA>(p * r, r, r) + 1.0;
    let two_n = (shifted
        .to_bits()
        .wrapping_sub(ROUND.to_bits())
        .wrapping_add(127))
        << 23;
    er * f32::from_bits(two_n)
}
