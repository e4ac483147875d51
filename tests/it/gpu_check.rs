//! `bench/gpu-check.sh`, the one command that checks a GPU machine, run here on the CPU
//! (`DEVICE=cpu`) with the test build of the binary: its steps, its JSON report, its JUnit
//! files and logs, and its exit codes, so the script a GPU session relies on is tested in CI.

use std::path::Path;
use std::process::Command;

use crate::common::{Run, TestJob, without_scheduler};

/// `bash bench/gpu-check.sh <steps>` from the repository root, on the CPU, writing to `out`;
/// `None` without a `python3` (the script writes its report with it).
fn gpu_check(out: &Path, steps: &[&str], env: &[(&str, &str)]) -> Option<Run> {
    let python = std::env::var("DDPJOB_TEST_PYTHON").unwrap_or_else(|_| "python3".into());
    if Command::new(&python).arg("--version").output().is_err() {
        eprintln!("skipping: no {python} to write gpu-check.json");
        return None;
    }
    let mut cmd = Command::new("bash");
    without_scheduler(&mut cmd);
    // The script's own knobs from the caller's environment would change what it runs.
    for knob in [
        "QUICK",
        "SMOKE_ONLY",
        "GPT_STEPS",
        "STEP_TIMEOUT",
        "DATA",
        "TEXT",
        "BENCH_CONFIG",
        "ALLREDUCE_SIZES",
    ] {
        cmd.env_remove(knob);
    }
    let output = cmd
        .arg("bench/gpu-check.sh")
        .args(steps)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .env("DEVICE", "cpu")
        .env("BIN", env!("CARGO_BIN_EXE_ddpjob"))
        .env("OUT", out)
        .env("PYTHON", &python)
        .env("DDPJOB_PLAIN", "1")
        .envs(env.iter().copied())
        .output()
        .expect("spawn bash");
    Some(output.into())
}

/// The report's steps as (step, status).
fn steps(report: &serde_json::Value) -> Vec<(String, String)> {
    report["steps"]
        .as_array()
        .expect("steps")
        .iter()
        .map(|s| {
            (
                s["step"].as_str().unwrap().into(),
                s["status"].as_str().unwrap().into(),
            )
        })
        .collect()
}

#[test]
fn the_gpu_check_runs_its_steps_on_the_cpu_and_reports_each() {
    let t = TestJob::new();
    let out = t.path("out");
    let quick = [
        ("QUICK", "1"),
        ("BENCH_CONFIG", "configs/smoke.toml"),
        ("ALLREDUCE_SIZES", "64K"),
    ];
    let steps_run = [
        "driver", "warmup", "kernels", "smoke", "tcp2", "bench", "profile", "resume",
    ];
    let Some(run) = gpu_check(&out, &steps_run, &quick) else {
        return;
    };
    run.success();
    let report = t.json(&out.join("gpu-check.json"));
    let expected = [
        ("driver and GPU", "skipped"),
        ("libraries ddpjob loads", "ok"),
        ("warm-up (kernels loaded)", "ok"),
        ("kernels vs host references", "skipped"),
        ("bench step", "ok"),
        ("bench step (the cnn epoch's step)", "ok"),
        ("bench allreduce", "ok"),
        ("profile (ncu, GPT step)", "skipped"),
        ("profile (ncu, cnn step)", "skipped"),
        ("smoke f32 (--junit)", "ok"),
        ("smoke bf16 (--junit)", "ok"),
        ("2 workers on one device (tcp)", "ok"),
        ("SIGTERM, resume vs uninterrupted", "ok"),
    ];
    let expected: Vec<(String, String)> = expected
        .iter()
        .map(|(s, v)| (s.to_string(), v.to_string()))
        .collect();
    assert_eq!(steps(&report), expected, "{}", run.stdout);
    assert_eq!(report["failed"], 0);
    assert_eq!(report["device"], "cpu");
    let bench = report["steps"][4]["detail"].as_str().unwrap();
    assert!(
        bench.contains("queued by the host in") && bench.contains("(host clock: forward"),
        "{bench}"
    );
    let resume = &report["steps"][12]["detail"];
    assert!(
        resume.as_str().unwrap().ends_with("resumed; bit-identical"),
        "{resume}"
    );
    for precision in ["f32", "bf16"] {
        let junit = std::fs::read_to_string(out.join(format!("smoke-{precision}.xml")))
            .expect("the smoke job's JUnit report");
        assert!(
            junit.contains("<testsuite") && !junit.contains("<failure"),
            "{junit}"
        );
    }
    // Everything comes back in four files (the device tool brings back eight at most).
    let mut files: Vec<String> = std::fs::read_dir(&out)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    files.sort();
    assert_eq!(
        files,
        [
            "gpu-check.json",
            "logs.tar.gz",
            "smoke-bf16.xml",
            "smoke-f32.xml"
        ]
    );
    assert!(run.stdout.contains("0 step(s) failed"), "{}", run.stdout);
}

#[test]
fn a_failing_step_fails_the_check_a_skipped_one_does_not_and_an_unknown_one_is_a_usage_error() {
    let t = TestJob::new();
    let out = t.path("out");
    let text = [("TEXT", "/nonexistent/input.txt")];
    let Some(run) = gpu_check(&out, &["gpt"], &text) else {
        return;
    };
    assert_eq!(run.code, 1, "{}\n{}", run.stdout, run.stderr);
    let report = t.json(&out.join("gpu-check.json"));
    assert_eq!(
        steps(&report),
        [("GPT recipe vs gpt_ref.py".to_string(), "FAIL".to_string())]
    );
    assert_eq!(report["failed"], 1);
    assert!(
        report["steps"][0]["detail"]
            .as_str()
            .unwrap()
            .contains("no text at /nonexistent/input.txt"),
        "{report}"
    );

    // CI's GPU job skips the comparisons with PyTorch, and says so.
    let smoke_only = t.path("smoke-only");
    let run = gpu_check(&smoke_only, &["cnn", "gpt"], &[("SMOKE_ONLY", "1")]).expect("python3");
    run.success();
    let skipped = |step: &str| (step.to_string(), "skipped".to_string());
    assert_eq!(
        steps(&t.json(&smoke_only.join("gpu-check.json"))),
        [
            skipped("cnn epoch vs torch_ref.py"),
            skipped("GPT recipe vs gpt_ref.py")
        ]
    );

    let run = gpu_check(&t.path("out2"), &["smoke", "gpu"], &[]).expect("python3 is there");
    run.fails_with(2, "unknown step 'gpu'");
    assert!(!t.path("out2").join("gpu-check.json").exists());
}
