//! Jobs written by an older ddpjob resume with this one. `tests/fixtures/pre-workspace/` holds
//! two jobs cut short by the last single-crate build (commit 2ae961e, before the workspace of
//! `crates/`; `make.sh` there made them) and the weights those jobs end with when run whole by
//! that build. Today's binary must read their checkpoints, continue them and end bit-identical
//! to a run it never interrupted, and that run must be bit-identical to the old build's.

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

/// The fixture's cut jobs under the test's jobs directory, its text where `lm-cut` reads it.
fn old_jobs(t: &TestJob) {
    let fixture = Path::new(FIXTURE);
    for job in ["cut", "lm-cut"] {
        copy_tree(&fixture.join("jobs").join(job), &t.jobs_dir().join(job));
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
    let t = TestJob::new();
    old_jobs(&t);
    let fixture = Path::new(FIXTURE);
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
        &fixture.join("whole-model.safetensors"),
        &t.job("whole").join("model.safetensors"),
    );
    assert_same_bits(
        &fixture.join("lm-whole-model.safetensors"),
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
