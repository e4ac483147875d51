//! `ddpjob bench step` and `ddpjob bench allreduce`: real processes, JSON and table output, and
//! usage errors.

use crate::common::{TINY, TestJob};

#[test]
fn bench_step_times_the_configured_model_and_reports_json() {
    let t = TestJob::new();
    let cfg = t.config("tiny", TINY);
    let cfg = cfg.to_str().unwrap();
    let run = t.ddpjob(&[
        "bench",
        "step",
        "--config",
        cfg,
        "--steps",
        "12",
        "--warmup",
        "2",
        "--threads",
        "1",
        "--set",
        "train.accumulation=2",
        "--json",
    ]);
    run.success();
    let r: serde_json::Value = serde_json::from_str(run.stdout.trim()).expect("one JSON line");
    // An mlp of one hidden layer of 32 on 1×8×8 inputs with 4 classes: 64·32 + 32 + 32·4 + 4 parameters.
    assert_eq!(r["parameters"], 64 * 32 + 32 + 32 * 4 + 4);
    assert_eq!(r["model"], "mlp (hidden = [32])");
    assert_eq!(r["batch_size"], 32);
    assert_eq!(r["accumulation"], 2);
    assert_eq!(r["steps"], 12);
    assert_eq!(r["threads"], 1);
    let rate = r["samples_per_s"].as_f64().unwrap();
    let step_ms = r["step_ms_mean"].as_f64().unwrap();
    assert!(rate > 0.0 && step_ms > 0.0, "{r}");
    // samples/s is the 64 samples of a step over the mean step time.
    let implied = 64.0 / (step_ms / 1e3);
    assert!((rate / implied - 1.0).abs() < 0.01, "{rate} vs {implied}");
    let phases: f64 = ["forward_ms", "backward_ms", "update_ms"]
        .iter()
        .map(|k| r[k].as_f64().unwrap())
        .sum();
    assert!(phases > 0.0, "{r}");
    // On the CPU the work is done as it is called: the host's queueing is the step, and the
    // phases are the host's clock.
    let queued = r["queue_ms_median"].as_f64().unwrap();
    assert!(
        queued > 0.0 && queued <= r["step_ms_median"].as_f64().unwrap(),
        "{r}"
    );
    assert_eq!(r["phase_clock"], "host");
    // How close to the arithmetic limit: 3 × 2·(64·32 + 32·4) less fc1's input gradient.
    assert_eq!(r["train_flops_per_sample"], 8960.0);
    let peak = r["gemm_peak_gflops"].as_f64().unwrap();
    let achieved = r["achieved_gflops"].as_f64().unwrap();
    assert!(
        peak > 0.1,
        "a GEMM peak below 0.1 GFLOP/s is no measurement: {r}"
    );
    assert!((achieved / (8960.0 * rate / 1e9) - 1.0).abs() < 1e-6, "{r}");
    assert!((r["fraction_of_peak"].as_f64().unwrap() - achieved / peak).abs() < 1e-9);
    assert_eq!(r["flush_denormals"], true);

    let table = t.ddpjob(&[
        "bench",
        "step",
        "--config",
        cfg,
        "--steps",
        "3",
        "--set",
        "model.arch=cnn",
    ]);
    table.success();
    assert!(
        table.stdout.contains("# training step: cnn"),
        "{}",
        table.stdout
    );
    assert!(table.stdout.contains("samples/s"), "{}", table.stdout);
    // A build without GPUs (or a job that says cpu) times the step on the CPU.
    assert!(
        table.stdout.contains("measured GEMM peak") && table.stdout.contains("on the CPU with"),
        "{}",
        table.stdout
    );
    assert!(
        table.stdout.contains("# arithmetic: 2.0 MFLOP per sample"),
        "{}",
        table.stdout
    );
    assert!(
        table.stdout.contains("phases by the host's clock"),
        "{}",
        table.stdout
    );

    // --no-peak (for profilers' traces): the step alone, no peak and no fraction of it.
    let quiet = t.ddpjob(&[
        "bench",
        "step",
        "--config",
        cfg,
        "--steps",
        "3",
        "--warmup",
        "1",
        "--no-peak",
        "--json",
    ]);
    quiet.success();
    let r: serde_json::Value = serde_json::from_str(quiet.stdout.trim()).expect("one JSON line");
    assert!(
        r["gemm_peak_gflops"].is_null() && r["fraction_of_peak"].is_null(),
        "{r}"
    );
    assert!(r["achieved_gflops"].as_f64().unwrap() > 0.0, "{r}");
    let table = t.ddpjob(&[
        "bench",
        "step",
        "--config",
        cfg,
        "--steps",
        "3",
        "--no-peak",
    ]);
    assert!(
        table
            .success()
            .stdout
            .contains("GEMM peak not measured (--no-peak)"),
        "{}",
        table.stdout
    );

    // A world-size-invariant step's phases are not timed, and it says so.
    let text = TINY.replace("batch_size = 32", "global_batch_size = 16")
        + "[distributed]\ndeterministic = \"world-size-invariant\"\nvirtual_shards = 2\n";
    let invariant = t.config("invariant", &text);
    let invariant = t.ddpjob(&[
        "bench",
        "step",
        "--config",
        invariant.to_str().unwrap(),
        "--steps",
        "2",
        "--warmup",
        "1",
        "--json",
    ]);
    invariant.success();
    let r: serde_json::Value =
        serde_json::from_str(invariant.stdout.trim()).expect("one JSON line");
    assert_eq!(r["phase_clock"], "none", "{r}");
    assert_eq!(r["forward_ms"], 0.0, "{r}");
}

#[test]
fn bench_step_refuses_bad_input_with_usage_errors() {
    let t = TestJob::new();
    let cfg = t.config("tiny", TINY);
    let cfg = cfg.to_str().unwrap();
    t.ddpjob(&["bench", "step", "--config", cfg, "--steps", "0"])
        .fails_with(2, "--steps must be at least 1");
    t.ddpjob(&["bench", "step", "--config", cfg, "--threads", "0"])
        .fails_with(2, "--threads must be at least 1");
    t.ddpjob(&["bench", "step", "--config", "missing.toml"])
        .fails_with(2, "missing.toml");
    t.ddpjob(&["bench", "step", "--config", cfg, "--set", "train.lr=fast"])
        .fails_with(2, "train.lr");
}

#[test]
fn bench_allreduce_reports_bandwidth_per_size() {
    let t = TestJob::new();
    let run = t.ddpjob(&[
        "bench",
        "allreduce",
        "--nproc-per-node",
        "2",
        "--sizes",
        "1K,100K",
        "--json",
    ]);
    run.success();
    let rows: serde_json::Value = serde_json::from_str(run.stdout.trim()).expect("JSON");
    let rows = rows.as_array().unwrap();
    assert_eq!(rows.len(), 2);
    assert_eq!(rows[1]["floats"], 100_000);
    assert_eq!(rows[1]["bytes"], 400_000);
    for row in rows {
        let (alg, bus) = (
            row["algbw_gbs"].as_f64().unwrap(),
            row["busbw_gbs"].as_f64().unwrap(),
        );
        // nccl-tests: busbw = algbw · 2(n-1)/n, which is algbw itself for 2 ranks.
        assert!(alg > 0.0 && (bus - alg).abs() < 1e-9, "{row}");
    }
    assert!(rows.iter().all(|r| r["algorithm"] == "ring"), "{rows:?}");
    t.ddpjob(&["bench", "allreduce", "--nproc-per-node", "1"])
        .fails_with(2, "at least 2");
    // Sizes no machine holds: refused before a worker is spawned (they aborted in the
    // allocator, and the error pointed at a log that did not exist).
    t.ddpjob(&["bench", "allreduce", "--device", "cpu", "--sizes", "1000G"])
        .fails_with(2, "1000000000000 floats is 4000.00 GB per worker");
    // NCCL needs GPUs: a build without them says how to get them.
    if !cfg!(feature = "cuda") {
        t.ddpjob(&["bench", "allreduce", "--device", "cuda"])
            .fails_with(
                2,
                "--device cuda: this build has no GPU support (`--features cuda`)",
            );
    }
}

/// `--algorithm tree`: the tree-ordered all-reduce between partner processes (its sums are
/// checked by the workers), refused where it cannot run.
#[test]
fn bench_allreduce_times_the_tree_between_partners() {
    let t = TestJob::new();
    let run = t.ddpjob(&[
        "bench",
        "allreduce",
        "--device",
        "cpu",
        "--nproc-per-node",
        "4",
        "--sizes",
        "1001,100K",
        "--algorithm",
        "tree",
        "--json",
    ]);
    run.success();
    let rows: serde_json::Value = serde_json::from_str(run.stdout.trim()).expect("JSON");
    let rows = rows.as_array().unwrap();
    assert_eq!(rows.len(), 2);
    for row in rows {
        assert_eq!(row["algorithm"], "tree");
        assert!(row["busbw_gbs"].as_f64().unwrap() > 0.0, "{row}");
    }
    let table = t.ddpjob(&[
        "bench",
        "allreduce",
        "--device",
        "cpu",
        "--sizes",
        "1K",
        "--algorithm",
        "tree",
    ]);
    table.success();
    assert!(table.stdout.contains("tree order"), "{}", table.stdout);
    t.ddpjob(&[
        "bench",
        "allreduce",
        "--nproc-per-node",
        "3",
        "--algorithm",
        "tree",
    ])
    .fails_with(2, "power of two (2, 4, 8, ...), not 3");
    t.ddpjob(&[
        "bench",
        "allreduce",
        "--device",
        "cuda",
        "--algorithm",
        "tree",
    ])
    .fails_with(2, "use --device cpu");
}
