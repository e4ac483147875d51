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

    // Runs that finish their epochs (32 steps) missing the job's [expect] (exit 1 from `run`)
    // did not fail: their weights are compared.
    let strict = t.config(
        "strict",
        &format!("{TINY}[expect]\nmin_test_accuracy = 0.999\n"),
    );
    let strict_runs = t.path("strict-runs");
    let verify_strict = |steps: &str| {
        t.ddpjob(&[
            "verify",
            strict.to_str().unwrap(),
            "--world-sizes",
            "2,2",
            "--steps",
            steps,
            "--jobs-dir",
            strict_runs.to_str().unwrap(),
        ])
    };
    // More steps than the epochs hold is the request's mistake, said before anything runs
    // (it ran every world size, then exited 1 as if the weights had differed).
    verify_strict("40").fails_with(
        2,
        "--steps 40: the job's train.epochs = 2 hold 32 optimizer steps on 2 worker(s) (512 \
         training samples); ask for --steps 32 or fewer",
    );
    assert!(!strict_runs.exists());
    let ended = verify_strict("32");
    ended.success();
    assert!(
        ended
            .stdout
            .contains("bit-identical weights at every one of 32 steps"),
        "{}",
        ended.stdout
    );
}

#[test]
fn world_sizes_that_do_not_divide_the_global_batch_are_a_usage_error() {
    let t = TestJob::new();
    let cfg = t.config("v", TINY);
    t.ddpjob(&["verify", cfg.to_str().unwrap(), "--world-sizes", "1,3"])
        .fails_with(2, "world sizes that do: 1, 2, 4, 8, 16, 32");
    assert!(!t.path("jobs").exists());
}

/// `verify` stopped by a signal sent to it alone (a scheduler's, `timeout`'s) stops the run it
/// started, workers and all, instead of leaving it training.
#[test]
fn verify_stopped_by_a_signal_stops_its_run() {
    let t = TestJob::new();
    let cfg = t.config("v", &TINY.replace("epochs = 2", "epochs = 100000"));
    let runs = t.path("runs");
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_ddpjob"));
    crate::common::without_scheduler(&mut cmd);
    let child = cmd
        .args([
            "verify",
            cfg.to_str().unwrap(),
            "--steps",
            "1000000",
            "--jobs-dir",
        ])
        .arg(&runs)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut verify = crate::common::Background { child };
    let metrics = runs.join("verify-0-w1/metrics.jsonl");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while std::fs::read_to_string(&metrics).map_or(0, |m| m.lines().count()) < 2 {
        assert!(
            std::time::Instant::now() < deadline,
            "the run does not train"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    assert_eq!(crate::common::workers_under(&runs).len(), 1);
    unsafe { libc::kill(verify.child.id() as i32, libc::SIGTERM) };
    let out = verify
        .wait_for(std::time::Duration::from_secs(30))
        .expect("verify hung");
    out.fails_with(
        143,
        "interrupted by SIGTERM during the 1-worker run, which was stopped",
    );
    std::thread::sleep(std::time::Duration::from_millis(500));
    assert_eq!(crate::common::workers_under(&runs), Vec::new());
}
