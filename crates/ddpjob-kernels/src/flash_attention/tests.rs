//! The tiled attention against the plain one (every head's [t, t] scores from candle's ops
//! under a mask written from the definition), its bits across thread counts and lengths.

use std::sync::Arc;

use candle_core::{D, DType, Device, Tensor, Var};

use super::{Attention, flash_attention};
use crate::testing::random;

/// softmax(q·kᵀ/√hd + mask)·v from candle's ops, each query head reading key-value head
/// h / group, the mask hiding every key position i may not see.
fn plain(qkv: &Tensor, a: &Attention) -> Tensor {
    let (rows, _) = qkv.dims2().unwrap();
    let (t, hd, h, kv) = (a.t, a.head_dim, a.heads, a.kv_heads);
    let n = rows / t;
    let heads = |first: usize, count: usize| {
        qkv.narrow(1, first * hd, count * hd)
            .unwrap()
            .reshape((n, t, count, hd))
            .unwrap()
            .transpose(1, 2)
            .unwrap()
    };
    let grouped = |x: Tensor| {
        x.unsqueeze(2)
            .unwrap()
            .broadcast_as((n, kv, h / kv, t, hd))
            .unwrap()
            .reshape((n, h, t, hd))
            .unwrap()
    };
    let (q, k, v) = (
        heads(0, h),
        grouped(heads(h, kv)),
        grouped(heads(h + kv, kv)),
    );
    let mut mask = vec![f32::NEG_INFINITY; n * t * t];
    for s in 0..n {
        for i in 0..t {
            let mut lo = a.starts.as_ref().map_or(0, |st| st[s * t + i] as usize);
            if let Some(w) = a.window {
                lo = lo.max((i + 1).saturating_sub(w));
            }
            for j in lo..=i {
                mask[(s * t + i) * t + j] = 0.0;
            }
        }
    }
    let mask = Tensor::from_vec(mask, (n, 1, t, t), &Device::Cpu).unwrap();
    let scores = (q.contiguous().unwrap())
        .matmul(&k.contiguous().unwrap().t().unwrap())
        .unwrap()
        .affine(1.0 / (hd as f64).sqrt(), 0.0)
        .unwrap()
        .broadcast_add(&mask)
        .unwrap();
    candle_nn::ops::softmax(&scores, D::Minus1)
        .unwrap()
        .matmul(&v.contiguous().unwrap())
        .unwrap()
        .transpose(1, 2)
        .unwrap()
        .reshape((rows, h * hd))
        .unwrap()
}

/// Packed rows: examples of uneven lengths back to back in each sequence.
fn packed_starts(n: usize, t: usize, lengths: &[usize]) -> Arc<Vec<u32>> {
    let mut starts = Vec::with_capacity(n * t);
    for s in 0..n {
        let (mut start, mut k) = (0, s);
        for i in 0..t {
            if i - start == lengths[k % lengths.len()] {
                start = i;
                k += 1;
            }
            starts.push(start as u32);
        }
    }
    Arc::new(starts)
}

fn attention(t: usize, (heads, kv_heads, head_dim): (usize, usize, usize)) -> Attention {
    Attention {
        heads,
        kv_heads,
        head_dim,
        t,
        window: None,
        starts: None,
    }
}

fn input(n: usize, a: &Attention, seed: u64) -> Var {
    random(&[n * a.t, a.cols()], 0.0, seed)
}

/// Values and every gradient within 1e-5 of the plain attention's (f32), for causal heads,
/// grouped-query heads, sliding windows, packed rows and both together, at lengths on and
/// beside the tiles' edges (64 rows and keys).
#[test]
fn tiles_give_the_plain_attentions_values_and_gradients() {
    let cases: Vec<(usize, Attention)> = vec![
        (2, attention(70, (4, 4, 16))),
        (1, attention(130, (4, 2, 8))),
        (1, attention(1, (2, 1, 8))),
        (1, attention(64, (2, 2, 8))),
        (1, attention(65, (2, 2, 8))),
        (1, attention(128, (3, 1, 8))),
        (
            1,
            Attention {
                window: Some(37),
                ..attention(200, (6, 2, 16))
            },
        ),
        (
            1,
            Attention {
                window: Some(64),
                ..attention(129, (2, 2, 8))
            },
        ),
        (
            2,
            Attention {
                starts: Some(packed_starts(2, 150, &[5, 64, 1, 70, 9])),
                ..attention(150, (4, 1, 8))
            },
        ),
        (
            1,
            Attention {
                window: Some(20),
                starts: Some(packed_starts(1, 129, &[65, 40])),
                ..attention(129, (2, 2, 8))
            },
        ),
    ];
    for (case, (n, a)) in cases.into_iter().enumerate() {
        let x = input(n, &a, 7 + case as u64);
        crate::testing::same_with_gradients(
            &[x],
            |xs| flash_attention(xs[0], &a).unwrap(),
            |xs| plain(xs[0], &a),
            1e-5,
        );
    }
}

/// Values and gradients, as bits, of a forward and backward run on a pool of `threads`.
fn bits(threads: usize, x: &Var, a: &Attention) -> Vec<Vec<u32>> {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .unwrap();
    pool.install(|| {
        let y = flash_attention(x.as_tensor(), a).unwrap();
        let grads = crate::host::uneven_sum(&y).backward().unwrap();
        vec![
            crate::f32_bits(&y),
            crate::f32_bits(grads.get(x.as_tensor()).unwrap()),
        ]
    })
}

/// 1, 2 or 5 threads: the same bits (each task's order of work is fixed).
#[test]
fn the_same_bits_for_any_thread_count() {
    let a = Attention {
        window: Some(90),
        ..attention(300, (4, 2, 16))
    };
    let x = input(3, &a, 11);
    let one = bits(1, &x, &a);
    assert_eq!(one, bits(2, &x, &a));
    assert_eq!(one, bits(5, &x, &a));
}

/// A position's values and gradients are the same bits whatever follows it in the sequence
/// (with no gradient from the positions after it, as padding has none): a batch's rows cut
/// to another length train as before.
#[test]
fn a_positions_values_and_gradients_do_not_depend_on_the_sequences_length() {
    let (long, short) = (attention(200, (4, 2, 8)), attention(77, (4, 2, 8)));
    let x = input(1, &long, 5);
    let head = Var::from_tensor(&x.as_tensor().narrow(0, 0, 77).unwrap()).unwrap();
    let run = |x: &Var, a: &Attention| {
        let y = flash_attention(x.as_tensor(), a)
            .unwrap()
            .narrow(0, 0, 77)
            .unwrap();
        let grads = crate::host::uneven_sum(&y).backward().unwrap();
        let dx = grads.get(x.as_tensor()).unwrap().narrow(0, 0, 77).unwrap();
        (crate::f32_bits(&y), crate::f32_bits(&dx))
    };
    assert!(run(&x, &long) == run(&head, &short));
}

/// Geometries that do not fit the rows are errors, not out-of-bounds reads.
#[test]
fn geometries_that_do_not_fit_are_refused() {
    let x = Tensor::zeros((10, 48), DType::F32, &Device::Cpu).unwrap();
    for (a, says) in [
        (attention(5, (3, 2, 8)), "not a grouping"),
        (attention(3, (4, 1, 8)), "are not sequences"),
        (
            Attention {
                window: Some(0),
                ..attention(5, (4, 1, 8))
            },
            "window of 0",
        ),
        (
            Attention {
                starts: Some(Arc::new(vec![0; 3])),
                ..attention(5, (4, 1, 8))
            },
            "3 starts",
        ),
    ] {
        let err = flash_attention(&x, &a).unwrap_err().to_string();
        assert!(err.contains(says), "{err}");
    }
}
