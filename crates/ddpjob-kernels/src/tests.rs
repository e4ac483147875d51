//! The fused kernels against candle's own ops: outputs and every gradient, over random shapes,
//! strides and padding.

use candle_core::{Device, Tensor, Var};

use super::*;
use candle_core::{CpuStorage, Result};
use ddpjob_rng::Mt19937;

pub(super) fn random(rng: &mut Mt19937, shape: &[usize]) -> Tensor {
    let n = shape.iter().product();
    let values: Vec<f32> = (0..n).map(|_| rng.uniform(-1.0, 1.0)).collect();
    Tensor::from_vec(values, shape, &Device::Cpu).unwrap()
}

pub(super) fn assert_close(what: &str, ours: &Tensor, theirs: &Tensor) {
    assert_eq!(ours.dims(), theirs.dims(), "{what}: shapes");
    let a = ours.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let b = theirs.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let scale = b.iter().fold(1e-3f32, |m, v| m.max(v.abs()));
    for (i, (x, y)) in a.iter().zip(&b).enumerate() {
        assert!(
            (x - y).abs() <= 1e-4 * scale,
            "{what}[{i}]: ours {x}, reference {y}"
        );
    }
}

/// A layer's output and the gradients of x (when it needs one), w and b (see [`run`]).
pub(super) type LayerRun = (Tensor, Option<Tensor>, Tensor, Tensor);

/// Two runs of a layer on the same inputs agree: output and every gradient (`ours` against
/// the reference `theirs`).
pub(super) fn assert_runs_agree(
    what: &str,
    ours: &LayerRun,
    theirs: &LayerRun,
    x_needs_grad: bool,
) {
    assert_close(&format!("{what} output"), &ours.0, &theirs.0);
    assert_close(&format!("{what} weight grad"), &ours.2, &theirs.2);
    assert_close(&format!("{what} bias grad"), &ours.3, &theirs.3);
    match (&ours.1, &theirs.1) {
        (Some(a), Some(b)) => assert_close(&format!("{what} input grad"), a, b),
        (None, None) => assert!(!x_needs_grad, "{what}: no input gradient"),
        _ => panic!("{what}: input gradient present in one only"),
    }
}

/// Output and gradients of `f(x, w, b)` under a random upstream gradient; `x` is a variable
/// only when `x_needs_grad` (otherwise it is data, as for a first layer).
pub(super) fn run(
    f: impl Fn(&Tensor, &Tensor, &Tensor) -> candle_core::Result<Tensor>,
    tensors: [&Tensor; 3],
    upstream_seed: u64,
    x_needs_grad: bool,
) -> LayerRun {
    let [x, w, b] = tensors.map(|t| Var::from_tensor(t).unwrap());
    let x_in = if x_needs_grad {
        x.as_tensor().clone()
    } else {
        x.as_tensor().detach()
    };
    let out = f(&x_in, w.as_tensor(), b.as_tensor()).unwrap();
    let upstream = random(&mut Mt19937::new(upstream_seed), out.dims());
    let grads = (&out * &upstream)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    let gx = grads.get(x.as_tensor()).cloned();
    let gw = grads.get(w.as_tensor()).unwrap().clone();
    let gb = grads.get(b.as_tensor()).unwrap().clone();
    (out, gx, gw, gb)
}

/// `ours` and the reference `theirs` agree on `tensors` (x, w, b), with x as a variable and as
/// data (a first layer's input), under the upstream gradient of `seed`.
pub(super) fn assert_layers_agree(
    what: &str,
    ours: impl Fn(&Tensor, &Tensor, &Tensor) -> candle_core::Result<Tensor>,
    theirs: impl Fn(&Tensor, &Tensor, &Tensor) -> candle_core::Result<Tensor>,
    tensors: [&Tensor; 3],
    seed: u64,
) {
    for x_needs_grad in [true, false] {
        let a = run(&ours, tensors, seed, x_needs_grad);
        let r = run(&theirs, tensors, seed, x_needs_grad);
        let what = format!("{what} (x needs grad: {x_needs_grad})");
        assert_runs_agree(&what, &a, &r, x_needs_grad);
    }
}

/// A convolution: n, c, h, w, o, k, stride, padding, relu, pooling.
pub(super) type ConvCase = (
    usize,
    usize,
    usize,
    usize,
    usize,
    usize,
    usize,
    usize,
    bool,
    Pooling,
);

/// Convolutions over shapes, strides and padding.
pub(super) const CONV_CASES: [ConvCase; 10] = [
    (2, 1, 8, 8, 4, 3, 1, 0, true, Pooling::None),
    (3, 3, 9, 7, 5, 3, 2, 1, false, Pooling::None),
    (2, 2, 6, 6, 3, 1, 1, 0, true, Pooling::Max2),
    (4, 4, 10, 11, 6, 3, 1, 0, true, Pooling::Max2),
    (1, 2, 5, 5, 2, 5, 1, 2, false, Pooling::None),
    (2, 3, 12, 9, 4, 2, 3, 2, true, Pooling::None),
    (5, 2, 9, 9, 3, 3, 1, 1, false, Pooling::Max2),
    // Larger: more channels and output rows, odd sizes, padding.
    (2, 16, 26, 26, 8, 3, 1, 1, true, Pooling::Max2),
    (1, 20, 33, 30, 4, 5, 1, 2, false, Pooling::None),
    // 1×1 images and kernels: a linear layer, as `bias_relu` runs its bias and ReLU.
    (6, 7, 1, 1, 5, 1, 1, 0, true, Pooling::None),
];

#[test]
fn conv2d_matches_candle_over_shapes_strides_and_padding() {
    let mut rng = Mt19937::new(7);
    for (case, &(n, c, h, w, o, k, stride, padding, relu, pooling)) in CONV_CASES.iter().enumerate()
    {
        let x = random(&mut rng, &[n, c, h, w]);
        let wt = random(&mut rng, &[o, c, k, k]);
        let b = random(&mut rng, &[o]);
        let geometry = ConvGeometry { stride, padding };
        let ours = |x: &Tensor, w: &Tensor, b: &Tensor| conv2d(x, w, b, geometry, relu, pooling);
        let candle = |x: &Tensor, w: &Tensor, b: &Tensor| {
            let mut y = x
                .conv2d(w, padding, stride, 1, 1)?
                .broadcast_add(&b.reshape((1, o, 1, 1))?)?;
            if relu {
                y = y.relu()?;
            }
            if pooling == Pooling::Max2 {
                y = max_pool2_with_ops(&y)?;
            }
            Ok(y)
        };
        let what = format!("case {case}");
        assert_layers_agree(&what, ours, candle, [&x, &wt, &b], case as u64);
    }
}

#[test]
fn max_pool_with_ops_passes_the_whole_gradient_to_the_maximum() {
    let x = Var::new(
        &[[[[1f32, 4.0, 0.5], [2.0, 3.0, 9.0], [7.0, 7.5, 8.0]]]],
        &Device::Cpu,
    )
    .unwrap();
    let y = max_pool2_with_ops(x.as_tensor()).unwrap();
    assert_eq!(y.flatten_all().unwrap().to_vec1::<f32>().unwrap(), [4.0]);
    let grads = (y * 3.0).unwrap().sum_all().unwrap().backward().unwrap();
    let g = grads.get(x.as_tensor()).unwrap().flatten_all().unwrap();
    assert_eq!(
        g.to_vec1::<f32>().unwrap(),
        [0.0, 3.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    );
}

/// Linear layers: rows, inputs, outputs, relu. The last two take the CPU kernel's transposed
/// forward (few rows against a large weight).
pub(super) const LINEAR_CASES: [(usize, usize, usize, bool); 4] = [
    (5, 7, 3, true),
    (64, 33, 17, false),
    (1, 4, 9, true),
    (8, 300, 40, true),
];

/// `x·wᵀ + b`, then ReLU when `relu`, with candle's own ops: the reference for the layers.
pub(super) fn candle_linear(x: &Tensor, w: &Tensor, b: &Tensor, relu: bool) -> Result<Tensor> {
    let y = x.matmul(&w.t()?)?.broadcast_add(b)?;
    if relu { y.relu() } else { Ok(y) }
}

#[test]
fn linear_matches_candle_with_and_without_relu() {
    let mut rng = Mt19937::new(11);
    for (case, &(n, inputs, outputs, relu)) in LINEAR_CASES.iter().enumerate() {
        let x = random(&mut rng, &[n, inputs]);
        let w = random(&mut rng, &[outputs, inputs]);
        let b = random(&mut rng, &[outputs]);
        let ours = |x: &Tensor, w: &Tensor, b: &Tensor| linear(x, w, b, relu);
        let candle = |x: &Tensor, w: &Tensor, b: &Tensor| candle_linear(x, w, b, relu);
        for x_needs_grad in [true, false] {
            let a = run(ours, [&x, &w, &b], 100 + case as u64, x_needs_grad);
            let r = run(candle, [&x, &w, &b], 100 + case as u64, x_needs_grad);
            assert_close("linear output", &a.0, &r.0);
            assert_close("linear weight grad", &a.2, &r.2);
            assert_close("linear bias grad", &a.3, &r.3);
            assert_eq!(a.1.is_some(), x_needs_grad, "input grad only when needed");
            if let (Some(ours), Some(theirs)) = (&a.1, &r.1) {
                assert_close("linear input grad", ours, theirs);
            }
        }
    }
}

#[test]
fn gemm_split_over_threads_matches_one_thread() {
    let mut rng = Mt19937::new(3);
    let mut fill = |n: usize| -> Vec<f32> { (0..n).map(|_| rng.uniform(-1.0, 1.0)).collect() };
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(2)
        .build()
        .unwrap();
    // Big enough to split: by columns (a has fewer rows than b has columns), then by rows,
    // with transposed operands and accumulation.
    for (m, n, k, transpose, accumulate) in
        [(64, 300, 1000, false, false), (300, 64, 1000, true, true)]
    {
        let (a, b, start) = (fill(m * k), fill(k * n), fill(m * n));
        let (a, b) = if transpose {
            (Mat::new(&a, k, m).t(), Mat::new(&b, n, k).t())
        } else {
            (Mat::new(&a, m, k), Mat::new(&b, k, n))
        };
        let mut one = start.clone();
        gemm(&mut one, a, b, accumulate, 1);
        let mut two = start.clone();
        pool.install(|| gemm(&mut two, a, b, accumulate, 2));
        // The reference: plain loops.
        for i in (0..m).step_by(37) {
            for j in (0..n).step_by(11) {
                let dot: f32 = (0..k)
                    .map(|p| {
                        let x = a.data[i * a.row_stride + p * a.col_stride];
                        x * b.data[p * b.row_stride + j * b.col_stride]
                    })
                    .sum();
                let want = dot + if accumulate { start[i * n + j] } else { 0.0 };
                assert!(
                    (one[i * n + j] - want).abs() < 1e-3,
                    "one thread at ({i}, {j})"
                );
            }
        }
        let worst = one
            .iter()
            .zip(&two)
            .map(|(x, y)| (x - y).abs())
            .fold(0f32, f32::max);
        assert!(worst < 1e-4, "{m}x{n}x{k}: split differs by {worst}");
    }
}

/// Many threads: 305 rows in shares of 17 fill 18 parts, not the 19 asked for; the product is
/// still the one-thread product (the 19th share would have started past the last row).
#[test]
fn a_split_into_more_shares_than_rows_fill_runs_the_filled_ones() {
    let (m, n, k) = (305, 64, 8000);
    let mut rng = Mt19937::new(5);
    let mut fill = |n: usize| -> Vec<f32> { (0..n).map(|_| rng.uniform(-1.0, 1.0)).collect() };
    let (a, b) = (fill(m * k), fill(k * n));
    let (a, b) = (Mat::new(&a, m, k), Mat::new(&b, k, n));
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(19)
        .build()
        .unwrap();
    let mut one = vec![0.0; m * n];
    gemm(&mut one, a, b, false, 1);
    let mut many = vec![f32::NAN; m * n];
    pool.install(|| gemm(&mut many, a, b, false, 19));
    let worst = one
        .iter()
        .zip(&many)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max);
    assert!(worst < 1e-3, "19 shares differ from one by {worst}");
}

/// Under `train.precision = "bf16-matmul"` (where the CPU has the instructions) a product split
/// over threads, by rows or by columns, is the one-thread product bit for bit: every part
/// multiplies from bf16, and no element's sums depend on the block it falls in.
#[test]
fn bf16_products_split_over_threads_equal_one_thread_bit_for_bit() {
    if !super::bf16_products::available() {
        return;
    }
    let mut rng = Mt19937::new(4);
    let mut fill = |n: usize| -> Vec<f32> { (0..n).map(|_| rng.uniform(-1.0, 1.0)).collect() };
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(2)
        .build()
        .unwrap();
    // Split by columns, by rows (transposed, accumulating), and into uneven halves off every
    // block edge of the kernel.
    let shapes = [
        (64, 300, 1000, false, false),
        (300, 64, 1000, true, true),
        (257, 129, 515, false, true),
    ];
    for (m, n, k, transpose, accumulate) in shapes {
        let (a, b, start) = (fill(m * k), fill(k * n), fill(m * n));
        let (a, b) = if transpose {
            (Mat::new(&a, k, m).t(), Mat::new(&b, n, k).t())
        } else {
            (Mat::new(&a, m, k), Mat::new(&b, k, n))
        };
        let run = |threads: usize| {
            let mut dst = start.clone();
            let out = Out {
                ptr: dst.as_mut_ptr(),
                row_stride: n,
            };
            // SAFETY: `dst` is m × n; the CPU has the instructions (checked above).
            let product = || unsafe {
                split_gemm(out, a, b, accumulate, threads, Products::Bf16);
            };
            pool.install(product);
            dst
        };
        let (one, two) = (run(1), run(2));
        let same = one
            .iter()
            .zip(&two)
            .all(|(x, y)| x.to_bits() == y.to_bits());
        assert!(same, "{m}x{n}x{k}: the split changed the bf16 product");
        let f32_product = {
            let mut dst = start.clone();
            gemm(&mut dst, a, b, accumulate, 1);
            dst
        };
        assert!(one != f32_product, "{m}x{n}x{k}: no bf16 rounding seen");
    }
}

#[test]
fn add_pairs_matches_candle_for_large_small_and_shaped_gradients() {
    let mut rng = Mt19937::new(7);
    // Over several parallel chunks, a tail, one value, and a matrix (shape kept).
    let shapes: [&[usize]; 4] = [&[100_003], &[7], &[1], &[33, 65]];
    let a: Vec<Tensor> = shapes.iter().map(|s| random(&mut rng, s)).collect();
    let b: Vec<Tensor> = shapes.iter().map(|s| random(&mut rng, s)).collect();
    let pairs: Vec<(&Tensor, &Tensor)> = a.iter().zip(&b).collect();
    let sums = add_pairs(&pairs).unwrap();
    for ((sum, a), b) in sums.iter().zip(&a).zip(&b) {
        let expected = (a + b).unwrap();
        assert_eq!(sum.dims(), expected.dims());
        let (ours, theirs) = (
            sum.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            expected.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
        );
        assert_eq!(ours, theirs, "shape {:?}", a.dims());
    }
    let short = random(&mut rng, &[6]);
    let err = add_pairs(&[(&a[1], &short)]).unwrap_err().to_string();
    assert!(err.contains("7 and 6 values"), "{err}");
}

/// The column sums' row of ones: ones of the length asked for, shorter ones views of the kept
/// row, a longer one replacing it.
#[test]
fn a_row_of_ones_is_kept_and_grown() {
    let start = |t: &Tensor| {
        let (storage, layout) = t.storage_and_layout();
        let candle_core::Storage::Cpu(CpuStorage::F32(v)) = &*storage else {
            panic!("f32 CPU values expected");
        };
        (v.as_ptr() as usize, v.len(), layout.start_offset())
    };
    let five = ones_row(5, &Device::Cpu).unwrap();
    assert_eq!(five.dims(), [1, 5]);
    assert_eq!(
        five.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
        [1.; 5]
    );
    let three = ones_row(3, &Device::Cpu).unwrap();
    assert_eq!(
        three.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
        [1.; 3]
    );
    assert_eq!(
        start(&three),
        start(&five),
        "a shorter row is a view of the kept one"
    );
    let eight = ones_row(8, &Device::Cpu).unwrap();
    assert_eq!(start(&eight).1, 8, "a longer row replaces the kept one");
    assert_eq!(start(&ones_row(2, &Device::Cpu).unwrap()), start(&eight));
    // Products with it are the column sums.
    let t = Tensor::new(&[[1f32, 2.], [3., 4.], [5., 6.]], &Device::Cpu).unwrap();
    let sums = ones_row(3, &Device::Cpu).unwrap().matmul(&t).unwrap();
    assert_eq!(
        sums.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
        [9., 12.]
    );
}
