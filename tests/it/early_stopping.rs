//! `[train.early_stopping]`: a job ends once its evaluation loss (or accuracy) has not improved
//! for `patience` evaluations in a row, at the step the rule names, on any world size, and a job
//! killed on the way there resumes to the same stop with the same weights.

use crate::common::{TestJob, assert_same_bits};

/// 512 samples, batch 16 × accumulation 2 on 2 workers: 8 optimizer steps an epoch.
fn job(epochs: usize, eval_every: usize, early_stopping: &str) -> String {
    format!(
        r#"
seed = 5
[model]
arch = "mlp"
hidden = [32]
[data]
dataset = "synthetic"
[data.synthetic]
train_samples = 512
test_samples = 128
shape = [1, 8, 8]
classes = 4
noise = 0.8
[train]
epochs = {epochs}
batch_size = 16
accumulation = 2
lr = 0.02
eval_every = {eval_every}
log_every = 3
[train.early_stopping]
{early_stopping}
[checkpoint]
every_epochs = 1
keep_last = 0
"#
    )
}

/// (step, loss) of every evaluation that counts for early stopping, in order, from
/// `metrics.jsonl`: the periodic ones (not step 0's, taken before training) and the epochs'
/// (one per step: an epoch ended by a stop reports the evaluation that stopped it).
fn evaluations(t: &TestJob, name: &str) -> Vec<(u64, f64)> {
    figures(t, name, "test_loss")
}

/// (step, `field`) of every evaluation that counts, as [`evaluations`].
fn figures(t: &TestJob, name: &str, field: &str) -> Vec<(u64, f64)> {
    let mut out: Vec<(u64, f64)> = Vec::new();
    for line in t.metrics(name) {
        if line["kind"] != "eval" && line["kind"] != "epoch" {
            continue;
        }
        let (step, loss) = (line["step"].as_u64().unwrap(), line[field].as_f64());
        if step > 0 && out.last().is_none_or(|&(s, _)| s != step) {
            out.push((step, loss.unwrap()));
        }
    }
    out
}

/// Lightning's rule over `evals`: the step of the evaluation that ends training, and the
/// loss it failed to beat.
fn where_the_rule_stops(evals: &[(u64, f64)], patience: usize, min_delta: f64) -> (u64, f64) {
    let (mut best, mut without) = (f64::INFINITY, 0);
    for &(step, loss) in evals {
        if loss < best - min_delta {
            (best, without) = (loss, 0);
        } else {
            without += 1;
        }
        if without == patience {
            return (step, best);
        }
    }
    panic!("the rule does not stop within {evals:?}");
}

#[test]
fn a_plateau_ends_the_job_where_the_rule_says() {
    let t = TestJob::new();
    // 40 epochs planned (320 steps); this data's test loss stops improving within a few.
    let cfg = t.config("job", &job(40, 3, "patience = 3"));
    let run = t.run(&cfg, &["--nproc-per-node", "2", "--name", "plateau"]);
    run.success();
    let summary = t.json(&t.job("plateau").join("summary.json"));
    let stop = &summary["stopped_early"];
    let (step, best) = where_the_rule_stops(&evaluations(&t, "plateau"), 3, 0.0);
    assert_eq!(stop["step"].as_u64(), Some(step), "{summary}");
    assert_eq!(summary["steps"].as_u64(), Some(step));
    assert!(step < 320, "stopped at the plan's end: {summary}");
    assert_eq!(stop["planned_steps"].as_u64(), Some(320));
    assert_eq!(stop["evaluations"].as_u64(), Some(3));
    assert_eq!(stop["best"].as_f64(), Some(best));
    assert_eq!(stop["monitor"], "loss");
    assert!(
        run.stdout.contains(&format!(
            "stopped early after step {step} of 320: 3 evaluations in a row did not improve"
        )),
        "{}",
        run.stdout
    );
    let last_train = t
        .metrics("plateau")
        .iter()
        .filter(|l| l["kind"] == "train")
        .map(|l| l["step"].as_u64().unwrap())
        .max();
    assert_eq!(last_train, Some(step), "trained past the stop");
    let jobs = t.jobs_dir().display().to_string();
    let show = t.ddpjob(&["show", "plateau", "--jobs-dir", &jobs]);
    show.success();
    assert!(
        show.stdout.contains(&format!(
            "early stop  stopped early after step {step} of 320"
        )),
        "{}",
        show.stdout
    );
}

#[test]
fn a_stop_mid_epoch_is_exact_and_a_resumed_job_stops_there_too() {
    let t = TestJob::new();
    // min_delta 10: only the first evaluation (step 5) improves; the next two (the epoch's end
    // at step 8, then step 10 mid-epoch) do not, so training ends after step 10 of 24.
    let cfg = t.config("job", &job(3, 5, "patience = 2\nmin_delta = 10.0"));
    let n = ["--nproc-per-node", "2"];
    t.run(&cfg, &[&n[..], &["--name", "whole"]].concat())
        .success();
    let summary = t.json(&t.job("whole").join("summary.json"));
    let first = evaluations(&t, "whole")[0];
    assert_eq!(first.0, 5);
    assert_eq!(
        summary["stopped_early"],
        serde_json::json!({"step": 10, "planned_steps": 24, "evaluations": 2, "monitor": "loss", "best": first.1}),
    );
    // The stopped epoch is closed as a cut-short one is (train.max_steps): counted, its line
    // written with the evaluation that stopped it, no other evaluation taken.
    assert_eq!(
        (summary["steps"].as_u64(), summary["epochs"].as_u64()),
        (Some(10), Some(2))
    );
    let steps: Vec<u64> = evaluations(&t, "whole").iter().map(|e| e.0).collect();
    assert_eq!(steps, [5, 8, 10]);
    // Step 10 is no log step (log_every = 3): the steps since step 9 are logged all the same,
    // so the cut epoch's train loss counts them.
    let metrics = t.metrics("whole");
    let trained: Vec<u64> = metrics
        .iter()
        .filter(|l| l["kind"] == "train" && l["epoch"] == 1)
        .map(|l| l["step"].as_u64().unwrap())
        .collect();
    assert_eq!(trained, [9, 10]);
    let epoch_loss = metrics.iter().rfind(|l| l["kind"] == "epoch").unwrap()["loss"].as_f64();
    let final_loss = summary["final_train_loss"].as_f64().unwrap();
    assert_eq!(epoch_loss, Some(final_loss));
    assert!((0.1..2.0).contains(&final_loss), "{summary}");

    // Killed after step 9: the checkpoint of step 8 holds one evaluation without improvement,
    // so the resumed job stops at step 10 as well (it would go on to step 15 if it had lost
    // count), with the same weights.
    t.run_env(
        &cfg,
        &[&n[..], &["--name", "killed"]].concat(),
        &[("DDPJOB_FAULT", "rank=1,step=9,kind=kill")],
    )
    .fails_with(1, "killed by signal 9");
    let jobs = t.jobs_dir().display().to_string();
    let resumed = t.ddpjob(&["resume", "killed", "--jobs-dir", &jobs]);
    resumed.success();
    assert!(
        resumed.stdout.contains("step-00000008"),
        "{}",
        resumed.stdout
    );
    let again = t.json(&t.job("killed").join("summary.json"));
    assert_eq!(again["stopped_early"], summary["stopped_early"]);
    assert_same_bits(
        &t.job("whole").join("model.safetensors"),
        &t.job("killed").join("model.safetensors"),
    );
    // Finished: resume leaves it.
    t.ddpjob(&["resume", "killed", "--jobs-dir", &jobs])
        .success();

    // Preempted right after an evaluation step (5): that evaluation is recorded before the
    // checkpoint, so the resumed run counts it as the uninterrupted run did (it started at
    // step 6 without it, took step 8's for the first, and went on to step 15).
    t.run_env(
        &cfg,
        &[&n[..], &["--name", "preempted"]].concat(),
        &[("DDPJOB_FAULT", "rank=0,step=5,kind=preempt")],
    )
    .fails_with(143, "after checkpoint `step-00000005`");
    t.ddpjob(&["resume", "preempted", "--jobs-dir", &jobs])
        .success();
    let preempted = t.json(&t.job("preempted").join("summary.json"));
    assert_eq!(preempted["stopped_early"], summary["stopped_early"]);
    assert_same_bits(
        &t.job("whole").join("model.safetensors"),
        &t.job("preempted").join("model.safetensors"),
    );

    // The launcher gone after the stopping step's checkpoint, before the job was marked
    // finished: resumed from that checkpoint, it ends there rather than training on.
    let gone = t.job("gone");
    let copied = std::process::Command::new("cp")
        .args([
            "-a",
            t.job("whole").to_str().unwrap(),
            gone.to_str().unwrap(),
        ])
        .status()
        .unwrap();
    assert!(copied.success());
    std::fs::remove_file(gone.join("summary.json")).unwrap();
    std::fs::remove_file(gone.join("model.safetensors")).unwrap();
    let state_path = gone.join("state.json");
    let mut state = t.json(&state_path);
    state["status"] = "interrupted".into();
    std::fs::write(&state_path, state.to_string()).unwrap();
    let resumed = t.ddpjob(&["resume", "gone", "--jobs-dir", &jobs]);
    resumed.success();
    assert!(
        resumed.stdout.contains("step-00000010"),
        "{}",
        resumed.stdout
    );
    let ended = t.json(&gone.join("summary.json"));
    assert_eq!(ended["steps"].as_u64(), Some(10), "{ended}");
    assert_eq!(ended["stopped_early"]["step"].as_u64(), Some(10), "{ended}");
    assert_same_bits(
        &t.job("whole").join("model.safetensors"),
        &gone.join("model.safetensors"),
    );
}

/// `monitor = "accuracy"` (Lightning's `monitor="val_acc", mode="max"`): the stop comes where
/// the test accuracy stopped rising by more than min_delta, whatever the loss did.
#[test]
fn an_accuracy_that_stops_rising_ends_the_job() {
    let t = TestJob::new();
    let cfg = t.config(
        "job",
        &job(
            40,
            3,
            "patience = 2\nmonitor = \"accuracy\"\nmin_delta = 0.01",
        ),
    );
    t.run(&cfg, &["--nproc-per-node", "2", "--name", "acc"])
        .success();
    let summary = t.json(&t.job("acc").join("summary.json"));
    let stop = &summary["stopped_early"];
    let (mut best, mut without, mut expected) = (f64::NEG_INFINITY, 0, None);
    for (step, accuracy) in figures(&t, "acc", "test_accuracy") {
        if accuracy > best + 0.01 {
            (best, without) = (accuracy, 0);
        } else {
            without += 1;
        }
        if without == 2 {
            expected = Some((step, best));
            break;
        }
    }
    let (step, best) = expected.expect("the rule stops within the run");
    assert_eq!(
        (stop["step"].as_u64(), stop["monitor"].as_str()),
        (Some(step), Some("accuracy")),
        "{summary}"
    );
    assert_eq!(stop["best"].as_f64(), Some(best));
    assert!(step < 320, "{summary}");
    let cfg = t.config("lonely", &job(3, 0, "monitor = \"accuracy\""));
    t.ddpjob(&["validate", cfg.to_str().unwrap()])
        .fails_with(2, "invalid `train.early_stopping.monitor`")
        .fails_with(2, "has no effect without train.early_stopping.patience");
    let cfg = t.config("other", &job(3, 0, "patience = 1\nmonitor = \"f1\""));
    t.ddpjob(&["validate", cfg.to_str().unwrap()])
        .fails_with(2, "unknown value \"f1\"");
}

#[test]
fn early_stopping_keys_are_checked() {
    let t = TestJob::new();
    let cfg = t.config("job", &job(3, 0, "min_delta = 0.1"));
    t.ddpjob(&["validate", cfg.to_str().unwrap()])
        .fails_with(2, "invalid `train.early_stopping.min_delta` (")
        .fails_with(2, "has no effect without train.early_stopping.patience");
    let cfg = t.config("bad", &job(3, 0, "patience = -1"));
    t.ddpjob(&["validate", cfg.to_str().unwrap()])
        .fails_with(2, "train.early_stopping.patience");
    let cfg = t.config("typo", &job(3, 0, "patiense = 2"));
    t.ddpjob(&["validate", cfg.to_str().unwrap()])
        .fails_with(2, "did you mean `patience`?");
    let cfg = t.config("ok", &job(3, 4, "patience = 2"));
    let validated = t.ddpjob(&["validate", cfg.to_str().unwrap()]);
    validated.success();
    assert!(
        validated.stdout.contains(
            "early_stopping    = after 2 evaluation(s) in a row without a lower loss  \
             (evaluations at each epoch's end and every 4 steps"
        ),
        "{}",
        validated.stdout
    );
}
