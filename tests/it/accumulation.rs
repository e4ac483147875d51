use crate::common::{TINY, TestJob, load_weights};

/// B × accumulation 2 and 2B × accumulation 1 take the same optimizer steps on the same samples,
/// so after k steps the weights agree to float rounding.
#[test]
fn accumulating_two_micro_batches_equals_one_double_batch() {
    let t = TestJob::new();
    let cfg = t.config("acc", TINY);
    let common = [
        "--set",
        "train.max_steps=6",
        "--set",
        "train.grad_clip_norm=1.0",
        "--set",
        "train.weight_decay=1e-3",
    ];
    let mut a = vec![
        "--name",
        "b16x2",
        "--set",
        "train.batch_size=16",
        "--set",
        "train.accumulation=2",
    ];
    let mut b = vec![
        "--name",
        "b32x1",
        "--set",
        "train.batch_size=32",
        "--set",
        "train.accumulation=1",
    ];
    a.extend_from_slice(&common);
    b.extend_from_slice(&common);
    t.run(&cfg, &a).success();
    let run_b = t.run(&cfg, &b);
    run_b.success();
    // An epoch train.max_steps cuts short is said to be, not "done".
    let said = format!("{}{}", run_b.stdout, run_b.stderr);
    assert!(
        said.contains("epoch 1/2 ended after 6 of its 16 steps"),
        "{said}"
    );
    let wa = load_weights(&t.job("b16x2").join("model.safetensors"));
    let wb = load_weights(&t.job("b32x1").join("model.safetensors"));
    let mut max_diff = 0f32;
    for (name, va) in &wa {
        for (x, y) in va.iter().zip(&wb[name]) {
            max_diff = max_diff.max((x - y).abs());
        }
    }
    assert!(max_diff < 1e-5, "weights differ by {max_diff}");
    // Agreement is not trivial: the weights moved far more than the tolerance over those steps.
    t.run(&cfg, &["--name", "one-step", "--set", "train.max_steps=1"])
        .success();
    let w1 = load_weights(&t.job("one-step").join("model.safetensors"));
    let moved = wb["fc1.weight"]
        .iter()
        .zip(&w1["fc1.weight"])
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max);
    assert!(moved > 1e-3, "training barely moved the weights ({moved})");
    let summary = t.json(&t.job("b16x2").join("summary.json"));
    assert_eq!(summary["steps"], 6);
    // With clipping, each log line carries the step's gradient norm before clipping (as
    // transformers' Trainer logs `grad_norm`): the same gradient, the same norm.
    let norms = |name: &str| -> Vec<f64> {
        t.metrics(name)
            .iter()
            .filter(|l| l["kind"] == "train")
            .map(|l| l["grad_norm"].as_f64().expect("grad_norm on a train line"))
            .collect()
    };
    let (na, nb) = (norms("b16x2"), norms("b32x1"));
    assert_eq!(na.len(), 2, "{na:?}");
    for (x, y) in na.iter().zip(&nb) {
        assert!(*x > 0.0 && (x - y).abs() <= 1e-4 * y, "{na:?} vs {nb:?}");
    }
    assert!(
        t.metrics("one-step")
            .iter()
            .all(|l| l.get("grad_norm").is_none()),
        "no clipping, no norm computed"
    );
}
