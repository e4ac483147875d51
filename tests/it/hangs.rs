//! Hangs, a second Ctrl-C, a new world size on resume, write failures and the edges of
//! `ddpjob resume`: each ends with a message that says what happened, never a hang.

use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use crate::common::{Background, Run, TINY, TestJob, workers_under};

fn run_job(t: &TestJob, config: &str, extra: &[&str], env: &[(&str, &str)]) -> Run {
    t.run_env(Path::new(config), extra, env)
}

#[test]
fn a_hung_rank_ends_the_job_within_the_timeout_naming_it_and_the_collective() {
    let t = TestJob::new();
    let cfg = t.config("job", TINY);
    let started = Instant::now();
    let run = run_job(
        &t,
        cfg.to_str().unwrap(),
        &[
            "--nproc-per-node",
            "3",
            "--name",
            "hung",
            "--set",
            "distributed.timeout_s=3",
        ],
        &[("DDPJOB_FAULT", "rank=1,step=5,kind=hang")],
    );
    let took = started.elapsed();
    assert!(took < Duration::from_secs(3 + 7), "took {took:?}");
    run.fails_with(1, "did not complete within 3 s (distributed.timeout_s)")
        .fails_with(1, "collective `all_reduce_mean` #")
        .fails_with(1, "did not arrive: rank 1 (pid")
        .fails_with(1, "at step 5, computing, not in a collective")
        .fails_with(1, "alive but stuck");
    assert!(workers_under(&t.job("hung")).is_empty());
    assert_eq!(
        t.json(&t.job("hung").join("state.json"))["status"],
        "failed"
    );

    // With a restart allowed, the same hang is survived.
    let run = run_job(
        &t,
        cfg.to_str().unwrap(),
        &[
            "--nproc-per-node",
            "3",
            "--name",
            "revived",
            "--set",
            "distributed.timeout_s=3",
            "--set",
            "distributed.max_restarts=1",
        ],
        &[("DDPJOB_FAULT", "rank=1,step=5,kind=hang")],
    );
    run.success();
    assert!(run.stderr.contains("restart 1/1"), "{}", run.stderr);
    assert!(
        run.stderr.contains("did not arrive: rank 1"),
        "{}",
        run.stderr
    );
}

#[test]
fn a_rank_that_stops_heartbeating_is_found_by_the_launcher() {
    let t = TestJob::new();
    let cfg = t.config("job", TINY);
    let started = Instant::now();
    // One worker: no collective can time out, only the heartbeats show the stall.
    let run = run_job(
        &t,
        cfg.to_str().unwrap(),
        &["--name", "frozen", "--set", "distributed.timeout_s=2"],
        &[("DDPJOB_FAULT", "rank=0,step=3,kind=freeze")],
    );
    assert!(started.elapsed() < Duration::from_secs(2 + 7));
    run.fails_with(1, "rank 0 (pid")
        .fails_with(1, "stopped sending heartbeats")
        .fails_with(1, "distributed.timeout_s = 2");
    assert!(workers_under(&t.job("frozen")).is_empty());
}

/// A frozen rank among two: the other fails waiting for it in a collective, and the report
/// names the frozen one first, not the one that gave up.
#[test]
fn a_frozen_rank_is_named_rather_than_the_rank_that_waited_for_it() {
    let t = TestJob::new();
    let cfg = t.config("job", &TINY.replace("epochs = 2", "epochs = 2000"));
    let run = run_job(
        &t,
        cfg.to_str().unwrap(),
        &[
            "--name",
            "frozen",
            "--nproc-per-node",
            "2",
            "--set",
            "distributed.timeout_s=3",
        ],
        &[("DDPJOB_FAULT", "rank=1,step=40,kind=freeze")],
    );
    run.fails_with(1, "job `frozen` failed: rank 1 (pid")
        .fails_with(1, "stopped sending heartbeats");
    assert!(workers_under(&t.job("frozen")).is_empty());
}

#[test]
fn a_second_ctrl_c_stops_at_once() {
    let t = TestJob::new();
    let cfg = t.config("job", TINY);
    let jobs = t.jobs_dir();
    // Rank 1 hangs at step 3, so the first Ctrl-C cannot reach a step end.
    let child = t
        .command(
            &[
                "run",
                cfg.to_str().unwrap(),
                "--name",
                "stuck",
                "--nproc-per-node",
                "2",
            ],
            &[("DDPJOB_FAULT", "rank=1,step=3,kind=hang")],
        )
        .arg("--jobs-dir")
        .arg(&jobs)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut launcher = Background { child };
    let deadline = Instant::now() + Duration::from_secs(20);
    while !std::fs::read_to_string(t.job("stuck").join("logs/rank-1.log"))
        .unwrap_or_default()
        .contains("injecting Hang")
    {
        assert!(Instant::now() < deadline, "the hang never came");
        std::thread::sleep(Duration::from_millis(20));
    }
    let pid = launcher.child.id() as i32;
    // SAFETY: SIGINT to the launcher this test spawned.
    unsafe { libc::kill(pid, libc::SIGINT) };
    assert!(
        launcher.wait_for(Duration::from_millis(800)).is_none(),
        "the first Ctrl-C should wait for the step to end"
    );
    let second = Instant::now();
    // SAFETY: as above.
    unsafe { libc::kill(pid, libc::SIGINT) };
    let run = launcher
        .wait_for(Duration::from_secs(5))
        .expect("a second Ctrl-C must stop the job at once");
    assert!(second.elapsed() < Duration::from_secs(3));
    run.fails_with(130, "interrupted by SIGINT");
    assert!(workers_under(&t.job("stuck")).is_empty());
    assert_eq!(
        t.json(&t.job("stuck").join("state.json"))["status"],
        "interrupted"
    );
}

/// Every sample index each rank's trace lists for `epoch`.
fn traced(t: &TestJob, job: &str, epoch: usize) -> Vec<usize> {
    let mut seen = Vec::new();
    for entry in std::fs::read_dir(t.job(job).join("logs"))
        .unwrap()
        .flatten()
    {
        let name = entry.file_name().to_string_lossy().into_owned();
        if !name.starts_with("samples-rank-") {
            continue;
        }
        for line in std::fs::read_to_string(entry.path()).unwrap().lines() {
            let mut fields = line.split(' ').map(|f| f.parse::<usize>().unwrap());
            if fields.next() == Some(epoch) {
                fields.next();
                seen.extend(fields);
            }
        }
    }
    seen.sort_unstable();
    seen
}

#[test]
fn resuming_on_another_world_size_covers_the_rest_of_the_epoch_exactly_once() {
    let t = TestJob::new();
    // 482 samples: 2 ranks × batch 8 take 16 per step; after 5 steps 402 are left, 134 for
    // each of 3 ranks, so neither part needs padding.
    let text = TINY
        .replace("train_samples = 512", "train_samples = 482")
        .replace("batch_size = 32", "batch_size = 8");
    let cfg = t.config("job", &text);
    let trace = [("DDPJOB_TRACE_SAMPLES", "1")];
    run_job(
        &t,
        cfg.to_str().unwrap(),
        &["--nproc-per-node", "2", "--name", "grow"],
        &[("DDPJOB_FAULT", "rank=0,step=5,kind=preempt"), trace[0]],
    )
    .fails_with(143, "after checkpoint `step-00000005`");
    let jobs = t.jobs_dir().to_string_lossy().into_owned();
    let run: Run = t
        .command(
            &[
                "resume",
                "grow",
                "--jobs-dir",
                &jobs,
                "--nproc-per-node",
                "3",
            ],
            &trace,
        )
        .output()
        .unwrap()
        .into();
    run.success();
    assert!(
        run.stdout.contains("world size changed from 2 to 3")
            && run.stdout.contains("global batch 16 -> 24"),
        "{}",
        run.stdout
    );
    assert_eq!(traced(&t, "grow", 0), (0..482).collect::<Vec<_>>());
    // Epoch 2 runs on 3 ranks alone: 482 padded to 483, one sample twice, as torch pads.
    let second = traced(&t, "grow", 1);
    assert_eq!(second.len(), 483);
    let mut distinct = second.clone();
    distinct.dedup();
    assert_eq!(distinct, (0..482).collect::<Vec<_>>());
    let state = t.json(&t.job("grow").join("state.json"));
    assert_eq!(
        (state["status"].as_str(), state["world_size"].as_u64()),
        (Some("finished"), Some(3))
    );
}

#[test]
fn a_global_batch_survives_a_resume_on_another_world_size() {
    let t = TestJob::new();
    // 480 samples, 16 a step on any world size: 30 steps an epoch. Preempted after 5 steps on
    // 2 workers of 8, resumed on 4 workers of 4: still 16 a step, still 60 steps in all.
    let text = TINY
        .replace("train_samples = 512", "train_samples = 480")
        .replace("batch_size = 32", "global_batch_size = 16");
    let cfg = t.config("job", &text);
    let trace = [("DDPJOB_TRACE_SAMPLES", "1")];
    run_job(
        &t,
        cfg.to_str().unwrap(),
        &["--nproc-per-node", "2", "--name", "global"],
        &[("DDPJOB_FAULT", "rank=0,step=5,kind=preempt"), trace[0]],
    )
    .fails_with(143, "after checkpoint `step-00000005`");
    let jobs = t.jobs_dir().to_string_lossy().into_owned();
    let resume = |nproc: &str| -> Run {
        t.command(
            &[
                "resume",
                "global",
                "--jobs-dir",
                &jobs,
                "--nproc-per-node",
                nproc,
            ],
            &trace,
        )
        .output()
        .unwrap()
        .into()
    };
    // 3 workers cannot share 16 samples: refused before anything runs.
    let refused = resume("3");
    assert_eq!(refused.code, 2, "{}", refused.stderr);
    assert!(
        refused
            .stderr
            .contains("3 workers cannot share evenly: run on 1, 2, 4, 8, 16"),
        "{}",
        refused.stderr
    );
    let run = resume("4");
    run.success();
    assert!(
        run.stdout.contains("world size changed from 2 to 4")
            && run.stdout.contains("global batch 16 kept"),
        "{}",
        run.stdout
    );
    assert_eq!(traced(&t, "global", 0), (0..480).collect::<Vec<_>>());
    let state = t.json(&t.job("global").join("state.json"));
    assert_eq!(
        (
            state["status"].as_str(),
            state["world_size"].as_u64(),
            state["step"].as_u64()
        ),
        (Some("finished"), Some(4), Some(60))
    );
    let shown: Run = t
        .command(&["show", "global", "--jobs-dir", &jobs], &[])
        .output()
        .unwrap()
        .into();
    assert!(
        shown
            .stdout
            .contains("global 16 = 4 per worker x 1 accumulation x 4 worker(s)"),
        "{}",
        shown.stdout
    );
    // The frozen job.toml keeps the global batch, not the first world size's share.
    let frozen = std::fs::read_to_string(t.job("global").join("job.toml")).unwrap();
    assert!(frozen.contains("global_batch_size = 16") && !frozen.contains("\nbatch_size"));
}

#[test]
fn a_checkpoint_that_cannot_be_written_fails_the_job_and_keeps_the_previous_one() {
    let t = TestJob::new();
    // A model of 70 KB: its checkpoint cannot be written under a 32 KB file-size limit, while
    // logs, metrics and state stay far below it.
    let text = TINY.replace("hidden = [32]", "hidden = [256]").replace(
        "log_every = 4",
        "log_every = 1000\n[checkpoint]\nevery_steps = 4",
    );
    let cfg = t.config("job", &text);
    run_job(
        &t,
        cfg.to_str().unwrap(),
        &["--name", "full"],
        &[("DDPJOB_FAULT", "rank=0,step=6,kind=kill")],
    )
    .fails_with(1, "killed by signal 9");
    let checkpoints = t.job("full").join("checkpoints");
    let before = std::fs::read(checkpoints.join("step-00000004/model.safetensors")).unwrap();
    let jobs = t.jobs_dir().to_string_lossy().into_owned();
    let mut cmd = t.command(&["resume", "full", "--jobs-dir", &jobs], &[]);
    // SAFETY: setrlimit and signal are async-signal-safe; both are inherited by the workers.
    unsafe {
        cmd.pre_exec(|| {
            let limit = libc::rlimit {
                rlim_cur: 32 * 1024,
                rlim_max: 32 * 1024,
            };
            libc::setrlimit(libc::RLIMIT_FSIZE, &limit);
            libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
            Ok(())
        });
    }
    let run: Run = cmd.output().unwrap().into();
    run.fails_with(1, "checkpoint write to")
        .fails_with(1, "any earlier checkpoint is untouched");
    assert!(run.stderr.contains("step-00000008"), "{}", run.stderr);
    assert_eq!(
        std::fs::read_to_string(checkpoints.join("latest"))
            .unwrap()
            .trim(),
        "step-00000004"
    );
    assert_eq!(
        std::fs::read(checkpoints.join("step-00000004/model.safetensors")).unwrap(),
        before
    );
    let leftovers: Vec<_> = std::fs::read_dir(&checkpoints)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n != "latest" && n != "step-00000004")
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
    assert!(workers_under(&t.job("full")).is_empty());
}

#[test]
fn resume_explains_what_it_cannot_do() {
    let t = TestJob::new();
    let cfg = t.config("job", TINY);
    let jobs = t.jobs_dir().to_string_lossy().into_owned();
    let resume = |args: &[&str]| {
        let mut all = vec!["resume", "--jobs-dir", jobs.as_str()];
        all.extend_from_slice(args);
        t.ddpjob(&all)
    };
    resume(&[]).fails_with(2, "no unfinished job in");
    resume(&["ghost"]).fails_with(2, "no job `ghost` in");

    t.run(&cfg, &["--name", "done"]).success();
    let run = resume(&["done"]);
    run.success();
    assert!(
        run.stdout.contains("job `done` already finished"),
        "{}",
        run.stdout
    );

    // Killed before its first checkpoint (every epoch; step 3 is in the first).
    run_job(
        &t,
        cfg.to_str().unwrap(),
        &["--name", "early"],
        &[("DDPJOB_FAULT", "rank=0,step=3,kind=kill")],
    )
    .fails_with(1, "killed by signal 9");
    resume(&["early"])
        .fails_with(2, "job `early` has no usable checkpoint")
        .fails_with(2, "--from-scratch");
    let run = resume(&["early", "--from-scratch"]);
    run.success();
    assert!(
        run.stdout.contains("training again from the start"),
        "{}",
        run.stdout
    );

    // A job that is running cannot be resumed a second time.
    let long = t.config("long", &TINY.replace("epochs = 2", "epochs = 100000"));
    let mut launcher = t.spawn_run(&long, "jobs", &["--name", "busy"]);
    let deadline = Instant::now() + Duration::from_secs(20);
    while !t.job("busy").join("metrics.jsonl").exists() {
        assert!(Instant::now() < deadline, "the job never started");
        std::thread::sleep(Duration::from_millis(20));
    }
    resume(&["busy"]).fails_with(2, "is being run by another ddpjob (pid");
    // SAFETY: SIGTERM to the launcher this test spawned.
    unsafe { libc::kill(launcher.child.id() as i32, libc::SIGTERM) };
    launcher
        .wait_for(Duration::from_secs(20))
        .expect("launcher stopped")
        .fails_with(143, "continue with `ddpjob resume busy --jobs-dir");
}
