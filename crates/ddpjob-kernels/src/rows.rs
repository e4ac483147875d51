//! The row and element loops on f32 slices: LayerNorm, the causal softmax and exact GELU with
//! their backwards, and the lane sums and exponential they share. Each loop is compiled for
//! AVX2 with FMA, AVX2 alone and the baseline, and [`simd`] picks the best the CPU has at run
//! time; the fused ops (`layer_norm`, `gelu`, `swiglu`), the GPT's hand-written pass and the
//! model kit's attention and head call them.

use std::ops::Range;

pub use crate::host::sum_map;

/// Mean and 1/std of one row (two passes, as torch).
#[inline(always)]
fn moments(row: &[f32], eps: f32) -> (f32, f32) {
    let n = row.len() as f32;
    let mean = sum_map(row, |v| v) / n;
    let var = sum_map(row, |v| (v - mean) * (v - mean)) / n;
    (mean, 1.0 / (var + eps).sqrt())
}

/// Σ a·b, in lanes as [`sum_map`].
#[inline(always)]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
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
pub fn max(v: &[f32]) -> f32 {
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

/// GELU(x) and its slope GELU'(x): the exact x·Φ(x) (slope Φ(x) + x·φ(x)), or with `TANH`
/// GPT-2's approximation ½x(1 + tanh u), u = √(2/π)(x + 0.044715x³) (`transformers`'
/// `gelu_new`). Only inlined uses that keep the slope compute it.
#[inline(always)]
fn gelu_and_slope_of<const FMA: bool, const TANH: bool>(x: f32) -> (f32, f32) {
    if TANH {
        const SQRT_2_OVER_PI: f32 = 0.797_884_6;
        let x2 = x * x;
        let u = SQRT_2_OVER_PI * madd::<FMA>(0.044_715 * x2, x, x);
        // tanh u = 1 - 2/(e^{2u} + 1): one exponential, exact at both tails.
        let th = 1.0 - 2.0 / (exp_with::<FMA>(2.0 * u) + 1.0);
        let half_x = 0.5 * x;
        let du = SQRT_2_OVER_PI * madd::<FMA>(3.0 * 0.044_715, x2, 1.0);
        let value = madd::<FMA>(half_x, th, half_x);
        let slope = madd::<FMA>(
            half_x * madd::<FMA>(-th, th, 1.0),
            du,
            madd::<FMA>(0.5, th, 0.5),
        );
        (value, slope)
    } else {
        let (cdf, pdf) = cdf_pdf::<FMA>(x);
        (x * cdf, madd::<FMA>(x, pdf, cdf))
    }
}

/// y = GELU(x); with `FMA`, multiply-adds fused (one rounding instead of two).
#[inline(always)]
fn gelu_rows<const FMA: bool, const TANH: bool>(x: &[f32], y: &mut [f32]) {
    for (y, &x) in y.iter_mut().zip(x) {
        *y = gelu_and_slope_of::<FMA, TANH>(x).0;
    }
}

/// y = GELU(x), and x replaced by GELU's slope there: a backward that keeps the slope
/// multiplies by it instead of computing it again.
#[inline(always)]
fn gelu_slope_rows<const FMA: bool, const TANH: bool>(x: &mut [f32], y: &mut [f32]) {
    for (y, x) in y.iter_mut().zip(x) {
        (*y, *x) = gelu_and_slope_of::<FMA, TANH>(*x);
    }
}

/// dx = g·GELU'(x).
#[inline(always)]
fn gelu_grad_rows<const FMA: bool, const TANH: bool>(x: &[f32], g: &[f32], dx: &mut [f32]) {
    for ((dx, &x), g) in dx.iter_mut().zip(x).zip(g) {
        *dx = g * gelu_and_slope_of::<FMA, TANH>(x).1;
    }
}

/// The exact and the tanh forms of the three loops, as the dispatcher names them.
macro_rules! gelu_forms {
    ($($name:ident = $rows:ident::<$tanh:literal>($($arg:ident: $ty:ty),*);)*) => {$(
        #[inline(always)]
        fn $name<const FMA: bool>($($arg: $ty),*) {
            $rows::<FMA, $tanh>($($arg),*)
        }
    )*};
}

gelu_forms! {
    gelu_erf_rows = gelu_rows::<false>(x: &[f32], y: &mut [f32]);
    gelu_tanh_rows = gelu_rows::<true>(x: &[f32], y: &mut [f32]);
    gelu_erf_slope_rows = gelu_slope_rows::<false>(x: &mut [f32], y: &mut [f32]);
    gelu_tanh_slope_rows = gelu_slope_rows::<true>(x: &mut [f32], y: &mut [f32]);
    gelu_erf_grad_rows = gelu_grad_rows::<false>(x: &[f32], g: &[f32], dx: &mut [f32]);
    gelu_tanh_grad_rows = gelu_grad_rows::<true>(x: &[f32], g: &[f32], dx: &mut [f32]);
}

/// a·b + c, fused when `FMA` (only instantiated inside functions compiled for FMA, where it is
/// one instruction; elsewhere `mul_add` would be a slow library call).
#[inline(always)]
pub(crate) fn madd<const FMA: bool>(a: f32, b: f32, c: f32) -> f32 {
    if FMA { a.mul_add(b, c) } else { a * b + c }
}

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
pub(crate) use dispatched;

/// The elementwise loops, compiled for AVX2 and FMA (8-wide vectors, fused multiply-adds)
/// where the CPU has them, else for AVX2 alone, else for the baseline. The FMA build rounds
/// once where the others round twice, so its last bits differ; the others agree exactly.
pub mod simd {
    use std::ops::Range;

    dispatched!(
        /// y = GELU(x), exact.
        gelu(x: &[f32], y: &mut [f32]) => gelu_erf_rows
    );
    dispatched!(
        /// y = GELU(x), exact, and x replaced by GELU's slope there.
        gelu_and_slope(x: &mut [f32], y: &mut [f32]) => gelu_erf_slope_rows
    );
    dispatched!(
        /// dx = g · GELU'(x), exact.
        gelu_grad(x: &[f32], g: &[f32], dx: &mut [f32]) => gelu_erf_grad_rows
    );
    dispatched!(
        /// y = GELU(x), GPT-2's tanh form.
        gelu_tanh(x: &[f32], y: &mut [f32]) => gelu_tanh_rows
    );
    dispatched!(
        /// y = GELU(x), tanh form, and x replaced by its slope there.
        gelu_tanh_and_slope(x: &mut [f32], y: &mut [f32]) => gelu_tanh_slope_rows
    );
    dispatched!(
        /// dx = g · GELU'(x), tanh form.
        gelu_tanh_grad(x: &[f32], g: &[f32], dx: &mut [f32]) => gelu_tanh_grad_rows
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
pub fn exp(x: f32) -> f32 {
    exp_with::<false>(x)
}

/// [`exp`], its multiply-adds fused when `FMA`.
#[inline(always)]
pub(crate) fn exp_with<const FMA: bool>(x: f32) -> f32 {
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

#[cfg(test)]
mod tests {
    /// The exponential the fused ops use, against the standard library's.
    #[test]
    fn exp_is_the_standard_librarys_within_2e_7_relative() {
        for i in -8_000..=8_000 {
            let x = i as f32 / 100.0;
            let (fast, std) = (super::exp(x), x.exp());
            assert!(
                (fast - std).abs() <= 2e-7 * std,
                "exp({x}): {fast} vs {std}"
            );
        }
    }
}
