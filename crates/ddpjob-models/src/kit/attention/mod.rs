//! Causal self-attention over the fused projection `qkv` [n, t, 3C] as one CPU op for f32:
//! per sequence and head, softmax(q·kᵀ·scale + causal mask)·v as GEMMs that read q, k and v in
//! place (strided) and write each head's columns of the output, so no permute, transpose or
//! split is copied, in the forward or the backward. The backward recomputes the [t, t]
//! probabilities, or reads the ones a caller kept from the forward (the GPT's hand-written
//! pass does for short contexts). Sequences run in parallel; their outputs are
//! disjoint rows. Where the CPU has AVX2 and FMA and the context and head size are multiples
//! of 8, each head's products run on register tiles instead of gemm (`tiles`). [`with_ops`]
//! does the same with candle's ops, for other devices and dtypes and for generation with a KV
//! cache.

use std::ops::Range;

use candle_core::{CpuStorage, CustomOp1, Layout, Result, Shape, Tensor, bail};
use rayon::prelude::*;

use ddpjob_kernels::rows as ops;
use ddpjob_kernels::{values, with_values};
#[cfg(target_arch = "x86_64")]
#[cfg(target_arch = "x86_64")]
pub(crate) mod tiles;

use ddpjob_kernels as kernels;

/// Positions from which the GPT's attention runs in tiles (`kernels::flash_attention`, no
/// [t, t] probabilities): below, its small heads run faster on the register tiles here
/// (measured, docs/src/performance-llama.md, "Long contexts"). The `llama` tiles at every
/// length.
pub(crate) const TILED_FROM: usize = 1024;

/// Whether windows of `t` positions attend in tiles (see [`TILED_FROM`]).
pub(crate) fn tiled(t: usize) -> bool {
    t >= TILED_FROM
}

/// Causal attention of `qkv` [n·t, 3C] (sequences of `t` rows; q, k, v side by side, heads of
/// `C / heads` columns each): the attended values [n·t, C], heads side by side, before the
/// output projection.
pub fn causal_attention(qkv: &Tensor, heads: usize, t: usize) -> Result<Tensor> {
    if tiled(t) {
        return in_tiles(qkv, heads, t, None);
    }
    qkv.contiguous()?.apply_op1(AttentionOp {
        heads,
        t,
        starts: None,
    })
}

/// [`causal_attention`] of packed rows (see `models::packed`): `starts` [n·t] holds, for each
/// position, the first position of its example in its row, the first key it may see.
pub fn packed_attention(
    qkv: &Tensor,
    heads: usize,
    t: usize,
    starts: std::sync::Arc<Vec<u32>>,
) -> Result<Tensor> {
    if tiled(t) {
        return in_tiles(qkv, heads, t, Some(starts));
    }
    qkv.contiguous()?.apply_op1(AttentionOp {
        heads,
        t,
        starts: Some(starts),
    })
}

/// [`causal_attention`] (or [`packed_attention`]) in tiles, every head its own key-value head.
fn in_tiles(
    qkv: &Tensor,
    heads: usize,
    t: usize,
    starts: Option<std::sync::Arc<Vec<u32>>>,
) -> Result<Tensor> {
    let c = qkv.dim(1)? / 3;
    if heads == 0 || c % heads != 0 {
        bail!("attention: {c} channels do not split into {heads} heads");
    }
    let shape = kernels::Attention {
        starts,
        ..kernels::Attention::multi_head(heads, c / heads, t)
    };
    kernels::flash_attention(qkv, &shape)
}

/// [`causal_attention`] from candle's ops, after the cached keys and values `past` (if any,
/// [n, heads, past, hd]): the attended values [n, t, C] and the keys and values with this
/// call's appended, [n, heads, past + t, hd]. `mask`: see `ops::causal_softmax_with_ops`.
pub fn with_ops(
    qkv: &Tensor,
    heads: usize,
    past: Option<&(Tensor, Tensor)>,
    mask: &Tensor,
) -> Result<(Tensor, Tensor, Tensor)> {
    let (n, t, c3) = qkv.dims3()?;
    let (c, h) = (c3 / 3, heads);
    let hd = c / h;
    let (q, mut k, mut v) = split_heads(qkv, heads)?;
    let offset = match past {
        Some((pk, pv)) => {
            k = Tensor::cat(&[pk, &k], 2)?;
            v = Tensor::cat(&[pv, &v], 2)?;
            pk.dims()[2]
        }
        None => 0,
    };
    let tk = offset + t;
    let q = q.reshape((n * h, t, hd))?;
    let (kf, vf) = (k.reshape((n * h, tk, hd))?, v.reshape((n * h, tk, hd))?);
    let y = attend(&q, &kf, &vf, offset, mask)?
        .reshape((n, h, t, hd))?
        .transpose(1, 2)?
        .reshape((n, t, c))?;
    Ok((y, k, v))
}

/// softmax(q·kᵀ / √hd + causal mask)·v for q [b, t, hd] at positions `offset`.., k and v
/// [b, offset + t, hd]: [b, t, hd].
fn attend(q: &Tensor, k: &Tensor, v: &Tensor, offset: usize, mask: &Tensor) -> Result<Tensor> {
    let scale = 1.0 / (q.dim(2)? as f64).sqrt();
    kernels::causal_softmax_with_ops(&q.matmul(&k.t()?)?, scale, offset, mask)?.matmul(v)
}

/// [`with_ops`] (no cache) of q, k and v given apart, each [n·t, C] with the heads side by
/// side: the attended values [n·t, C]. A GPU's GPT makes them as three products (see
/// `Linear::forward_thirds`): slicing them out of one [n·t, 3C] product would cost, in the
/// backward, three zero-padded [n·t, 3C] gradients and their sums, ~10 ms a step of the
/// shakespeare-char recipe on an H200 (ncu, 2026-11-26).
pub fn of_parts(
    (q, k, v): (&Tensor, &Tensor, &Tensor),
    n: usize,
    heads: usize,
    mask: &Tensor,
) -> Result<Tensor> {
    let (rows, c) = q.dims2()?;
    let (t, hd) = (rows / n, c / heads);
    // One kernel each way per move between the layouts (see `kernels::swap_middle`).
    let split = |x: &Tensor| {
        kernels::swap_middle(&x.reshape((n, t, heads, hd))?)?.reshape((n * heads, t, hd))
    };
    let y = attend(&split(q)?, &split(k)?, &split(v)?, 0, mask)?;
    kernels::swap_middle(&y.reshape((n, heads, t, hd))?)?.reshape((rows, c))
}

/// q, k and v of `qkv` [n, t, 3C], each [n, heads, t, C / heads].
pub fn split_heads(qkv: &Tensor, heads: usize) -> Result<(Tensor, Tensor, Tensor)> {
    let (n, t, c3) = qkv.dims3()?;
    let hd = c3 / 3 / heads;
    let qkv = qkv
        .reshape((n, t, 3, heads, hd))?
        .permute((2, 0, 3, 1, 4))?
        .contiguous()?;
    Ok((qkv.get(0)?, qkv.get(1)?, qkv.get(2)?))
}

struct AttentionOp {
    heads: usize,
    t: usize,
    /// Packed rows: each position's first visible key (see [`packed_attention`]).
    starts: Option<std::sync::Arc<Vec<u32>>>,
}

impl AttentionOp {
    /// The first visible key of each position of sequence `s`, when packed.
    fn starts_of(&self, s: usize) -> Option<&[u32]> {
        let t = self.t;
        self.starts.as_deref().map(|all| &all[s * t..(s + 1) * t])
    }
}

/// A strided matrix inside `data`: element (i, j) at `i · rs + j · cs`.
#[derive(Clone, Copy)]
pub(crate) struct View<'a> {
    data: &'a [f32],
    rows: usize,
    cols: usize,
    rs: usize,
    cs: usize,
}

impl<'a> View<'a> {
    /// Rows of `cols` values `rs` apart, starting at `data[start]`.
    pub(crate) fn rows(data: &'a [f32], start: usize, rows: usize, cols: usize, rs: usize) -> Self {
        let v = View {
            data: &data[start..],
            rows,
            cols,
            rs,
            cs: 1,
        };
        assert!(v.fits(v.data.len()), "attention: view out of bounds");
        v
    }

    pub(crate) fn t(self) -> Self {
        View {
            rows: self.cols,
            cols: self.rows,
            rs: self.cs,
            cs: self.rs,
            ..self
        }
    }

    /// Rows `range` of the view.
    fn row_range(self, range: Range<usize>) -> Self {
        View {
            data: &self.data[range.start * self.rs..],
            rows: range.len(),
            ..self
        }
    }

    /// The first `rows` rows of the view.
    fn first_rows(self, rows: usize) -> Self {
        View { rows, ..self }
    }

    fn fits(&self, len: usize) -> bool {
        self.rows == 0
            || self.cols == 0
            || (self.rows - 1) * self.rs + (self.cols - 1) * self.cs < len
    }
}

/// `dst` (rows `rs` apart) = a·b, single-threaded (the callers run one task per sequence).
fn matmul(dst: &mut [f32], rs: usize, a: View, b: View) {
    gemm_into(dst, rs, a, b, false)
}

/// `dst` (rows `rs` apart) = a·b, or += a·b when `accumulate`; single-threaded.
pub(crate) fn gemm_into(dst: &mut [f32], rs: usize, a: View, b: View, accumulate: bool) {
    assert_eq!(a.cols, b.rows, "attention: inner dimensions differ");
    let out = View {
        data: dst,
        rows: a.rows,
        cols: b.cols,
        rs,
        cs: 1,
    };
    assert!(out.fits(dst.len()), "attention: destination too small");
    // SAFETY: `View::rows` and the assertions above keep every element gemm reads (a, b) or
    // writes (dst: a.rows rows of b.cols values, rs apart) inside the borrowed slices; `dst`
    // is borrowed mutably, so nothing else touches it meanwhile.
    unsafe {
        kernels::strided_product(
            (a.rows, b.cols, a.cols),
            (dst.as_mut_ptr(), rs),
            accumulate,
            (a.data.as_ptr(), a.rs, a.cs),
            (b.data.as_ptr(), b.rs, b.cs),
            kernels::Products::for_depth(a.cols),
        )
    }
}

/// Rows `rows` of `p` [t, t] (row stride t) = causal softmax(q·kᵀ·scale) of one head, over
/// the keys 0..rows.end: each row sums to 1, zeros above the diagonal. `q`: the block's query
/// rows; `k`: all t keys.
fn probabilities(
    p: &mut [f32],
    rows: Range<usize>,
    q: View,
    k: View,
    scale: f32,
    starts: Option<&[u32]>,
) {
    let t = k.rows;
    let seen_keys = k.first_rows(rows.end);
    let block = &mut p[rows.start * t..];
    matmul(block, t, q, seen_keys.t());
    // Packed rows: a query sees no key before its example's first, whose probability is 0.
    if let Some(starts) = starts {
        for (i, row) in rows.clone().zip(block.chunks_mut(t)) {
            row[..starts[i] as usize].fill(f32::NEG_INFINITY);
        }
    }
    ops::simd::causal_softmax(block, rows, t, scale);
}

/// Query rows per block of the causal products: a block of rows attends to the keys up to its
/// last row only, so the products skip what the mask would zero (with 2 blocks, a quarter of
/// the work; more for longer contexts), while each product stays large enough for gemm.
const QUERY_BLOCK: usize = 32;

/// The row blocks of a sequence of `t`, first to last.
fn query_blocks(t: usize) -> impl DoubleEndedIterator<Item = Range<usize>> {
    (0..t.div_ceil(QUERY_BLOCK)).map(move |b| b * QUERY_BLOCK..((b + 1) * QUERY_BLOCK).min(t))
}

impl AttentionOp {
    /// (n, t, C) of `qkv` [n·t, 3C].
    fn dims(&self, shape: &Shape) -> Result<(usize, usize, usize)> {
        let (rows, c3) = shape.dims2()?;
        let (c, h, t) = (c3 / 3, self.heads, self.t);
        if c3 % 3 != 0 || h == 0 || c % h != 0 || t == 0 || rows % t != 0 {
            bail!("attention: qkv {shape:?} does not split into sequences of {t}, 3 × {h} heads");
        }
        Ok((rows / t, t, c))
    }
}

/// 1/√head_dim, the scale of the attention scores.
pub(crate) fn scale(hd: usize) -> f32 {
    1.0 / (hd as f32).sqrt()
}

/// Causal attention of one sequence of `t` positions: `x` its [t, 3C] rows of q, k and v
/// (`heads` heads of C / heads columns each), `y` its [t, C] output. `p` receives the
/// probabilities: t × t values of scratch that each head overwrites, or `heads` · t × t, where
/// every head's are left for [`sequence_bwd`] to read instead of recomputing them.
pub(crate) fn sequence(x: &[f32], y: &mut [f32], t: usize, heads: usize, p: &mut [f32]) {
    sequence_in(x, y, t, heads, p, None)
}

/// [`sequence`] of a packed row when `starts` gives each position's first visible key.
fn sequence_in(
    x: &[f32],
    y: &mut [f32],
    t: usize,
    heads: usize,
    p: &mut [f32],
    starts: Option<&[u32]>,
) {
    let c = y.len() / t;
    let hd = c / heads;
    let per_head = if p.len() >= heads * t * t { t * t } else { 0 };
    #[cfg(target_arch = "x86_64")]
    if tiles::applies(t, hd) && starts.is_none() {
        for h in 0..heads {
            tiles::forward(x, y, &mut p[h * per_head..], tiles::Head { t, c, h, hd });
        }
        return;
    }
    for h in 0..heads {
        let p = &mut p[h * per_head..];
        let q = View::rows(x, h * hd, t, hd, 3 * c);
        let k = View::rows(x, c + h * hd, t, hd, 3 * c);
        let v = View::rows(x, 2 * c + h * hd, t, hd, 3 * c);
        for rows in query_blocks(t) {
            let (r0, n) = (rows.start, rows.len());
            let qb = q.row_range(rows.clone());
            probabilities(p, rows.clone(), qb, k, scale(hd), starts);
            let pb = View::rows(p, r0 * t, n, rows.end, t);
            matmul(&mut y[r0 * c + h * hd..], c, pb, v.first_rows(rows.end));
        }
    }
}

/// The backward of [`sequence`]: `dy` [t, C] the output's gradient, `dx` [t, 3C] written with
/// the gradient of q, k and v; `scratch`: 2 · t × t values. With P the probabilities of a
/// head: dV = Pᵀ·dY, dP = dY·Vᵀ, dS = P ⊙ (dP - rowsum(dP ⊙ P)) · scale, dQ = dS·K,
/// dK = dSᵀ·Q. P is read from `kept` (every head's, as [`sequence`] left them) or recomputed.
pub(crate) fn sequence_bwd(
    x: &[f32],
    dy: &[f32],
    dx: &mut [f32],
    t: usize,
    heads: usize,
    kept: Option<&[f32]>,
    scratch: &mut [f32],
) {
    sequence_bwd_in(x, (dy, dx), t, heads, (kept, None), scratch)
}

/// [`sequence_bwd`] of a packed row when `starts` gives each position's first visible key (the
/// probabilities recomputed with them; the masked ones, 0, pass no gradient).
fn sequence_bwd_in(
    x: &[f32],
    (dy, dx): (&[f32], &mut [f32]),
    t: usize,
    heads: usize,
    (kept, starts): (Option<&[f32]>, Option<&[u32]>),
    scratch: &mut [f32],
) {
    let c = dy.len() / t;
    let hd = c / heads;
    let scale = scale(hd);
    let (recomputed, ds) = scratch.split_at_mut(t * t);
    #[cfg(target_arch = "x86_64")]
    if tiles::applies(t, hd) && starts.is_none() {
        for h in 0..heads {
            let head = tiles::Head { t, c, h, hd };
            let p: &[f32] = match kept {
                Some(kept) => &kept[h * t * t..][..t * t],
                None => {
                    tiles::probabilities(x, recomputed, head);
                    recomputed
                }
            };
            tiles::backward(x, dy, dx, p, ds, head);
        }
        return;
    }
    for h in 0..heads {
        let q = View::rows(x, h * hd, t, hd, 3 * c);
        let k = View::rows(x, c + h * hd, t, hd, 3 * c);
        let v = View::rows(x, 2 * c + h * hd, t, hd, 3 * c);
        let dyh = View::rows(dy, h * hd, t, hd, c);
        // Last block first: it reaches every key, so it writes all of dK and dV and the
        // blocks before it add to their first rows.
        for rows in query_blocks(t).rev() {
            let (r0, n, seen) = (rows.start, rows.len(), rows.end);
            let accumulate = seen < t;
            let (qb, dyb) = (q.row_range(rows.clone()), dyh.row_range(rows.clone()));
            let p: &[f32] = match kept {
                Some(kept) => &kept[h * t * t..][..t * t],
                None => {
                    probabilities(recomputed, rows.clone(), qb, k, scale, starts);
                    recomputed
                }
            };
            let pb = View::rows(p, r0 * t, n, seen, t);
            let dv = &mut dx[2 * c + h * hd..];
            gemm_into(dv, 3 * c, pb.t(), dyb, accumulate);
            let dsb = &mut ds[r0 * t..];
            matmul(dsb, t, dyb, v.first_rows(seen).t());
            ops::simd::causal_softmax_bwd(dsb, &p[r0 * t..], n, seen, t, scale);
            let dsv = View::rows(ds, r0 * t, n, seen, t);
            matmul(
                &mut dx[r0 * 3 * c + h * hd..],
                3 * c,
                dsv,
                k.first_rows(seen),
            );
            gemm_into(&mut dx[c + h * hd..], 3 * c, dsv.t(), qb, accumulate);
        }
    }
}

impl CustomOp1 for AttentionOp {
    fn name(&self) -> &'static str {
        "ddpjob-gpt-attention"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        let (n, t, c) = self.dims(layout.shape())?;
        let qkv = values(storage, layout)?;
        let mut y = vec![0f32; n * t * c];
        if c > 0 {
            y.par_chunks_mut(t * c)
                .zip(qkv.par_chunks(t * 3 * c))
                .enumerate()
                .for_each(|(s, (y, x))| {
                    let p = &mut vec![0f32; t * t];
                    sequence_in(x, y, t, self.heads, p, self.starts_of(s))
                });
        }
        Ok((CpuStorage::F32(y), Shape::from((n * t, c))))
    }

    /// See [`sequence_bwd`].
    fn bwd(&self, qkv: &Tensor, _y: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let (_, t, c) = self.dims(qkv.shape())?;
        let mut dqkv = vec![0f32; qkv.elem_count()];
        if c > 0 {
            with_values(qkv, |qkv| {
                with_values(grad, |grad| {
                    dqkv.par_chunks_mut(t * 3 * c)
                        .zip(qkv.par_chunks(t * 3 * c))
                        .zip(grad.par_chunks(t * c))
                        .enumerate()
                        .for_each(|(s, ((dx, x), dy))| {
                            let mut scratch = vec![0f32; 2 * t * t];
                            let how = (None, self.starts_of(s));
                            sequence_bwd_in(x, (dy, dx), t, self.heads, how, &mut scratch)
                        });
                    Ok(())
                })
            })?;
        }
        Ok(Some(Tensor::from_vec(dqkv, qkv.shape(), qkv.device())?))
    }
}
