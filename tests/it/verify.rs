//! `ddpjob verify`: the same job on several world sizes with one global batch, every step's
//! weights compared (real runs of the binary, real worker processes).

use crate::common::{TINY, TestJob};

/// Two runs on the same world size are bit-identical at every step (the default mode's
/// promise); 1 and 2 workers are not in that mode (their gradients are summed in another
/// order), and `verify` names the first step and tensor where they part.
#[test]
fn verify_passes_on_one_world_size_and_names_where_two_part() {
    let t = TestJob::new();
    let cfg = t.config("v", TINY);
    let cfg = cfg.to_str().unwrap();
    let (runs, parted_runs) = (t.path("runs"), t.path("parted"));
    let (dir, parted_dir) = (runs.to_str().unwrap(), parted_runs.to_str().unwrap());
    let same = t.ddpjob(&[
        "verify",
        cfg,
        "--world-sizes",
        "2,2",
        "--steps",
        "5",
        "--jobs-dir",
        dir,
    ]);
    same.success();
    assert!(
        same.stdout.contains(
            "bit-identical weights at every one of 5 steps on 2, 2 worker(s) (4 tensors)"
        ),
        "{}",
        same.stdout
    );
    // Each run's batch is the global batch over its workers.
    assert!(
        same.stdout.contains("2 worker(s) x batch 16, 5 steps"),
        "{}",
        same.stdout
    );
    let digests = std::fs::read_to_string(t.path("runs/verify-0-w2/logs/weights.jsonl")).unwrap();
    assert_eq!(digests.lines().count(), 5);

    let parted = t.ddpjob(&[
        "verify",
        cfg,
        "--world-sizes",
        "1,2",
        "--steps",
        "3",
        "--jobs-dir",
        parted_dir,
    ]);
    parted.fails_with(1, "differs between 1 and 2 worker(s)");
    let named = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
        .iter()
        .any(|n| parted.stderr.contains(&format!("step 1: `{n}` differs")));
    assert!(named, "{}", parted.stderr);

    // Another verify into the same folder would read the first one's runs: refused.
    t.ddpjob(&["verify", cfg, "--world-sizes", "2,2", "--jobs-dir", dir])
        .fails_with(2, "already exists (an earlier verify's run)");

    // Runs that finish their epochs (32 steps) before --steps, missing the job's [expect]
    // (exit 1 from `run`), did not fail: verify says where they ended.
    let strict = t.config(
        "strict",
        &format!("{TINY}[expect]\nmin_test_accuracy = 0.999\n"),
    );
    let ended = t.ddpjob(&[
        "verify",
        strict.to_str().unwrap(),
        "--world-sizes",
        "2,2",
        "--steps",
        "40",
        "--jobs-dir",
        t.path("strict-runs").to_str().unwrap(),
    ]);
    ended.fails_with(
        1,
        "every run ended after step 32 (the job's train.epochs hold no more)",
    );
    assert!(!ended.stderr.contains("run failed"), "{}", ended.stderr);
}

#[test]
fn world_sizes_that_do_not_divide_the_global_batch_are_a_usage_error() {
    let t = TestJob::new();
    let cfg = t.config("v", TINY);
    t.ddpjob(&["verify", cfg.to_str().unwrap(), "--world-sizes", "1,3"])
        .fails_with(2, "world sizes that do: 1, 2, 4, 8, 16, 32");
    assert!(!t.path("jobs").exists());
}
