//! Instruction fine-tuning end to end: `data.dataset = "jsonl"` prompt/completion examples
//! (made from the fixture's Shakespeare, each line the prompt for the next) trained with LoRA on
//! the tiny Qwen2 checkpoint by the real binary: the loss is the mean over completion tokens of
//! the whole global batch (2 workers × 4 equal 1 × 8), resume is bit-exact, `eval` scores the
//! validation split, packed rows train as their examples would, and bad lines are refused
//! before anything is created.

use std::path::{Path, PathBuf};

use crate::common::{TestJob, copy_dir, load_weights, max_abs_diff, preempt_resume_and_compare};

fn qwen2() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf/qwen2")
}

/// `{"prompt": line, "completion": next line}` for the fixture's non-empty lines, with a
/// plain-text example now and then.
pub(crate) fn examples(t: &TestJob) -> PathBuf {
    let lines: Vec<&str> = include_str!("../fixtures/hf/sample.txt")
        .lines()
        .filter(|l| !l.trim().is_empty())
        .collect();
    let mut out = String::new();
    for (i, pair) in lines.windows(2).enumerate() {
        let line = match i % 7 {
            6 => serde_json::json!({ "text": pair[0] }),
            _ => serde_json::json!({ "prompt": pair[0], "completion": pair[1] }),
        };
        out.push_str(&format!("{line}\n"));
    }
    let path = t.path("train.jsonl");
    std::fs::write(&path, out).unwrap();
    path
}

pub(crate) fn job(data: &Path, extra_data: &str, train: &str) -> String {
    format!(
        r#"
seed = 3
[model]
init_from = "{}"
block_size = 64
[model.lora]
r = 4
alpha = 8
dropout = 0.1
target_modules = ["q_proj", "v_proj", "down_proj"]
[data]
dataset = "jsonl"
train_path = "{}"
{extra_data}
[train]
epochs = 2
batch_size = 8
lr = 3e-3
optimizer = "adamw"
grad_clip_norm = 1.0
log_every = 4
eval_batch_size = 16
{train}
[checkpoint]
every_epochs = 1
keep_last = 0
"#,
        qwen2().display(),
        data.display()
    )
}

/// Runs `one` (batch 8) on one worker, as batch 4 on two, and as batch 4 with 2 accumulated
/// micro-batches on one: the weights must agree.
pub(crate) fn one_worker_matches_two(t: &TestJob, one: &str) {
    let half = one.replace("batch_size = 8", "batch_size = 4");
    t.run(&t.config("one", one), &[]).success();
    t.run(&t.config("two", &half), &["--nproc-per-node", "2"])
        .success();
    let accumulated = half.replace("[train]", "[train]\naccumulation = 2");
    t.run(&t.config("acc", &accumulated), &[]).success();
    let weights = |name: &str| load_weights(&t.job(name).join("model.safetensors"));
    let one = weights("one");
    for (other, what) in [("two", "2 x 4"), ("acc", "1 x 4 x 2 accumulated")] {
        let diff = max_abs_diff(&one, &weights(other));
        assert!(diff < 1e-5, "1 x 8 and {what} differ by {diff}");
    }
}

#[test]
fn an_sft_lora_job_trains_on_completions_resumes_and_two_workers_match_one() {
    let t = TestJob::new();
    let data = examples(&t);
    let cfg = t.config("sft", &job(&data, "", "max_steps = 24"));
    let two = ["--nproc-per-node", "2"];
    let whole = t.run(&cfg, &[&two[..], &["--name", "whole"]].concat());
    whole.success();
    assert!(
        whole.stdout.contains("loss on completions only"),
        "{}",
        whole.stdout
    );
    // The job keeps its tokenised examples and the tokenizer.
    for file in ["jsonl-train.bin", "jsonl-val.bin", "vocab.json"] {
        assert!(t.job("whole").join(file).is_file(), "{file}");
    }

    preempt_resume_and_compare(&t, &cfg, &two, "rank=1,step=15,kind=preempt");
    let jobs = t.jobs_dir().display().to_string();

    // Examples differ in length and in completion tokens: a rank's mean weighted by rows
    // instead of by the tokens that score would not give the 1-worker step.
    one_worker_matches_two(&t, &job(&data, "", "max_steps = 6"));

    let eval = t.ddpjob(&["eval", "whole", "--json", "--jobs-dir", &jobs]);
    eval.success();
    let scored: serde_json::Value = serde_json::from_str(&eval.stdout).unwrap();
    let loss = scored["loss"].as_f64().unwrap();
    assert!(loss.is_finite() && loss > 0.0, "{scored}");

    // The adapters are what trains: summary.json and `show` say how much of the model that is,
    // the same count the launch log gave.
    let summary = t.json(&t.job("whole").join("summary.json"));
    let all = summary["parameters"].as_u64().unwrap();
    let trained = summary["trainable_parameters"].as_u64().unwrap();
    assert!(0 < trained && trained < all, "{summary}");
    assert!(
        whole
            .stdout
            .contains(&format!("{trained} of {all} values train")),
        "{}",
        whole.stdout
    );
    let show = t.ddpjob(&["show", "whole", "--jobs-dir", &jobs]);
    show.success();
    assert!(
        show.stdout
            .contains(&format!("{all} parameters, {trained} of them trained (")),
        "{}",
        show.stdout
    );
    // A model key changed on the command line is the user's to fix (2), not a broken job.
    let deeper = [
        "eval",
        "whole",
        "--set",
        "model.lora.r=8",
        "--jobs-dir",
        &jobs,
    ];
    t.ddpjob(&deeper).fails_with(
        2,
        "--set model.lora.r=8 changed the model these weights were trained as",
    );
}

#[test]
fn bad_instruction_data_exits_2_naming_the_line_before_the_job_exists() {
    let t = TestJob::new();
    let data = t.path("bad.jsonl");
    std::fs::write(
        &data,
        "{\"prompt\": \"a\", \"completion\": \"b\"}\n{\"prompt\": \"a\"\n{\"text\": \"c\"}\n",
    )
    .unwrap();
    let cfg = t.config("bad", &job(&data, "", "max_steps = 2"));
    t.run(&cfg, &[]).fails_with(2, "bad.jsonl` line 2");
    assert!(!t.job("bad").exists());
    let nowhere = ["--set", "data.train_path=\"nope.jsonl\""];
    t.run(&cfg, &nowhere)
        .fails_with(2, "data.train_path `nope.jsonl` does not exist");
    assert!(!t.job("bad").exists());

    let lenient = job(
        &data,
        "skip_bad_lines = true\nval_fraction = 0.5",
        "max_steps = 2",
    );
    let run = t.run(&t.config("lenient", &lenient), &[]);
    run.success();
    assert!(run.stdout.contains("1 bad lines skipped"), "{}", run.stdout);
}

#[test]
fn a_packed_sft_job_resumes_bit_for_bit_and_two_workers_match_one() {
    let t = TestJob::new();
    let data = examples(&t);
    let cfg = t.config("packed", &job(&data, "pack = true", "max_steps = 12"));
    let two = ["--nproc-per-node", "2"];
    let whole = t.run(&cfg, &[&two[..], &["--name", "whole"]].concat());
    whole.success();
    assert!(whole.stdout.contains("packed into"), "{}", whole.stdout);
    preempt_resume_and_compare(&t, &cfg, &two, "rank=0,step=7,kind=preempt");

    one_worker_matches_two(&t, &job(&data, "pack = true", "max_steps = 4"));
}

#[test]
fn lora_checkpoints_hold_the_adapters_and_resume_refuses_a_changed_base() {
    let t = TestJob::new();
    let data = examples(&t);
    // A base of our own, to change under the job.
    let base = t.path("base");
    copy_dir(&qwen2(), &base);
    let text = job(&data, "", "max_steps = 12")
        .replace(&qwen2().display().to_string(), &base.display().to_string());
    let cfg = t.config("adapters", &text);
    let cut = t.run_env(
        &cfg,
        &[],
        &[("DDPJOB_FAULT", "rank=0,step=11,kind=preempt")],
    );
    cut.fails_with(143, "interrupted by SIGTERM");
    let jobs = t.jobs_dir().display().to_string();
    let checkpoints = t.job("adapters").join("checkpoints");
    let latest = std::fs::read_to_string(checkpoints.join("latest")).unwrap();
    let step = checkpoints.join(latest.trim());
    let saved = load_weights(&step.join("model.safetensors"));
    assert_eq!(saved.len(), 3 * 2 * 2, "q, v, down: A and B of 2 layers");
    assert!(saved.keys().all(|k| k.contains(".lora_")), "{saved:?}");
    let state = t.json(&step.join("state.json"));
    assert_eq!(state["base_sha256"].as_str().unwrap().len(), 64);

    // The checkpoint is whole again over its base: eval scores it.
    t.ddpjob(&[
        "eval",
        "adapters",
        "--checkpoint",
        "latest",
        "--jobs-dir",
        &jobs,
    ])
    .success();

    // The base changes: resume refuses, naming why; the checkpoint stays.
    let weights = base.join("model.safetensors");
    let mut tensors = candle_core::safetensors::load(&weights, &candle_core::Device::Cpu).unwrap();
    let norm = "model.norm.weight";
    tensors.insert(norm.into(), (tensors[norm].clone() * 2.0).unwrap());
    candle_core::safetensors::save(&tensors, &weights).unwrap();
    t.ddpjob(&["resume", "adapters", "--jobs-dir", &jobs])
        .fails_with(1, "the base changed");
    assert!(step.join("model.safetensors").is_file());
}

/// `model.init_from` naming a PEFT adapter (`tests/fixtures/hf/qwen2-lora`, saved by `peft`):
/// the job continues it over its base, scores at step 0 what `eval` of the adapter scores, and
/// its own `export --peft` continues again.
#[test]
fn a_job_continues_a_peft_adapter_and_its_export_continues_again() {
    let t = TestJob::new();
    let data = examples(&t);
    // A copy beside the base it names (`../qwen2`): it moves away once the job has begun.
    let adapter = t.path("qwen2-lora");
    copy_dir(&qwen2().with_file_name("qwen2-lora"), &adapter);
    std::os::unix::fs::symlink(qwen2(), t.path("qwen2")).unwrap();
    let text = job(&data, "", "max_steps = 6\neval_every = 3\neval_batches = 2").replace(
        &qwen2().display().to_string(),
        &adapter.display().to_string(),
    );
    // The adapter sets [model.lora]: the job's own keys go.
    let start = text.find("[model.lora]").unwrap();
    let end = text.find("[data]").unwrap();
    let text = format!("{}{}", &text[..start], &text[end..]);
    let cfg = t.config("continued", &text);
    let cut = t.run_env(
        &cfg,
        &["--nproc-per-node", "2"],
        &[("DDPJOB_FAULT", "rank=0,step=4,kind=preempt")],
    );
    cut.fails_with(143, "interrupted by SIGTERM");
    let frozen = std::fs::read_to_string(t.job("continued").join("job.toml")).unwrap();
    assert!(frozen.contains("adapter = "), "{frozen}");
    // The base the adapter names, as a path of its own (the adapter's directory may move).
    let base = std::fs::canonicalize(qwen2()).unwrap();
    assert!(
        frozen.contains(&format!("init_from = \"{}\"", base.display())),
        "{frozen}"
    );

    let metrics = std::fs::read_to_string(t.job("continued").join("metrics.jsonl")).unwrap();
    let first_eval: serde_json::Value = metrics
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .find(|m| m["kind"] == "eval")
        .unwrap();
    assert_eq!(first_eval["step"], 0, "{first_eval}");
    let cfg_s = cfg.display().to_string();
    let scored = t.ddpjob(&[
        "eval",
        &adapter.display().to_string(),
        "--data",
        &cfg_s,
        "--json",
    ]);
    scored.success();
    let scored: serde_json::Value = serde_json::from_str(&scored.stdout).unwrap();
    let (job_loss, eval_loss) = (
        first_eval["test_loss"].as_f64().unwrap(),
        scored["loss"].as_f64().unwrap(),
    );
    assert!(
        (job_loss - eval_loss).abs() < 1e-5,
        "{job_loss} vs {eval_loss}"
    );

    // The job holds the adapters as trained: it resumes, scores, samples and exports without
    // the directory it started from.
    std::fs::rename(&adapter, t.path("moved")).unwrap();
    let jobs = t.jobs_dir().display().to_string();
    t.ddpjob(&["resume", "continued", "--jobs-dir", &jobs])
        .success();
    t.ddpjob(&["eval", "continued", "--jobs-dir", &jobs])
        .success();
    t.ddpjob(&["sample", "continued", "--tokens", "3", "--jobs-dir", &jobs])
        .success();
    let out = t.path("exported");
    let out_s = out.display().to_string();
    t.ddpjob(&["export", "continued", "--peft", &out_s, "--jobs-dir", &jobs])
        .success();
    let again = text.replace(&adapter.display().to_string(), &out_s);
    t.run(&t.config("again", &again), &[]).success();
}

/// A new job started from a finished LoRA job (`init_from = "jobs/NAME"`) without its
/// `[model.lora]`, or with another rank, starts from the adapters folded into their layers
/// (PEFT's `merge_and_unload`): it scores at step 0 what the LoRA job scored last.
#[test]
fn a_job_started_from_a_lora_job_starts_from_its_adapters_folded_in() {
    let t = TestJob::new();
    let data = examples(&t);
    let evals = |name: &str| -> Vec<(u64, f64)> {
        let metrics = std::fs::read_to_string(t.job(name).join("metrics.jsonl")).unwrap();
        metrics
            .lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
            .filter(|m| m["kind"] == "eval")
            .map(|m| {
                (
                    m["step"].as_u64().unwrap(),
                    m["test_loss"].as_f64().unwrap(),
                )
            })
            .collect()
    };
    let text = job(&data, "", "max_steps = 4\neval_batches = 2");
    t.run(&t.config("adapted", &text), &[]).success();
    let summary = t.json(&t.job("adapted").join("summary.json"));
    let trained = summary["test_loss"].as_f64().unwrap();
    let source = t.job("adapted").display().to_string();
    let next = job(&data, "", "max_steps = 2\neval_every = 2\neval_batches = 2")
        .replace(&qwen2().display().to_string(), &source);
    let start = next.find("[model.lora]").unwrap();
    let end = next.find("[data]").unwrap();
    let without = format!("{}{}", &next[..start], &next[end..]);
    for (name, text) in [
        ("merged", without),
        ("rank8", next.replace("r = 4", "r = 8")),
    ] {
        t.run(&t.config(name, &text), &[]).success();
        let (step, loss) = evals(name)[0];
        assert_eq!(step, 0, "{name}");
        assert!((loss - trained).abs() < 1e-6, "{name}: {loss} vs {trained}");
    }

    // Exported for PEFT, adapters that continued the source's go over the source's base;
    // folded ones over weights no directory holds, said, with how to write them.
    t.run(&t.config("same", &next), &[]).success();
    let jobs = t.jobs_dir().display().to_string();
    let base_of = |name: &str| {
        let out = t.path(&format!("peft-{name}"));
        let out_s = out.display().to_string();
        let exported = t.ddpjob(&["export", name, "--peft", &out_s, "--jobs-dir", &jobs]);
        exported.success();
        let config = t.json(&out.join("adapter_config.json"));
        (config["base_model_name_or_path"].clone(), exported.stdout)
    };
    let (base, _) = base_of("same");
    let qwen2 = std::fs::canonicalize(qwen2()).unwrap();
    assert_eq!(base, qwen2.display().to_string());
    let (base, said) = base_of("rank8");
    assert!(base.is_null(), "{base}");
    assert!(
        said.contains("their base is the weights of job `adapted` with its adapters folded in")
            && said.contains("--merge-lora"),
        "{said}"
    );
}

/// `sample` of a job trained on prompt/completion examples stops where its model ends the
/// answer (the end-of-sequence token every example ended with), as transformers' `generate`.
#[test]
fn sample_of_an_instruction_tuned_job_stops_at_the_end_of_sequence_token() {
    let t = TestJob::new();
    let lines: String = (0..200)
        .map(|i| {
            format!(
                "{{\"prompt\": \"Q{}: say ok\", \"completion\": \" ok\"}}\n",
                i % 10
            )
        })
        .collect();
    let data = t.path("ok.jsonl");
    std::fs::write(&data, lines).unwrap();
    let text = format!(
        "seed = 3\n[model]\ninit_from = \"{}\"\nblock_size = 32\n[data]\ndataset = \"jsonl\"\n\
         train_path = \"{}\"\n[train]\nepochs = 10\nmax_steps = 80\nbatch_size = 8\nlr = 1e-2\n\
         optimizer = \"adamw\"\n",
        qwen2().display(),
        data.display()
    );
    t.run(&t.config("ok", &text), &[]).success();
    let jobs = t.jobs_dir().display().to_string();
    let sampled = t.ddpjob(&[
        "sample",
        "ok",
        "--prompt",
        "Q3: say ok",
        "--tokens",
        "20",
        "--temperature",
        "0",
        "--json",
        "--jobs-dir",
        &jobs,
    ]);
    sampled.success();
    let line: serde_json::Value = serde_json::from_str(sampled.stdout.trim()).unwrap();
    assert_eq!(line["text"], " ok", "{line}");
    assert_eq!(line["ended"], true, "{line}");
}

/// A job that ended its examples with another token than the base's end of sequence exports a
/// model that ends there too: `config.json`, `generation_config.json` and the tokenizer's
/// `eos_token` name it, as an instruct release's files do, so `generate` stops after an answer.
#[test]
fn an_instruction_tuned_export_ends_where_its_examples_ended() {
    let t = TestJob::new();
    let data = examples(&t);
    let text = job(&data, "eos_token = \"#\"", "max_steps = 2");
    t.run(&t.config("ends", &text), &[]).success();
    let out = t.path("exported");
    let jobs = t.jobs_dir().display().to_string();
    let exported = t.ddpjob(&[
        "export",
        "ends",
        "--hf",
        &out.display().to_string(),
        "--merge-lora",
        "--jobs-dir",
        &jobs,
    ]);
    exported.success();
    let json = |name: &str| -> serde_json::Value {
        serde_json::from_str(&std::fs::read_to_string(out.join(name)).unwrap()).unwrap()
    };
    // "#" is id 3 of the fixture's tokenizer; the base names none in config.json.
    assert_eq!(json("config.json")["eos_token_id"], 3);
    assert_eq!(json("generation_config.json")["eos_token_id"], 3);
    assert_eq!(json("tokenizer_config.json")["eos_token"], "#");
}
