//! `ddpjob show` and `ddpjob list` on jobs in every state: finished, failed, running,
//! interrupted, and "stale" (state says running, launcher gone).

use std::time::{Duration, Instant};

use crate::common::{TINY, TestJob, workers_under};

/// The `list` line of job `name`.
fn list_line(list: &str, name: &str) -> String {
    list.lines()
        .find(|l| l.split_whitespace().next() == Some(name))
        .unwrap_or_else(|| panic!("no line for {name}:\n{list}"))
        .to_string()
}

fn status_column(line: &str) -> &str {
    line.split_whitespace().nth(1).unwrap()
}

#[test]
fn show_and_list_describe_finished_failed_running_and_interrupted_jobs() {
    let t = TestJob::new();
    let jobs = t.jobs_dir();
    let jobs = jobs.to_str().unwrap();
    let cfg = t.config(
        "tiny",
        &format!("{TINY}\n[expect]\nmin_test_accuracy = 0.3\nmax_test_loss = 0.0001\n"),
    );
    assert_eq!(
        t.run(&cfg, &["--name", "done"]).code,
        1,
        "max_test_loss is unmet"
    );
    t.run_env(
        &cfg,
        &["--name", "broken"],
        &[("DDPJOB_FAULT", "rank=0,step=20,kind=exit")],
    )
    .fails_with(1, "rank 0")
    // The last line says how to go on, and where a setting's fix goes.
    .fails_with(
        1,
        &format!(
            "`ddpjob resume broken --jobs-dir {jobs}` continues from checkpoint `step-00000016`"
        ),
    )
    .fails_with(
        1,
        &format!("once the cause is fixed (a setting's fix goes in `{jobs}/broken/job.toml`"),
    );

    // One long epoch: its state.json stays at step 0 while it trains.
    let long = t.config(
        "long",
        &TINY
            .replace("epochs = 2", "epochs = 1")
            .replace("train_samples = 512", "train_samples = 2000000")
            .replace("log_every = 4", "log_every = 8"),
    );
    let mut live = t.spawn_run(&long, "jobs", &["--name", "live"]);
    let deadline = Instant::now() + Duration::from_secs(30);
    while t.metrics_lines("live") < 3 {
        assert!(Instant::now() < deadline, "the live job never logged");
        std::thread::sleep(Duration::from_millis(50));
    }

    // Finished, with an unmet expectation.
    let show = t.ddpjob(&["show", "done", "--jobs-dir", jobs]);
    show.success();
    let out = &show.stdout;
    for expected in [
        "job done: finished",
        "model       mlp (hidden = [32])",
        "data        synthetic 512/256",
        "batch       global 32 = 32 per worker x 1 accumulation x 1 worker(s)",
        "progress    epoch 2/2 done, step 32/32 (100%)",
        "last epoch  2: train loss",
        "best        test accuracy",
        "checkpoints 2,",
        "step-00000032  step 32, after epoch 2",
        "(latest)",
        "expect      1 of 2 met",
        "met   min_test_accuracy: test_accuracy",
        "UNMET max_test_loss: test_loss",
        "curves.svg",
    ] {
        assert!(out.contains(expected), "show lacks {expected:?}:\n{out}");
    }
    // Nothing frozen: one count, and summary.json without a trainable one.
    assert!(!out.contains("trained"), "{out}");
    let summary = t.json(&t.job("done").join("summary.json"));
    assert!(summary.get("trainable_parameters").is_none(), "{summary}");
    let spark = out
        .lines()
        .find(|l| l.contains("train loss  "))
        .expect("a sparkline line");
    assert!(spark.chars().any(|c| ('▁'..='█').contains(&c)), "{spark}");

    // Failed: the error and the way on.
    let show = t.ddpjob(&["show", "broken", "--jobs-dir", jobs]);
    show.success();
    for expected in [
        &format!("job broken: failed (`ddpjob resume broken --jobs-dir {jobs}` continues it)"),
        "error       job `broken` failed",
        "rank 0",
        "expect      not checked yet: min_test_accuracy, max_test_loss",
    ] {
        assert!(
            show.stdout.contains(expected),
            "lacks {expected:?}:\n{}",
            show.stdout
        );
    }

    // Failed before its first checkpoint (16 steps, an epoch): a plain resume is refused, so
    // the way on is starting over, and that command works.
    t.run_env(
        &cfg,
        &["--name", "early"],
        &[("DDPJOB_FAULT", "rank=0,step=10,kind=exit")],
    )
    .fails_with(1, "rank 0")
    .fails_with(
        1,
        &format!("`ddpjob resume early --jobs-dir {jobs} --from-scratch` trains it again"),
    )
    .fails_with(1, "no checkpoint was written; once the cause is fixed");
    let show = t.ddpjob(&["show", "early", "--jobs-dir", jobs]);
    let over = format!("ddpjob resume early --jobs-dir {jobs} --from-scratch");
    let expected = format!("job early: failed (no checkpoint yet: `{over}` starts it over)");
    assert!(show.stdout.contains(&expected), "{}", show.stdout);
    // Exit 1 for the unmet max_test_loss, as `done`'s; but the job ran to its end.
    t.ddpjob(&["resume", "early", "--jobs-dir", jobs, "--from-scratch"])
        .fails_with(1, "max_test_loss");
    assert_eq!(
        t.json(&t.job("early").join("state.json"))["status"],
        "finished"
    );

    // Running: the live launcher's pid, progress so far (its latest logged step at least).
    let logged = t
        .metrics("live")
        .iter()
        .filter_map(|m| m["step"].as_u64())
        .max()
        .unwrap();
    assert!(logged > 0);
    let show = t.ddpjob(&["show", "live", "--jobs-dir", jobs]);
    show.success();
    let pid = live.child.id();
    assert!(
        show.stdout
            .contains(&format!("job live: running (launcher pid {pid})")),
        "{}",
        show.stdout
    );
    let progress = show
        .stdout
        .lines()
        .find(|l| l.contains("progress    epoch "))
        .unwrap_or_else(|| panic!("{}", show.stdout));
    let step: u64 = progress
        .split("step ")
        .nth(1)
        .and_then(|rest| rest.split('/').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{progress}"));
    assert!(step >= logged, "{progress} (logged: step {logged})");

    let list = t.ddpjob(&["list", "--jobs-dir", jobs]);
    list.success();
    assert!(list.stdout.starts_with("NAME"), "{}", list.stdout);
    assert_eq!(status_column(&list_line(&list.stdout, "live")), "running");
    assert_eq!(status_column(&list_line(&list.stdout, "broken")), "failed");
    let done = list_line(&list.stdout, "done");
    assert_eq!(status_column(&done), "finished");
    assert!(
        done.contains("mlp")
            && done.contains("synthetic 512/256")
            && done.contains(" 2/2 ")
            && done.contains("32/32"),
        "{done}"
    );
    assert!(done.contains("1 unmet"), "{done}");

    // The same for scripts: `list --json` holds each job's `show --json` object.
    let listed = t.ddpjob(&["list", "--jobs-dir", jobs, "--json"]);
    listed.success();
    let listed: serde_json::Value = serde_json::from_str(&listed.stdout).unwrap();
    let listed_job = |name: &str| {
        listed
            .as_array()
            .unwrap()
            .iter()
            .find(|j| j["name"] == name)
            .cloned()
            .unwrap_or_else(|| panic!("no {name} in {listed}"))
    };
    let running = listed_job("live");
    assert_eq!(running["status"], "running");
    assert_eq!(running["launcher_pid"], pid);
    let broken = listed_job("broken");
    assert_eq!(broken["status"], "failed");
    assert!(
        broken["error"].as_str().unwrap().contains("rank 0"),
        "{broken}"
    );
    assert_eq!(broken["checkpoints"][0]["step"], 16, "{broken}");
    assert!(broken["summary"].is_null(), "{broken}");
    let shown = t.ddpjob(&["show", "done", "--jobs-dir", jobs, "--json"]);
    shown.success();
    let finished: serde_json::Value = serde_json::from_str(&shown.stdout).unwrap();
    assert_eq!(finished, listed_job("done"));
    for (key, value) in [
        ("status", serde_json::json!("finished")),
        ("arch", "mlp".into()),
        ("data", "synthetic 512/256".into()),
        ("global_batch", 32.into()),
        ("step", 32.into()),
        ("total_steps", 32.into()),
        ("epochs", 2.into()),
        ("metric", "accuracy".into()),
        ("summary", summary.clone()),
    ] {
        assert_eq!(finished[key], value, "{key}: {finished}");
    }
    let accuracy = finished["best"]["test_accuracy"].as_f64().unwrap();
    assert!(accuracy > 0.0 && accuracy <= 1.0, "{finished}");
    let latest: Vec<_> = finished["checkpoints"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c["latest"] == true)
        .collect();
    assert_eq!(latest.len(), 1, "{finished}");
    assert_eq!(latest[0]["name"], "step-00000032");
    // No jobs: an empty array, the same shape.
    let none = t.path("no-jobs-here").display().to_string();
    let empty = t.ddpjob(&["list", "--jobs-dir", &none, "--json"]);
    assert_eq!(empty.success().stdout.trim(), "[]");

    // Interrupted: Ctrl-C to the launcher.
    // SAFETY: SIGINT to the launcher this test spawned.
    unsafe { libc::kill(pid as i32, libc::SIGINT) };
    live.wait_for(Duration::from_secs(20))
        .expect("the launcher did not stop")
        .fails_with(130, "interrupted by SIGINT");
    let show = t.ddpjob(&["show", "live", "--jobs-dir", jobs]);
    assert!(
        show.stdout.contains(&format!(
            "job live: interrupted (`ddpjob resume live --jobs-dir {jobs}` continues it)"
        )),
        "{}",
        show.stdout
    );
    assert!(show.stdout.contains("(latest)"), "{}", show.stdout);
    let list = t.ddpjob(&["list", "--jobs-dir", jobs]);
    assert_eq!(
        status_column(&list_line(&list.stdout, "live")),
        "interrupted"
    );
}

#[test]
fn a_running_job_whose_launcher_was_killed_shows_as_stale() {
    let t = TestJob::new();
    let jobs = t.jobs_dir();
    let jobs = jobs.to_str().unwrap();
    let long = t.config("long", &TINY.replace("epochs = 2", "epochs = 100000"));
    let mut launcher = t.spawn_run(&long, "jobs", &["--name", "orphan"]);
    let deadline = Instant::now() + Duration::from_secs(30);
    // Its first checkpoint (epoch 1's), which the hint below names; waiting for a logged line
    // instead raced it on a loaded machine (the kill landed between epoch 1's evaluation and
    // its checkpoint, and the hint rightly said to start over).
    while !t.job("orphan").join("checkpoints/latest").is_file() {
        assert!(Instant::now() < deadline, "the job never checkpointed");
        std::thread::sleep(Duration::from_millis(50));
    }
    // SIGKILL: the launcher cannot record anything; then its worker, so nothing is left.
    let _ = launcher.child.kill();
    let _ = launcher.child.wait();
    for (pid, _) in workers_under(&t.job("orphan")) {
        // SAFETY: kill(2) of a worker this test started, found by its environment.
        unsafe { libc::kill(pid as i32, libc::SIGKILL) };
    }
    assert_eq!(
        t.json(&t.job("orphan").join("state.json"))["status"],
        "running"
    );
    let show = t.ddpjob(&["show", "orphan", "--jobs-dir", jobs]);
    assert!(
        show.stdout
            .contains("stale: state.json says running, but its launcher")
            && show.stdout.contains(&format!(
                "`ddpjob resume orphan --jobs-dir {jobs}` continues it"
            )),
        "{}",
        show.stdout
    );
    let list = t.ddpjob(&["list", "--jobs-dir", jobs]);
    assert_eq!(status_column(&list_line(&list.stdout, "orphan")), "stale");
    // As JSON: stale, and no pid (the dead launcher's may be another process's by now).
    let shown = t.ddpjob(&["show", "orphan", "--jobs-dir", jobs, "--json"]);
    let orphan: serde_json::Value = serde_json::from_str(&shown.success().stdout).unwrap();
    assert_eq!(orphan["status"], "stale", "{orphan}");
    assert!(orphan["launcher_pid"].is_null(), "{orphan}");

    t.ddpjob(&["show", "nothing", "--jobs-dir", jobs])
        .fails_with(2, "no job `nothing` in");
}
