//! Matrix transposition, 8 × 8 blocks at a time in AVX registers where the CPU has AVX (the
//! GPT's attention transposes each head's keys and values).

/// `dst[j·dst_rs + i] = src[i·src_rs + j]` for the `rows` × `cols` matrix in `src` (rows
/// `src_rs` apart): its transpose into `dst` (rows `dst_rs` apart).
pub fn transpose(
    src: &[f32],
    src_rs: usize,
    rows: usize,
    cols: usize,
    dst: &mut [f32],
    dst_rs: usize,
) {
    if rows == 0 || cols == 0 {
        return;
    }
    assert!(
        src_rs >= cols && dst_rs >= rows,
        "transpose: rows overlap their strides"
    );
    assert!(
        src.len() >= (rows - 1) * src_rs + cols && dst.len() >= (cols - 1) * dst_rs + rows,
        "transpose: matrix out of bounds"
    );
    let (rows8, cols8) = (rows / 8 * 8, cols / 8 * 8);
    #[cfg(target_arch = "x86_64")]
    if rows8 > 0 && cols8 > 0 && is_x86_feature_detected!("avx") {
        // SAFETY: AVX is there; the blocks lie inside the matrices the assertions bound.
        unsafe { blocks_avx(src, src_rs, rows8, cols8, dst, dst_rs) };
    } else {
        scalar(src, src_rs, 0..rows8, 0..cols8, dst, dst_rs);
    }
    #[cfg(not(target_arch = "x86_64"))]
    scalar(src, src_rs, 0..rows8, 0..cols8, dst, dst_rs);
    // What the 8 × 8 blocks leave: the last columns of every row, the last rows.
    scalar(src, src_rs, 0..rows8, cols8..cols, dst, dst_rs);
    scalar(src, src_rs, rows8..rows, 0..cols, dst, dst_rs);
}

fn scalar(
    src: &[f32],
    src_rs: usize,
    rows: std::ops::Range<usize>,
    cols: std::ops::Range<usize>,
    dst: &mut [f32],
    dst_rs: usize,
) {
    for i in rows {
        for j in cols.clone() {
            dst[j * dst_rs + i] = src[i * src_rs + j];
        }
    }
}

/// [`transpose`] of the first `rows` × `cols` values, both multiples of 8.
///
/// # Safety
/// AVX; both matrices inside their slices.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx")]
unsafe fn blocks_avx(
    src: &[f32],
    src_rs: usize,
    rows: usize,
    cols: usize,
    dst: &mut [f32],
    dst_rs: usize,
) {
    use std::arch::x86_64::*;
    let (src, dst) = (src.as_ptr(), dst.as_mut_ptr());
    // Down each 8-column strip, so the transposed rows are written front to back.
    for c in (0..cols).step_by(8) {
        for r in (0..rows).step_by(8) {
            // SAFETY: rows r..r + 8 and columns c..c + 8 are inside both (the caller's).
            unsafe {
                let a: [__m256; 8] =
                    std::array::from_fn(|i| _mm256_loadu_ps(src.add((r + i) * src_rs + c)));
                let t0 = _mm256_unpacklo_ps(a[0], a[1]);
                let t1 = _mm256_unpackhi_ps(a[0], a[1]);
                let t2 = _mm256_unpacklo_ps(a[2], a[3]);
                let t3 = _mm256_unpackhi_ps(a[2], a[3]);
                let t4 = _mm256_unpacklo_ps(a[4], a[5]);
                let t5 = _mm256_unpackhi_ps(a[4], a[5]);
                let t6 = _mm256_unpacklo_ps(a[6], a[7]);
                let t7 = _mm256_unpackhi_ps(a[6], a[7]);
                let u = [
                    _mm256_shuffle_ps::<0x44>(t0, t2),
                    _mm256_shuffle_ps::<0xEE>(t0, t2),
                    _mm256_shuffle_ps::<0x44>(t1, t3),
                    _mm256_shuffle_ps::<0xEE>(t1, t3),
                    _mm256_shuffle_ps::<0x44>(t4, t6),
                    _mm256_shuffle_ps::<0xEE>(t4, t6),
                    _mm256_shuffle_ps::<0x44>(t5, t7),
                    _mm256_shuffle_ps::<0xEE>(t5, t7),
                ];
                for i in 0..4 {
                    let low = _mm256_permute2f128_ps::<0x20>(u[i], u[i + 4]);
                    let high = _mm256_permute2f128_ps::<0x31>(u[i], u[i + 4]);
                    _mm256_storeu_ps(dst.add((c + i) * dst_rs + r), low);
                    _mm256_storeu_ps(dst.add((c + i + 4) * dst_rs + r), high);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::transpose;

    #[test]
    fn transposes_blocks_and_ragged_edges_at_any_strides() {
        for (rows, cols) in [(8, 8), (16, 24), (13, 21), (3, 40), (40, 3), (1, 1), (0, 5)] {
            let (src_rs, dst_rs) = (cols + 3, rows + 5);
            let src: Vec<f32> = (0..rows * src_rs).map(|v| v as f32).collect();
            let mut dst = vec![-1.0; cols * dst_rs];
            transpose(&src, src_rs, rows, cols, &mut dst, dst_rs);
            for j in 0..cols {
                for i in 0..dst_rs {
                    let expected = if i < rows { src[i * src_rs + j] } else { -1.0 };
                    assert_eq!(dst[j * dst_rs + i], expected, "{rows}x{cols} at ({i}, {j})");
                }
            }
        }
    }
}
