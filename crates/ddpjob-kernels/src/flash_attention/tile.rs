//! The elementwise work on one tile of attention scores (`rows` query rows × `width` keys,
//! `ld` values apart): the online softmax of the forward, and the probabilities and the scores'
//! gradient of the backward. Each row sees the keys `seen[r] = (lo, hi)` of the tile (columns
//! `lo..hi`; an empty range for none): the causal mask, a packed row's example start and a
//! sliding window all come down to that range, and every value outside it becomes 0. Compiled
//! for AVX2 with FMA, AVX2 alone and the baseline (see `rows::dispatched`).

use crate::rows::{dot, exp_with, madd, max, sum_map};

/// A row's visible keys, as columns `lo..hi` of its tile.
pub(super) type Seen = (u32, u32);

/// One step of the online softmax: the tile's scores `s` made exp(s·scale − m′) where each
/// row's running maximum m′ = max(m, its scores' maximum · scale); `l` (the running sums of
/// the exponentials) rescaled by `alpha` = exp(m − m′) and the row's new sum added; `alpha`
/// is left for the caller to rescale its running output by.
#[inline(always)]
fn online_rows<const FMA: bool>(
    (s, ld, width): (&mut [f32], usize, usize),
    seen: &[Seen],
    scale: f32,
    (m, l, alpha): (&mut [f32], &mut [f32], &mut [f32]),
) {
    for (r, &(lo, hi)) in seen.iter().enumerate() {
        let row = &mut s[r * ld..r * ld + width];
        let (lo, hi) = (lo as usize, hi as usize);
        if lo >= hi {
            row.fill(0.0);
            alpha[r] = 1.0;
            continue;
        }
        let top = m[r].max(max(&row[lo..hi]) * scale);
        alpha[r] = match m[r] == f32::NEG_INFINITY {
            true => 0.0,
            false => exp_with::<FMA>(m[r] - top),
        };
        for v in &mut row[lo..hi] {
            *v = exp_with::<FMA>(madd::<FMA>(*v, scale, -top));
        }
        row[..lo].fill(0.0);
        row[hi..].fill(0.0);
        l[r] = madd::<FMA>(l[r], alpha[r], sum_map(&row[lo..hi], |v| v));
        m[r] = top;
    }
}

/// The backward's probabilities from the scores: exp(s·scale − lse) for each row's visible
/// keys (`lse` its log-sum-exp, kept by the forward), 0 elsewhere.
#[inline(always)]
fn probability_rows<const FMA: bool>(
    (s, ld, width): (&mut [f32], usize, usize),
    seen: &[Seen],
    scale: f32,
    lse: &[f32],
) {
    for (r, &(lo, hi)) in seen.iter().enumerate() {
        let row = &mut s[r * ld..r * ld + width];
        let (lo, hi) = (lo as usize, (hi as usize).max(lo as usize));
        for v in &mut row[lo..hi] {
            *v = exp_with::<FMA>(madd::<FMA>(*v, scale, -lse[r]));
        }
        row[..lo].fill(0.0);
        row[hi..].fill(0.0);
    }
}

/// The scores' gradient in place of the probabilities' (`dp`): p ⊙ (dp − d) · scale, where
/// `d` per row is Σ dO ⊙ O (the backward's D of FlashAttention-2, equal to Σ dp ⊙ p over the
/// whole row of keys).
#[inline(always)]
fn score_grad_rows<const FMA: bool>(
    (dp, ld, width): (&mut [f32], usize, usize),
    p: &[f32],
    d: &[f32],
    scale: f32,
) {
    for (r, &d) in d.iter().enumerate() {
        let (dp, p) = (&mut dp[r * ld..r * ld + width], &p[r * ld..r * ld + width]);
        for (g, p) in dp.iter_mut().zip(p) {
            *g = p * (*g - d) * scale;
        }
    }
}

/// Σ a ⊙ b of two rows (D of the backward).
#[inline(always)]
fn dot_rows<const FMA: bool>(a: &[f32], b: &[f32], out: &mut f32) {
    *out = dot(a, b);
}

/// The tile loops, each built for the best of the CPU's targets.
pub(super) mod simd {
    use super::Seen;
    use crate::rows::dispatched;

    dispatched!(
        /// See `online_rows`.
        online(
            tile: (&mut [f32], usize, usize),
            seen: &[Seen],
            scale: f32,
            running: (&mut [f32], &mut [f32], &mut [f32])
        ) => online_rows
    );
    dispatched!(
        /// See `probability_rows`.
        probabilities(tile: (&mut [f32], usize, usize), seen: &[Seen], scale: f32, lse: &[f32])
            => probability_rows
    );
    dispatched!(
        /// See `score_grad_rows`.
        score_grads(tile: (&mut [f32], usize, usize), p: &[f32], d: &[f32], scale: f32)
            => score_grad_rows
    );
    dispatched!(
        /// Σ a ⊙ b.
        row_dot(a: &[f32], b: &[f32], out: &mut f32) => dot_rows
    );
}
