//! Devices and precision as a CPU build sees them: bf16 autocast trains (f32 weights kept),
//! GPU-only settings are refused with the way to get them.

use crate::common::{TINY, TestJob};

#[test]
fn bf16_autocast_trains_like_f32_and_keeps_f32_weights() {
    let t = TestJob::new();
    let cfg = t.config("tiny", TINY);
    let summary = |name: &str| t.json(&t.job(name).join("summary.json"));
    for arch in ["mlp", "cnn"] {
        let arch_set = format!("model.arch={arch}");
        let (full, half) = (format!("f32-{arch}"), format!("bf16-{arch}"));
        t.run(&cfg, &["--name", &full, "--set", &arch_set])
            .success();
        t.run(
            &cfg,
            &[
                "--name",
                &half,
                "--set",
                "train.precision=bf16",
                "--set",
                &arch_set,
            ],
        )
        .success();
        assert_f32_weights(&t, &half);
        // Close to f32 (bf16 keeps ~3 significant digits), yet not the same numbers: the
        // bf16 path really ran.
        let (a, b) = (summary(&full), summary(&half));
        assert_close_results(&a, &b, 0.1);
        let loss = |s: &serde_json::Value| s["final_train_loss"].as_f64().unwrap();
        assert_ne!(loss(&a), loss(&b), "{arch}: bf16 gave f32's exact loss");
    }
}

/// Job `name`'s saved weights are all f32.
fn assert_f32_weights(t: &TestJob, name: &str) {
    let weights = candle_core::safetensors::load(
        t.job(name).join("model.safetensors"),
        &candle_core::Device::Cpu,
    )
    .unwrap();
    let f32 = |w: &candle_core::Tensor| w.dtype() == candle_core::DType::F32;
    assert!(weights.values().all(f32), "{name}: weights not all f32");
}

/// Two summaries' final training loss within `within` of the first's (relative) and test
/// accuracy within `within` (absolute).
fn assert_close_results(a: &serde_json::Value, b: &serde_json::Value, within: f64) {
    let loss = |s: &serde_json::Value| s["final_train_loss"].as_f64().unwrap();
    let accuracy = |s: &serde_json::Value| s["test_accuracy"].as_f64().unwrap();
    assert!((loss(a) - loss(b)).abs() < within * loss(a), "{a} vs {b}");
    assert!((accuracy(a) - accuracy(b)).abs() < within, "{a} vs {b}");
}

/// The CPU has no TF32: `train.precision = "tf32"` trains exactly as f32 there, and says so.
#[test]
fn tf32_on_the_cpu_is_f32_bit_for_bit() {
    let t = TestJob::new();
    let cfg = t.config("tiny", TINY);
    t.run(&cfg, &["--name", "f32"]).success();
    let tf32 = t.run(&cfg, &["--name", "tf32", "--set", "train.precision=tf32"]);
    tf32.success();
    let log = std::fs::read_to_string(t.job("tf32").join("logs/rank-0.log")).unwrap();
    assert!(log.contains("in f32 (the CPU has no TF32)"), "{log}");
    let weights = |name: &str| std::fs::read(t.job(name).join("model.safetensors")).unwrap();
    assert!(
        weights("f32") == weights("tf32"),
        "tf32 changed the CPU's weights"
    );
}

/// `train.precision = "bf16-matmul"`: where the CPU has AVX512_BF16 the matrix products take
/// bf16 inputs (the job says so, trains as well as f32, with other numbers, weights still
/// f32, and stays deterministic: the world-size-invariant mode gives 1 and 2 workers the same
/// weights); elsewhere it is f32 bit for bit, and says that instead.
#[test]
fn bf16_matmul_uses_the_cpus_bf16_products_or_says_it_cannot() {
    let t = TestJob::new();
    let cfg = t.config("tiny", TINY);
    t.run(&cfg, &["--name", "f32"]).success();
    let set = "train.precision=bf16-matmul";
    t.run(&cfg, &["--name", "medium", "--set", set]).success();
    let log = std::fs::read_to_string(t.job("medium").join("logs/rank-0.log")).unwrap();
    let weights = |name: &str| std::fs::read(t.job(name).join("model.safetensors")).unwrap();
    #[cfg(target_arch = "x86_64")]
    let has_them = is_x86_feature_detected!("avx512bf16");
    #[cfg(not(target_arch = "x86_64"))]
    let has_them = false;
    if !has_them {
        assert!(log.contains("in f32 (this CPU has no AVX512_BF16"), "{log}");
        assert!(weights("f32") == weights("medium"));
        return;
    }
    assert!(
        log.contains("with bf16 matrix products (AVX512_BF16)"),
        "{log}"
    );
    assert!(
        weights("f32") != weights("medium"),
        "the bf16 products did not run"
    );
    let summary = |name: &str| t.json(&t.job(name).join("summary.json"));
    assert_close_results(&summary("f32"), &summary("medium"), 0.05);
    assert_f32_weights(&t, "medium");

    let runs = t.path("runs");
    let text = TINY.replace("batch_size = 32", "global_batch_size = 16")
        + "[distributed]\ndeterministic = \"world-size-invariant\"\nvirtual_shards = 4\n";
    let invariant = t.config("invariant", &text);
    let verify = t.ddpjob(&[
        "verify",
        invariant.to_str().unwrap(),
        "--world-sizes",
        "1,2",
        "--steps",
        "4",
        "--jobs-dir",
        runs.to_str().unwrap(),
        "--set",
        set,
    ]);
    verify.success();
    assert!(
        verify
            .stdout
            .contains("bit-identical weights at every one of 4 steps"),
        "{}",
        verify.stdout
    );
}

/// `distributed.collectives = "always"` runs a single worker's collectives (buckets, the vote,
/// the broadcasts) instead of skipping them; on the CPU they are the identity, so the weights
/// are the skipping run's bit for bit (on a GPU, gpu-check compares NCCL's the same way).
#[test]
fn exercised_collectives_on_one_worker_change_no_bit() {
    let t = TestJob::new();
    let cfg = t.config("tiny", TINY);
    t.run(&cfg, &["--name", "skipped"]).success();
    let set = "distributed.collectives=always";
    t.run(&cfg, &["--name", "exercised", "--set", set])
        .success();
    let weights = |name: &str| std::fs::read(t.job(name).join("model.safetensors")).unwrap();
    assert!(weights("skipped") == weights("exercised"));
    let log = |name: &str| std::fs::read_to_string(t.job(name).join("logs/rank-0.log")).unwrap();
    assert!(log("exercised").contains("collectives: run at world size 1"));
    assert!(!log("skipped").contains("collectives: run"));
    t.run(
        &cfg,
        &["--name", "bad", "--set", "distributed.collectives=never"],
    )
    .fails_with(2, "distributed.collectives");
}

#[cfg(not(feature = "cuda"))]
#[test]
fn gpu_settings_in_a_cpu_build_name_the_build_that_has_them() {
    let t = TestJob::new();
    let cfg = t.config("tiny", TINY);
    for (set, key) in [
        ("distributed.device=cuda", "distributed.device"),
        ("distributed.backend=nccl", "distributed.backend"),
        ("distributed.devices=[0]", "distributed.devices"),
    ] {
        t.run(&cfg, &["--set", set])
            .fails_with(2, &format!("invalid `{key}`"))
            .fails_with(2, "--features cuda");
    }
    t.run(&cfg, &["--set", "train.precision=fp8"])
        .fails_with(2, "expected one of \"f32\", \"bf16\"");
    // "auto" on a CPU build is the CPU, silently, and the job says where it trains.
    let run = t.run(&cfg, &[]);
    run.success();
    assert!(!run.stderr.contains("note: no GPU"), "{}", run.stderr);
    assert!(run.stdout.contains("on cpu"), "{}", run.stdout);
}
