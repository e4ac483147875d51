//! Data parallelism end to end: worker processes, the ring, the store, failures, two nodes.

use std::time::{Duration, Instant};

use crate::common::{
    TINY, TestJob, free_port, load_weights, max_abs_diff, two_node_flags, workers_under,
};

/// 2 workers × batch B and 1 worker × batch 2B see the same samples step by step (torch's
/// DistributedSampler) and average to the same gradient, so they end at the same weights.
#[test]
fn two_workers_match_one_worker_with_the_double_batch() {
    let t = TestJob::new();
    let cfg = t.config("eq", TINY);
    // (optimizer, accumulation, epochs): every case takes at least 20 optimizer steps.
    for (optimizer, accumulation, epochs) in
        [("sgd", 1, 3), ("adam", 1, 3), ("sgd", 2, 5), ("adam", 2, 5)]
    {
        let common = |name: String, batch: usize, nproc: usize| -> Vec<String> {
            [
                "--name",
                &name,
                "--set",
                &format!("train.optimizer=\"{optimizer}\""),
                "--set",
                // Momentum for sgd; adam's betas play its part (and refuse it).
                if optimizer == "sgd" {
                    "train.momentum=0.9"
                } else {
                    "train.betas=[0.9, 0.999]"
                },
                "--set",
                &format!("train.accumulation={accumulation}"),
                "--set",
                &format!("train.epochs={epochs}"),
                "--set",
                &format!("train.batch_size={batch}"),
                "--nproc-per-node",
                &nproc.to_string(),
            ]
            .map(String::from)
            .to_vec()
        };
        let two = format!("{optimizer}-acc{accumulation}-2x32");
        let one = format!("{optimizer}-acc{accumulation}-1x64");
        for (name, batch, nproc) in [(&two, 32, 2), (&one, 64, 1)] {
            let args = common(name.clone(), batch, nproc);
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            t.run(&cfg, &args).success();
        }
        let s2 = t.json(&t.job(&two).join("summary.json"));
        let s1 = t.json(&t.job(&one).join("summary.json"));
        assert_eq!(s2["world_size"], 2);
        assert_eq!(s2["steps"], s1["steps"]);
        assert!(s2["steps"].as_u64().unwrap() >= 20, "{s2}");
        let diff = max_abs_diff(
            &load_weights(&t.job(&two).join("model.safetensors")),
            &load_weights(&t.job(&one).join("model.safetensors")),
        );
        assert!(diff < 1e-5, "{two} vs {one}: weights differ by {diff}");
        // Evaluation shards the test set without padding: the same test loss, each sample once.
        let (l2, l1) = (
            s2["test_loss"].as_f64().unwrap(),
            s1["test_loss"].as_f64().unwrap(),
        );
        assert!((l2 - l1).abs() < 1e-4, "test loss {l2} vs {l1}");
        assert_eq!(s2["test_accuracy"], s1["test_accuracy"]);
    }
    // Not trivially equal: a different seed on one worker ends far away.
    t.run(
        &cfg,
        &[
            "--name",
            "other-seed",
            "--set",
            "seed=99",
            "--set",
            "train.epochs=3",
            "--set",
            "train.batch_size=64",
        ],
    )
    .success();
    let far = max_abs_diff(
        &load_weights(&t.job("other-seed").join("model.safetensors")),
        &load_weights(&t.job("adam-acc1-1x64").join("model.safetensors")),
    );
    assert!(far > 1e-2, "a different seed should end elsewhere ({far})");
}

#[test]
fn every_rank_logs_to_its_own_file_and_rank_0_to_the_terminal() {
    let t = TestJob::new();
    let cfg = t.config("logs", TINY);
    let run = t.run(&cfg, &["--nproc-per-node", "3"]);
    run.success();
    for rank in 0..3 {
        let log =
            std::fs::read_to_string(t.job("logs").join(format!("logs/rank-{rank}.log"))).unwrap();
        assert!(
            log.contains(&format!("rank {rank}/3")),
            "rank {rank} log:\n{log}"
        );
        assert!(log.contains("epoch 2/2 done"), "rank {rank} log:\n{log}");
    }
    assert!(
        run.stdout.contains("rank 0/3") && !run.stdout.contains("rank 1/3"),
        "{}",
        run.stdout
    );
    let state = t.json(&t.job("logs").join("state.json"));
    assert_eq!(state["world_size"], 3);
    assert_eq!(state["status"], "finished");
}

/// A long job, so there is time to do things to it while it runs.
fn long_job(t: &TestJob) -> std::path::PathBuf {
    t.config(
        "long",
        &TINY
            .replace("epochs = 2", "epochs = 100000")
            .replace("log_every = 4", "log_every = 1000000"),
    )
}

fn wait_until_training(t: &TestJob, job: &str, workers: usize) -> Vec<(u32, usize)> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let found = workers_under(&t.job(job));
        let trained = t.job(job).join("metrics.jsonl").exists();
        if found.len() == workers && trained {
            return found;
        }
        assert!(
            Instant::now() < deadline,
            "workers never started training: {found:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn killing_one_worker_fails_the_job_naming_it_and_leaves_no_process() {
    let t = TestJob::new();
    let cfg = long_job(&t);
    let mut launcher = t.spawn_run(&cfg, "jobs", &["--nproc-per-node", "2", "--name", "victim"]);
    let workers = wait_until_training(&t, "victim", 2);
    let (pid, _) = workers
        .iter()
        .find(|(_, rank)| *rank == 1)
        .copied()
        .unwrap();
    let killed_at = Instant::now();
    // SAFETY: a plain kill(2) of a process this test found by its environment.
    assert_eq!(unsafe { libc::kill(pid as i32, libc::SIGKILL) }, 0);
    let run = launcher
        .wait_for(Duration::from_secs(20))
        .expect("the launcher did not exit within 20 s of a worker's death");
    assert!(killed_at.elapsed() < Duration::from_secs(20));
    run.fails_with(1, "rank 1")
        .fails_with(1, "killed by signal 9")
        .fails_with(1, "rank-1.log");
    assert!(
        workers_under(&t.job("victim")).is_empty(),
        "processes left: {:?}",
        workers_under(&t.job("victim"))
    );
    let state = t.json(&t.job("victim").join("state.json"));
    assert_eq!(state["status"], "failed");
    assert!(
        state["error"].as_str().unwrap().contains("rank 1"),
        "{state}"
    );
}

#[test]
fn interrupting_the_launcher_stops_every_worker() {
    let t = TestJob::new();
    let cfg = long_job(&t);
    let mut launcher = t.spawn_run(
        &cfg,
        "jobs",
        &["--nproc-per-node", "2", "--name", "stopped"],
    );
    wait_until_training(&t, "stopped", 2);
    // SAFETY: SIGINT to the launcher we spawned, as Ctrl-C would send.
    unsafe { libc::kill(launcher.child.id() as i32, libc::SIGINT) };
    let run = launcher
        .wait_for(Duration::from_secs(20))
        .expect("launcher did not stop");
    // Every worker finished its step, rank 0 checkpointed it, and resume is offered.
    run.fails_with(130, "interrupted by SIGINT")
        .fails_with(130, "every worker stopped after checkpoint `step-")
        .fails_with(130, "continue with `ddpjob resume stopped --jobs-dir");
    let latest = std::fs::read_to_string(t.job("stopped").join("checkpoints/latest")).unwrap();
    assert!(
        t.job("stopped")
            .join("checkpoints")
            .join(latest.trim())
            .join("MANIFEST")
            .exists()
    );
    assert!(workers_under(&t.job("stopped")).is_empty());
    assert_eq!(
        t.json(&t.job("stopped").join("state.json"))["status"],
        "interrupted"
    );
}

#[test]
fn two_single_node_jobs_at_once_do_not_collide() {
    let t = TestJob::new();
    let cfg = t.config("pair", TINY);
    let mut a = t.spawn_run(&cfg, "jobs", &["--nproc-per-node", "2", "--name", "a"]);
    let mut b = t.spawn_run(&cfg, "jobs", &["--nproc-per-node", "2", "--name", "b"]);
    a.wait_for(Duration::from_secs(120))
        .expect("job a hung")
        .success();
    b.wait_for(Duration::from_secs(120))
        .expect("job b hung")
        .success();
    // Same config, same seed: two independent jobs end at the same weights.
    let diff = max_abs_diff(
        &load_weights(&t.job("a").join("model.safetensors")),
        &load_weights(&t.job("b").join("model.safetensors")),
    );
    assert_eq!(diff, 0.0);
}

#[test]
fn a_taken_master_port_is_a_clear_error_and_creates_nothing() {
    let t = TestJob::new();
    let cfg = t.config("port", TINY);
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port().to_string();
    t.run(&cfg, &["--master-port", &port])
        .fails_with(2, &format!("127.0.0.1:{port}"))
        .fails_with(2, "--master-port");
    assert!(!t.job("port").exists());
}

fn strs(args: &[String]) -> Vec<&str> {
    args.iter().map(String::as_str).collect()
}

/// torchrun's multi-node form on one machine: node 0 hosts the store, node 1 joins it.
#[test]
fn two_nodes_train_together_like_one_node_with_two_workers() {
    let t = TestJob::new();
    let cfg = t.config("nodes", TINY);
    let port = free_port().to_string();
    let node = |rank: &str, jobs: &str| {
        let mut flags = two_node_flags(rank, &port);
        flags.extend(["--nproc-per-node".into(), "1".into()]);
        t.spawn_run(&cfg, jobs, &strs(&flags))
    };
    // Node 1 first: it waits for node 0's store.
    let mut n1 = node("1", "jobs-node1");
    std::thread::sleep(Duration::from_millis(300));
    let mut n0 = node("0", "jobs-node0");
    n0.wait_for(Duration::from_secs(120))
        .expect("node 0 hung")
        .success();
    n1.wait_for(Duration::from_secs(120))
        .expect("node 1 hung")
        .success();
    assert!(t.path("jobs-node1/nodes/logs/rank-1.log").is_file());
    assert!(!t.path("jobs-node0/nodes/logs/rank-1.log").exists());

    t.run(&cfg, &["--name", "single", "--nproc-per-node", "2"])
        .success();
    let diff = max_abs_diff(
        &load_weights(&t.path("jobs-node0/nodes/model.safetensors")),
        &load_weights(&t.job("single").join("model.safetensors")),
    );
    // Bit-identical here; a tolerance only for kernels that split work by thread count.
    assert!(
        diff <= 1e-6,
        "two nodes and one node with two workers differ by {diff}"
    );
    assert_eq!(
        t.json(&t.path("jobs-node0/nodes/state.json"))["world_size"],
        2
    );
}

#[test]
fn a_node_with_another_config_or_no_token_is_refused() {
    let t = TestJob::new();
    let cfg = long_job(&t);
    let other = t.config("other", &TINY.replace("seed = 3", "seed = 4"));
    let port = free_port().to_string();
    let mut flags0 = two_node_flags("0", &port);
    flags0.extend(["--set", "distributed.timeout_s=5"].map(String::from));
    let mut node0 = t.spawn_run(&cfg, "jobs", &strs(&flags0));
    // Let node 0's store come up.
    let deadline = Instant::now() + Duration::from_secs(20);
    while !t.job("long").join("state.json").exists() {
        assert!(Instant::now() < deadline, "node 0 never created its job");
        std::thread::sleep(Duration::from_millis(50));
    }
    let mut args1 = vec!["run".to_string(), other.display().to_string()];
    args1.extend(two_node_flags("1", &port));
    args1.extend(["--name", "long", "--jobs-dir"].map(String::from));
    args1.push(t.path("jobs1").display().to_string());
    let full = strs(&args1);
    t.ddpjob(&full)
        .fails_with(2, "refused")
        .fails_with(2, "wrong job token");

    // A raw connection that does not present the token gets a refusal, not a hang.
    use std::io::{Read, Write};
    let mut raw = std::net::TcpStream::connect(format!("127.0.0.1:{port}")).unwrap();
    raw.write_all(b"DDPJOB-STORE/1\n\x05\x00\x00\x00guess")
        .unwrap();
    let mut reply = Vec::new();
    raw.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    raw.read_to_end(&mut reply).unwrap();
    assert!(
        String::from_utf8_lossy(&reply).contains("REFUSED"),
        "{reply:?}"
    );
    // Node 0's ranks, waiting for a node 1 that will not come, say who was refused.
    node0
        .wait_for(Duration::from_secs(60))
        .expect("node 0 hung")
        .fails_with(
            1,
            "did not join within 5 s (distributed.timeout_s); a launcher on 127.0.0.1 was refused",
        );
}

/// DistributedSampler's two ways with a tail that does not divide: pad by wrapping around
/// (every sample seen, two ranks see 2 × 256), or drop it (2 × 255).
#[test]
fn an_uneven_tail_is_padded_or_dropped_as_torch_does() {
    let t = TestJob::new();
    let cfg = t.config(
        "tail",
        &TINY.replace("train_samples = 512", "train_samples = 511"),
    );
    for (drop_last, samples) in [("false", 512), ("true", 510)] {
        let name = format!("drop-{drop_last}");
        t.run(
            &cfg,
            &[
                "--name",
                &name,
                "--nproc-per-node",
                "2",
                "--set",
                "train.epochs=1",
                "--set",
                &format!("data.drop_last={drop_last}"),
            ],
        )
        .success();
        let summary = t.json(&t.job(&name).join("summary.json"));
        assert_eq!(
            summary["samples"], samples,
            "drop_last = {drop_last}: {summary}"
        );
    }
    // Dropping a tail that is all there is leaves no step: refused before the job exists
    // (by `validate` too), not a job that trains nothing.
    let one = [
        "--set",
        "data.synthetic.train_samples=1",
        "--set",
        "data.drop_last=true",
    ];
    let why = "data.drop_last = true drops the 1 training sample(s), fewer than the 2 ranks";
    t.run(
        &cfg,
        &[&one[..], &["--name", "empty", "--nproc-per-node", "2"]].concat(),
    )
    .fails_with(2, why);
    assert!(!t.job("empty").exists());
    let cfg = cfg.to_str().unwrap();
    t.ddpjob(&[&["validate", cfg, "--nproc-per-node", "2"][..], &one[..]].concat())
        .fails_with(2, why);
}

#[test]
fn a_node_that_never_comes_names_the_missing_ranks_within_the_timeout() {
    let t = TestJob::new();
    let cfg = t.config("alone", TINY);
    let port = free_port().to_string();
    let started = Instant::now();
    let mut flags = two_node_flags("0", &port);
    flags.extend(["--nproc-per-node", "2", "--set", "distributed.timeout_s=2"].map(String::from));
    let run = t.run(&cfg, &strs(&flags));
    run.fails_with(1, "ranks [2, 3] (nodes [1]) did not join within 2 s");
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "took {:?}",
        started.elapsed()
    );
    assert!(workers_under(&t.job("alone")).is_empty());
}
