//! FlashAttention-2's loops over one sequence on the CPU: the forward of one query head, the
//! backward of one key-value head with the query heads of its group, in tiles of [`TILE`]
//! query rows × [`TILE`] keys. A task first copies its heads' columns out of the
//! [t, (H + 2·KV)·hd] rows into contiguous [t′, hd] panels, zero-padded to whole tiles, and
//! every product is then one single-threaded `strided_product` of the same shape and strides
//! whatever the sequence's length: gemm picks its kernel by shape, and a short last tile
//! would otherwise round differently, so a position's values would depend on how many
//! positions follow it (world-size invariance cuts rows to their own length). A task's order
//! of work is fixed (heads, then keys first to last, then queries), so the results are the
//! same bits whatever the thread count.

use std::ops::Range;

use super::Attention;
use super::tile::{Seen, simd};
use crate::host::{Out, Products, strided_product};

/// Query rows, and keys, per tile.
pub(super) const TILE: usize = 64;

/// The geometry of one sequence's tiles.
struct Walk<'a> {
    a: &'a Attention,
    starts: Option<&'a [u32]>,
}

impl Walk<'_> {
    /// The first key position `i` sees (its example's start, the window's first key).
    fn first_key(&self, i: usize) -> usize {
        let lo = self.starts.map_or(0, |s| s[i] as usize);
        match self.a.window {
            Some(w) => lo.max((i + 1).saturating_sub(w)),
            None => lo,
        }
    }

    /// Each query row's visible keys among `keys`, as columns of the tile; false when no row
    /// sees any.
    fn seen(&self, rows: Range<usize>, keys: &Range<usize>, out: &mut Vec<Seen>) -> bool {
        out.clear();
        let mut any = false;
        for i in rows {
            let lo = self.first_key(i).max(keys.start);
            let hi = (i + 1).min(keys.end);
            match lo < hi {
                true => {
                    any = true;
                    out.push(((lo - keys.start) as u32, (hi - keys.start) as u32));
                }
                false => out.push((0, 0)),
            }
        }
        any
    }
}

/// A tile product: `dst` (rows `rs` apart) = a·b, or += when `accumulate`, for a m × k and
/// b k × n given as (pointer, row stride, column stride).
///
/// # Safety
/// As `strided_product`'s: every element in its allocation, `dst` touched by nobody else.
unsafe fn product(
    (m, n, k): (usize, usize, usize),
    dst: (*mut f32, usize),
    accumulate: bool,
    a: (*const f32, usize, usize),
    b: (*const f32, usize, usize),
) {
    // SAFETY: the caller's.
    unsafe { strided_product((m, n, k), dst, accumulate, a, b, Products::for_depth(k)) }
}

/// Columns `first..first + hd` of the t rows of `width` values in `rows`, as a contiguous
/// [padded, hd] panel (zeros after row t).
fn panel(
    rows: &[f32],
    width: usize,
    first: usize,
    (t, hd): (usize, usize),
    padded: usize,
) -> Vec<f32> {
    let mut out = vec![0f32; padded * hd];
    for (i, dst) in out.chunks_exact_mut(hd).take(t).enumerate() {
        dst.copy_from_slice(&rows[i * width + first..][..hd]);
    }
    out
}

/// Writes the first t rows of a [_, hd] panel into columns `first..first + hd` of the rows at
/// `dst`.
///
/// # Safety
/// `dst` must hold t rows of `dst.row_stride` values, those columns written by nobody else.
unsafe fn unpanel(panel: &[f32], dst: Out, first: usize, (t, hd): (usize, usize)) {
    for (i, src) in panel.chunks_exact(hd).take(t).enumerate() {
        let at = dst.offset(i * dst.row_stride + first).ptr;
        // SAFETY: the caller's.
        let row = unsafe { std::slice::from_raw_parts_mut(at, hd) };
        row.copy_from_slice(src);
    }
}

/// The sequence's length rounded up to whole tiles.
fn padded(t: usize) -> usize {
    t.div_ceil(TILE) * TILE
}

/// The forward of query head `h` over one sequence: `x` its [t, cols] rows of q, k and v, `o`
/// the sequence's first output row ([t, H·hd], rows `o.row_stride` apart), `lse` the head's t
/// log-sum-exps.
///
/// # Safety
/// `o` must hold the sequence's t rows, and no other task may write head `h`'s columns of
/// them.
pub(super) unsafe fn forward_head(
    a: &Attention,
    x: &[f32],
    o: Out,
    lse: &mut [f32],
    h: usize,
    starts: Option<&[u32]>,
) {
    let (t, hd, cols) = (a.t, a.head_dim, a.cols());
    assert!(
        x.len() >= t * cols && lse.len() >= t,
        "flash attention: short input"
    );
    let (walk, scale, tp) = (Walk { a, starts }, a.scale(), padded(t));
    let g = h / a.group();
    let q = panel(x, cols, h * hd, (t, hd), tp);
    let k = panel(x, cols, (a.heads + g) * hd, (t, hd), tp);
    let v = panel(x, cols, (a.heads + a.kv_heads + g) * hd, (t, hd), tp);
    let (mut out, mut s) = (vec![0f32; tp * hd], vec![0f32; TILE * TILE]);
    let (mut m, mut l, mut alpha) = ([0f32; TILE], [0f32; TILE], [0f32; TILE]);
    let mut seen = Vec::with_capacity(TILE);
    for i0 in (0..t).step_by(TILE) {
        let i1 = (i0 + TILE).min(t);
        let br = i1 - i0;
        m[..br].fill(f32::NEG_INFINITY);
        l[..br].fill(0.0);
        let acc = &mut out[i0 * hd..(i0 + TILE) * hd];
        let first = (i0..i1).map(|i| walk.first_key(i)).min().unwrap_or(0);
        for j0 in (first / TILE * TILE..i1).step_by(TILE) {
            if !walk.seen(i0..i1, &(j0..j0 + TILE), &mut seen) {
                continue;
            }
            // SAFETY: the panels hold whole tiles: rows i0.. and j0.. of TILE rows of hd.
            unsafe {
                product(
                    (TILE, TILE, hd),
                    (s.as_mut_ptr(), TILE),
                    false,
                    (q[i0 * hd..].as_ptr(), hd, 1),
                    (k[j0 * hd..].as_ptr(), 1, hd),
                );
            }
            let running = (&mut m[..br], &mut l[..br], &mut alpha[..br]);
            simd::online((&mut s, TILE, TILE), &seen, scale, running);
            for (row, &f) in acc.chunks_exact_mut(hd).zip(&alpha[..br]) {
                if f != 1.0 {
                    row.iter_mut().for_each(|v| *v *= f);
                }
            }
            // Rows br.. of the tile (past the sequence) are zeros: q's padding.
            // SAFETY: as above; `acc` is TILE rows of hd.
            unsafe {
                product(
                    (TILE, hd, TILE),
                    (acc.as_mut_ptr(), hd),
                    true,
                    (s.as_ptr(), TILE, 1),
                    (v[j0 * hd..].as_ptr(), hd, 1),
                );
            }
        }
        for (r, row) in acc.chunks_exact_mut(hd).take(br).enumerate() {
            let inv = 1.0 / l[r];
            row.iter_mut().for_each(|v| *v *= inv);
            lse[i0 + r] = m[r] + l[r].ln();
        }
    }
    // SAFETY: the caller's.
    unsafe { unpanel(&out, o, h * hd, (t, hd)) }
}

/// The sequence's forward results a backward reads: the output [t, H·hd] and every head's
/// log-sum-exps [H, t].
pub(super) struct Saved<'a> {
    pub o: &'a [f32],
    pub lse: &'a [f32],
}

/// The backward of key-value head `g` and the query heads of its group over one sequence:
/// `x` its [t, cols] rows, `dy` the output's gradient [t, H·hd], `dx` the sequence's first
/// gradient row ([t, cols], rows `dx.row_stride` apart) receiving the group's q, k and v
/// gradients. With P recomputed
/// from the saved log-sum-exps: dV += Pᵀ·dO, dP = dO·Vᵀ, dS = P ⊙ (dP − D)·scale
/// (D = Σ dO ⊙ O per row), dK += dSᵀ·Q, dQ += dS·K.
///
/// # Safety
/// `dx` must hold the sequence's t rows, and no other task may write the group's columns of
/// them.
pub(super) unsafe fn backward_group(
    a: &Attention,
    (x, dy): (&[f32], &[f32]),
    saved: Saved,
    dx: Out,
    g: usize,
    starts: Option<&[u32]>,
) {
    let (t, hd, cols, co, group) = (a.t, a.head_dim, a.cols(), a.out_cols(), a.group());
    assert!(
        x.len() >= t * cols && dy.len() >= t * co && saved.o.len() >= t * co,
        "flash attention: short input"
    );
    assert!(
        saved.lse.len() >= a.heads * t,
        "flash attention: short log-sum-exps"
    );
    let (walk, scale, tp) = (Walk { a, starts }, a.scale(), padded(t));
    let (kc, vc) = ((a.heads + g) * hd, (a.heads + a.kv_heads + g) * hd);
    let k = panel(x, cols, kc, (t, hd), tp);
    let v = panel(x, cols, vc, (t, hd), tp);
    let (mut dk, mut dv) = (vec![0f32; tp * hd], vec![0f32; tp * hd]);
    let (mut s, mut dp) = (vec![0f32; TILE * TILE], vec![0f32; TILE * TILE]);
    let mut seen = Vec::with_capacity(TILE);
    let mut d = vec![0f32; tp];
    for h in g * group..(g + 1) * group {
        let q = panel(x, cols, h * hd, (t, hd), tp);
        let dyh = panel(dy, co, h * hd, (t, hd), tp);
        let oh = panel(saved.o, co, h * hd, (t, hd), tp);
        for (i, d) in d.iter_mut().enumerate().take(t) {
            simd::row_dot(&dyh[i * hd..][..hd], &oh[i * hd..][..hd], d);
        }
        let mut dq = vec![0f32; tp * hd];
        for j0 in (0..t).step_by(TILE) {
            for i0 in (j0..t).step_by(TILE) {
                // Unpacked, later rows see no earlier key than this one (the first key only
                // moves forward); packed rows are checked row by row.
                if starts.is_none() && walk.first_key(i0) >= j0 + TILE {
                    break;
                }
                let i1 = (i0 + TILE).min(t);
                if !walk.seen(i0..i1, &(j0..j0 + TILE), &mut seen) {
                    continue;
                }
                // SAFETY: every panel holds whole tiles (rows i0.. and j0.. of TILE rows of
                // hd); the tiles are TILE × TILE.
                unsafe {
                    let (qi, dyi, kj, vj) = (
                        q[i0 * hd..].as_ptr(),
                        dyh[i0 * hd..].as_ptr(),
                        k[j0 * hd..].as_ptr(),
                        v[j0 * hd..].as_ptr(),
                    );
                    product(
                        (TILE, TILE, hd),
                        (s.as_mut_ptr(), TILE),
                        false,
                        (qi, hd, 1),
                        (kj, 1, hd),
                    );
                    let lse = &saved.lse[h * t + i0..h * t + i1];
                    simd::probabilities((&mut s, TILE, TILE), &seen, scale, lse);
                    // Rows past the sequence stay zeros (the panels' padding) in S, dO and dP.
                    let dvj = dv[j0 * hd..].as_mut_ptr();
                    product(
                        (TILE, hd, TILE),
                        (dvj, hd),
                        true,
                        (s.as_ptr(), 1, TILE),
                        (dyi, hd, 1),
                    );
                    product(
                        (TILE, TILE, hd),
                        (dp.as_mut_ptr(), TILE),
                        false,
                        (dyi, hd, 1),
                        (vj, 1, hd),
                    );
                    simd::score_grads((&mut dp, TILE, TILE), &s, &d[i0..i1], scale);
                    let dkj = dk[j0 * hd..].as_mut_ptr();
                    product(
                        (TILE, hd, TILE),
                        (dkj, hd),
                        true,
                        (dp.as_ptr(), 1, TILE),
                        (qi, hd, 1),
                    );
                    let dqi = dq[i0 * hd..].as_mut_ptr();
                    product(
                        (TILE, hd, TILE),
                        (dqi, hd),
                        true,
                        (dp.as_ptr(), TILE, 1),
                        (kj, hd, 1),
                    );
                }
            }
        }
        // SAFETY: the caller's: head h's q columns are this task's.
        unsafe { unpanel(&dq, dx, h * hd, (t, hd)) }
    }
    // SAFETY: the caller's: the group's k and v columns are this task's.
    unsafe {
        unpanel(&dk, dx, kc, (t, hd));
        unpanel(&dv, dx, vc, (t, hd));
    }
}
