//! Expected numbers come from this PyTorch script (run with torch 2.15, float64), 3 steps on two scalar
//! parameters p = [1.0, -2.0] with gradients [[0.5, 0.3], [-0.2, 0.1], [0.4, -0.6]]:
//!
//! ```python
//! p = torch.tensor([1.0, -2.0], dtype=torch.float64, requires_grad=True)
//! opt = torch.optim.Adam([p], lr=0.1, weight_decay=0.01)   # or SGD / AdamW, see each test
//! for g in grads: p.grad = torch.tensor(g, dtype=torch.float64); opt.step()
//! ```
//!
//! (The same values come out of a plain-Python transcription of torch.optim's documented update
//! rules; ours runs in f32, hence the 1e-5 tolerance.)

use candle_core::{DType, Device, Tensor, Var};

use super::*;
use ddpjob_seam::Params;

const GRADS: [[f32; 2]; 3] = [[0.5, 0.3], [-0.2, 0.1], [0.4, -0.6]];

/// The three steps, in `dtype`: f32 on the CPU takes the fused kernels, f64 candle's tensor ops
/// (the path other devices take).
fn run_as(spec: OptimizerSpec, dtype: DType) -> Vec<f32> {
    run_with(spec, dtype, false)
}

/// [`run_as`], with the parameter marked exempt from weight decay when `exempt`.
fn run_with(spec: OptimizerSpec, dtype: DType, exempt: bool) -> Vec<f32> {
    let p = Tensor::new(&[1.0f32, -2.0], &Device::Cpu).unwrap();
    let var = Var::from_tensor(&p.to_dtype(dtype).unwrap()).unwrap();
    let mut params = Params::from_vars(vec![("p".to_string(), var.clone())]);
    if exempt {
        params.exempt_from_decay(0);
    }
    let mut opt = Optimizer::new(spec, 1);
    for g in GRADS {
        let g = Tensor::new(&g, &Device::Cpu)
            .unwrap()
            .to_dtype(dtype)
            .unwrap();
        opt.step(&params, &[g], 0.1).unwrap();
    }
    var.to_dtype(DType::F32).unwrap().to_vec1::<f32>().unwrap()
}

fn run(spec: OptimizerSpec) -> Vec<f32> {
    let fused = run_as(spec, DType::F32);
    let tensor_ops = run_as(spec, DType::F64);
    for (a, b) in fused.iter().zip(&tensor_ops) {
        assert!(
            (a - b).abs() < 1e-5,
            "fused {fused:?} vs tensor ops {tensor_ops:?}"
        );
    }
    fused
}

fn assert_close(actual: &[f32], expected: &[f64]) {
    for (a, e) in actual.iter().zip(expected) {
        assert!((*a as f64 - e).abs() < 1e-5, "{actual:?} vs {expected:?}");
    }
}

#[test]
fn sgd_momentum_with_weight_decay() {
    // torch.optim.SGD([p], lr=0.1, momentum=0.9, weight_decay=0.01)
    let spec = OptimizerSpec::Sgd {
        momentum: 0.9,
        nesterov: false,
        weight_decay: 0.01,
    };
    assert_close(&run(spec), &[0.857064749, -2.028965628]);
}

#[test]
fn sgd_nesterov() {
    // torch.optim.SGD([p], lr=0.1, momentum=0.9, nesterov=True)
    let spec = OptimizerSpec::Sgd {
        momentum: 0.9,
        nesterov: true,
        weight_decay: 0.0,
    };
    assert_close(&run(spec), &[0.80625, -2.01627]);
}

#[test]
fn adam_with_l2_weight_decay() {
    // torch.optim.Adam([p], lr=0.1, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    let spec = OptimizerSpec::Adam {
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.01,
    };
    assert_close(&run(spec), &[0.802356669, -2.154553595]);
}

#[test]
fn adamw_with_decoupled_weight_decay() {
    // torch.optim.AdamW([p], lr=0.1, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    let spec = OptimizerSpec::AdamW {
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.01,
    };
    assert_close(&run(spec), &[0.803123210, -2.155672011]);
}

#[test]
fn parameters_exempt_from_decay_step_as_without_it() {
    // nanoGPT's second parameter group (biases, LayerNorm gains): weight_decay=0.0 there.
    let decaying = [
        OptimizerSpec::AdamW {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.5,
        },
        OptimizerSpec::Adam {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.5,
        },
        OptimizerSpec::Sgd {
            momentum: 0.9,
            nesterov: false,
            weight_decay: 0.5,
        },
    ];
    for spec in decaying {
        let undecayed: Vec<f64> = run(spec.without_weight_decay())
            .iter()
            .map(|&v| v as f64)
            .collect();
        for dtype in [DType::F32, DType::F64] {
            let exempt = run_with(spec, dtype, true);
            assert_close(&exempt, &undecayed);
            let decayed = run_with(spec, dtype, false);
            assert!(
                (decayed[0] - exempt[0]).abs() > 1e-3,
                "{spec:?}: decay had no effect on a decaying parameter"
            );
        }
    }
}

#[test]
fn sgd_without_momentum_and_large_parameters_split_over_threads() {
    let plain = OptimizerSpec::Sgd {
        momentum: 0.0,
        nesterov: false,
        weight_decay: 0.0,
    };
    // p - 0.1·(g1 + g2 + g3)
    assert_close(&run(plain), &[0.93, -1.98]);
    // More elements than one parallel chunk: every chunk is updated, as the tensor path does.
    let n = 100_003;
    let values: Vec<f32> = (0..n).map(|i| (i % 17) as f32 * 0.1 - 0.8).collect();
    let grads: Vec<f32> = (0..n).map(|i| (i % 13) as f32 * 0.05 - 0.3).collect();
    for spec in [
        plain,
        OptimizerSpec::Adam {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
        },
    ] {
        let results: Vec<Vec<f32>> = [DType::F32, DType::F64]
            .into_iter()
            .map(|dtype| {
                let p = Tensor::new(values.as_slice(), &Device::Cpu).unwrap();
                let var = Var::from_tensor(&p.to_dtype(dtype).unwrap()).unwrap();
                let params = Params::from_vars(vec![("p".to_string(), var.clone())]);
                let g = Tensor::new(grads.as_slice(), &Device::Cpu).unwrap();
                let mut opt = Optimizer::new(spec, 1);
                for _ in 0..2 {
                    opt.step(&params, &[g.to_dtype(dtype).unwrap()], 0.1)
                        .unwrap();
                }
                var.to_dtype(DType::F32).unwrap().to_vec1::<f32>().unwrap()
            })
            .collect();
        let worst = results[0]
            .iter()
            .zip(&results[1])
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(
            worst < 1e-5,
            "{spec:?}: fused and tensor ops differ by {worst}"
        );
        assert_ne!(results[0], values, "{spec:?}: nothing was updated");
    }
}

#[test]
fn state_round_trips_exactly() {
    let spec = OptimizerSpec::Adam {
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.0,
    };
    let var = Var::from_tensor(&Tensor::new(&[1.0f32, -2.0], &Device::Cpu).unwrap()).unwrap();
    let params = Params::from_vars(vec![("w".to_string(), var)]);
    let mut a = Optimizer::new(spec, 1);
    a.step(
        &params,
        &[Tensor::new(&GRADS[0], &Device::Cpu).unwrap()],
        0.1,
    )
    .unwrap();
    let (tensors, steps) = a.state(&params).unwrap();
    assert!(tensors.contains_key("w.exp_avg") && tensors.contains_key("w.exp_avg_sq"));
    let mut b = Optimizer::new(spec, 1);
    b.load_state(&params, tensors, steps).unwrap();
    assert_eq!(b.steps(), 1);
    let (again, _) = b.state(&params).unwrap();
    let (before, _) = a.state(&params).unwrap();
    for key in ["w.exp_avg", "w.exp_avg_sq"] {
        assert_eq!(
            again[key].to_vec1::<f32>().unwrap(),
            before[key].to_vec1::<f32>().unwrap()
        );
    }
    // And both take the same next step.
    let g = [Tensor::new(&GRADS[1], &Device::Cpu).unwrap()];
    let var_b =
        Var::from_tensor(&params.vars().next().unwrap().as_tensor().copy().unwrap()).unwrap();
    let params_b = Params::from_vars(vec![("w".to_string(), var_b.clone())]);
    a.step(&params, &g, 0.1).unwrap();
    b.step(&params_b, &g, 0.1).unwrap();
    let after_a = params.vars().next().unwrap().to_vec1::<f32>().unwrap();
    assert_eq!(after_a, var_b.to_vec1::<f32>().unwrap());
}

#[test]
fn clipping_scales_to_the_global_norm() {
    // torch.nn.utils.clip_grad_norm_([a, b], 1.0) with a = [3, 0], b = [4]: norm 5, coef 1/5.
    let mut grads = vec![
        Tensor::new(&[3.0f32, 0.0], &Device::Cpu).unwrap(),
        Tensor::new(&[4.0f32], &Device::Cpu).unwrap(),
    ];
    let norm = clip_grad_norm(&mut grads, 1.0).unwrap();
    assert!((norm.to_scalar::<f32>().unwrap() - 5.0).abs() < 1e-6);
    let a = grads[0].to_vec1::<f32>().unwrap();
    assert!((a[0] - 0.6).abs() < 1e-6, "{a:?}");
    assert!((grads[1].to_vec1::<f32>().unwrap()[0] - 0.8).abs() < 1e-6);
    // Under the limit nothing changes.
    let mut small = vec![Tensor::new(&[0.1f32], &Device::Cpu).unwrap()];
    clip_grad_norm(&mut small, 1.0).unwrap();
    assert!((small[0].to_vec1::<f32>().unwrap()[0] - 0.1).abs() < 1e-9);
}

#[test]
fn clipping_on_the_host_agrees_with_the_tensor_ops() {
    // Sizes over and under a chunk of the host's sum, values of both signs and scales.
    let grads = |scale: f32| -> Vec<Tensor> {
        [100_003usize, 7, 4_096]
            .iter()
            .enumerate()
            .map(|(k, &n)| {
                let values: Vec<f32> = (0..n)
                    .map(|i| ((i * 7919 + k * 31) % 1000) as f32 / 500.0 - 1.0)
                    .map(|v| v * scale * (k + 1) as f32)
                    .collect();
                Tensor::from_vec(values, n, &Device::Cpu).unwrap()
            })
            .collect()
    };
    for (scale, clips) in [(1.0, true), (1e-5, false)] {
        let (mut host, mut ops) = (grads(scale), grads(scale));
        let host_norm = clip_on_host(&mut host, 1.0)
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        let ops_norm = clip_with_tensors(&mut ops, 1.0)
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        assert!(
            (host_norm - ops_norm).abs() <= 1e-5 * ops_norm,
            "norms {host_norm} and {ops_norm}"
        );
        assert_eq!(host_norm > 1.0, clips);
        let original = grads(scale);
        for ((h, o), g) in host.iter().zip(&ops).zip(&original) {
            let (h, o, g) = (
                h.to_vec1::<f32>().unwrap(),
                o.to_vec1::<f32>().unwrap(),
                g.to_vec1::<f32>().unwrap(),
            );
            for ((h, o), g) in h.iter().zip(&o).zip(&g) {
                assert!((h - o).abs() <= 1e-5 * o.abs().max(1e-6), "{h} vs {o}");
                if !clips {
                    assert_eq!(h, g, "under the limit the gradients stay as they were");
                }
            }
        }
    }
}
