use super::*;

fn hosts(list: &str) -> Vec<String> {
    expand_hostlist(list).unwrap()
}

#[test]
fn hostlists_expand_as_scontrol_show_hostnames() {
    assert_eq!(hosts("n1"), ["n1"]);
    assert_eq!(hosts("n[1-2]"), ["n1", "n2"]);
    assert_eq!(hosts("gpu[01-03,07]"), ["gpu01", "gpu02", "gpu03", "gpu07"]);
    assert_eq!(
        hosts("gpu[09-11],login1"),
        ["gpu09", "gpu10", "gpu11", "login1"]
    );
    assert_eq!(hosts("a1,b[2,4]c"), ["a1", "b2c", "b4c"]);
    assert_eq!(hosts("r[1-2]n[1-2]"), ["r1n1", "r1n2", "r2n1", "r2n2"]);
    assert_eq!(hosts("127.0.0.[1-2]"), ["127.0.0.1", "127.0.0.2"]);
    for bad in [
        "", "n[1-2", "n1-2]", "n[a-b]", "n[3-1]", "n[[1]]", "a,,b", "n[]", "n[1-]",
    ] {
        assert!(expand_hostlist(bad).is_err(), "{bad:?} was accepted");
    }
}

fn srun(node: &str) -> Vec<(&'static str, String)> {
    vec![
        ("SLURM_JOB_ID", "4242".into()),
        ("SLURM_STEP_ID", "0".into()),
        ("SLURM_JOB_NUM_NODES", "2".into()),
        ("SLURM_NTASKS", "2".into()),
        ("SLURM_NODEID", node.into()),
        ("SLURM_JOB_NODELIST", "gpu[07-08]".into()),
    ]
}

fn env(pairs: &[(&'static str, String)]) -> SchedulerEnv {
    let pairs: Vec<(&str, &str)> = pairs.iter().map(|(k, v)| (*k, v.as_str())).collect();
    SchedulerEnv::from_pairs(&pairs)
}

#[test]
fn an_srun_task_takes_its_place_from_slurm_and_flags_win() {
    let r = resolve(&NodeFlags::default(), &env(&srun("1"))).unwrap();
    assert_eq!(r.node.nnodes, 2);
    assert_eq!(r.node.node_rank, 1);
    assert_eq!(r.node.master_addr.as_deref(), Some("gpu07"));
    assert_eq!(r.node.master_port, Some(15000 + 4242));
    let notes = r.notes.join("\n");
    assert!(
        notes.contains("--nnodes 2 from SLURM_JOB_NUM_NODES"),
        "{notes}"
    );
    assert!(notes.contains("--node-rank 1 from SLURM_NODEID"), "{notes}");
    assert!(
        notes.contains("the first node of SLURM_JOB_NODELIST"),
        "{notes}"
    );

    // An explicit flag wins, and the difference is said.
    let flags = NodeFlags {
        master_port: Some(29999),
        ..NodeFlags::default()
    };
    let r = resolve(&flags, &env(&srun("0"))).unwrap();
    assert_eq!(r.node.master_port, Some(29999));
    assert!(
        r.notes
            .iter()
            .any(|n| n.contains("--master-port 29999 given"))
    );
    // A script's MASTER_PORT overrides the port derived from the job id.
    let mut vars = srun("0");
    vars.push(("MASTER_PORT", "23456".into()));
    assert_eq!(
        resolve(&NodeFlags::default(), &env(&vars))
            .unwrap()
            .node
            .master_port,
        Some(23456)
    );
}

#[test]
fn slurm_mistakes_are_refused_with_what_to_do() {
    let fails = |vars: Vec<(&'static str, String)>, says: &str| {
        let e = resolve(&NodeFlags::default(), &env(&vars)).unwrap_err();
        assert!(e.contains(says), "{e}");
    };
    let mut several = srun("0");
    several[3] = ("SLURM_NTASKS", "4".into());
    fails(several, "--ntasks-per-node=1");
    let mut malformed = srun("0");
    malformed[5] = ("SLURM_JOB_NODELIST", "gpu[07-08".into());
    fails(malformed, "SLURM_JOB_NODELIST");
    let mut outside = srun("2");
    outside[4] = ("SLURM_NODEID", "2".into());
    fails(outside, "outside 2 node(s)");
    // The batch script of a 2-node job, without srun: it would run on one node only.
    let batch: Vec<_> = srun("0")
        .into_iter()
        .filter(|(k, _)| *k != "SLURM_STEP_ID")
        .collect();
    fails(batch, "srun --ntasks-per-node=1");
    // A one-node batch script needs no rendezvous: plain single-node defaults.
    let one = env(&[
        ("SLURM_JOB_ID", "7".into()),
        ("SLURM_JOB_NUM_NODES", "1".into()),
    ]);
    let r = resolve(&NodeFlags::default(), &one).unwrap();
    assert_eq!((r.node.nnodes, r.node.master_addr), (1, None));
    // A one-node srun step takes a free port, not the job id's: steps run side by side.
    let step = env(&[
        ("SLURM_JOB_ID", "7".into()),
        ("SLURM_STEP_ID", "1".into()),
        ("SLURM_STEP_NUM_NODES", "1".into()),
        ("SLURM_NODEID", "0".into()),
        ("SLURM_STEP_NODELIST", "gpu01".into()),
    ]);
    let r = resolve(&NodeFlags::default(), &step).unwrap();
    assert_eq!((r.node.nnodes, r.node.master_port), (1, None));
}

#[test]
fn torchrun_and_pod_level_variables_are_read_in_their_order() {
    // Kubeflow's PyTorchJob: PET_* for torchrun's flags win over the pod-level WORLD_SIZE/RANK.
    let pet = env(&[
        ("PET_NNODES", "3".into()),
        ("PET_NODE_RANK", "2".into()),
        ("PET_MASTER_ADDR", "job-master-0".into()),
        ("PET_MASTER_PORT", "23456".into()),
        ("MASTER_ADDR", "job-master-0".into()),
        ("WORLD_SIZE", "12".into()),
        ("RANK", "5".into()),
    ]);
    let r = resolve(&NodeFlags::default(), &pet).unwrap();
    assert_eq!((r.node.nnodes, r.node.node_rank), (3, 2));
    assert_eq!(r.node.master_addr.as_deref(), Some("job-master-0"));
    assert_eq!(r.node.master_port, Some(23456));
    // Only the pod-level convention: WORLD_SIZE pods, this one RANK.
    let pods = env(&[
        ("MASTER_ADDR", "10.0.0.5".into()),
        ("MASTER_PORT", "29500".into()),
        ("WORLD_SIZE", "2".into()),
        ("RANK", "1".into()),
    ]);
    let r = resolve(&NodeFlags::default(), &pods).unwrap();
    assert_eq!((r.node.nnodes, r.node.node_rank), (2, 1));
    assert!(
        r.notes.iter().any(|n| n.contains("WORLD_SIZE (pods)")),
        "{:?}",
        r.notes
    );
    // WORLD_SIZE/RANK without MASTER_ADDR mean nothing here.
    let stray = env(&[("WORLD_SIZE", "8".into()), ("RANK", "3".into())]);
    let r = resolve(&NodeFlags::default(), &stray).unwrap();
    assert_eq!((r.node.nnodes, r.node.node_rank), (1, 0));
    assert!(r.notes.is_empty());
    // Elastic ranges are refused; a fixed "2:2" is fine.
    let elastic = env(&[("PET_NNODES", "1:4".into())]);
    assert!(
        resolve(&NodeFlags::default(), &elastic)
            .unwrap_err()
            .contains("elastic")
    );
    let fixed = env(&[
        ("PET_NNODES", "2:2".into()),
        ("PET_MASTER_ADDR", "m".into()),
    ]);
    assert_eq!(
        resolve(&NodeFlags::default(), &fixed).unwrap().node.nnodes,
        2
    );
}

#[test]
fn a_worker_count_other_than_slurms_gpus_is_refused_for_gpu_jobs() {
    let slurm = env(&[("SLURM_GPUS_ON_NODE", "4".into())]);
    assert!(check_gpus(&slurm, Some(4), true).is_ok());
    assert!(
        check_gpus(&slurm, None, true).is_ok(),
        "auto takes what Slurm gave"
    );
    assert!(
        check_gpus(&slurm, Some(8), false).is_ok(),
        "CPU workers use no GPU"
    );
    let e = check_gpus(&slurm, Some(8), true).unwrap_err();
    assert!(
        e.contains("4 GPU(s) (SLURM_GPUS_ON_NODE)") && e.contains("--gpus-per-node=8"),
        "{e}"
    );
    assert!(check_gpus(&SchedulerEnv::default(), Some(8), true).is_ok());
}
