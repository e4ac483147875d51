//! The example trainer end to end, as its user runs it: its own binary validates, trains with 2
//! worker processes (re-executions of itself), is stopped by SIGTERM and resumed bit for bit,
//! and meets its `[expect]` threshold; bad options are refused with the file and line.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const BIN: &str = env!("CARGO_BIN_EXE_custom-model");
/// The example's data maker, as its README tells a user to run it.
const MAKE_DATA: &str = env!("CARGO_BIN_EXE_make-data");

/// The job file the example ships, as its README tells a user to run it.
const JOB: &str = include_str!("../job.toml");

struct Dir {
    dir: tempfile::TempDir,
}

impl Dir {
    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let made = Command::new(MAKE_DATA).arg(dir.path()).status().unwrap();
        assert!(made.success());
        std::fs::write(dir.path().join("job.toml"), JOB).unwrap();
        Dir { dir }
    }

    fn path(&self) -> &Path {
        self.dir.path()
    }

    fn run(&self, args: &[&str], env: &[(&str, &str)]) -> (i32, String, String) {
        self.run_in(self.path(), args, env)
    }

    fn run_in(&self, cwd: &Path, args: &[&str], env: &[(&str, &str)]) -> (i32, String, String) {
        let mut cmd = Command::new(BIN);
        cmd.args(args).current_dir(cwd);
        // Scheduler variables of an outer job must not make this a multi-node run.
        for (key, _) in std::env::vars() {
            if key.starts_with("SLURM_") || key.starts_with("PET_") || key == "WORLD_SIZE" {
                cmd.env_remove(key);
            }
        }
        cmd.envs(env.iter().copied());
        let Output {
            status,
            stdout,
            stderr,
        } = cmd.output().unwrap();
        let text = |b: Vec<u8>| String::from_utf8_lossy(&b).into_owned();
        (status.code().unwrap_or(-1), text(stdout), text(stderr))
    }

    fn weights(&self, job: &str) -> Vec<(String, Vec<f32>)> {
        let path: PathBuf = self.path().join("jobs").join(job).join("model.safetensors");
        let tensors = candle_core::safetensors::load(&path, &candle_core::Device::Cpu).unwrap();
        let mut named: Vec<(String, Vec<f32>)> = tensors
            .into_iter()
            .map(|(name, t)| (name, t.flatten_all().unwrap().to_vec1().unwrap()))
            .collect();
        named.sort_by(|a, b| a.0.cmp(&b.0));
        named
    }
}

#[test]
fn trains_on_two_workers_and_resumes_after_sigterm_bit_for_bit() {
    let d = Dir::new();
    let (code, out, err) = d.run(&["validate", "job.toml"], &[]);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("channels = 8") && out.contains("blocks = 1"),
        "{out}"
    );
    assert!(
        out.contains("train_samples     = 480  (csv, opened)"),
        "{out}"
    );

    let two = ["--nproc-per-node", "2"];
    let (code, out, err) = d.run(
        &[&["run", "job.toml", "--name", "whole"], &two[..]].concat(),
        &[],
    );
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(out.contains("expect met   min_test_accuracy"), "{out}");
    let whole = d.weights("whole");
    let names: Vec<&str> = whole.iter().map(|(n, _)| n.as_str()).collect();
    for name in [
        "stem.conv.weight",
        "stem.bn.running_mean",
        "layer1.b.bn.running_var",
        "fc.bias",
    ] {
        assert!(names.contains(&name), "{name} missing from {names:?}");
    }
    let mean = &whole
        .iter()
        .find(|(n, _)| n == "stem.bn.running_mean")
        .unwrap()
        .1;
    assert!(
        mean.iter().any(|&v| v != 0.0),
        "BatchNorm statistics never updated"
    );

    // `[logging] tensorboard = true` in the shipped job: its event file is there.
    let events = std::fs::read_dir(d.path().join("jobs/whole/tensorboard")).unwrap();
    let names: Vec<String> = events
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(
        names.iter().any(|n| n.starts_with("events.out.tfevents.")),
        "{names:?}"
    );

    // SIGTERM to the launcher as step 12 begins (mid-epoch 1 of 15 steps on 2 workers): the job
    // stops after checkpointing step 12 and `resume` finishes it.
    let (code, _, err) = d.run(
        &[&["run", "job.toml", "--name", "cut"], &two[..]].concat(),
        &[("DDPJOB_FAULT", "rank=0,step=12,kind=preempt")],
    );
    assert_eq!(code, 143, "{err}");
    assert!(err.contains("interrupted by SIGTERM"), "{err}");
    // A model that no longer matches its checkpoint is refused, naming what differs.
    let frozen = d.path().join("jobs/cut/job.toml");
    let text = std::fs::read_to_string(&frozen).unwrap();
    std::fs::write(&frozen, text.replace("channels = 8", "channels = 16")).unwrap();
    let (code, _, err) = d.run(&["resume", "cut"], &[]);
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("`stem.conv.weight` has shape [8, 1, 3, 3] there but [16, 1, 3, 3]"),
        "{err}"
    );
    std::fs::write(&frozen, text).unwrap();

    // From another directory: job.toml holds the CSV paths (the dataset's `PATHS`) absolute.
    let elsewhere = d.path().join("elsewhere");
    std::fs::create_dir(&elsewhere).unwrap();
    let jobs = d.path().join("jobs").display().to_string();
    let args = ["resume", "cut", "--jobs-dir", &jobs];
    let (code, out, err) = d.run_in(&elsewhere, &args, &[]);
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(out.contains("resuming job `cut`"), "{out}");
    assert_eq!(
        d.weights("cut"),
        whole,
        "resumed weights and buffers differ"
    );
}

#[test]
fn bad_options_and_names_are_refused_before_training() {
    let d = Dir::new();
    let typo = JOB.replace("channels = 8", "chanels = 8");
    std::fs::write(d.path().join("typo.toml"), typo).unwrap();
    let (code, _, err) = d.run(&["run", "typo.toml"], &[]);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("unknown key `chanels` in [model] (arch = \"tiny-resnet\") (typo.toml:7:1)")
            && err.contains("did you mean `channels`?"),
        "{err}"
    );

    let unknown = JOB.replace("\"tiny-resnet\"", "\"resnet50\"");
    std::fs::write(d.path().join("unknown.toml"), unknown).unwrap();
    let (code, _, err) = d.run(&["validate", "unknown.toml"], &[]);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains(
            "\"resnet50\"; expected one of \"cnn\", \"gpt\", \"llama\", \"mlp\", \"tiny-resnet\""
        ),
        "{err}"
    );

    // The builder's own refusal reaches the user with the arch it came from, before the job
    // exists: the launcher builds the model to check its memory.
    let zero = JOB.replace("channels = 8", "channels = 0");
    std::fs::write(d.path().join("zero.toml"), zero).unwrap();
    let (code, _, err) = d.run(&["run", "zero.toml"], &[]);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("model.arch = \"tiny-resnet\": model.channels must be at least 1"),
        "{err}"
    );
    assert!(!d.path().join("jobs/tiny-resnet").exists());

    let (code, _, err) = d.run(
        &[
            "validate",
            "job.toml",
            "--set",
            "data.train_path=missing.csv",
        ],
        &[],
    );
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("cannot read `missing.csv`"), "{err}");
}

/// `sharding = "full"` needs a model that gathers its parameters block by block
/// (`Model::shard_parameters`); this one does not: refused before the job exists.
#[test]
fn fully_sharded_parameters_are_refused_for_a_model_without_blocks() {
    let d = Dir::new();
    let text = JOB.to_string() + "\n[distributed]\nsharding = \"full\"\n";
    std::fs::write(d.path().join("full.toml"), text).unwrap();
    let (code, _, err) = d.run(&["run", "full.toml", "--nproc-per-node", "2"], &[]);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("model.arch = \"tiny-resnet\" cannot gather its parameters block by block")
            && err.contains("use \"gradients\""),
        "{err}"
    );
    assert!(!d.path().join("jobs/tiny-resnet").exists());
}

/// A model with BatchNorm's running statistics cannot train world-size-invariantly (they would
/// come from whichever pieces rank 0 computed): refused naming the key and the reason.
#[test]
fn world_size_invariant_training_refuses_running_statistics() {
    let d = Dir::new();
    let text = JOB.replace("batch_size = 16", "global_batch_size = 16")
        + "\n[distributed]\ndeterministic = \"world-size-invariant\"\n";
    std::fs::write(d.path().join("invariant.toml"), text).unwrap();
    let (code, _, err) = d.run(&["run", "invariant.toml", "--nproc-per-node", "2"], &[]);
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("model.arch = \"tiny-resnet\" keeps running statistics"),
        "{err}"
    );
}

/// Without BatchNorm the registered network and data train world-size-invariantly: `verify`
/// (the example's own binary, its workers re-executions of it) finds the same weights at
/// every step on 1, 2 and 4 workers.
#[test]
fn world_size_invariant_training_of_a_registered_model_is_bit_identical() {
    let d = Dir::new();
    let text = JOB
        .replace("batch_size = 16", "global_batch_size = 16")
        .replace("blocks = 1", "blocks = 1\nbatch_norm = false")
        + "\n[distributed]\ndeterministic = \"world-size-invariant\"\nvirtual_shards = 4\n";
    std::fs::write(d.path().join("invariant.toml"), text).unwrap();
    let (code, out, err) = d.run(
        &[
            "verify",
            "invariant.toml",
            "--world-sizes",
            "1,2,4",
            "--steps",
            "5",
        ],
        &[],
    );
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        out.contains("bit-identical weights at every one of 5 steps on 1, 2, 4 worker(s)"),
        "{out}"
    );
}
