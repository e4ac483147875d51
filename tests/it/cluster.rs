//! Launchers placed by a scheduler's environment instead of flags: two `ddpjob run` on this
//! machine with exactly the variables `srun` or a PyTorchJob would give each node.

use std::time::Duration;

use crate::common::{TINY, TestJob, free_port, load_weights, max_abs_diff};

/// A Slurm job id whose derived port (15000 + id mod 20000) is free here now.
fn job_id_with_a_free_port() -> u32 {
    let start = std::process::id() % 20000;
    (0..20000)
        .map(|i| (start + i) % 20000)
        .find(|j| std::net::TcpListener::bind(("127.0.0.1", 15000 + *j as u16)).is_ok())
        .expect("a free port in 15000..35000")
}

/// Two nodes that learn their place only from `env_of(node)`, then the same job as one node
/// with two workers: the weights must agree.
fn two_nodes_from_env(t: &TestJob, env_of: &dyn Fn(&str) -> Vec<(&'static str, String)>) {
    let cfg = t.config("nodes", TINY);
    let node = |rank: &str, jobs: &str| {
        let vars = env_of(rank);
        let vars: Vec<(&str, &str)> = vars.iter().map(|(k, v)| (*k, v.as_str())).collect();
        t.spawn_run_env(&cfg, jobs, &["--nproc-per-node", "1"], &vars)
    };
    let mut n1 = node("1", "jobs-node1");
    std::thread::sleep(Duration::from_millis(300));
    let mut n0 = node("0", "jobs-node0");
    let out0 = n0.wait_for(Duration::from_secs(120)).expect("node 0 hung");
    out0.success();
    n1.wait_for(Duration::from_secs(120))
        .expect("node 1 hung")
        .success();
    assert!(
        out0.stderr.contains("note: --nnodes 2 from"),
        "node 0 says where its place came from: {}",
        out0.stderr
    );
    assert!(t.path("jobs-node1/nodes/logs/rank-1.log").is_file());
    assert_eq!(
        t.json(&t.path("jobs-node0/nodes/state.json"))["world_size"],
        2
    );
    t.run(&cfg, &["--name", "single", "--nproc-per-node", "2"])
        .success();
    let diff = max_abs_diff(
        &load_weights(&t.path("jobs-node0/nodes/model.safetensors")),
        &load_weights(&t.job("single").join("model.safetensors")),
    );
    assert!(diff <= 1e-6, "two nodes and one differ by {diff}");
}

#[test]
fn srun_tasks_find_their_nodes_from_slurm_alone() {
    let t = TestJob::new();
    let job = job_id_with_a_free_port().to_string();
    two_nodes_from_env(&t, &|node| {
        vec![
            ("SLURM_JOB_ID", job.clone()),
            ("SLURM_STEP_ID", "0".into()),
            ("SLURM_JOB_NUM_NODES", "2".into()),
            ("SLURM_NTASKS", "2".into()),
            ("SLURM_NODEID", node.into()),
            ("SLURM_JOB_NODELIST", "127.0.0.[1-2]".into()),
        ]
    });
}

#[test]
fn pytorchjob_pods_find_their_nodes_from_torchrun_variables() {
    let t = TestJob::new();
    let port = free_port().to_string();
    two_nodes_from_env(&t, &|node| {
        vec![
            ("PET_NNODES", "2".into()),
            ("PET_NODE_RANK", node.into()),
            ("PET_MASTER_ADDR", "127.0.0.1".into()),
            ("PET_MASTER_PORT", port.clone()),
            // What the operator sets for every pod besides: pods, not processes.
            ("MASTER_ADDR", "127.0.0.1".into()),
            ("MASTER_PORT", port.clone()),
            ("WORLD_SIZE", "2".into()),
            ("RANK", node.into()),
        ]
    });
}

#[test]
fn several_srun_tasks_per_node_are_refused_before_anything_is_created() {
    let t = TestJob::new();
    let cfg = t.config("many", TINY);
    let env = [
        ("SLURM_JOB_ID", "77"),
        ("SLURM_STEP_ID", "0"),
        ("SLURM_JOB_NUM_NODES", "1"),
        ("SLURM_NTASKS", "4"),
        ("SLURM_NODEID", "0"),
        ("SLURM_JOB_NODELIST", "n1"),
    ];
    t.run_env(&cfg, &[], &env)
        .fails_with(2, "srun started 4 tasks on 1 node(s)")
        .fails_with(2, "--ntasks-per-node=1");
    assert!(!t.job("many").exists());
    let bad = [("SLURM_JOB_NODELIST", "n[1-2"), ("SLURM_NTASKS", "1")];
    let env: Vec<_> = env
        .iter()
        .filter(|(k, _)| !bad.iter().any(|(b, _)| b == k))
        .chain(bad.iter())
        .copied()
        .collect();
    t.run_env(&cfg, &[], &env)
        .fails_with(2, r#"SLURM_JOB_NODELIST="n[1-2""#);
}
