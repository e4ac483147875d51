//! The unfolded convolution against the fused CPU kernel, its kernels' source run on the host
//! against their references, and (where a GPU is) the kernels against the host bit for bit.

use candle_core::{DType, Device, Tensor};

use super::*;
use crate::device_code::host::{Buffer, HostKernel};
use crate::tests::{
    CONV_CASES, ConvCase, LINEAR_CASES, assert_layers_agree, assert_runs_agree, candle_linear,
    random, run,
};
use crate::{conv2d, f32_bits};
use ddpjob_rng::Mt19937;

/// The fused CPU kernel and the unfolded layer on the CPU give the same outputs and gradients
/// (the products are summed in other orders: equal to float rounding).
#[test]
fn the_unfolded_layer_matches_the_fused_cpu_kernel() {
    let mut rng = Mt19937::new(7);
    for (case, &(n, c, h, w, o, k, stride, padding, relu, pooling)) in CONV_CASES.iter().enumerate()
    {
        let x = random(&mut rng, &[n, c, h, w]);
        let wt = random(&mut rng, &[o, c, k, k]);
        let b = random(&mut rng, &[o]);
        let geometry = ConvGeometry { stride, padding };
        let unfolded =
            |x: &Tensor, w: &Tensor, b: &Tensor| conv2d_unfolded(x, w, b, geometry, relu, pooling);
        let fused = |x: &Tensor, w: &Tensor, b: &Tensor| conv2d(x, w, b, geometry, relu, pooling);
        let what = format!("case {case}");
        assert_layers_agree(&what, unfolded, fused, [&x, &wt, &b], case as u64);
    }
}

/// A linear layer's bias and ReLU through the finishing kernel (as on a GPU) against candle's
/// broadcast addition and ReLU: outputs and the gradients of x, w and b.
#[test]
fn a_linear_layers_bias_and_relu_match_candles_ops() {
    let mut rng = Mt19937::new(13);
    for (case, &(n, inputs, outputs, relu)) in LINEAR_CASES.iter().enumerate() {
        let (x, w, b) = (
            random(&mut rng, &[n, inputs]),
            random(&mut rng, &[outputs, inputs]),
            random(&mut rng, &[outputs]),
        );
        let ours = |x: &Tensor, w: &Tensor, b: &Tensor| bias_relu(&x.matmul(&w.t()?)?, b, relu);
        let candle = |x: &Tensor, w: &Tensor, b: &Tensor| candle_linear(x, w, b, relu);
        let what = format!("linear case {case}");
        assert_layers_agree(&what, ours, candle, [&x, &w, &b], 200 + case as u64);
    }
}

/// Where z + b is exactly 0 the ReLU passes no gradient, as torch's and the CPU kernels'
/// (candle's own ReLU passes it); a wrong bias shape is an error that says so.
#[test]
fn a_linear_relu_at_zero_passes_no_gradient_and_bad_shapes_are_named() {
    let z = Tensor::new(&[[-1.0f32, 0.0], [2.0, 0.5]], &Device::Cpu).unwrap();
    let b = Tensor::new(&[0.5f32, 0.0], &Device::Cpu).unwrap();
    let zv = candle_core::Var::from_tensor(&z).unwrap();
    let y = bias_relu(zv.as_tensor(), &b, true).unwrap();
    assert_eq!(
        y.to_vec2::<f32>().unwrap(),
        [[0.0, 0.0], [2.5, 0.5]],
        "relu(z + b)"
    );
    let grads = y.sum_all().unwrap().backward().unwrap();
    let gz = grads.get(zv.as_tensor()).unwrap().to_vec2::<f32>().unwrap();
    assert_eq!(gz, [[0.0, 0.0], [1.0, 1.0]], "gradient at z");
    let wrong = Tensor::new(&[1.0f32, 2.0, 3.0], &Device::Cpu).unwrap();
    let e = bias_relu(&z, &wrong, true).unwrap_err().to_string();
    assert!(
        e.contains("linear: bias [3]") && e.contains("for 2 outputs"),
        "{e}"
    );
}

/// Ties, negative windows and a dropped odd row and column go as in the fused kernel: the
/// gradient to a window's first maximum, none where the ReLU clamped, none to dropped places.
#[test]
fn pooling_ties_clamps_and_dropped_places_go_as_in_the_fused_kernel() {
    #[rustfmt::skip]
    let x: [f32; 25] = [
        1.0, 3.0,   -1.0, -2.0,   9.0,
        3.0, 0.5,   -3.0, -1.0,   9.0,
        2.0, 2.0,    0.0, 4.0,    9.0,
        2.0, 2.0,    4.0, 4.0,    9.0,
        9.0, 9.0,    9.0, 9.0,    9.0,
    ];
    let x = Tensor::from_slice(&x, (1, 1, 5, 5), &Device::Cpu).unwrap();
    let (w, b) = (
        Tensor::ones((1, 1, 1, 1), DType::F32, &Device::Cpu).unwrap(),
        Tensor::zeros(1, DType::F32, &Device::Cpu).unwrap(),
    );
    let geometry = ConvGeometry {
        stride: 1,
        padding: 0,
    };
    let unfolded = |x: &Tensor, w: &Tensor, b: &Tensor| {
        conv2d_unfolded(x, w, b, geometry, true, Pooling::Max2)
    };
    let fused = |x: &Tensor, w: &Tensor, b: &Tensor| conv2d(x, w, b, geometry, true, Pooling::Max2);
    let (a, r) = (
        run(unfolded, [&x, &w, &b], 3, true),
        run(fused, [&x, &w, &b], 3, true),
    );
    let values = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    assert_eq!(values(&a.0), [3.0, 0.0, 2.0, 4.0]);
    assert_eq!(values(&a.0), values(&r.0));
    let (ours, theirs) = (values(a.1.as_ref().unwrap()), values(r.1.as_ref().unwrap()));
    assert_eq!(ours, theirs);
    let places: Vec<usize> = (0..25).filter(|&i| ours[i] != 0.0).collect();
    // The first 3 of its window (place 1), no gradient through the clamped window, the first 2
    // (place 10) and the first 4 (place 13); nothing in the dropped last row and column.
    assert_eq!(places, [1, 10, 13]);
}

/// In bf16 (values and products rounded to 8 bits) the layer stays near its f32 result.
#[test]
fn in_bf16_the_unfolded_layer_stays_near_f32() {
    let mut rng = Mt19937::new(11);
    let (n, c, h, w, o, k, _, _, relu, pooling) = CONV_CASES[3];
    let (x, wt, b) = (
        random(&mut rng, &[n, c, h, w]),
        random(&mut rng, &[o, c, k, k]),
        random(&mut rng, &[o]),
    );
    let geometry = ConvGeometry {
        stride: 1,
        padding: 0,
    };
    let layer = |dtype: DType| {
        move |x: &Tensor, w: &Tensor, b: &Tensor| {
            let cast = |t: &Tensor| t.to_dtype(dtype);
            conv2d_unfolded(&cast(x)?, &cast(w)?, &cast(b)?, geometry, relu, pooling)?
                .to_dtype(DType::F32)
        }
    };
    let (lo, hi) = (
        run(layer(DType::BF16), [&x, &wt, &b], 1, true),
        run(layer(DType::F32), [&x, &wt, &b], 1, true),
    );
    let scale_err = |a: &Tensor, r: &Tensor| {
        let (a, r) = (
            a.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            r.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
        );
        let scale = r.iter().fold(1e-3f32, |m, v| m.max(v.abs()));
        a.iter()
            .zip(&r)
            .map(|(a, r)| (a - r).abs() / scale)
            .fold(0f32, f32::max)
    };
    for (what, a, r) in [
        ("output", &lo.0, &hi.0),
        ("input grad", lo.1.as_ref().unwrap(), hi.1.as_ref().unwrap()),
        ("weight grad", &lo.2, &hi.2),
        ("bias grad", &lo.3, &hi.3),
    ] {
        let err = scale_err(a, r);
        assert!(err < 0.05, "bf16 {what}: {err} of the f32 scale");
    }
    assert!(scale_err(&lo.0, &hi.0) > 0.0, "bf16 rounds");
}

/// The convolution of a test case (see `CONV_CASES`).
fn case_dims(case: &ConvCase) -> Dims {
    let &(n, c, h, w, o, k, stride, padding, _, pooling) = case;
    let geometry = ConvGeometry { stride, padding };
    Dims::new(
        &Shape::from((n, c, h, w)),
        &Shape::from((o, c, k, k)),
        geometry,
        pooling,
    )
    .unwrap()
}

/// Values to feed the kernels: random, on a grid of quarters so that pooled windows tie, and
/// no negative zero (whose maximum with a zero either value may be).
fn quartered(rng: &mut Mt19937, shape: &[usize], dtype: DType) -> Tensor {
    let n = shape.iter().product();
    let v: Vec<f32> = (0..n)
        .map(|_| (rng.uniform(-1.0, 1.0) * 4.0).round() / 4.0 + 0.0)
        .collect();
    Tensor::from_vec(v, shape, &Device::Cpu)
        .unwrap()
        .to_dtype(dtype)
        .unwrap()
}

fn buffer(t: &Tensor) -> Buffer {
    let t = t.flatten_all().unwrap();
    match t.dtype() {
        DType::BF16 => Buffer::Bf16(
            t.to_vec1::<half::bf16>()
                .unwrap()
                .iter()
                .map(|v| v.to_bits())
                .collect(),
        ),
        _ => Buffer::F32(t.to_vec1::<f32>().unwrap()),
    }
}

/// An output buffer the kernel must fill: every value a NaN no result equals bit for bit.
fn unwritten(n: usize, dtype: DType) -> Buffer {
    match dtype {
        DType::BF16 => Buffer::Bf16(vec![0x7f81; n]),
        _ => Buffer::F32(vec![f32::from_bits(0x7f80_0123); n]),
    }
}

/// Values to feed the kernels: on a grid of quarters (`tied`: pooled windows tie, sums are
/// exact), or random (sums and biases round, in bf16 too).
fn kernel_input(rng: &mut Mt19937, shape: &[usize], dtype: DType, tied: bool) -> Tensor {
    if tied {
        return quartered(rng, shape, dtype);
    }
    random(rng, shape).to_dtype(dtype).unwrap()
}

/// The kernels' CUDA source, compiled for the host and run thread by thread, gives the ops'
/// host references bit for bit, in f32 and bf16, for every convolution of the CPU kernel's
/// tests (strides, padding, odd sizes, with and without ReLU and pooling): the windows, their
/// fold, and the bias, ReLU and pooling each way, on tied values and on values that round.
#[test]
fn the_kernels_source_gives_the_host_values_bit_for_bit() {
    let mut rng = Mt19937::new(5);
    for dtype in [DType::F32, DType::BF16] {
        let name = if dtype == DType::F32 { "f32" } else { "bf16" };
        let source = [crate::device_code::ELEMENTS, SOURCE];
        let args = |n: usize| {
            (0..n)
                .map(|i| format!("A({i})"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let probe = unwritten(1, dtype);
        let compile = |kernel: &str, buffers: &[&str], scalars: usize| {
            let named: Vec<(&str, &Buffer)> = buffers.iter().map(|b| (*b, &probe)).collect();
            let call = format!(
                "ddpjob_{kernel}_{name}({}, {})",
                buffers.join(", "),
                args(scalars)
            );
            HostKernel::compile(&source, &call, &named)
        };
        let Some(unfold) = compile("unfold", &["x", "cols"], 9) else {
            return;
        };
        let compiled = "the compiler that built the first kernel";
        let fold = compile("fold", &["cols", "x"], 9).expect(compiled);
        let finish = compile("conv_finish", &["z", "b", "y"], 6).expect(compiled);
        let finish_grad = compile("conv_finish_grad", &["z", "b", "g", "gz"], 6).expect(compiled);
        let cases = CONV_CASES.iter().enumerate();
        for ((case, &(n, c, h, w, _, _, _, _, relu, pooling)), tied) in
            cases.flat_map(|case| [(case, true), (case, false)])
        {
            let what = format!("{name} case {case} (tied values: {tied})");
            let d = case_dims(&CONV_CASES[case]);
            let mut values = |shape: &[usize]| kernel_input(&mut rng, shape, dtype, tied);
            let widen = |s: &[u32]| s.iter().map(|&v| u64::from(v)).collect::<Vec<_>>();
            let with_count = |count: usize, s: &[u32]| [vec![count as u64], widen(s)].concat();

            let x = values(&[n, c, h, w]);
            let cols = x.apply_op1_no_bwd(&Unfold(d)).unwrap();
            let mut out = [buffer(&x), unwritten(cols.elem_count(), dtype)];
            let [a, b] = &mut out;
            let scalars = with_count(cols.elem_count(), &geometry_scalars(&d));
            unfold.run(cols.elem_count() as u64, &scalars, &mut [a, b]);
            assert!(out[1].bits() == buffer(&cols).bits(), "{what}: unfold");

            let gcols = values(cols.dims());
            let gx = gcols.apply_op1_no_bwd(&Fold(d)).unwrap();
            let mut out = [buffer(&gcols), unwritten(gx.elem_count(), dtype)];
            let [a, b] = &mut out;
            let scalars = with_count(gx.elem_count(), &geometry_scalars(&d));
            fold.run(gx.elem_count() as u64, &scalars, &mut [a, b]);
            assert!(out[1].bits() == buffer(&gx).bits(), "{what}: fold");

            let f = Finish { d, relu, pooling };
            let (z, bias) = (values(&[d.n * d.l, d.o]), values(&[d.o]));
            let y = z.apply_op2_no_bwd(&bias, &f).unwrap();
            let mut out = [buffer(&z), buffer(&bias), unwritten(y.elem_count(), dtype)];
            let [a, b, c] = &mut out;
            let scalars = with_count(y.elem_count(), &f.scalars());
            finish.run(y.elem_count() as u64, &scalars, &mut [a, b, c]);
            assert!(
                out[2].bits() == buffer(&y).bits(),
                "{what}: bias, ReLU and pooling"
            );

            let g = values(y.dims());
            let gz = z.apply_op3_no_bwd(&bias, &g, &FinishGrad(f)).unwrap();
            let mut out = [
                buffer(&z),
                buffer(&bias),
                buffer(&g),
                unwritten(gz.elem_count(), dtype),
            ];
            let [a, b, c, e] = &mut out;
            let scalars = with_count(gz.elem_count(), &f.scalars());
            finish_grad.run(gz.elem_count() as u64, &scalars, &mut [a, b, c, e]);
            assert!(
                out[3].bits() == buffer(&gz).bits(),
                "{what}: their gradient"
            );
        }
    }
}

/// Runs where a GPU is: each kernel gives its host reference bit for bit (f32 and bf16), and
/// the whole layer's output and gradients on the GPU agree with the CPU's to float rounding.
#[test]
fn the_gpu_convolves_as_the_host() {
    let Ok(gpu) = Device::new_cuda(0) else {
        eprintln!("skipping: no GPU");
        return;
    };
    let mut rng = Mt19937::new(3);
    let on = |t: &Tensor, device: &Device| t.to_device(device).unwrap();
    for (case, &(n, c, h, w, o, k, stride, padding, relu, pooling)) in CONV_CASES.iter().enumerate()
    {
        let geometry = ConvGeometry { stride, padding };
        let d = case_dims(&CONV_CASES[case]);
        let f = Finish { d, relu, pooling };
        for dtype in [DType::F32, DType::BF16] {
            let what = format!("case {case} {dtype:?}");
            let x = quartered(&mut rng, &[n, c, h, w], dtype);
            let cols = x.apply_op1_no_bwd(&Unfold(d)).unwrap();
            let same = |host: &Tensor, gpu: &Tensor| f32_bits(host) == f32_bits(gpu);
            assert!(
                same(&cols, &on(&x, &gpu).apply_op1_no_bwd(&Unfold(d)).unwrap()),
                "{what}: unfold"
            );
            let gcols = quartered(&mut rng, cols.dims(), dtype);
            let gx = gcols.apply_op1_no_bwd(&Fold(d)).unwrap();
            assert!(
                same(&gx, &on(&gcols, &gpu).apply_op1_no_bwd(&Fold(d)).unwrap()),
                "{what}: fold"
            );
            let (z, bias) = (
                quartered(&mut rng, &[d.n * d.l, d.o], dtype),
                quartered(&mut rng, &[d.o], dtype),
            );
            let y = z.apply_op2_no_bwd(&bias, &f).unwrap();
            let y_gpu = on(&z, &gpu).apply_op2_no_bwd(&on(&bias, &gpu), &f).unwrap();
            assert!(same(&y, &y_gpu), "{what}: bias, ReLU and pooling");
            let g = quartered(&mut rng, y.dims(), dtype);
            let gz = z.apply_op3_no_bwd(&bias, &g, &FinishGrad(f)).unwrap();
            let gz_gpu = on(&z, &gpu)
                .apply_op3_no_bwd(&on(&bias, &gpu), &on(&g, &gpu), &FinishGrad(f))
                .unwrap();
            assert!(same(&gz, &gz_gpu), "{what}: their gradient");
        }
        // The whole layer in f32, cuBLAS's products against the CPU's.
        let (x, wt, b) = (
            random(&mut rng, &[n, c, h, w]),
            random(&mut rng, &[o, c, k, k]),
            random(&mut rng, &[o]),
        );
        let layer =
            |x: &Tensor, w: &Tensor, b: &Tensor| conv2d_unfolded(x, w, b, geometry, relu, pooling);
        let host = run(layer, [&x, &wt, &b], case as u64, true);
        let on_gpu = |x: &Tensor, w: &Tensor, b: &Tensor| {
            let y = conv2d_unfolded(
                &x.to_device(&gpu)?,
                &w.to_device(&gpu)?,
                &b.to_device(&gpu)?,
                geometry,
                relu,
                pooling,
            )?;
            y.to_device(&Device::Cpu)
        };
        let device = run(on_gpu, [&x, &wt, &b], case as u64, true);
        assert_runs_agree(&format!("case {case} on the GPU"), &device, &host, true);
    }
}

/// Runs where a GPU is: a linear layer's bias and ReLU on the GPU give the host's values bit
/// for bit (f32 and bf16), and the layer's gradients agree with the CPU's.
#[test]
fn the_gpu_linear_bias_relu_is_the_hosts() {
    let Ok(gpu) = Device::new_cuda(0) else {
        eprintln!("skipping: no GPU");
        return;
    };
    let mut rng = Mt19937::new(5);
    let on = |t: &Tensor| t.to_device(&gpu).unwrap();
    let to_host = |t: Tensor| t.to_device(&Device::Cpu).unwrap();
    // Quarter-grid values (ties at 0 and exact sums) and random ones (sums that round in bf16).
    let rounding = |rng: &mut Mt19937, shape: &[usize], dtype: DType| {
        random(rng, shape).to_dtype(dtype).unwrap()
    };
    for dtype in [DType::F32, DType::BF16] {
        for (relu, tied) in [(true, true), (false, true), (true, false)] {
            let what = format!("{dtype:?}, relu {relu}, tied values {tied}");
            let values = if tied { quartered } else { rounding };
            let (z, b) = (
                values(&mut rng, &[64, 128], dtype),
                values(&mut rng, &[128], dtype),
            );
            let y = bias_relu(&z, &b, relu).unwrap();
            let y_gpu = to_host(bias_relu(&on(&z), &on(&b), relu).unwrap());
            assert_eq!(f32_bits(&y), f32_bits(&y_gpu), "{what}: output");
        }
    }
    let (x, w, b) = (
        random(&mut rng, &[64, 300]),
        random(&mut rng, &[128, 300]),
        random(&mut rng, &[128]),
    );
    let layer = |x: &Tensor, w: &Tensor, b: &Tensor| bias_relu(&x.matmul(&w.t()?)?, b, true);
    let host = run(layer, [&x, &w, &b], 9, true);
    let on_gpu = |x: &Tensor, w: &Tensor, b: &Tensor| {
        let (x, w, b) = (x.to_device(&gpu)?, w.to_device(&gpu)?, b.to_device(&gpu)?);
        layer(&x, &w, &b)?.to_device(&Device::Cpu)
    };
    let device = run(on_gpu, [&x, &w, &b], 9, true);
    assert_runs_agree("linear on the GPU", &device, &host, true);
}
