//! The 2×2 max-pool that follows a convolution, fused with its bias and ReLU, and its backward,
//! four windows at a time with SSE2 (part of every x86-64 CPU). Done one value at a time they
//! were 4% of a cnn step: the windows' stride-2 loads kept the compiler from vectorising them.

/// The convolution's output maps before pooling: `channels` maps of `rows` × `cols`.
#[derive(Debug, Clone, Copy)]
pub(super) struct Maps {
    pub channels: usize,
    pub rows: usize,
    pub cols: usize,
}

impl Maps {
    fn pooled_cols(&self) -> usize {
        self.cols / 2
    }

    /// The offsets in the maps of the two rows pooled row `r` (over all channels) is taken from.
    fn window_rows(&self, r: usize) -> (usize, usize) {
        let ph = self.rows / 2;
        let top = (r / ph) * self.rows * self.cols + 2 * (r % ph) * self.cols;
        (top, top + self.cols)
    }

    fn pooled_rows(&self) -> usize {
        self.channels * (self.rows / 2)
    }
}

/// `out` = relu(max over each 2×2 window of z + bias) for `z` [channels, rows, cols], and in
/// `argmax` the window's place (0–3, row-major) of its first maximum (a NaN loses to any number;
/// unlike torch). An odd last row or column is dropped. Pooling first and then adding the
/// bias and clamping gives the same values as the other order, with 4× less work on the clamp.
pub(super) fn bias_relu_pool(
    z: &[f32],
    bias: &[f32],
    relu: bool,
    m: Maps,
    out: &mut [f32],
    argmax: &mut [u8],
) {
    let (pw, ph) = (m.pooled_cols(), m.rows / 2);
    if pw == 0 || ph == 0 {
        return;
    }
    let rows = out.chunks_exact_mut(pw).zip(argmax.chunks_exact_mut(pw));
    for (r, (out, argmax)) in rows.take(m.pooled_rows()).enumerate() {
        let (top, bottom) = m.window_rows(r);
        let (top, bottom) = (&z[top..][..2 * pw], &z[bottom..][..2 * pw]);
        let b = bias[r / ph];
        #[cfg(target_arch = "x86_64")]
        let done = sse::pool_row(top, bottom, b, relu, out, argmax);
        #[cfg(not(target_arch = "x86_64"))]
        let done = 0;
        for px in done..pw {
            let window = [
                top[2 * px],
                top[2 * px + 1],
                bottom[2 * px],
                bottom[2 * px + 1],
            ];
            (out[px], argmax[px]) = pool_window(window.map(|v| v + b), relu);
        }
    }
}

/// One window's output and the place of its first maximum.
#[inline(always)]
pub(super) fn pool_window([a, b, c, e]: [f32; 4], relu: bool) -> (f32, u8) {
    let max = a.max(b).max(c.max(e));
    // The first place holding the maximum, as arithmetic rather than branches.
    let (na, nb, nc) = (a != max, b != max, c != max);
    let arg = u8::from(na) * (1 + u8::from(nb) * (1 + u8::from(nc)));
    (if relu && max < 0.0 { 0.0 } else { max }, arg)
}

/// The gradient at the convolution's output `gz` [channels, rows, cols] from the pooled
/// outputs' gradient `g`, the pooled outputs `y` and [`bias_relu_pool`]'s `argmax`: each
/// window's gradient goes to its maximum (when the ReLU passed it), zeros elsewhere.
pub(super) fn pool_grad(g: &[f32], y: &[f32], argmax: &[u8], relu: bool, m: Maps, gz: &mut [f32]) {
    if m.rows % 2 == 1 || m.cols % 2 == 1 {
        // The dropped last row or column gets no gradient; the windows overwrite the rest.
        gz.fill(0.0);
    }
    let pw = m.pooled_cols();
    if pw == 0 {
        return;
    }
    let rows = g.chunks_exact(pw).zip(y.chunks_exact(pw));
    for (r, ((g, y), argmax)) in rows.zip(argmax.chunks_exact(pw)).enumerate() {
        let (top, bottom) = m.window_rows(r);
        let (head, tail) = gz.split_at_mut(bottom);
        let (top, bottom) = (&mut head[top..][..2 * pw], &mut tail[..2 * pw]);
        #[cfg(target_arch = "x86_64")]
        let done = sse::grad_row(g, y, argmax, relu, top, bottom);
        #[cfg(not(target_arch = "x86_64"))]
        let done = 0;
        for px in done..pw {
            let passed = if !relu || y[px] > 0.0 { g[px] } else { 0.0 };
            let mut window = [0.0; 4];
            window[usize::from(argmax[px])] = passed;
            top[2 * px..][..2].copy_from_slice(&window[..2]);
            bottom[2 * px..][..2].copy_from_slice(&window[2..]);
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod sse {
    use std::arch::x86_64::*;

    /// The even- and odd-indexed values of `row[8j..8j + 8]`: the windows' left and right
    /// columns for four windows.
    ///
    /// SAFETY: the caller ensures `8j + 8 <= row.len()`.
    #[inline(always)]
    unsafe fn columns(row: &[f32], j: usize) -> (__m128, __m128) {
        unsafe {
            let lo = _mm_loadu_ps(row.as_ptr().add(8 * j));
            let hi = _mm_loadu_ps(row.as_ptr().add(8 * j + 4));
            (
                _mm_shuffle_ps::<0b10_00_10_00>(lo, hi),
                _mm_shuffle_ps::<0b11_01_11_01>(lo, hi),
            )
        }
    }

    /// [`super::bias_relu_pool`] over the first windows of a row, four at a time; returns how
    /// many it did. A group holding a NaN is left to the scalar code, which ranks NaNs.
    pub(super) fn pool_row(
        top: &[f32],
        bottom: &[f32],
        bias: f32,
        relu: bool,
        out: &mut [f32],
        argmax: &mut [u8],
    ) -> usize {
        let groups = out.len() / 4;
        assert!(top.len() >= 8 * groups && bottom.len() >= 8 * groups && argmax.len() >= out.len());
        // SAFETY: SSE2 is part of x86-64; every load and store is within the lengths checked.
        unsafe {
            let b = _mm_set1_ps(bias);
            let zero = _mm_setzero_ps();
            for j in 0..groups {
                let (a, c) = columns(top, j);
                let (e, f) = columns(bottom, j);
                let (a, c, e, f) = (
                    _mm_add_ps(a, b),
                    _mm_add_ps(c, b),
                    _mm_add_ps(e, b),
                    _mm_add_ps(f, b),
                );
                let nan = _mm_or_ps(_mm_cmpunord_ps(a, c), _mm_cmpunord_ps(e, f));
                if _mm_movemask_ps(nan) != 0 {
                    return 4 * j;
                }
                let max = _mm_max_ps(_mm_max_ps(a, c), _mm_max_ps(e, f));
                // Place = [a ≠ max] + [a, c ≠ max] + [a, c, e ≠ max]; masks are -1 where true.
                let not_a = _mm_castps_si128(_mm_cmpneq_ps(a, max));
                let not_ac = _mm_and_si128(not_a, _mm_castps_si128(_mm_cmpneq_ps(c, max)));
                let not_ace = _mm_and_si128(not_ac, _mm_castps_si128(_mm_cmpneq_ps(e, max)));
                let place = _mm_sub_epi32(
                    _mm_setzero_si128(),
                    _mm_add_epi32(_mm_add_epi32(not_a, not_ac), not_ace),
                );
                let bytes = _mm_packus_epi16(_mm_packs_epi32(place, place), place);
                let bytes = (_mm_cvtsi128_si32(bytes) as u32).to_le_bytes();
                argmax[4 * j..4 * j + 4].copy_from_slice(&bytes);
                // max < 0 → 0, keeping -0.0 as the scalar clamp does.
                let value = if relu {
                    _mm_andnot_ps(_mm_cmplt_ps(max, zero), max)
                } else {
                    max
                };
                _mm_storeu_ps(out.as_mut_ptr().add(4 * j), value);
            }
        }
        4 * groups
    }

    /// [`super::pool_grad`] over the first windows of a row, four at a time; returns how many
    /// it did.
    pub(super) fn grad_row(
        g: &[f32],
        y: &[f32],
        argmax: &[u8],
        relu: bool,
        top: &mut [f32],
        bottom: &mut [f32],
    ) -> usize {
        let groups = g.len() / 4;
        assert!(y.len() >= 4 * groups && argmax.len() >= 4 * groups);
        assert!(top.len() >= 8 * groups && bottom.len() >= 8 * groups);
        // SAFETY: SSE2 is part of x86-64; every load and store is within the lengths checked.
        unsafe {
            let zero = _mm_setzero_ps();
            for j in 0..groups {
                let mut gv = _mm_loadu_ps(g.as_ptr().add(4 * j));
                if relu {
                    let passed = _mm_cmpgt_ps(_mm_loadu_ps(y.as_ptr().add(4 * j)), zero);
                    gv = _mm_and_ps(gv, passed);
                }
                let bytes: [u8; 4] = argmax[4 * j..4 * j + 4].try_into().expect("4 places");
                let place = _mm_cvtsi32_si128(i32::from_le_bytes(bytes));
                let zeros = _mm_setzero_si128();
                let place = _mm_unpacklo_epi16(_mm_unpacklo_epi8(place, zeros), zeros);
                let at = |k: i32| {
                    _mm_and_ps(
                        gv,
                        _mm_castsi128_ps(_mm_cmpeq_epi32(place, _mm_set1_epi32(k))),
                    )
                };
                let (a, c, e, f) = (at(0), at(1), at(2), at(3));
                _mm_storeu_ps(top.as_mut_ptr().add(8 * j), _mm_unpacklo_ps(a, c));
                _mm_storeu_ps(top.as_mut_ptr().add(8 * j + 4), _mm_unpackhi_ps(a, c));
                _mm_storeu_ps(bottom.as_mut_ptr().add(8 * j), _mm_unpacklo_ps(e, f));
                _mm_storeu_ps(bottom.as_mut_ptr().add(8 * j + 4), _mm_unpackhi_ps(e, f));
            }
        }
        4 * groups
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pooling_takes_the_first_maximum_and_ranks_nans_last() {
        let m = Maps {
            channels: 1,
            rows: 2,
            cols: 4,
        };
        let z = [1.0, 3.0, 5.0, 0.0, 3.0, 2.0, 5.0, 9.0];
        let (mut out, mut arg) = ([0f32; 2], [0u8; 2]);
        bias_relu_pool(&z, &[0.0], true, m, &mut out, &mut arg);
        assert_eq!((out, arg), ([3.0, 9.0], [1, 3]));
        let z = [7.0, 7.0, 1.0, f32::NAN, 7.0, 0.0, 2.0, 2.0];
        bias_relu_pool(&z, &[-10.0], false, m, &mut out, &mut arg);
        assert_eq!((out, arg), ([-3.0, -8.0], [0, 2]));
        bias_relu_pool(&z, &[-10.0], true, m, &mut out, &mut arg);
        assert_eq!(out, [0.0, 0.0]);
    }

    /// The SSE groups and the scalar windows agree on every output, place and gradient: rows
    /// of 13 windows (three groups and one left over), NaNs in some groups, ties everywhere,
    /// with and without a dropped last row and column.
    #[test]
    fn grouped_and_single_windows_agree() {
        let odd = Maps {
            channels: 3,
            rows: 5,
            cols: 27,
        };
        let even = Maps {
            channels: 2,
            rows: 4,
            cols: 26,
        };
        for m in [odd, even] {
            grouped_and_single_windows_agree_on(m);
        }
    }

    fn grouped_and_single_windows_agree_on(m: Maps) {
        let mut state = 17u32;
        let mut next = || {
            state = state.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            state >> 8
        };
        // Few distinct values, so windows tie often.
        let z: Vec<f32> = (0..m.channels * m.rows * m.cols)
            .map(|i| match next() % 23 {
                0 if i % 7 == 0 => f32::NAN,
                v => v as f32 / 4.0 - 2.0,
            })
            .collect();
        let bias = [0.25, -1.0, 0.5][..m.channels].to_vec();
        let pooled = m.pooled_rows() * m.pooled_cols();
        let g: Vec<f32> = (0..pooled).map(|_| next() as f32 / 1e6).collect();
        for relu in [true, false] {
            let (mut out, mut arg) = (vec![0f32; pooled], vec![0u8; pooled]);
            bias_relu_pool(&z, &bias, relu, m, &mut out, &mut arg);
            let mut gz = vec![f32::NAN; z.len()];
            pool_grad(&g, &out, &arg, relu, m, &mut gz);
            let mut want_gz = vec![0f32; z.len()];
            for q in 0..pooled {
                let (r, px) = (q / m.pooled_cols(), q % m.pooled_cols());
                let (top, bottom) = m.window_rows(r);
                let at = [
                    top + 2 * px,
                    top + 2 * px + 1,
                    bottom + 2 * px,
                    bottom + 2 * px + 1,
                ];
                let b = bias[r / (m.rows / 2)];
                let (want, place) = pool_window(at.map(|i| z[i] + b), relu);
                assert_eq!(out[q].to_bits(), want.to_bits(), "{m:?} output {q}");
                assert_eq!(arg[q], place, "{m:?} place {q}");
                if !relu || want > 0.0 {
                    want_gz[at[usize::from(place)]] = g[q];
                }
            }
            let same = gz
                .iter()
                .zip(&want_gz)
                .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "{m:?}, relu {relu}: gradients differ");
        }
    }
}
