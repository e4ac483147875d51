//! `[logging] tensorboard = true`, read back by TensorBoard's own reader (the `tensorboard`
//! Python package): the scalars are metrics.jsonl's, and a job stopped by SIGTERM and resumed
//! continues the same curves without repeating a step. Skipped, with the reason printed, only
//! where there is no Python at all; `.ci/run` makes sure there is.

use std::path::Path;
use std::process::Command;

use serde_json::Value;

use crate::common::{TINY, TestJob, python_with};

const READER: &str = r#"
import json, sys
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
acc = EventAccumulator(sys.argv[1], size_guidance={"scalars": 0})
acc.Reload()
print(json.dumps({t: [[e.step, e.value] for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}))
"#;

fn scalars(python: &Path, dir: &Path) -> serde_json::Map<String, Value> {
    let out = Command::new(python)
        .args(["-c", READER])
        .arg(dir)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice::<Value>(&out.stdout)
        .unwrap()
        .as_object()
        .unwrap()
        .clone()
}

/// (step, value) pairs of `tag`.
fn series(scalars: &serde_json::Map<String, Value>, tag: &str) -> Vec<(u64, f64)> {
    scalars[tag]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| (p[0].as_u64().unwrap(), p[1].as_f64().unwrap()))
        .collect()
}

#[test]
fn tensorboard_reads_the_metrics_and_a_resumed_job_continues_its_curves() {
    let Some(python) = python_with("tensorboard", &["tensorboard"], "tensorboard-venv") else {
        eprintln!("SKIPPED: no python3 on this machine to run TensorBoard's reader");
        return;
    };
    let t = TestJob::new();
    let text = format!("{TINY}\n[checkpoint]\nevery_steps = 4\n[logging]\ntensorboard = true\n");
    let cfg = t.config("job", &text);
    // 16 steps per epoch, 32 in all; SIGTERM as step 22 begins: the job checkpoints step 22
    // and stops; resume goes on from there.
    let cut = t.run_env(
        &cfg,
        &["--name", "cut"],
        &[("DDPJOB_FAULT", "rank=0,step=22,kind=preempt")],
    );
    cut.fails_with(143, "interrupted by SIGTERM");
    let resumed = t.ddpjob(&[
        "resume",
        "cut",
        "--jobs-dir",
        &t.jobs_dir().to_string_lossy(),
    ]);
    resumed.success();
    t.run(&cfg, &["--name", "whole"]).success();

    let files: Vec<_> = std::fs::read_dir(t.job("cut").join("tensorboard"))
        .unwrap()
        .collect();
    assert_eq!(files.len(), 1, "one event file after the resume: {files:?}");
    let got = scalars(&python, &t.job("cut").join("tensorboard"));
    for tag in [
        "train/loss",
        "train/lr",
        "train/samples_per_s",
        "test/loss",
        "test/accuracy",
    ] {
        assert!(got.contains_key(tag), "{tag} missing: {:?}", got.keys());
    }
    let loss = series(&got, "train/loss");
    let steps: Vec<u64> = loss.iter().map(|p| p.0).collect();
    assert!(
        steps.windows(2).all(|w| w[0] < w[1]),
        "a step repeated or out of order: {steps:?}"
    );
    // The values are metrics.jsonl's (as f32): its log steps, plus the partial interval the
    // stop at step 22 logged.
    let logged: Vec<(u64, f64)> = t
        .metrics("cut")
        .iter()
        .filter(|m| m["kind"] == "train")
        .map(|m| (m["step"].as_u64().unwrap(), m["loss"].as_f64().unwrap()))
        .collect();
    assert_eq!(steps, logged.iter().map(|p| p.0).collect::<Vec<_>>());
    for ((s, v), (_, lv)) in loss.iter().zip(&logged) {
        assert_eq!(*v as f32, *lv as f32, "step {s}");
    }
    // The uninterrupted job's curve, point for point, where the intervals are the same.
    let whole = series(
        &scalars(&python, &t.job("whole").join("tensorboard")),
        "train/loss",
    );
    assert_eq!(
        whole.iter().map(|p| p.0).collect::<Vec<_>>(),
        (1..=8).map(|i| i * 4).collect::<Vec<_>>()
    );
    for point in whole.iter().filter(|p| p.0 != 24) {
        assert!(
            loss.contains(point),
            "{point:?} of the whole job is not in the resumed curve {loss:?}"
        );
    }
    let accuracy = series(&got, "test/accuracy");
    assert_eq!(accuracy.iter().map(|p| p.0).collect::<Vec<_>>(), [16, 32]);

    // A worker killed as step 30 begins: the step-28 line was written after the last
    // checkpoint (24), the restart rewinds it away, and the curve must not show it twice.
    let restarted_text =
        text.replace("every_steps = 4", "every_steps = 8") + "[distributed]\nmax_restarts = 1\n";
    let cfg = t.config("restarted", &restarted_text);
    t.run_env(
        &cfg,
        &["--name", "restarted"],
        &[("DDPJOB_FAULT", "rank=0,step=30,kind=kill")],
    )
    .success();
    let resumes: Vec<_> = t
        .metrics("restarted")
        .into_iter()
        .filter(|m| m["kind"] == "resume")
        .collect();
    assert_eq!(resumes.len(), 1, "the kill did not restart the job");
    assert_eq!(resumes[0]["step"], 24);
    let again = series(
        &scalars(&python, &t.job("restarted").join("tensorboard")),
        "train/loss",
    );
    assert_eq!(again, whole, "restarted curve");
}
