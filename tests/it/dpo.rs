//! DPO end to end with the real binary, on the chat fixture's tiny Qwen3 and the preference
//! pairs of tests/fixtures/dpo (made, with TRL's reference, by make_dpo_fixture.py): the loss
//! and reward margin of every step equal TRL's `DPOTrainer`; LoRA's reference is the base
//! with the adapters off; the reference never moves; a precomputed reference trains the same
//! bits as a live one; 2 workers × B/2 = 1 × B; a preempted job resumes bit for bit; `eval`
//! and `[expect]` read the rewards; bad settings and data are refused before a job exists.

use std::path::PathBuf;

use crate::common::{TestJob, load_weights, max_abs_diff, preempt_resume_and_compare};

fn fixture(path: &str) -> String {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(path)
        .display()
        .to_string()
}

/// A DPO job of the fixture model on the fixture pairs, `train` and `more` added to
/// `[train]` and the end.
fn job(train: &str, more: &str) -> String {
    with_model("", train, more)
}

/// [`job`] with `model` after `[model]`'s keys (a `[model.lora]` table).
fn with_model(model: &str, train: &str, more: &str) -> String {
    format!(
        r#"
seed = 4
[model]
init_from = "{}"
{model}
[data]
dataset = "jsonl"
train_path = "{}"
val_path = "{}"
[train]
objective = "dpo"
epochs = 5
batch_size = 24
optimizer = "adamw"
lr = 1e-3
log_every = 1
{train}
{more}
"#,
        fixture("chat/model"),
        fixture("dpo/prefs.jsonl"),
        fixture("dpo/prefs-val.jsonl"),
    )
}

fn train_records(t: &TestJob, name: &str) -> Vec<serde_json::Value> {
    let all = t.metrics(name);
    all.into_iter().filter(|r| r["kind"] == "train").collect()
}

/// The evaluations at each epoch's end (five).
fn eval_records(t: &TestJob, name: &str) -> Vec<serde_json::Value> {
    let all = t.metrics(name);
    let evals: Vec<_> = all.into_iter().filter(|r| r["kind"] == "epoch").collect();
    assert_eq!(evals.len(), 5, "{name}'s evaluations");
    evals
}

/// The same model, data and settings as TRL's run in make_dpo_fixture.py (the whole set as one
/// batch, AdamW without weight decay at a constant 1e-3, no clipping, f32, beta 0.1): every
/// step's loss and `rewards/margins` within 1e-4 of TRL's, for each of the three losses, and
/// the first step's rewards and log-probabilities TRL's.
#[test]
fn every_step_matches_trls_dpo_trainer() {
    let t = TestJob::new();
    let reference = t.json(&PathBuf::from(fixture("dpo/reference.json")));
    for loss in ["sigmoid", "ipo", "hinge"] {
        let cfg = t.config(loss, &job("", &format!("[train.dpo]\nloss = \"{loss}\"")));
        let run = t.run(&cfg, &[]);
        run.success();
        assert!(run.stdout.contains("objective: DPO"), "{}", run.stdout);
        let records = train_records(&t, loss);
        let want = &reference["trl"][loss];
        assert_eq!(records.len(), 5);
        for (step, r) in records.iter().enumerate() {
            for (key, got) in [
                ("loss", r["loss"].as_f64().unwrap()),
                (
                    "rewards/margins",
                    r["metrics"]["rewards/margins"].as_f64().unwrap(),
                ),
            ] {
                let trl = want[key][step].as_f64().unwrap();
                // The issue asks 2e-3; measured 6e-6 (sigmoid, ipo, hinge alike).
                assert!(
                    (got - trl).abs() < 1e-4,
                    "{loss} step {}: {key} {got} vs TRL's {trl}",
                    step + 1
                );
            }
        }
        if loss == "sigmoid" {
            for (key, trl) in reference["trl"]["first_step"].as_object().unwrap() {
                let got = records[0]["metrics"][key].as_f64().unwrap();
                // Accuracies count pairs whose rewards differ by rounding alone at step 1.
                if key != "rewards/accuracies" {
                    assert!(
                        (got - trl.as_f64().unwrap()).abs() < 1e-3,
                        "{key}: {got} vs {trl}"
                    );
                }
            }
        }
    }
}

/// The reference's log-probability of the validation completions, as every evaluation of a job
/// implies it: logps − rewards / beta.
fn reference_logps(t: &TestJob, name: &str) -> Vec<[f64; 2]> {
    eval_records(t, name)
        .iter()
        .map(|r| {
            let of = |which: &str| {
                r[format!("test_logps/{which}")].as_f64().unwrap()
                    - r[format!("test_rewards/{which}")].as_f64().unwrap() / 0.1
            };
            [of("chosen"), of("rejected")]
        })
        .collect()
}

/// LoRA: the reference is the base with the adapters off, so the first step (B = 0: the
/// policy is the base) has a loss of ln 2 and no reward; the reference never moves
/// while the policy does, live or precomputed; a precomputed reference trains the same weights,
/// bit for bit, as one computed as training goes; and `eval` scores the job's rewards.
#[test]
fn a_lora_jobs_reference_is_the_base_and_a_precomputed_one_trains_the_same_bits() {
    let t = TestJob::new();
    let lora = "[model.lora]\nr = 4\nalpha = 8\ntarget_modules = \"all-linear\"";
    let cfg = |name: &str, precompute: bool| {
        let dpo = format!("[train.dpo]\nprecompute_reference = {precompute}");
        let text = with_model(lora, "", &dpo).replace("lr = 1e-3", "lr = 1e-2");
        t.config(name, &text)
    };
    let (live, table) = (cfg("live", false), cfg("table", true));
    let run = t.run(&live, &[]);
    run.success();
    assert!(
        run.stdout.contains("the base with the LoRA adapters off"),
        "{}",
        run.stdout
    );
    let first = &train_records(&t, "live")[0];
    assert!(
        (first["loss"].as_f64().unwrap() - 2f64.ln()).abs() < 1e-6,
        "{first}"
    );
    // The policy's rows are batched, the reference's scored one by one: equal but for rounding.
    assert!(
        first["metrics"]["rewards/margins"].as_f64().unwrap().abs() < 1e-5,
        "{first}"
    );
    let refs = reference_logps(&t, "live");
    for r in &refs {
        for k in 0..2 {
            assert!(
                (r[k] - refs[0][k]).abs() < 1e-3,
                "the reference moved: {refs:?}"
            );
        }
    }
    let evals = eval_records(&t, "live");
    let (start, end) = (&evals[0], evals.last().unwrap());
    assert_ne!(
        start["test_logps/chosen"], end["test_logps/chosen"],
        "the policy moved"
    );

    let run = t.run(&table, &[]);
    run.success();
    assert!(run.stdout.contains("precomputed now"), "{}", run.stdout);
    assert!(t.job("table").join("dpo-reference.bin").is_file());
    crate::common::assert_same_bits(
        &t.job("live").join("model.safetensors"),
        &t.job("table").join("model.safetensors"),
    );
    let logged = |name: &str| -> Vec<_> {
        let records = train_records(&t, name);
        records
            .iter()
            .map(|r| (r["loss"].clone(), r["metrics"].clone()))
            .collect()
    };
    assert_eq!(logged("live"), logged("table"));

    let jobs = t.jobs_dir().display().to_string();
    let eval = t.ddpjob(&["eval", "table", "--json", "--jobs-dir", &jobs]);
    eval.success();
    let scored: serde_json::Value = serde_json::from_str(&eval.stdout).unwrap();
    let last = eval_records(&t, "table").pop().unwrap();
    let margins = scored["rewards/margins"].as_f64().unwrap();
    assert!(
        (margins - last["test_rewards/margins"].as_f64().unwrap()).abs() < 1e-5,
        "{scored}"
    );
}

/// A full fine-tune's frozen reference never moves; activation checkpointing trains the same
/// weights (to rounding); 2 workers × 12 pairs train the weights 1 × 24 do; a job preempted
/// mid-run resumes bit for bit, and one whose worker dies restarts to the same bits;
/// world-size-invariant training gives the same bits on 1 and 2 workers; `[expect]` reads the
/// rewards.
#[test]
fn a_full_dpo_job_resumes_bit_for_bit_and_two_workers_match_one() {
    let t = TestJob::new();
    let one = t.config("one", &job("", "[expect]\nmin_rewards_accuracies = 0.1"));
    t.run(&one, &[]).success();
    let refs = reference_logps(&t, "one");
    assert!(
        refs.iter().all(|r| (r[0] - refs[0][0]).abs() < 1e-3),
        "{refs:?}"
    );
    let summary = t.json(&t.job("one").join("summary.json"));
    assert!(
        summary["test_rewards/accuracies"].as_f64().is_some(),
        "{summary}"
    );

    // Activation checkpointing: each row through the llama's recomputing pass, the same
    // weights but for rounding (a row computed alone, not beside the batch's others).
    let recomputed = t.config("recomputed", &job("activation_checkpointing = true", ""));
    t.run(&recomputed, &[]).success();
    let weights = |name: &str| load_weights(&t.job(name).join("model.safetensors"));
    let diff = max_abs_diff(&weights("one"), &weights("recomputed"));
    assert!(diff < 1e-5, "checkpointed and not differ by {diff}");
    let first = &train_records(&t, "recomputed")[0];
    assert_eq!(
        first["metrics"]["rewards/margins"].as_f64(),
        Some(0.0),
        "{first}"
    );

    let half = job("", "").replace("batch_size = 24", "batch_size = 12");
    let two = t.config("two", &half);
    t.run(&two, &["--nproc-per-node", "2"]).success();
    let diff = max_abs_diff(&weights("one"), &weights("two"));
    assert!(diff < 1e-5, "1 x 24 and 2 x 12 differ by {diff}");

    let small = job("", "").replace("batch_size = 24", "batch_size = 4");
    let whole = t.config("whole", &small);
    let two = ["--nproc-per-node", "2"];
    t.run(&whole, &[&two[..], &["--name", "whole"]].concat())
        .success();
    preempt_resume_and_compare(&t, &whole, &two, "rank=1,step=7,kind=preempt");
    // A worker that dies is restarted from the newest checkpoint (distributed.max_restarts):
    // the same bits again.
    let restarted = t.config(
        "restarted",
        &small.replace("[train]", "[distributed]\nmax_restarts = 1\n[train]"),
    );
    let fault = [("DDPJOB_FAULT", "rank=1,step=8,kind=exit")];
    let run = t.run_env(
        &restarted,
        &[&two[..], &["--name", "restarted"]].concat(),
        &fault,
    );
    run.success();
    assert!(
        run.stdout.contains("restart 1/1") || run.stderr.contains("restart 1/1"),
        "{}",
        run.stderr
    );
    crate::common::assert_same_bits(
        &t.job("whole").join("model.safetensors"),
        &t.job("restarted").join("model.safetensors"),
    );

    let unmet = t.config(
        "unmet",
        &job("max_steps = 1", "[expect]\nmin_rewards_margins = 5.0"),
    );
    t.run(&unmet, &[])
        .fails_with(1, "expect.min_rewards_margins");
}

/// Bad settings and data: exit 2 before a job exists, naming the key, file and line.
#[test]
fn bad_dpo_settings_and_data_are_refused() {
    let t = TestJob::new();
    let cases = [
        ("beta", job("", "[train.dpo]\nbeta = 0.0"), "train.dpo.beta"),
        (
            "loss",
            job("", "[train.dpo]\nloss = \"kto\""),
            "\"sigmoid\", \"ipo\", \"hinge\"",
        ),
        (
            "smooth",
            job("", "[train.dpo]\nloss = \"ipo\"\nlabel_smoothing = 0.1"),
            "train.dpo.label_smoothing",
        ),
        (
            "without",
            job("", "[train.dpo]\nbeta = 0.2").replace("objective = \"dpo\"", ""),
            "applies only with train.objective = \"dpo\"",
        ),
        (
            "text",
            job("", "")
                .replace("dataset = \"jsonl\"", "dataset = \"text\"")
                .replace("train_path", "path")
                .replace(
                    &format!("val_path = \"{}\"", fixture("dpo/prefs-val.jsonl")),
                    "",
                ),
            "trains on pairs",
        ),
        (
            "unpaired",
            job("", "").replace(
                &fixture("dpo/prefs.jsonl"),
                &fixture("chat/prompt_completion.jsonl"),
            ),
            "line 1: it has no \"chosen\"",
        ),
        (
            "packed",
            job("", "").replace("[train]", "pack = true\n[train]"),
            "drop pack",
        ),
        (
            "prompted",
            job("", "").replace("[train]", "train_on_prompt = true\n[train]"),
            "drop train_on_prompt",
        ),
        (
            "sharded",
            job("", "[distributed]\nsharding = \"full\""),
            "distributed.sharding",
        ),
    ];
    for (name, text, message) in cases {
        let run = t.run(&t.config(name, &text), &[]);
        run.fails_with(2, message);
        assert!(!t.job(name).exists(), "{name}: a job was made");
    }
}

/// `configs/dpo-lora.toml` runs from the repository's root as a new user runs it (its model
/// and pairs are the fixtures), meets its `[expect]`, and exports its adapter.
#[test]
fn the_shipped_dpo_recipe_runs_as_written() {
    let t = TestJob::new();
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let jobs = t.jobs_dir().display().to_string();
    let config = root.join("configs/dpo-lora.toml").display().to_string();
    let out = t
        .command(&["run", &config, "--jobs-dir", &jobs], &[])
        .current_dir(&root)
        .output()
        .unwrap();
    let run: crate::common::Run = out.into();
    run.success();
    assert!(
        run.stdout.contains("expect met   min_rewards_accuracies"),
        "{}",
        run.stdout
    );
    assert!(
        run.stdout.contains("reference: precomputed now"),
        "{}",
        run.stdout
    );
    // `preview` shows each pair's two rows and counts pairs.
    let out = t
        .command(&["preview", &config, "--examples", "1"], &[])
        .current_dir(&root)
        .output()
        .unwrap();
    let preview: crate::common::Run = out.into();
    preview.success();
    for line in [
        "── pair 0, chosen:",
        "── pair 0, rejected:",
        "training set: 24 pairs (48 examples)",
    ] {
        assert!(preview.stdout.contains(line), "{}", preview.stdout);
    }
    let adapter = t.path("adapter").display().to_string();
    t.ddpjob(&[
        "export",
        "dpo-lora",
        "--peft",
        &adapter,
        "--jobs-dir",
        &jobs,
    ])
    .success();
    assert!(t.path("adapter/adapter_config.json").is_file());
}

/// `bench step` times a DPO step: random pairs, the live reference, the step the trainer runs.
#[test]
fn bench_step_times_a_dpo_step() {
    let t = TestJob::new();
    let cfg = t.config("bench", &job("", "")).display().to_string();
    let run = t.ddpjob(&["bench", "step", "--config", &cfg, "--steps", "1"]);
    run.success();
    assert!(run.stdout.contains("step ms median"), "{}", run.stdout);
}

/// Pairs as the Hub stores them: parquet files (string columns, and conversations as
/// `list<struct<role, content>>` columns, written by pyarrow in make_dpo_fixture.py) train the
/// weights their jsonl lines train, bit for bit.
#[test]
fn parquet_pairs_train_what_jsonl_pairs_train() {
    let t = TestJob::new();
    for set in ["prefs", "prefs-chat"] {
        let of = |ext: &str| fixture(&format!("dpo/{set}.{ext}"));
        let text = job("max_steps = 2", "")
            .replace(&fixture("dpo/prefs.jsonl"), &of("jsonl"))
            .replace(&fixture("dpo/prefs-val.jsonl"), &of("jsonl"));
        let lines = t.config(&format!("{set}-jsonl"), &text);
        let parquet = t.config(
            &format!("{set}-parquet"),
            &text
                .replace(&of("jsonl"), &of("parquet"))
                .replace("dataset = \"jsonl\"", "dataset = \"parquet\""),
        );
        t.run(&lines, &[]).success();
        t.run(&parquet, &[]).success();
        crate::common::assert_same_bits(
            &t.job(&format!("{set}-jsonl")).join("model.safetensors"),
            &t.job(&format!("{set}-parquet")).join("model.safetensors"),
        );
    }
}
