//! Checkpoints you can trust: a job stopped at any checkpoint and resumed (`ddpjob resume`), or
//! restarted after a worker died, ends bit-identical to the run that was never interrupted.
//! Failures are injected with the test-only `DDPJOB_FAULT` (a real SIGKILL, SIGTERM to the
//! launcher, ...), so each test stops exactly where it means to.

use std::path::Path;
use std::process::Command;

use crate::common::{Run, TestJob, load_weights, workers_under};

/// 512 samples, batch 16 × accumulation 2: 8 optimizer steps per epoch on 2 workers, 16 on one.
fn job(optimizer: &str, extra: &str) -> String {
    format!(
        r#"
seed = 5
[model]
arch = "mlp"
hidden = [32]
[data]
dataset = "synthetic"
[data.synthetic]
train_samples = 512
test_samples = 128
shape = [1, 8, 8]
classes = 4
noise = 0.8
[train]
epochs = 3
batch_size = 16
accumulation = 2
lr = 0.02
optimizer = "{optimizer}"
weight_decay = 0.01
grad_clip_norm = 0.5
log_every = 3
[train.scheduler]
kind = "cosine"
warmup_steps = 3
min_lr = 0.001
[checkpoint]
every_epochs = 1
keep_last = 0
{extra}
"#
    )
}

/// `ddpjob run` with `DDPJOB_FAULT` set.
fn run_with_fault(t: &TestJob, config: &Path, fault: &str, extra: &[&str]) -> Run {
    t.run_env(config, extra, &[("DDPJOB_FAULT", fault)])
}

fn resume(t: &TestJob, args: &[&str]) -> Run {
    let jobs = t.jobs_dir().to_string_lossy().into_owned();
    let mut all = vec!["resume", "--jobs-dir", jobs.as_str()];
    all.extend_from_slice(args);
    t.ddpjob(&all)
}

#[track_caller]
fn assert_bit_identical(t: &TestJob, a: &str, b: &str) {
    let (wa, wb) = (
        load_weights(&t.job(a).join("model.safetensors")),
        load_weights(&t.job(b).join("model.safetensors")),
    );
    assert_eq!(wa.keys().collect::<Vec<_>>(), wb.keys().collect::<Vec<_>>());
    for (name, va) in &wa {
        let same = va
            .iter()
            .zip(&wb[name])
            .all(|(x, y)| x.to_bits() == y.to_bits());
        assert!(same, "`{name}` differs between jobs {a} and {b}");
    }
}

/// The optimizer steps of `metrics.jsonl`'s train lines: each exactly once, in order.
#[track_caller]
fn assert_history_continues(t: &TestJob, name: &str) {
    let steps: Vec<u64> = t
        .metrics(name)
        .iter()
        .filter(|l| l["kind"] == "train")
        .map(|l| l["step"].as_u64().unwrap())
        .collect();
    let mut sorted = steps.clone();
    sorted.dedup();
    assert_eq!(steps, sorted, "train lines repeat or go back: {steps:?}");
    assert!(
        t.metrics(name).iter().any(|l| l["kind"] == "resume"),
        "no resume line"
    );
}

#[test]
fn sigterm_then_resume_ends_bit_identical() {
    // (workers, optimizer, stop after step): sgd with momentum on one worker, adam and adamw on
    // two; all accumulate, clip and follow a cosine schedule with warm-up. Step 13 is mid-epoch
    // on one worker (16 steps per epoch), step 20 mid-way through the last epoch on two (8 steps
    // each), between log lines; step 8 ends the first epoch on two, before its evaluation;
    // step 24 is the job's last, before the last epoch's end (the resumed run takes no step).
    for (workers, optimizer, momentum, stop) in [
        ("1", "sgd", "momentum = 0.9", 13),
        ("2", "adam", "", 20),
        ("2", "adamw", "", 8),
        ("2", "sgd", "", 24),
    ] {
        let t = TestJob::new();
        let text =
            job(optimizer, "").replace("log_every = 3", &format!("log_every = 3\n{momentum}"));
        let cfg = t.config("job", &text);
        let n = ["--nproc-per-node", workers];
        t.run(&cfg, &[&n[..], &["--name", "whole"]].concat())
            .success();
        let run = run_with_fault(
            &t,
            &cfg,
            &format!("rank=0,step={stop},kind=preempt"),
            &[&n[..], &["--name", "cut"]].concat(),
        );
        run.fails_with(143, "interrupted by SIGTERM")
            .fails_with(143, &format!("after checkpoint `step-{stop:08}`"))
            // The command to continue finds the job where it is.
            .fails_with(
                143,
                &format!("ddpjob resume cut --jobs-dir {}", t.jobs_dir().display()),
            );
        let state = t.json(&t.job("cut").join("state.json"));
        assert_eq!(
            (state["status"].as_str(), state["step"].as_u64()),
            (Some("interrupted"), Some(stop))
        );
        assert!(workers_under(&t.job("cut")).is_empty());

        // No name: the most recently updated unfinished job.
        let resumed = resume(&t, &[]);
        resumed.success();
        assert!(
            resumed.stdout.contains("resuming job `cut` from")
                && resumed.stdout.contains(&format!("step {stop})")),
            "{}",
            resumed.stdout
        );
        assert_bit_identical(&t, "whole", "cut");
        assert_history_continues(&t, "cut");
        let (a, b) = (
            t.json(&t.job("whole").join("summary.json")),
            t.json(&t.job("cut").join("summary.json")),
        );
        assert_eq!(
            (a["steps"].clone(), a["samples"].clone()),
            (b["steps"].clone(), b["samples"].clone())
        );
        assert_eq!(
            a["final_train_loss"], b["final_train_loss"],
            "{workers} workers"
        );
        // Each epoch's train loss adds the same steps' losses in the same order, however the
        // cut regrouped them into log intervals.
        let epoch_losses = |name: &str| -> Vec<serde_json::Value> {
            t.metrics(name)
                .into_iter()
                .filter(|l| l["kind"] == "epoch")
                .map(|l| l["loss"].clone())
                .collect()
        };
        assert_eq!(
            epoch_losses("whole"),
            epoch_losses("cut"),
            "{workers} workers"
        );
        assert_eq!(a["test_accuracy"], b["test_accuracy"]);
    }
}

/// An adam job on 2 workers run whole (job `whole`), then again as job `cut` with `fault`
/// injected; returns the config and the cut run.
fn whole_then_cut(t: &TestJob, fault: &str) -> (std::path::PathBuf, Run) {
    let cfg = t.config("job", &job("adam", ""));
    t.run(&cfg, &["--nproc-per-node", "2", "--name", "whole"])
        .success();
    let cut = run_with_fault(t, &cfg, fault, &["--nproc-per-node", "2", "--name", "cut"]);
    (cfg, cut)
}

/// Slurm's `--signal=USR1@N` (the warning before a time limit) stops the job as SIGTERM does.
#[test]
fn sigusr1_checkpoints_and_stops_then_resume_ends_bit_identical() {
    let t = TestJob::new();
    let (_, cut) = whole_then_cut(&t, "rank=1,step=5,kind=usr1");
    cut.fails_with(138, "interrupted by SIGUSR1")
        .fails_with(138, "after checkpoint `step-00000005`");
    let state = t.json(&t.job("cut").join("state.json"));
    assert_eq!(state["status"].as_str(), Some("interrupted"));
    resume(&t, &["cut"]).success();
    assert_bit_identical(&t, "whole", "cut");
}

/// A closed terminal or ssh session (SIGHUP) stops the job as SIGTERM does; it killed the
/// launcher and its workers unsaved, leaving `state.json` at "running".
#[test]
fn sighup_checkpoints_and_stops_then_resume_ends_bit_identical() {
    let t = TestJob::new();
    let (_, cut) = whole_then_cut(&t, "rank=0,step=6,kind=hup");
    cut.fails_with(129, "interrupted by SIGHUP")
        .fails_with(129, "after checkpoint `step-00000006`");
    let state = t.json(&t.job("cut").join("state.json"));
    assert_eq!(state["status"].as_str(), Some("interrupted"));
    resume(&t, &["cut"]).success();
    assert_bit_identical(&t, "whole", "cut");
}

#[test]
fn a_crash_after_an_epoch_checkpoint_resumes_from_it_bit_identical() {
    let t = TestJob::new();
    let cfg = t.config("job", &job("adamw", ""));
    let n = ["--nproc-per-node", "2"];
    t.run(&cfg, &[&n[..], &["--name", "whole"]].concat())
        .success();
    // Step 9 opens epoch 2: the newest checkpoint is the epoch-boundary one at step 8.
    let run = run_with_fault(
        &t,
        &cfg,
        "rank=1,step=9,kind=crash",
        &[&n[..], &["--name", "crashed"]].concat(),
    );
    run.fails_with(1, "rank 1").fails_with(1, "SIGABRT");
    assert_eq!(
        t.json(&t.job("crashed").join("state.json"))["status"],
        "failed"
    );
    let resumed = resume(&t, &["crashed"]);
    resumed.success();
    assert!(
        resumed.stdout.contains("step-00000008"),
        "{}",
        resumed.stdout
    );
    assert_bit_identical(&t, "whole", "crashed");
    assert_history_continues(&t, "crashed");
}

#[test]
fn a_mid_epoch_checkpoint_resumes_bit_identical() {
    let t = TestJob::new();
    let cfg = t.config("job", &job("sgd", "every_steps = 5"));
    t.run(&cfg, &["--name", "whole"]).success();
    // One worker: 16 steps per epoch, checkpoints at 5 and 10; killed at step 12.
    run_with_fault(&t, &cfg, "rank=0,step=12,kind=kill", &["--name", "killed"])
        .fails_with(1, "killed by signal 9");
    let resumed = resume(&t, &["killed"]);
    resumed.success();
    assert!(
        resumed.stdout.contains("step-00000010"),
        "{}",
        resumed.stdout
    );
    assert_bit_identical(&t, "whole", "killed");
}

/// Damages the newest checkpoint of a copy of job `src` in `jobs-<how>/`.
fn damaged_copy(t: &TestJob, how: &str) -> std::path::PathBuf {
    let jobs = t.path(&format!("jobs-{how}"));
    std::fs::create_dir_all(&jobs).unwrap();
    let status = Command::new("cp")
        .arg("-a")
        .arg(t.job("broken"))
        .arg(&jobs)
        .status()
        .unwrap();
    assert!(status.success());
    let newest = jobs.join("broken/checkpoints/step-00000020");
    let model = newest.join("model.safetensors");
    match how {
        "flipped" => {
            let mut bytes = std::fs::read(&model).unwrap();
            let last = bytes.len() - 1;
            bytes[last] ^= 0x40;
            std::fs::write(&model, bytes).unwrap();
        }
        "missing" => std::fs::remove_file(newest.join("optimizer.safetensors")).unwrap(),
        "truncated" => {
            let bytes = std::fs::read(&model).unwrap();
            std::fs::write(&model, &bytes[..bytes.len() / 2]).unwrap();
        }
        // Not damaged: written by a ddpjob whose checkpoint format is newer.
        "newer" => {
            let path = newest.join("state.json");
            let mut state: serde_json::Value =
                serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
            state["format"] = 2.into();
            std::fs::write(&path, state.to_string()).unwrap();
        }
        _ => unreachable!(),
    }
    jobs
}

#[test]
fn a_damaged_newest_checkpoint_is_named_and_the_previous_one_used() {
    let t = TestJob::new();
    let cfg = t.config("job", &job("adam", "every_steps = 4"));
    let n = ["--nproc-per-node", "2"];
    t.run(&cfg, &[&n[..], &["--name", "whole"]].concat())
        .success();
    // Killed at step 22: checkpoints at 4, 8, ..., 20.
    run_with_fault(
        &t,
        &cfg,
        "rank=1,step=22,kind=kill",
        &[&n[..], &["--name", "broken"]].concat(),
    )
    .fails_with(1, "killed by signal 9");
    for (how, reason) in [
        ("flipped", "model.safetensors: checksum mismatch"),
        ("missing", "optimizer.safetensors: No such file"),
        ("truncated", "model.safetensors: checksum mismatch"),
    ] {
        let jobs = damaged_copy(&t, how);
        let jobs_arg = jobs.to_string_lossy().into_owned();
        let run = t.ddpjob(&["resume", "broken", "--jobs-dir", &jobs_arg]);
        run.success();
        assert!(
            run.stderr.contains("checkpoint `step-00000020` is damaged")
                && run.stderr.contains(reason),
            "{how}: {}",
            run.stderr
        );
        assert!(
            run.stdout.contains("step-00000016"),
            "{how}: {}",
            run.stdout
        );
        // Kept aside for inspection, never deleted; the step was written afresh.
        assert!(
            jobs.join("broken/checkpoints/damaged-step-00000020")
                .is_dir()
        );
        let fresh = jobs.join("broken/checkpoints/step-00000020");
        assert!(fresh.join("MANIFEST").exists(), "{how}");
        let weights = |dir: &Path| load_weights(&dir.join("broken/model.safetensors"));
        let whole = load_weights(&t.job("whole").join("model.safetensors"));
        assert_eq!(weights(&jobs), whole, "{how}: not bit-identical");
    }
    // A newer format is refused, not mistaken for damage and set aside.
    let jobs = damaged_copy(&t, "newer");
    let jobs_arg = jobs.to_string_lossy().into_owned();
    t.ddpjob(&["resume", "broken", "--jobs-dir", &jobs_arg])
        .fails_with(1, "written by a newer ddpjob (checkpoint format 2");
    assert!(jobs.join("broken/checkpoints/step-00000020").is_dir());
}

#[test]
fn a_killed_worker_is_restarted_from_the_checkpoint_when_allowed() {
    let t = TestJob::new();
    let cfg = t.config("job", &job("adam", "every_steps = 5"));
    let n = ["--nproc-per-node", "2"];
    t.run(&cfg, &[&n[..], &["--name", "whole"]].concat())
        .success();
    let run = run_with_fault(
        &t,
        &cfg,
        "rank=1,step=12,kind=kill",
        &[
            &n[..],
            &["--name", "restarted", "--set", "distributed.max_restarts=1"],
        ]
        .concat(),
    );
    run.success();
    assert!(
        run.stderr
            .contains("restart 1/1 of job `restarted` from checkpoint")
            && run.stderr.contains("step-00000010")
            && run.stderr.contains("rank 1 (pid")
            && run.stderr.contains("killed by signal 9"),
        "{}",
        run.stderr
    );
    assert_bit_identical(&t, "whole", "restarted");
    let state = t.json(&t.job("restarted").join("state.json"));
    assert_eq!(
        (state["status"].as_str(), state["restarts"].as_u64()),
        (Some("finished"), Some(1))
    );
    // `show` counts the restart as one, and nothing as a resume of the user's.
    let jobs = t.jobs_dir().to_string_lossy().into_owned();
    let shown = t.ddpjob(&["show", "restarted", "--jobs-dir", &jobs]);
    shown.success();
    assert!(
        shown.stdout.contains("1 automatic restart(s)") && !shown.stdout.contains("resumed"),
        "{}",
        shown.stdout
    );

    // Without restarts the same failure ends the job, naming the rank, leaving nothing behind.
    run_with_fault(
        &t,
        &cfg,
        "rank=1,step=12,kind=kill",
        &[&n[..], &["--name", "gone"]].concat(),
    )
    .fails_with(1, "job `gone` failed: rank 1")
    .fails_with(1, "killed by signal 9");
    assert!(workers_under(&t.job("gone")).is_empty());
}

#[test]
fn a_worker_that_fails_on_every_attempt_is_given_up_with_each_failure_listed() {
    let t = TestJob::new();
    let cfg = t.config("job", &job("sgd", ""));
    let run = run_with_fault(
        &t,
        &cfg,
        "rank=0,step=2,kind=exit,attempt=any",
        &["--name", "doomed", "--set", "distributed.max_restarts=2"],
    );
    run.fails_with(1, "job `doomed` failed and was given up after 2 restart(s)")
        .fails_with(1, "attempt 1: rank 0")
        .fails_with(1, "attempt 3: rank 0")
        .fails_with(1, "injected failure at step 2");
    let state = t.json(&t.job("doomed").join("state.json"));
    assert_eq!(
        (state["status"].as_str(), state["restarts"].as_u64()),
        (Some("failed"), Some(2))
    );
}

#[test]
fn a_failure_a_restart_would_repeat_is_not_restarted() {
    let t = TestJob::new();
    let cfg = t.config("job", &job("adam", "every_steps = 5"));
    run_with_fault(
        &t,
        &cfg,
        "rank=0,step=7,kind=preempt",
        &["--name", "edited"],
    )
    .fails_with(143, "interrupted by SIGTERM");
    // Someone edits the frozen config: the checkpoint no longer fits the model, which every
    // attempt would find again.
    let frozen = t.job("edited").join("job.toml");
    let text = std::fs::read_to_string(&frozen).unwrap();
    let edited = text
        .replace("hidden = [32]", "hidden = [16]")
        .replace("max_restarts = 0", "max_restarts = 2");
    assert_ne!(edited, text);
    std::fs::write(&frozen, edited).unwrap();
    let run = resume(&t, &["edited"]);
    run.fails_with(1, "does not fit this job")
        .fails_with(1, "not restarted (distributed.max_restarts = 2)");
    assert!(!run.stderr.contains("restart 1/2"), "{}", run.stderr);
    assert_eq!(t.json(&t.job("edited").join("state.json"))["restarts"], 0);
}

/// `run --resume auto`, what a requeued scheduler job runs again: continue, leave, or refuse.
#[test]
fn run_resume_auto_continues_leaves_or_refuses_an_existing_job() {
    let t = TestJob::new();
    let n = ["--nproc-per-node", "2"];
    // Preempted at step 5, then the same command again, as Slurm's requeue would: without the
    // flag, SLURM_RESTART_COUNT > 0 makes it auto.
    let (cfg, cut) = whole_then_cut(&t, "rank=0,step=5,kind=preempt");
    cut.fails_with(143, "interrupted by SIGTERM");
    let again = t.run_env(
        &cfg,
        &[&n[..], &["--name", "cut"]].concat(),
        &[("SLURM_RESTART_COUNT", "1")],
    );
    again.success();
    assert!(
        again.stderr.contains("--resume auto: Slurm requeued"),
        "{}",
        again.stderr
    );
    assert!(
        again.stdout.contains("resuming job `cut` from"),
        "{}",
        again.stdout
    );
    assert_bit_identical(&t, "whole", "cut");

    // Finished: nothing to do, exit 0, nothing touched.
    let lines = t.metrics_lines("cut");
    let done = t.run(
        &cfg,
        &[&n[..], &["--name", "cut", "--resume", "auto"]].concat(),
    );
    done.success();
    assert!(done.stdout.contains("already finished"), "{}", done.stdout);
    assert_eq!(t.metrics_lines("cut"), lines);

    // Another config: refused with the keys that differ, exit 2, nothing touched.
    t.run(
        &cfg,
        &[
            &n[..],
            &[
                "--name",
                "cut",
                "--resume",
                "auto",
                "--set",
                "train.lr=0.05",
            ],
        ]
        .concat(),
    )
    .fails_with(2, "with another config")
    .fails_with(2, "train.lr: 0.02 -> 0.05");
    assert_eq!(t.metrics_lines("cut"), lines);
    // And without auto, an existing job is never run again.
    t.run(
        &cfg,
        &[&n[..], &["--name", "cut", "--resume", "never"]].concat(),
    )
    .fails_with(2, "cut");
}

/// `run --resume auto` given another number of workers (a requeued job's new allocation)
/// continues the job re-sharded, as `resume --nproc-per-node` does, saying so.
#[test]
fn run_resume_auto_continues_on_another_number_of_workers() {
    let t = TestJob::new();
    let cfg = t.config("job", &job("adam", ""));
    let n2 = ["--nproc-per-node", "2", "--name", "cut"];
    run_with_fault(&t, &cfg, "rank=0,step=5,kind=preempt", &n2)
        .fails_with(143, "interrupted by SIGTERM");
    let again = t.run(
        &cfg,
        &["--nproc-per-node", "1", "--name", "cut", "--resume", "auto"],
    );
    again.success();
    assert!(
        again.stdout.contains(
            "--resume auto: job `cut` continues with another number of workers \
             (distributed.nproc_per_node: 2 -> 1)"
        ),
        "{}",
        again.stdout
    );
    assert_eq!(
        t.json(&t.job("cut").join("state.json"))["status"],
        "finished"
    );
    assert_eq!(t.json(&t.job("cut").join("summary.json"))["world_size"], 1);
}

/// `model.freeze` on two workers: the frozen layer keeps the seed's values (the same in a job
/// with another learning rate and optimizer, whose other layer ends elsewhere), a kill and
/// `resume` end bit-identical, and a pattern that names nothing is refused before the job
/// exists, with the model's parameter names.
#[test]
fn frozen_layers_stay_put_and_resume_bit_identical() {
    let t = TestJob::new();
    // `model.freeze` sits in [model], which `job()` starts; `{extra}` lands in [checkpoint].
    let frozen = |optimizer: &str| {
        job(optimizer, "every_steps = 5")
            .replace("hidden = [32]", "hidden = [32]\nfreeze = [\"fc1\"]")
    };
    let cfg = t.config("frozen", &frozen("adamw"));
    let two = ["--nproc-per-node", "2"];
    let whole = t.run(&cfg, &[&two[..], &["--name", "whole"]].concat());
    whole.success();
    assert!(
        whole.stdout.contains("frozen: 2 of 4 parameter tensors"),
        "{}",
        whole.stdout
    );
    let other = t.config("other", &frozen("sgd").replace("lr = 0.02", "lr = 0.1"));
    t.run(&other, &[&two[..], &["--name", "other"]].concat())
        .success();
    let (a, b) = (
        load_weights(&t.job("whole").join("model.safetensors")),
        load_weights(&t.job("other").join("model.safetensors")),
    );
    assert_eq!(a["fc1.weight"], b["fc1.weight"]);
    assert_eq!(a["fc1.bias"], b["fc1.bias"]);
    assert_ne!(a["fc2.weight"], b["fc2.weight"]);
    // The optimizer state in a checkpoint holds the trained layer's moments only.
    let newest = std::fs::read_dir(t.job("whole").join("checkpoints"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .max()
        .unwrap();
    let state = load_weights(&newest.join("optimizer.safetensors"));
    assert!(
        state.keys().all(|k| k.starts_with("fc2.")) && !state.is_empty(),
        "{:?}",
        state.keys()
    );

    run_with_fault(
        &t,
        &cfg,
        "rank=1,step=12,kind=kill",
        &[&two[..], &["--name", "killed"]].concat(),
    )
    .fails_with(1, "killed by signal 9");
    resume(&t, &["killed"]).success();
    assert_bit_identical(&t, "whole", "killed");

    let bad = t.config("bad", &frozen("adam").replace("[\"fc1\"]", "[\"fc3\"]"));
    t.run(&bad, &[])
        .fails_with(2, "\"fc3\" matches no parameter")
        .fails_with(2, "fc1.weight, fc1.bias, fc2.weight, fc2.bias");
    assert!(!t.job("bad").exists());
}

/// A job another launcher is running is neither picked by `resume` without a name nor taken
/// by `run` of its name; an unfinished one that is not running is pointed to `resume`.
#[test]
fn a_running_job_is_left_to_its_launcher_and_an_unfinished_one_pointed_to_resume() {
    let t = TestJob::new();
    let cfg = t.config("job", crate::common::TINY);
    let jobs = t.jobs_dir().display().to_string();
    run_with_fault(&t, &cfg, "rank=0,step=3,kind=preempt", &["--name", "old"])
        .fails_with(143, "interrupted by SIGTERM");
    t.run(&cfg, &["--name", "old"])
        .fails_with(
            2,
            "is not finished; continue it with `ddpjob resume old --jobs-dir",
        )
        .fails_with(2, "--resume auto");

    // Few lines: nobody reads its output pipe until it ends.
    let long = [
        "--set",
        "data.synthetic.train_samples=200000",
        "--set",
        "train.epochs=50",
        "--set",
        "train.log_every=100000",
    ];
    let mut live = t.spawn_run(&cfg, "jobs", &[&long[..], &["--name", "live"]].concat());
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    let running = || {
        std::fs::read_to_string(t.job("live").join("state.json"))
            .ok()
            .and_then(|s| serde_json::from_str::<serde_json::Value>(&s).ok())
            .is_some_and(|s| s["status"] == "running" && s["step"].as_u64() > Some(0))
    };
    while !running() {
        assert!(std::time::Instant::now() < deadline, "`live` never started");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    t.run(&cfg, &["--name", "live"])
        .fails_with(2, "another ddpjob (pid")
        .fails_with(2, "is running it");
    // `live` is the most recently updated unfinished job, but it is running: `old` is resumed.
    let resumed = resume(&t, &[]);
    resumed.success();
    assert!(
        resumed.stdout.contains("resuming job `old`"),
        "{}",
        resumed.stdout
    );
    // Nothing else left to resume: the running one is named.
    resume(&t, &[])
        .fails_with(2, "no unfinished job")
        .fails_with(2, "`live` (pid");
    unsafe { libc::kill(live.child.id() as i32, libc::SIGTERM) };
    let stopped = live.wait_for(std::time::Duration::from_secs(60)).unwrap();
    assert_eq!(stopped.code, 143, "{}", stopped.stderr);
    assert!(
        std::path::Path::new(&jobs)
            .join("live/checkpoints/latest")
            .is_file()
    );
}

/// A damaged or missing `state.json` does not disown a job: it is listed, shown, refused as
/// an existing name and resumed from its checkpoints, ending as the uninterrupted run does.
#[test]
fn a_job_whose_state_json_is_damaged_is_still_listed_and_resumed() {
    let t = TestJob::new();
    let (cfg, cut) = whole_then_cut(&t, "rank=0,step=6,kind=preempt");
    cut.fails_with(143, "interrupted by SIGTERM");
    // One that failed before its first checkpoint: its metrics say it ran.
    let two = ["--nproc-per-node", "2", "--name", "early"];
    run_with_fault(&t, &cfg, "rank=0,step=5,kind=exit", &two).fails_with(1, "injected");
    let jobs = t.jobs_dir().display().to_string();
    std::fs::write(t.job("cut").join("state.json"), "{\"status\": \"interr").unwrap();
    std::fs::remove_file(t.job("whole").join("state.json")).unwrap();
    std::fs::remove_file(t.job("early").join("state.json")).unwrap();
    let list = t.ddpjob(&["list", "--jobs-dir", &jobs]);
    list.success();
    let line = |name: &str| {
        list.stdout
            .lines()
            .find(|l| l.starts_with(name))
            .unwrap_or_else(|| panic!("no `{name}` in:\n{}", list.stdout))
            .to_string()
    };
    assert!(line("cut").contains("interrupted"), "{}", list.stdout);
    // The checkpoint gives the step; the run's total is not known until it reads its data.
    assert!(line("cut").contains(" 6/? "), "{}", list.stdout);
    assert!(line("whole").contains("finished"), "{}", list.stdout);
    assert!(line("early").contains("interrupted"), "{}", list.stdout);
    let early = t.ddpjob(&["show", "early", "--jobs-dir", &jobs]);
    early.success();
    let over = "no checkpoint yet: `ddpjob resume early --jobs-dir";
    assert!(early.stdout.contains(over), "{}", early.stdout);
    let show = t.ddpjob(&["show", "cut", "--jobs-dir", &jobs]);
    show.success();
    assert!(
        show.stdout.contains("rebuilt from the job's files"),
        "{}",
        show.stdout
    );
    let config = t.path("job.toml").display().to_string();
    t.ddpjob(&["run", &config, "--jobs-dir", &jobs, "--name", "whole"])
        .fails_with(2, "job `whole` already finished");
    let resumed = resume(&t, &["cut"]);
    resumed.success();
    assert!(
        resumed.stdout.contains("step-00000006"),
        "{}",
        resumed.stdout
    );
    assert_bit_identical(&t, "whole", "cut");
    assert_eq!(
        t.json(&t.job("cut").join("state.json"))["status"],
        "finished"
    );
}

/// A checkpoint past the end of the job as an edited `job.toml` plans it is refused, not
/// "finished" at 250% of its steps.
#[test]
fn a_checkpoint_past_an_edited_job_end_is_refused() {
    let t = TestJob::new();
    let cfg = t.config("job", crate::common::TINY);
    // 16 steps an epoch: step 20 is in the second of two.
    run_with_fault(&t, &cfg, "rank=0,step=20,kind=preempt", &["--name", "cut"])
        .fails_with(143, "after checkpoint `step-00000020`");
    let toml = t.job("cut").join("job.toml");
    let text = std::fs::read_to_string(&toml).unwrap();
    std::fs::write(&toml, text.replace("epochs = 2", "epochs = 1")).unwrap();
    resume(&t, &["cut"])
        .fails_with(2, "is at step 20 (epoch 2), past the end of the job")
        .fails_with(2, "train.epochs = 1");
    assert_eq!(
        t.json(&t.job("cut").join("state.json"))["status"],
        "interrupted"
    );
    std::fs::write(&toml, text).unwrap();
    resume(&t, &["cut"]).success();
}

/// A `job.toml` edited to another optimizer than its checkpoint's state is refused before
/// anything changes (restored, Adam's moments would be missing or momentum dropped, silently).
#[test]
fn a_checkpoint_of_another_optimizer_is_refused() {
    let t = TestJob::new();
    let text = crate::common::TINY.replace("lr = 0.01", "lr = 0.01\noptimizer = \"sgd\"");
    for (name, momentum) in [("momentum", "\nmomentum = 0.9"), ("plain", "")] {
        let cfg = t.config(
            name,
            &text.replace(
                "optimizer = \"sgd\"",
                &format!("optimizer = \"sgd\"{momentum}"),
            ),
        );
        run_with_fault(&t, &cfg, "rank=0,step=20,kind=preempt", &[])
            .fails_with(143, "after checkpoint `step-00000020`");
        let toml = t.job(name).join("job.toml");
        let frozen = std::fs::read_to_string(&toml).unwrap();
        let edited = frozen.replace("optimizer = \"sgd\"", "optimizer = \"adamw\"");
        assert_ne!(edited, frozen);
        std::fs::write(&toml, &edited).unwrap();
        let refused = resume(&t, &[name]);
        match momentum.is_empty() {
            false => refused.fails_with(2, "its optimizer state is SGD with momentum"),
            true => refused.fails_with(2, "it holds no optimizer state after 20 steps"),
        }
        .fails_with(2, "set train.optimizer (and its keys) in job.toml back");
        // A requeued `run --resume auto` of the config edited the same way is refused alike.
        if momentum.is_empty() {
            let edited_config = t.config(&format!("{name}-edited"), &edited);
            t.run(&edited_config, &["--name", name, "--resume", "auto"])
                .fails_with(2, "it holds no optimizer state after 20 steps");
        }
        assert_eq!(
            t.json(&t.job(name).join("state.json"))["status"],
            "interrupted"
        );
        std::fs::write(&toml, frozen).unwrap();
        resume(&t, &[name]).success();
    }
}

/// `nohup ddpjob run ...` (SIGHUP ignored) outlives its session: the ignored signal is kept.
#[test]
fn a_job_under_nohup_outlives_a_hangup() {
    let t = TestJob::new();
    let cfg = t.config("job", crate::common::TINY);
    let mut cmd = std::process::Command::new("nohup");
    crate::common::without_scheduler(&mut cmd);
    let jobs = t.jobs_dir();
    let mut child = cmd
        .arg(env!("CARGO_BIN_EXE_ddpjob"))
        .args([
            "run",
            cfg.to_str().unwrap(),
            "--jobs-dir",
            jobs.to_str().unwrap(),
        ])
        .args([
            "--set",
            "data.synthetic.train_samples=100000",
            "--set",
            "train.log_every=100000",
        ])
        .env("DDPJOB_PLAIN", "1")
        .current_dir(t.path(""))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while !t.job("job").join("state.json").is_file() {
        assert!(
            std::time::Instant::now() < deadline,
            "the job never started"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    unsafe { libc::kill(child.id() as i32, libc::SIGHUP) };
    assert_eq!(child.wait().unwrap().code(), Some(0));
    assert_eq!(
        t.json(&t.job("job").join("state.json"))["status"],
        "finished"
    );
}

/// `resume --nproc-per-node` takes what `run`'s does: "auto" (one CPU worker here) or a count,
/// and a bad value is named as the flag the user typed.
#[test]
fn resume_takes_auto_workers_as_run_does() {
    let t = TestJob::new();
    let cfg = t.config("job", &job("adam", "every_steps = 5"));
    run_with_fault(
        &t,
        &cfg,
        "rank=0,step=6,kind=preempt",
        &["--nproc-per-node", "2", "--name", "cut"],
    )
    .fails_with(143, "interrupted by SIGTERM");
    resume(&t, &["cut", "--nproc-per-node", "0"]).fails_with(
        2,
        "`distributed.nproc_per_node` (--nproc-per-node 0): must be at least 1",
    );
    let resumed = resume(&t, &["cut", "--nproc-per-node", "auto"]);
    resumed.success();
    assert!(
        resumed.stdout.contains("on 1 worker(s)")
            && resumed.stdout.contains("world size changed from 2 to 1"),
        "{}",
        resumed.stdout
    );
}

/// A job started with relative data paths resumes, and is scored, from any directory: its
/// `job.toml` freezes them absolute (a requeue or a later `resume` need not start where `run`
/// did). The same config run with `--resume auto` where it started is still the same job.
#[test]
fn a_job_with_relative_paths_resumes_and_is_scored_from_another_directory() {
    let t = TestJob::new();
    std::fs::create_dir(t.path("data")).unwrap();
    let text: String = (0..400)
        .map(|i| format!("line {i} of the text\n"))
        .collect();
    std::fs::write(t.path("data/text.txt"), text).unwrap();
    let cfg = t.config(
        "rel",
        "seed = 1\n[model]\narch = \"gpt\"\nn_layer = 1\nn_head = 2\nn_embd = 16\n\
         block_size = 16\n[data]\ndataset = \"text\"\npath = \"data/text.txt\"\n[train]\n\
         epochs = 2\nbatch_size = 16\nlog_every = 10\n[checkpoint]\nevery_steps = 10\n",
    );
    run_with_fault(&t, &cfg, "rank=0,step=12,kind=preempt", &[])
        .fails_with(143, "interrupted by SIGTERM");
    let frozen = std::fs::read_to_string(t.job("rel").join("job.toml")).unwrap();
    let absolute = t.path("data/text.txt").display().to_string();
    assert!(
        frozen.contains(&format!("path = \"{absolute}\"")),
        "{frozen}"
    );
    let elsewhere = tempfile::tempdir().unwrap();
    let jobs = t.jobs_dir().display().to_string();
    let from_elsewhere = |args: &[&str]| -> crate::common::Run {
        let mut cmd = t.command(args, &[]);
        cmd.current_dir(elsewhere.path());
        cmd.output().unwrap().into()
    };
    from_elsewhere(&["resume", "rel", "--jobs-dir", &jobs]).success();
    let scored = from_elsewhere(&["eval", "rel", "--jobs-dir", &jobs]);
    scored.success();
    assert!(scored.stdout.contains("val loss"), "{}", scored.stdout);
    let again = t.run(&cfg, &["--resume", "auto"]);
    again.success();
    assert!(
        again.stdout.contains("already finished"),
        "{}",
        again.stdout
    );
}

/// A job that failed before its first checkpoint: `run` of it again says to train it from the
/// start (`resume` would refuse without --from-scratch), and a bare `resume` passes over it
/// for an older job that has a checkpoint, saying so.
#[test]
fn a_bare_resume_picks_the_newest_job_it_can_continue() {
    let t = TestJob::new();
    let jobs = t.jobs_dir().display().to_string();
    let fault = |step: &str, kind: &str| format!("rank=0,step={step},kind={kind}");
    let older = t.config("older", crate::common::TINY);
    t.run_env(&older, &[], &[("DDPJOB_FAULT", &fault("5", "preempt"))])
        .fails_with(143, "interrupted by SIGTERM");
    let newer = t.config("newer", crate::common::TINY);
    t.run_env(&newer, &[], &[("DDPJOB_FAULT", &fault("2", "exit"))])
        .fails_with(1, "injected failure");
    t.run(&newer, &[]).fails_with(
        2,
        "it has no checkpoint: train it again with `ddpjob resume newer",
    );
    let resumed = t.ddpjob(&["resume", "--jobs-dir", &jobs]);
    resumed.success();
    assert!(
        resumed
            .stderr
            .contains("resuming `older`, the newest unfinished job with a checkpoint (`newer` newer, without one)"),
        "{}",
        resumed.stderr
    );
    assert_eq!(
        t.json(&t.job("older").join("state.json"))["status"],
        "finished"
    );
}
