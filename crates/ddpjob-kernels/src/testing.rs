//! What the tests of fused ops share, here and in the model kit: the largest difference of two
//! tensors, and a check that an op's values and every input's gradient equal a reference's.
//! Not part of the API a user relies on (hidden from the docs).

use candle_core::{DType, Tensor, Var};

/// The largest absolute difference of `a` and `b`'s values, as f32.
pub fn max_difference(a: &Tensor, b: &Tensor) -> f32 {
    let d = (a.to_dtype(DType::F32).unwrap() - b.to_dtype(DType::F32).unwrap()).unwrap();
    let d = d.abs().unwrap().flatten_all().unwrap();
    d.max(0).unwrap().to_scalar().unwrap()
}

/// The values and the gradients of every input of `fused` and `composed` (of the same
/// inputs), under an uneven weighting of the outputs, differ by less than `tol`.
pub fn same_with_gradients(
    inputs: &[Var],
    fused: impl Fn(&[&Tensor]) -> Tensor,
    composed: impl Fn(&[&Tensor]) -> Tensor,
    tol: f32,
) {
    let run = |f: &dyn Fn(&[&Tensor]) -> Tensor| {
        let xs: Vec<&Tensor> = inputs.iter().map(|v| v.as_tensor()).collect();
        let y = f(&xs);
        let grads = crate::host::uneven_sum(&y).backward().unwrap();
        let mut all = vec![y.flatten_all().unwrap().to_vec1::<f32>().unwrap()];
        for v in inputs {
            let g = grads
                .get(v.as_tensor())
                .expect("a gradient for every input");
            all.push(g.flatten_all().unwrap().to_vec1::<f32>().unwrap());
        }
        all
    };
    for (i, (a, b)) in run(&fused).iter().zip(run(&composed)).enumerate() {
        let diff = a
            .iter()
            .zip(&b)
            .fold(0f32, |m, (x, y)| m.max((x - y).abs()));
        assert!(
            diff < tol,
            "output {i} (0: values, then each input's gradient) differs by {diff}"
        );
    }
}

/// Values drawn N(mean, 1) from `Mt19937(seed)`, as a variable of `shape` on the CPU.
#[cfg(test)]
pub fn random(shape: &[usize], mean: f32, seed: u64) -> Var {
    let mut rng = ddpjob_rng::Mt19937::new(seed);
    let n = shape.iter().product();
    let values: Vec<f32> = (0..n).map(|_| mean + rng.normal()).collect();
    let t = Tensor::from_vec(values, shape, &candle_core::Device::Cpu).unwrap();
    Var::from_tensor(&t).unwrap()
}
