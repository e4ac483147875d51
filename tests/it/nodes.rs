//! Two launchers on this machine as two nodes sharing one job directory (a shared file
//! system): restarts of the whole group across nodes, `--resume auto` on several nodes, and a
//! node whose launcher dies while the others want to restart.

use std::time::{Duration, Instant};

use crate::common::{
    Background, Run, TINY, TestJob, free_port, load_weights, max_abs_diff, two_node_flags,
};

/// 32 optimizer steps on two workers, a checkpoint every 4.
fn job(t: &TestJob) -> std::path::PathBuf {
    let text = TINY.replace("epochs = 2", "epochs = 4") + "[checkpoint]\nevery_steps = 4\n";
    t.config("pair", &text)
}

/// Node `rank` of two (one worker each) on 127.0.0.1:`port`, with the job directory in
/// `jobs`, extra flags and environment (a fault for its workers).
fn node(
    t: &TestJob,
    cfg: &std::path::Path,
    rank: &str,
    port: &str,
    extra: &[&str],
    env: &[(&str, &str)],
) -> Background {
    let mut flags = two_node_flags(rank, port);
    flags.extend(["--nproc-per-node", "1"].map(String::from));
    flags.extend(extra.iter().map(|s| s.to_string()));
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    t.spawn_run_env(cfg, "jobs", &flags, env)
}

/// Both nodes to the end (node 1 started first, as a scheduler may); their outputs.
fn both(t: &TestJob, cfg: &std::path::Path, extra: &[&str], env1: &[(&str, &str)]) -> [Run; 2] {
    let port = free_port().to_string();
    let mut n1 = node(t, cfg, "1", &port, extra, env1);
    std::thread::sleep(Duration::from_millis(200));
    let mut n0 = node(t, cfg, "0", &port, extra, &[]);
    let out0 = n0.wait_for(Duration::from_secs(180)).expect("node 0 hung");
    let out1 = n1.wait_for(Duration::from_secs(60)).expect("node 1 hung");
    [out0, out1]
}

/// The same job on one node with two workers: what the two nodes must reach.
fn reference(t: &TestJob, cfg: &std::path::Path) -> std::collections::BTreeMap<String, Vec<f32>> {
    t.run(cfg, &["--name", "reference", "--nproc-per-node", "2"])
        .success();
    load_weights(&t.job("reference").join("model.safetensors"))
}

fn assert_same_weights(t: &TestJob, reference: &std::collections::BTreeMap<String, Vec<f32>>) {
    let diff = max_abs_diff(
        &load_weights(&t.job("pair").join("model.safetensors")),
        reference,
    );
    // As in the two-launcher test: bit-identical but for kernels that split work by threads.
    assert!(diff <= 1e-6, "two nodes and the reference differ by {diff}");
}

#[test]
fn a_worker_killed_on_node_1_restarts_every_node_from_the_same_checkpoint() {
    let t = TestJob::new();
    let cfg = job(&t);
    let [out0, out1] = both(
        &t,
        &cfg,
        &["--set", "distributed.max_restarts=1"],
        &[("DDPJOB_FAULT", "rank=1,step=10,kind=kill")],
    );
    out0.success();
    out1.success();
    for out in [&out0, &out1] {
        assert!(
            out.stderr
                .contains("restart 1/1 of job `pair` from checkpoint")
                && out.stderr.contains("step-00000008")
                && out.stderr.contains("after: node 1: rank 1 (pid")
                && out.stderr.contains("was killed by signal 9"),
            "each node restarts from step 8, naming node 1's rank 1: {}",
            out.stderr
        );
    }
    let state = t.json(&t.job("pair").join("state.json"));
    assert_eq!(state["status"], "finished");
    assert_eq!(state["restarts"], 1);
    assert_same_weights(&t, &reference(&t, &cfg));
}

#[test]
fn two_nodes_continue_with_resume_auto_and_then_say_they_are_done() {
    let t = TestJob::new();
    let cfg = job(&t);
    let auto = ["--resume", "auto"];
    // A preemption on node 1: both nodes stop after the same step, with a checkpoint.
    let [out0, out1] = both(
        &t,
        &cfg,
        &auto,
        &[("DDPJOB_FAULT", "rank=1,step=13,kind=preempt")],
    );
    assert_eq!(
        (out0.code, out1.code),
        (143, 143),
        "{}\n{}",
        out0.stderr,
        out1.stderr
    );
    assert_eq!(
        t.json(&t.job("pair").join("state.json"))["status"],
        "interrupted"
    );

    // The scheduler starts the same command on both nodes again.
    let [out0, out1] = both(&t, &cfg, &auto, &[]);
    out0.success();
    out1.success();
    assert!(
        out0.stdout.contains("resuming job `pair` from"),
        "{}",
        out0.stdout
    );
    assert_same_weights(&t, &reference(&t, &cfg));

    // And once more: nothing to do, on either node.
    let [out0, out1] = both(&t, &cfg, &auto, &[]);
    out0.success();
    out1.success();
    assert!(out0.stdout.contains("already finished"), "{}", out0.stdout);
    assert!(
        out1.stdout.contains("already finished") && out1.stdout.contains("(node 0 says)"),
        "{}",
        out1.stdout
    );
}

#[test]
fn a_launcher_killed_on_node_1_fails_node_0_within_the_timeout_naming_the_node() {
    let t = TestJob::new();
    let cfg = t.config("pair", &TINY.replace("epochs = 2", "epochs = 100000"));
    let port = free_port().to_string();
    let extra = [
        "--set",
        "distributed.max_restarts=1",
        "--set",
        "distributed.timeout_s=4",
    ];
    let mut n0 = node(&t, &cfg, "0", &port, &extra, &[]);
    let mut n1 = node(&t, &cfg, "1", &port, &extra, &[]);
    let deadline = Instant::now() + Duration::from_secs(60);
    while t.metrics_lines("pair") < 2 {
        assert!(
            Instant::now() < deadline,
            "the nodes never started training"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    n1.child.kill().unwrap();
    let killed = Instant::now();
    let out0 = n0.wait_for(Duration::from_secs(60)).expect("node 0 hung");
    let took = killed.elapsed();
    out0.fails_with(1, "node 1 did not stop its workers within 4 s");
    assert!(took < Duration::from_secs(4 + 8), "took {took:?}");
    assert_eq!(
        t.json(&t.job("pair").join("state.json"))["status"],
        "failed"
    );
    drop(n1);
}

/// A second launcher given a node rank that has joined already (a duplicated pod or srun task)
/// is refused at once, and the job it would have disturbed trains on and stops cleanly.
#[test]
fn a_duplicated_node_rank_is_refused_and_the_job_goes_on() {
    let t = TestJob::new();
    let cfg = t.config("pair", &TINY.replace("epochs = 2", "epochs = 100000"));
    let port = free_port().to_string();
    let extra = ["--set", "distributed.timeout_s=10"];
    let mut n0 = node(&t, &cfg, "0", &port, &extra, &[]);
    let mut n1 = node(&t, &cfg, "1", &port, &extra, &[]);
    let training = |lines: usize| {
        let deadline = Instant::now() + Duration::from_secs(60);
        while t.metrics_lines("pair") < lines {
            assert!(Instant::now() < deadline, "the nodes do not train");
            std::thread::sleep(Duration::from_millis(50));
        }
    };
    training(2);
    let mut again = node(&t, &cfg, "1", &port, &extra, &[]);
    let refused = again.wait_for(Duration::from_secs(30)).expect("hung");
    refused.fails_with(2, "node 1 has already joined job `pair` at 127.0.0.1:");
    let lines = t.metrics_lines("pair");
    training(lines + 2);
    for launcher in [&n0, &n1] {
        unsafe { libc::kill(launcher.child.id() as i32, libc::SIGINT) };
    }
    let out0 = n0.wait_for(Duration::from_secs(60)).expect("node 0 hung");
    out0.fails_with(130, "interrupted by SIGINT");
    n1.wait_for(Duration::from_secs(60)).expect("node 1 hung");
}

/// Ctrl-C on node 0 while it waits for a node that never comes ends the wait at once, not
/// after `distributed.timeout_s`.
#[test]
fn a_stop_signal_ends_node_0s_wait_for_the_other_nodes() {
    let t = TestJob::new();
    let cfg = job(&t);
    let port = free_port().to_string();
    let extra = ["--set", "distributed.timeout_s=600"];
    let mut n0 = node(&t, &cfg, "0", &port, &extra, &[]);
    // Its worker started (a child of the launcher), then a moment to reach the rendezvous.
    let pid = n0.child.id();
    let children = format!("/proc/{pid}/task/{pid}/children");
    let deadline = Instant::now() + Duration::from_secs(60);
    while std::fs::read_to_string(&children)
        .unwrap_or_default()
        .trim()
        .is_empty()
    {
        assert!(Instant::now() < deadline, "node 0's worker never started");
        std::thread::sleep(Duration::from_millis(50));
    }
    // (It says it waits after a second of waiting.)
    std::thread::sleep(Duration::from_millis(3000));
    unsafe { libc::kill(n0.child.id() as i32, libc::SIGINT) };
    let out0 = n0
        .wait_for(Duration::from_secs(60))
        .expect("node 0 went on waiting for node 1");
    out0.fails_with(130, "interrupted by SIGINT");
    assert!(
        out0.stderr
            .contains("while ranks [1] (nodes [1]) had not joined yet"),
        "{}",
        out0.stderr
    );
    // It said what it was waiting for, not nothing.
    let all = format!("{}{}", out0.stdout, out0.stderr);
    assert!(
        all.contains("waiting for node(s) [1] to join (up to 600 s"),
        "{all}"
    );
}

/// Port 0 (any free one) on several nodes: the others could never find it; refused at once.
#[test]
fn a_random_master_port_is_refused_for_several_nodes() {
    let t = TestJob::new();
    let cfg = job(&t);
    let flags = two_node_flags("0", "0");
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    t.run(&cfg, &flags).fails_with(
        2,
        "--master-port 0 (any free port) cannot be found by the other nodes",
    );
    assert!(!t.job("pair").exists());
}
