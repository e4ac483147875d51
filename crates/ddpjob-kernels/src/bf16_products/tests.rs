use super::*;

/// Deterministic values in [-1, 1) that bf16 cannot hold exactly.
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

fn rounded(x: f32) -> f64 {
    f32::from_bits(bf16_bits(x) << 16) as f64
}

/// A product through the bf16 kernel, or `None` where this CPU lacks the instructions (then
/// the switch must refuse to turn on).
fn product(
    (m, n, k): (usize, usize, usize),
    a: (&[f32], usize, usize),
    b: (&[f32], usize, usize),
    dst: &mut [f32],
    accumulate: bool,
) -> Option<()> {
    if !available() {
        // Storing "off" where it is always off: no other test can notice.
        assert!(
            !set_bf16_products(true),
            "the switch must stay off without the instructions"
        );
        return None;
    }
    #[cfg(target_arch = "x86_64")]
    {
        let operand = |(data, rs, cs): (&[f32], usize, usize)| Operand {
            ptr: data.as_ptr(),
            rs,
            cs,
        };
        let out = Dst {
            ptr: dst.as_mut_ptr(),
            rs: n,
        };
        assert!(dst.len() >= m * n);
        // SAFETY: checked here (the instructions) and by the callers' sizes (the memory).
        unsafe { gemm((m, n, k), out, accumulate, operand(a), operand(b)) };
    }
    Some(())
}

#[test]
fn values_round_to_the_nearest_bf16_ties_to_even() {
    assert_eq!(bf16_bits(1.0), 0x3f80);
    assert_eq!(
        bf16_bits(f32::from_bits(0x3f80_8000)),
        0x3f80,
        "a tie goes to even (down)"
    );
    assert_eq!(
        bf16_bits(f32::from_bits(0x3f81_8000)),
        0x3f82,
        "a tie goes to even (up)"
    );
    assert_eq!(bf16_bits(f32::from_bits(0x3f80_8001)), 0x3f81);
    assert_eq!(bf16_bits(-2.5), 0xc020);
    assert_eq!(bf16_bits(f32::INFINITY), 0x7f80);
    assert_eq!(
        bf16_bits(f32::MAX),
        0x7f80,
        "past bf16's largest value: infinity"
    );
    // Subnormals become zeros of their sign, as the packing instructions read them.
    assert_eq!(bf16_bits(f32::from_bits(0x007f_ffff)), 0x0000);
    assert_eq!(bf16_bits(f32::from_bits(0x8000_0001)), 0x8000);
    assert_eq!(
        bf16_bits(f32::MIN_POSITIVE),
        0x0080,
        "the smallest normal stays"
    );
    let nan = f32::from_bits(bf16_bits(f32::NAN) << 16);
    assert!(nan.is_nan());
    assert!(f32::from_bits(bf16_bits(f32::from_bits(0x7f80_0001)) << 16).is_nan());
}

/// Every layout the kernels use (plain, either operand transposed), shapes off every block
/// edge (rows past MR and MC, columns past NR, an odd k past KC), with and without
/// accumulation: within f32 summation's bound of the exact product of the rounded inputs.
#[test]
fn products_equal_the_rounded_inputs_exact_product_within_f32_sums() {
    for &(m, n, k) in &[
        (1, 1, 2),
        (9, 33, 5),
        (130, 70, 301),
        (17, 1030, 64),
        (3, 40, 513),
    ] {
        let layouts = [(false, false), (true, false), (false, true), (true, true)];
        for (transpose_a, transpose_b) in layouts {
            for accumulate in [false, true] {
                let a = values(m * k, (m + 7 * k) as u64);
                let b = values(k * n, (n + 3 * k) as u64);
                let a_at = |i: usize, p: usize| {
                    if transpose_a {
                        a[p * m + i]
                    } else {
                        a[i * k + p]
                    }
                };
                let b_at = |p: usize, j: usize| {
                    if transpose_b {
                        b[j * k + p]
                    } else {
                        b[p * n + j]
                    }
                };
                let a_op = if transpose_a {
                    (&a[..], 1, m)
                } else {
                    (&a[..], k, 1)
                };
                let b_op = if transpose_b {
                    (&b[..], 1, k)
                } else {
                    (&b[..], n, 1)
                };
                let start = values(m * n, 99);
                let mut got = start.clone();
                if product((m, n, k), a_op, b_op, &mut got, accumulate).is_none() {
                    return;
                }
                for i in 0..m {
                    for j in 0..n {
                        let terms = (0..k).map(|p| rounded(a_at(i, p)) * rounded(b_at(p, j)));
                        let (exact, size) =
                            terms.fold((0.0, 0.0), |(s, z), t| (s + t, z + t.abs()));
                        let before = if accumulate {
                            start[i * n + j] as f64
                        } else {
                            0.0
                        };
                        let bound = (k + 2) as f64 * f32::EPSILON as f64 * (size + before.abs());
                        let error = (got[i * n + j] as f64 - (exact + before)).abs();
                        assert!(
                            error <= bound,
                            "{m}x{n}x{k} ({transpose_a}, {transpose_b}, {accumulate}) at ({i}, {j}): \
                             {} vs {}",
                            got[i * n + j],
                            exact + before
                        );
                    }
                }
            }
        }
    }
}

/// The inputs are rounded, not used as they are: 1 + 2⁻¹⁰ is 1 in bf16, so k of them times 1
/// sum to exactly k (the f32 product would be k·(1 + 2⁻¹⁰)).
#[test]
fn the_inputs_are_rounded_to_bf16() {
    let (m, n, k) = (4, 40, 300);
    let a = vec![1.0 + 1.0 / 1024.0; m * k];
    let b = vec![1.0f32; k * n];
    let mut got = vec![f32::NAN; m * n];
    if product((m, n, k), (&a, k, 1), (&b, n, 1), &mut got, false).is_none() {
        return;
    }
    assert!(got.iter().all(|&x| x == k as f32), "{:?}", &got[..4]);
}

/// How the rows or columns are split between threads changes nothing: each element's sums
/// run over k in the same order whatever block it falls in.
#[test]
fn a_block_of_the_product_equals_the_same_part_of_the_whole() {
    let (m, n, k) = (70, 90, 530);
    let a = values(m * k, 1);
    let b = values(k * n, 2);
    let mut whole = vec![0.0; m * n];
    if product((m, n, k), (&a, k, 1), (&b, n, 1), &mut whole, false).is_none() {
        return;
    }
    let (r0, c0, rows, cols) = (13, 37, 41, 50);
    let mut part = vec![0.0; rows * cols];
    let a_part = (&a[r0 * k..], k, 1);
    let b_part = (&b[c0..], n, 1);
    product((rows, cols, k), a_part, b_part, &mut part, false).unwrap();
    for i in 0..rows {
        for j in 0..cols {
            assert_eq!(
                part[i * cols + j].to_bits(),
                whole[(r0 + i) * n + c0 + j].to_bits()
            );
        }
    }
}

#[test]
fn a_nan_input_gives_nan_in_its_row_only() {
    let (m, n, k) = (10, 20, 64);
    let mut a = values(m * k, 3);
    a[4 * k + 10] = f32::NAN;
    let b = values(k * n, 4);
    let mut got = vec![0.0; m * n];
    if product((m, n, k), (&a, k, 1), (&b, n, 1), &mut got, false).is_none() {
        return;
    }
    for i in 0..m {
        let nans = got[i * n..(i + 1) * n]
            .iter()
            .filter(|x| x.is_nan())
            .count();
        assert_eq!(nans, if i == 4 { n } else { 0 }, "row {i}");
    }
}

/// Neither stride 1 (every other value of a wider matrix): the packing's general path.
#[test]
fn operands_with_no_unit_stride_are_read_where_they_are() {
    let (m, n, k) = (19, 45, 67);
    let a = values(2 * m * k, 5);
    let b = values(2 * k * n, 6);
    let mut got = vec![0.0; m * n];
    if product((m, n, k), (&a, 2 * k, 2), (&b, 2 * n, 2), &mut got, false).is_none() {
        return;
    }
    for i in 0..m {
        for j in 0..n {
            let exact: f64 = (0..k)
                .map(|p| rounded(a[2 * (i * k + p)]) * rounded(b[2 * (p * n + j)]))
                .sum();
            assert!((got[i * n + j] as f64 - exact).abs() < 1e-4, "({i}, {j})");
        }
    }
}
