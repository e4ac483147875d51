//! Jobs written by an older ddpjob resume with this one. `tests/fixtures/pre-workspace/` holds
//! two jobs cut short by the last single-crate build (commit 2ae961e, before the workspace of
//! `crates/`; `make.sh` there made them) and the weights those jobs end with when run whole by
//! that build. Today's binary must read their checkpoints, continue them and end bit-identical
//! to a run it never interrupted, and that run must be bit-identical to the old build's.
//!
//! The bits are those of one CPU level: gemm picks its kernels at run time (AVX-512 or AVX2 and
//! FMA), and their sums round differently, so the fixture holds the old build's jobs and
//! weights made on a machine of each level (`x86-v4/`, `x86-v3/`), and a machine compares with
//! its own level's.

use std::path::Path;

use crate::common::{TestJob, assert_same_bits};

const FIXTURE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/pre-workspace");

/// A copy of directory `from` and everything under it as `to`.
fn copy_tree(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let dest = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_tree(&entry.path(), &dest);
        } else {
            std::fs::copy(entry.path(), dest).unwrap();
        }
    }
}

/// The fixture's folder of this machine's CPU level (how gemm's kernels round).
fn level() -> Option<&'static str> {
    #[cfg(target_arch = "x86_64")]
    {
        if is_x86_feature_detected!("avx512f") {
            return Some("x86-v4");
        }
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
            return Some("x86-v3");
        }
    }
    None
}

/// The fixture's cut jobs (of this CPU level) under the test's jobs directory, its text where
/// `lm-cut` reads it.
fn old_jobs(t: &TestJob, level: &Path) {
    let fixture = Path::new(FIXTURE);
    for job in ["cut", "lm-cut"] {
        copy_tree(&level.join("jobs").join(job), &t.jobs_dir().join(job));
    }
    std::fs::copy(fixture.join("corpus.txt"), t.path("corpus.txt")).unwrap();
    let frozen = t.job("lm-cut").join("job.toml");
    let text = std::fs::read_to_string(&frozen).unwrap();
    assert!(text.contains("@FIXTURE@/corpus.txt"), "{text}");
    let here = t
        .path("")
        .to_string_lossy()
        .trim_end_matches('/')
        .to_string();
    std::fs::write(&frozen, text.replace("@FIXTURE@", &here)).unwrap();
}

fn resume(t: &TestJob, name: &str) -> crate::common::Run {
    let jobs = t.jobs_dir().to_string_lossy().into_owned();
    t.ddpjob(&["resume", "--jobs-dir", &jobs, name])
}

#[test]
fn jobs_cut_before_the_workspace_resume_bit_identical() {
    let Some(level) = level() else {
        eprintln!("skipping: the fixture's bits are those of x86-64 CPUs with AVX2 or AVX-512");
        return;
    };
    let t = TestJob::new();
    let fixture = Path::new(FIXTURE);
    let level = fixture.join(level);
    old_jobs(&t, &level);
    let classifier = t.config(
        "job",
        &std::fs::read_to_string(fixture.join("job.toml")).unwrap(),
    );
    let lm = t.config(
        "lm",
        &std::fs::read_to_string(fixture.join("lm.toml")).unwrap(),
    );

    t.run(&classifier, &["--nproc-per-node", "2", "--name", "whole"])
        .success();
    t.run(&lm, &["--name", "lm-whole"]).success();
    // The same config, the same weights as the old build made: the move changed no number.
    assert_same_bits(
        &level.join("whole-model.safetensors"),
        &t.job("whole").join("model.safetensors"),
    );
    assert_same_bits(
        &level.join("lm-whole-model.safetensors"),
        &t.job("lm-whole").join("model.safetensors"),
    );

    // Each old job resumed from its newest checkpoint ends as today's uninterrupted run.
    for (cut, whole, checkpoint) in [
        ("cut", "whole", "step-00000005"),
        ("lm-cut", "lm-whole", "step-00000010"),
    ] {
        let resumed = resume(&t, cut);
        resumed.success();
        assert!(resumed.stdout.contains(checkpoint), "{}", resumed.stdout);
        assert_same_bits(
            &t.job(whole).join("model.safetensors"),
            &t.job(cut).join("model.safetensors"),
        );
    }
    let state = t.json(&t.job("lm-cut").join("state.json"));
    assert_eq!(state["status"], "finished", "{state}");
}
