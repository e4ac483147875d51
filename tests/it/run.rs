use crate::common::{TINY, TestJob, load_weights};

#[test]
fn smoke_config_trains_and_fills_the_job_directory() {
    let t = TestJob::new();
    let smoke = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/smoke.toml");
    // As docs/src/ci.md runs it (a report named without a directory, written where it runs): the
    // shipped expectations hold.
    let report = t.path("smoke.xml");
    t.run(&smoke, &["--junit", "smoke.xml"]).success();
    assert!(
        std::fs::read_to_string(&report)
            .unwrap()
            .contains("failures=\"0\"")
    );
    let job = t.job("smoke");
    for file in [
        "curves.svg",
        "job.toml",
        "state.json",
        "metrics.jsonl",
        "logs/rank-0.log",
        "model.safetensors",
        "summary.json",
    ] {
        assert!(job.join(file).is_file(), "missing {file}");
    }
    let latest = std::fs::read_to_string(job.join("checkpoints/latest")).unwrap();
    let ckpt = job.join("checkpoints").join(latest.trim());
    for file in [
        "model.safetensors",
        "optimizer.safetensors",
        "state.json",
        "MANIFEST",
    ] {
        assert!(ckpt.join(file).is_file(), "checkpoint lacks {file}");
    }

    let summary = t.json(&job.join("summary.json"));
    for key in [
        "test_accuracy",
        "test_loss",
        "final_train_loss",
        "epochs",
        "steps",
        "train_samples_per_s",
        "wall_s",
    ] {
        assert!(
            summary[key].is_number(),
            "summary.json lacks {key}: {summary}"
        );
    }
    let classes = 10.0;
    assert!(
        summary["test_accuracy"].as_f64().unwrap() > 3.0 / classes,
        "accuracy near chance: {summary}"
    );
    assert!(summary["train_samples_per_s"].as_f64().unwrap() > 0.0);
    let expectations = summary["expectations"].as_array().unwrap();
    assert_eq!(expectations.len(), 5, "{summary}");
    assert!(expectations.iter().all(|e| e["met"] == true), "{summary}");
    assert_eq!(t.json(&job.join("state.json"))["status"], "finished");

    let metrics = t.metrics("smoke");
    let losses: Vec<f64> = metrics
        .iter()
        .filter(|m| m["kind"] == "train")
        .map(|m| m["loss"].as_f64().unwrap())
        .collect();
    assert!(losses.len() >= 4, "too few metric lines: {metrics:?}");
    assert!(
        losses.last().unwrap() < &(losses[0] * 0.7),
        "loss did not go down: {losses:?}"
    );
    let epochs: Vec<_> = metrics.iter().filter(|m| m["kind"] == "epoch").collect();
    assert_eq!(epochs.len(), summary["epochs"].as_u64().unwrap() as usize);
    for m in &epochs {
        for key in [
            "epoch",
            "step",
            "loss",
            "lr",
            "samples_per_s",
            "test_loss",
            "test_accuracy",
        ] {
            assert!(!m[key].is_null(), "epoch line lacks {key}: {m}");
        }
    }

    // The final weights carry torch's parameter names.
    let weights = load_weights(&job.join("model.safetensors"));
    assert!(
        weights.contains_key("fc1.weight") && weights.contains_key("fc2.bias"),
        "{:?}",
        weights.keys()
    );
    // job.toml is a complete config that validates on its own.
    t.ddpjob(&["validate", job.join("job.toml").to_str().unwrap()])
        .success();
}

#[test]
fn an_existing_job_is_never_overwritten() {
    let t = TestJob::new();
    let cfg = t.config("tiny", TINY);
    t.run(&cfg, &[]).success();
    let before = std::fs::read(t.job("tiny").join("model.safetensors")).unwrap();
    t.run(&cfg, &[])
        .fails_with(2, "job `tiny` already finished")
        .fails_with(2, "--name");
    assert_eq!(
        std::fs::read(t.job("tiny").join("model.safetensors")).unwrap(),
        before
    );

    // An unfinished job (here: marked failed) is refused too, with its state.
    let state_path = t.job("tiny").join("state.json");
    let mut state = t.json(&state_path);
    state["status"] = "failed".into();
    std::fs::write(&state_path, state.to_string()).unwrap();
    t.run(&cfg, &[]).fails_with(2, "is not finished");

    t.run(&cfg, &["--name", "tiny-2"]).success();
    assert!(t.job("tiny-2").join("summary.json").is_file());
    let list = t.ddpjob(&["list", "--jobs-dir", t.jobs_dir().to_str().unwrap()]);
    list.success();
    assert!(
        list.stdout.contains("tiny-2")
            && list.stdout.contains("finished")
            && list.stdout.contains("failed"),
        "{}",
        list.stdout
    );
}

#[test]
fn a_jobs_dir_that_is_a_file_is_a_usage_error() {
    let t = TestJob::new();
    let cfg = t.config("tiny", TINY);
    let file = t.path("jobs-notes.txt");
    std::fs::write(&file, "not a directory").unwrap();
    let file = file.to_str().unwrap();
    t.ddpjob(&["run", cfg.to_str().unwrap(), "--jobs-dir", file])
        .fails_with(2, "is a file, not a directory")
        .fails_with(2, "--jobs-dir");
    t.ddpjob(&["list", "--jobs-dir", file])
        .fails_with(2, "is a file, not a directory");
    assert_eq!(std::fs::read_to_string(file).unwrap(), "not a directory");
}

/// A model no machine has memory for is refused before the job exists (exit 2): a width past
/// any address space by its parameter's name, and a GPT too large for this machine's memory
/// by the estimate beside what the machine has (its blank weights are zero pages, never
/// touched, so the check itself costs little).
#[test]
fn a_model_larger_than_the_machine_is_refused_before_launch() {
    let t = TestJob::new();
    let cfg = t.config("tiny", TINY);
    t.run(&cfg, &["--set", "model.hidden=[17592186044416]"])
        .fails_with(2, "parameter `fc1.weight` of shape [17592186044416, 64]")
        .fails_with(2, "more memory than this machine can give");
    assert!(!t.job("tiny").exists());

    let text = t.path("corpus.txt");
    std::fs::write(&text, crate::common::corpus()).unwrap();
    let huge = format!(
        "name = \"huge\"\n[model]\narch = \"gpt\"\nn_layer = 200\nn_head = 64\nn_embd = 8192\n\
         block_size = 64\n[data]\ndataset = \"text\"\npath = \"{}\"\n[train]\nepochs = 1\n\
         batch_size = 2\nlr = 1e-3\n",
        text.display()
    );
    let cfg = t.config("huge", &huge);
    let refused = t.run(&cfg, &["--nproc-per-node", "2"]);
    // Under strict overcommit (mode 2) the blank weights themselves cannot be had.
    let strict = std::fs::read_to_string("/proc/sys/vm/overcommit_memory")
        .is_ok_and(|mode| mode.trim() == "2");
    match strict {
        true => refused.fails_with(2, "more memory than this machine can give"),
        false => refused
            .fails_with(2, "each worker needs about ")
            .fails_with(2, "GB (weights 644.33 GB, ")
            .fails_with(2, "for each of its 2 workers (fewer with --nproc-per-node)"),
    };
    assert!(!t.job("huge").exists());
    // `validate` says so too, from the same blank weights, and refuses it as `run` does.
    if !strict {
        let validate = t.ddpjob(&["validate", cfg.to_str().unwrap()]);
        validate.fails_with(
            2,
            "its workers do not fit this machine's memory (see above)",
        );
        assert!(
            validate
                .stdout
                .contains("  does not fit: each worker needs about ")
                && validate.stdout.contains("but this machine has "),
            "{}",
            validate.stdout
        );
    }
}

#[test]
fn a_diverging_loss_fails_the_job_naming_epoch_and_step() {
    let t = TestJob::new();
    let cfg = t.config("boom", TINY);
    let run = t.run(
        &cfg,
        &["--set", "train.lr=1e30", "--set", "train.optimizer=sgd"],
    );
    run.fails_with(1, "training loss became")
        .fails_with(1, "in epoch 1, between optimizer steps 1 and 4");
    let state = t.json(&t.job("boom").join("state.json"));
    assert_eq!(state["status"], "failed");
    assert!(
        state["error"]
            .as_str()
            .unwrap()
            .contains("training loss became")
    );
}

#[test]
fn mid_epoch_checkpoints_are_written_and_pruned() {
    let t = TestJob::new();
    let cfg = t.config("ck", TINY);
    t.run(
        &cfg,
        &[
            "--set",
            "checkpoint.every_steps=3",
            "--set",
            "checkpoint.keep_last=2",
        ],
    )
    .success();
    let dir = t.job("ck").join("checkpoints");
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("step-"))
        .collect();
    names.sort();
    // 16 steps per epoch, 32 in all: every 3 steps, plus the epoch ends 16 and 32; two kept.
    assert_eq!(names, vec!["step-00000030", "step-00000032"]);
    let state = t.json(&dir.join("step-00000030/state.json"));
    assert_eq!(
        (state["epoch"].as_u64(), state["step_in_epoch"].as_u64()),
        (Some(1), Some(14))
    );
}

#[test]
fn cpu_workers_flush_subnormals_unless_the_config_says_not_to() {
    let t = TestJob::new();
    let cfg = t.config("tiny", TINY);
    let log = |job: &str, rank: usize| {
        std::fs::read_to_string(t.job(job).join(format!("logs/rank-{rank}.log"))).unwrap()
    };
    t.run(&cfg, &["--nproc-per-node", "2"]).success();
    for rank in 0..2 {
        let log = log("tiny", rank);
        assert!(
            log.contains("subnormal floats flushed to zero on all"),
            "rank {rank}: {log}"
        );
    }
    t.run(
        &cfg,
        &[
            "--nproc-per-node",
            "2",
            "--name",
            "ieee",
            "--set",
            "train.flush_denormals=false",
        ],
    )
    .success();
    for rank in 0..2 {
        let log = log("ieee", rank);
        let counts = log
            .split("kept as IEEE subnormals on ")
            .nth(1)
            .and_then(|rest| rest.split(" threads").next())
            .unwrap_or_else(|| panic!("rank {rank}: {log}"));
        let (kept, of) = counts.split_once(" of ").unwrap();
        assert_eq!(
            kept, of,
            "rank {rank}: every thread keeps subnormals: {log}"
        );
    }
}

/// A panic in a worker (as a user model's `forward` might panic) reaches the user as the
/// rank's failure with the panic's message and place, from the worker's failure record; the
/// other worker is stopped and no process is left behind.
#[test]
fn a_panicking_worker_is_reported_with_its_message_and_leaves_no_process() {
    let t = TestJob::new();
    let cfg = t.config("job", TINY);
    let run = t.run_env(
        &cfg,
        &["--nproc-per-node", "2", "--name", "panicky"],
        &[("DDPJOB_FAULT", "rank=1,step=3,kind=panic")],
    );
    run.fails_with(1, "rank 1 (pid")
        .fails_with(1, "exited with status 101")
        .fails_with(1, "panicked at crates/ddpjob-train/src/fault.rs:")
        .fails_with(1, "DDPJOB_FAULT: injected panic at step 3");
    let record = t.json(&t.job("panicky").join("logs/rank-1.failure.json"));
    assert_eq!(
        (record["rank"].as_u64(), record["kind"].as_str()),
        (Some(1), Some("panic"))
    );
    assert!(crate::common::workers_under(&t.job("panicky")).is_empty());
    assert_eq!(
        t.json(&t.job("panicky").join("state.json"))["status"],
        "failed"
    );
}

#[test]
fn output_nobody_reads_does_not_stop_a_job() {
    // `ddpjob run job.toml | head -1`: stdout and stderr are pipes whose reader has gone. A
    // print to them failed with EPIPE and panicked the launcher and rank 0, failing the job.
    let t = TestJob::new();
    let cfg = t.config("job", TINY);
    let jobs = t.jobs_dir().display().to_string();
    let config = cfg.display().to_string();
    let args = ["run", &config, "--jobs-dir", &jobs, "--nproc-per-node", "2"];
    let mut child = t
        .command(&args, &[])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    drop((child.stdout.take(), child.stderr.take()));
    let status = child.wait().unwrap();
    assert_eq!(status.code(), Some(0), "{status}");
    let state = t.json(&t.job("job").join("state.json"));
    assert_eq!(state["status"], "finished", "{state}");
    // The lines nobody read are in the job's log.
    let log = std::fs::read_to_string(t.job("job").join("logs/rank-0.log")).unwrap();
    assert!(log.contains("epoch 2/2 done"), "{log}");
    // So does a command that only prints.
    let mut validate = t
        .command(&["validate", &config], &[])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    drop(validate.stdout.take());
    assert_eq!(validate.wait().unwrap().code(), Some(0));
}
