//! Checks of the patched backward pass in `vendor/candle-core` (PATCHES.md): gradient sums
//! that start from the first gradient must give upstream's values, contiguous sums, and a
//! gradient of its own to every variable.

use candle_core::{CpuStorage, D, Device, Storage, Tensor, Var};

/// Where an f32 CPU tensor's values live.
fn address(t: &Tensor) -> *const f32 {
    let (storage, _) = t.storage_and_layout();
    match &*storage {
        Storage::Cpu(CpuStorage::F32(v)) => v.as_ptr(),
        _ => panic!("f32 CPU values expected"),
    }
}

fn values(t: &Tensor) -> Vec<f32> {
    t.flatten_all().unwrap().to_vec1().unwrap()
}

#[test]
fn a_node_with_several_consumers_sums_them_and_a_subtraction_negates() {
    let x = Var::new(&[[1f32, 2., 3.], [4., 5., 6.]], &Device::Cpu).unwrap();
    let y = (x.as_tensor() * 2.0).unwrap();
    // d/dx of sum(y + y·y - y) with y = 2x: 2 + 8x - 2 = 8x.
    let loss = ((&y + (&y * &y).unwrap()).unwrap() - &y)
        .unwrap()
        .sum_all()
        .unwrap();
    let grads = loss.backward().unwrap();
    let g = grads.get(x.as_tensor()).unwrap();
    assert_eq!(values(g), [8., 16., 24., 32., 40., 48.]);
    // Only a subtraction's right side: d/dx of sum(1 - x) = -1.
    let loss = (x.ones_like().unwrap() - x.as_tensor())
        .unwrap()
        .sum_all()
        .unwrap();
    let g = loss.backward().unwrap();
    assert_eq!(values(g.get(x.as_tensor()).unwrap()), [-1.; 6]);
}

#[test]
fn strided_first_gradients_become_contiguous_sums() {
    // The gradient reaching `a` is a transposed view of a [2, 4, 3, 5] tensor; a batched
    // matmul's backward then consumes it, which needs a contiguous (or plainly transposed)
    // operand, as upstream's `zeros + grad` gave.
    let dev = Device::Cpu;
    let x = Var::from_tensor(
        &Tensor::arange(0f32, 120., &dev)
            .unwrap()
            .reshape((2, 3, 4, 5))
            .unwrap(),
    )
    .unwrap();
    let w = Tensor::arange(0f32, 30., &dev)
        .unwrap()
        .reshape((5, 6))
        .unwrap();
    let w = (w / 30.)
        .unwrap()
        .broadcast_as((2, 3, 5, 6))
        .unwrap()
        .contiguous()
        .unwrap();
    let a = x.as_tensor().matmul(&w).unwrap(); // [2, 3, 4, 6]
    let b = a.transpose(1, 2).unwrap(); // [2, 4, 3, 6], strided
    let loss = b.sqr().unwrap().sum_all().unwrap();
    let grads = loss.backward().unwrap();
    let g = grads.get(x.as_tensor()).unwrap();
    assert!(g.is_contiguous());
    // d/dx sum((x·w)²) = 2 (x·w) wᵀ.
    let expected = (a * 2.0)
        .unwrap()
        .matmul(&w.transpose(2, 3).unwrap())
        .unwrap();
    let (got, want) = (values(g), values(&expected));
    for (g, w) in got.iter().zip(&want) {
        assert!((g - w).abs() <= 1e-5 * w.abs().max(1.0), "{g} vs {w}");
    }
}

#[test]
fn every_variable_gets_a_contiguous_gradient_of_its_own() {
    let dev = Device::Cpu;
    let a = Var::new(&[1f32, 2., 3.], &dev).unwrap();
    let b = Var::new(&[4f32, 5., 6.], &dev).unwrap();
    // Both sides of an addition receive the same gradient tensor, and a sum's gradient is a
    // broadcast view (stride 0): each variable must still get contiguous storage of its own.
    let loss = (a.as_tensor() + b.as_tensor()).unwrap().sum_all().unwrap();
    let grads = loss.backward().unwrap();
    let (ga, gb) = (grads.get(&a).unwrap(), grads.get(&b).unwrap());
    assert!(ga.is_contiguous() && gb.is_contiguous());
    assert_eq!((values(ga), values(gb)), (vec![1.; 3], vec![1.; 3]));
    // Storage of its own: the two are not one buffer.
    assert_ne!(address(ga), address(gb));
}

#[test]
fn embedding_and_softmax_gradients_are_upstreams() {
    // index_select (an embedding) starts its sum from zeros as upstream does; a softmax's
    // several consumers of one node sum as before.
    let dev = Device::Cpu;
    let table = Var::new(&[[1f32, 2.], [3., 4.], [5., 6.]], &dev).unwrap();
    let ids = Tensor::new(&[2u32, 0, 2], &dev).unwrap();
    let rows = table.as_tensor().embedding(&ids).unwrap();
    let p = candle_nn::ops::softmax(&rows, D::Minus1).unwrap();
    let loss = p.narrow(1, 0, 1).unwrap().sum_all().unwrap();
    let g = loss.backward().unwrap();
    let g = values(g.get(&table).unwrap());
    // softmax([a, b])₀ = σ(a - b): d/da = σ(1 - σ) = -d/db, with a - b = -1 for every row.
    let s = 1.0 / (1.0 + 1f32.exp());
    let d = s * (1.0 - s);
    let want = [d, -d, 0., 0., 2. * d, -2. * d];
    for (g, w) in g.iter().zip(want) {
        assert!((g - w).abs() < 1e-6, "{g:?} vs {want:?}");
    }
}

/// Σ y·upstream: its gradient at y is `upstream`.
fn weighted_sum(y: &Tensor, upstream: &Tensor) -> Tensor {
    (y * upstream).unwrap().sum_all().unwrap()
}

#[test]
fn a_product_forms_no_gradient_for_an_operand_that_reaches_no_variable() {
    let dev = Device::Cpu;
    let data = Tensor::new(&[[1f32, 2.], [3., 4.], [5., 6.]], &dev).unwrap();
    let weight = Var::new(&[[1f32, -1., 0.5], [2., 0., -2.]], &dev).unwrap();
    let upstream = Tensor::new(&[[1f32, 0., 2.], [-1., 3., 0.], [0.5, 1., 1.]], &dev).unwrap();
    let y = data.matmul(weight.as_tensor()).unwrap();
    let grads = weighted_sum(&y, &upstream).backward().unwrap();
    // The weight's gradient is dataᵀ·upstream, as upstream's backward gives it.
    let want = data.t().unwrap().matmul(&upstream).unwrap();
    assert_eq!(values(grads.get(&weight).unwrap()), values(&want));
    // The data's product is skipped: no gradient is formed for it (upstream stored one).
    assert!(grads.get(&data).is_none());

    // A frozen weight handed to the product detached: only the input's gradient is formed,
    // upstream·weightᵀ.
    let x = Var::from_tensor(&data).unwrap();
    let frozen = weight.as_tensor().detach();
    let y = x.as_tensor().matmul(&frozen).unwrap();
    let grads = weighted_sum(&y, &upstream).backward().unwrap();
    let want = upstream.matmul(&frozen.t().unwrap()).unwrap();
    assert_eq!(values(grads.get(&x).unwrap()), values(&want));
    assert!(grads.get(&frozen).is_none());
    assert!(grads.get(weight.as_tensor()).is_none());

    // Both variables: both gradients, as before.
    let y = x.as_tensor().matmul(weight.as_tensor()).unwrap();
    let grads = weighted_sum(&y, &upstream).backward().unwrap();
    assert!(grads.get(&x).is_some() && grads.get(&weight).is_some());
}

/// Patch 4: the element-wise rules (and a convolution's) form no gradient for an operand that
/// reaches no variable, and still give the variable's exactly.
#[test]
fn element_wise_ops_form_no_gradient_for_an_operand_that_reaches_no_variable() {
    let dev = Device::Cpu;
    let x = Var::new(&[1f32, -2., 3., 0.5], &dev).unwrap();
    let (xv, data) = (
        x.as_tensor(),
        Tensor::new(&[2f32, 0., -1., 4.], &dev).unwrap(),
    );
    let upstream = Tensor::new(&[1f32, 3., -2., 0.25], &dev).unwrap();
    let mask = data.ge(0.0).unwrap();
    let zeros = data.zeros_like().unwrap();
    // (the op, dloss/dx for dloss/dy = upstream, by hand)
    let cases: [(&str, Tensor, Vec<f32>); 10] = [
        ("x + data", (xv + &data).unwrap(), vec![1., 3., -2., 0.25]),
        ("data + x", (&data + xv).unwrap(), vec![1., 3., -2., 0.25]),
        ("x - data", (xv - &data).unwrap(), vec![1., 3., -2., 0.25]),
        ("data - x", (&data - xv).unwrap(), vec![-1., -3., 2., -0.25]),
        ("x · data", (xv * &data).unwrap(), vec![2., 0., 2., 1.]),
        ("data · x", (&data * xv).unwrap(), vec![2., 0., 2., 1.]),
        (
            "x / (data + 8)",
            (xv / (&data + 8.0).unwrap()).unwrap(),
            vec![0.1, 0.375, -2. / 7., 0.02083333],
        ),
        (
            "max(x, data)",
            xv.maximum(&data).unwrap(),
            vec![0., 0., -2., 0.],
        ),
        (
            "where(data ≥ 0, x, 0)",
            mask.where_cond(xv, &zeros).unwrap(),
            vec![1., 3., 0., 0.25],
        ),
        (
            "where(data ≥ 0, 0, x)",
            mask.where_cond(&zeros, xv).unwrap(),
            vec![0., 0., -2., 0.],
        ),
    ];
    for (what, y, want) in cases {
        let grads = weighted_sum(&y, &upstream).backward().unwrap();
        let got = values(grads.get(&x).unwrap());
        for (g, w) in got.iter().zip(&want) {
            assert!((g - w).abs() <= 1e-6, "{what}: {got:?}, want {want:?}");
        }
        assert!(
            grads.get(&data).is_none(),
            "{what}: the data got a gradient"
        );
        assert!(
            grads.get(&zeros).is_none(),
            "{what}: the zeros got a gradient"
        );
    }

    // Both operands variables: both gradients, as before.
    let v = Var::from_tensor(&data).unwrap();
    let grads = weighted_sum(&(xv * v.as_tensor()).unwrap(), &upstream)
        .backward()
        .unwrap();
    assert_eq!(values(grads.get(&v).unwrap()), [1., -6., -6., 0.125]);
    assert_eq!(values(grads.get(&x).unwrap()), [2., 0., 2., 1.]);

    // A convolution over data: the kernel's gradient only (upstream formed the input's with a
    // transposed convolution); over a frozen kernel: the input's only.
    let image = Tensor::new(&[[[[1f32, 2., 0.], [0., 1., 3.], [2., 1., 1.]]]], &dev).unwrap();
    let kernel = Var::new(&[[[[1f32, -1.], [0.5, 2.]]]], &dev).unwrap();
    let y = image.conv2d(kernel.as_tensor(), 0, 1, 1, 1).unwrap();
    let grads = y.sum_all().unwrap().backward().unwrap();
    // Each kernel value's gradient sums the 2×2 window of inputs it meets.
    assert_eq!(values(grads.get(&kernel).unwrap()), [4., 6., 4., 6.]);
    assert!(grads.get(&image).is_none());
    let input = Var::from_tensor(&image).unwrap();
    let frozen = kernel.as_tensor().detach();
    let y = input.as_tensor().conv2d(&frozen, 0, 1, 1, 1).unwrap();
    let grads = y.sum_all().unwrap().backward().unwrap();
    // Each input's gradient sums the kernel values that meet it: a corner one, the middle all.
    let g = values(grads.get(&input).unwrap());
    assert_eq!((g[0], g[4], g[8]), (1., 2.5, 2.));
    assert!(grads.get(&frozen).is_none());
}

/// What `Doubled`'s backward returned: where the values live, and the gradient itself when
/// the op keeps it.
type Returned = std::sync::Arc<std::sync::Mutex<Option<(usize, Option<Tensor>)>>>;

/// `2·x`, whose backward returns a fresh `2·g` and notes where its values live; `keep` also
/// holds on to that gradient (as an op that caches what it returns would).
struct Doubled {
    returned: Returned,
    keep: bool,
}

impl candle_core::CustomOp1 for Doubled {
    fn name(&self) -> &'static str {
        "doubled"
    }

    fn cpu_fwd(
        &self,
        s: &CpuStorage,
        l: &candle_core::Layout,
    ) -> candle_core::Result<(CpuStorage, candle_core::Shape)> {
        let (start, end) = l.contiguous_offsets().unwrap();
        let v: Vec<f32> = s.as_slice::<f32>()?[start..end]
            .iter()
            .map(|x| 2.0 * x)
            .collect();
        Ok((CpuStorage::F32(v), l.shape().clone()))
    }

    fn bwd(&self, _: &Tensor, _: &Tensor, grad: &Tensor) -> candle_core::Result<Option<Tensor>> {
        let fresh = (grad * 2.0)?;
        let kept = self.keep.then(|| fresh.clone());
        *self.returned.lock().unwrap() = Some((address(&fresh) as usize, kept));
        Ok(Some(fresh))
    }
}

/// Patch 5: a variable's first gradient that nothing else holds becomes its gradient as it is;
/// one that something else still holds is copied, so the variable's is its own.
#[test]
fn a_fresh_gradient_is_the_variables_without_a_copy_and_a_shared_one_is_copied() {
    for keep in [false, true] {
        let x = Var::new(&[1f32, -2., 3.], &Device::Cpu).unwrap();
        let returned = Returned::default();
        let op = Doubled {
            returned: returned.clone(),
            keep,
        };
        let y = x.as_tensor().apply_op1(op).unwrap();
        let upstream = Tensor::new(&[1f32, 0.5, -1.], &Device::Cpu).unwrap();
        let grads = weighted_sum(&y, &upstream).backward().unwrap();
        let g = grads.get(&x).unwrap();
        assert_eq!(values(g), [2., 1., -2.]);
        let (fresh, kept) = returned.lock().unwrap().take().unwrap();
        if keep {
            // The op still holds what it returned: the variable's gradient is a copy.
            assert_ne!(address(g) as usize, fresh);
            assert_eq!(address(&kept.unwrap()) as usize, fresh);
        } else {
            assert_eq!(address(g) as usize, fresh, "the fresh gradient was copied");
        }
    }
}
