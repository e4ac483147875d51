//! Open models end to end: GPT-2 and Llama-family jobs from Hugging Face directories (the
//! tiny checkpoints of `tests/fixtures/hf`, made by `transformers`), trained by the real
//! binary, scored by `eval` and exported back; a llama from scratch resumed bit for bit and matched across world
//! sizes; the bad inputs refused before anything is created.

use std::path::{Path, PathBuf};

use crate::common::{TestJob, copy_dir, load_weights, max_abs_diff, preempt_resume_and_compare};

pub(crate) fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/hf")
        .join(name)
}

pub(crate) fn text(t: &TestJob) -> PathBuf {
    let path = t.path("corpus.txt");
    let shakespeare = include_str!("../fixtures/hf/sample.txt");
    std::fs::write(&path, shakespeare).unwrap();
    path
}

pub(crate) fn job(text: &Path, model: &str, extra: &str) -> String {
    format!(
        r#"
seed = 5
[model]
{model}
[data]
dataset = "text"
path = "{}"
[train]
epochs = 2
max_steps = 30
batch_size = 8
lr = 3e-3
optimizer = "adamw"
grad_clip_norm = 1.0
log_every = 1
eval_batch_size = 32
[checkpoint]
every_epochs = 1
keep_last = 0
{extra}
"#,
        text.display()
    )
}

fn scratch() -> &'static str {
    "arch = \"llama\"\nhidden_size = 32\nintermediate_size = 64\nnum_hidden_layers = 2\n\
     num_attention_heads = 4\nnum_key_value_heads = 2\nblock_size = 16"
}

#[test]
fn a_qwen2_checkpoint_fine_tunes_and_exports_back_to_hugging_face() {
    let t = TestJob::new();
    let text = text(&t);
    // The fixture with an end-of-sequence id, which the export must carry over.
    let dir = t.path("qwen2");
    copy_dir(&fixture("qwen2"), &dir);
    let config = std::fs::read_to_string(dir.join("config.json")).unwrap();
    let config = config.replace("\"eos_token_id\": null", "\"eos_token_id\": 7");
    std::fs::write(dir.join("config.json"), config).unwrap();
    // No arch: config.json says qwen2; the tokenizer is the directory's.
    let model = format!("init_from = \"{}\"\nblock_size = 16", dir.display());
    let cfg = t.config("ft", &job(&text, &model, ""));
    t.run(&cfg, &[]).success();
    let frozen = std::fs::read_to_string(t.job("ft").join("job.toml")).unwrap();
    for line in [
        "arch = \"llama\"",
        "model_type = \"qwen2\"",
        "hidden_size = 32",
    ] {
        assert!(frozen.contains(line), "job.toml lacks `{line}`:\n{frozen}");
    }
    assert!(frozen.contains("tokenizer.json"), "{frozen}");
    let losses: Vec<f64> = t
        .metrics("ft")
        .iter()
        .filter_map(|m| m["loss"].as_f64())
        .collect();
    let (first, last) = (losses[0], *losses.last().unwrap());
    // The fixture's random weights start near ln(320) = 5.77 nats.
    assert!(first > 5.0 && last < first - 0.5, "loss {first} → {last}");

    // The job keeps the tokenizer it trained with: its base may move or change after.
    std::fs::rename(&dir, t.path("qwen2-moved")).unwrap();
    let jobs = t.jobs_dir().display().to_string();
    let out = t.path("out");
    let out_s = out.display().to_string();
    t.ddpjob(&["export", "ft", "--hf", &out_s, "--jobs-dir", &jobs])
        .success();
    for file in [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ] {
        assert!(out.join(file).is_file(), "no {file} in the export");
    }
    let config = t.json(&out.join("config.json"));
    assert_eq!(config["model_type"], "qwen2");
    assert_eq!(config["architectures"][0], "Qwen2ForCausalLM");
    assert_eq!(config["tie_word_embeddings"], true);
    assert_eq!(config["eos_token_id"], 7);
    // The header's metadata as `save_pretrained` writes it (older transformers require it).
    let weights = std::fs::read(out.join("model.safetensors")).unwrap();
    let n = u64::from_le_bytes(weights[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&weights[8..8 + n]).unwrap();
    assert_eq!(header["__metadata__"]["format"], "pt");
    // The weights are the job's, bit for bit; the tied head is left out as transformers does.
    let mut trained = load_weights(&t.job("ft").join("model.safetensors"));
    trained.remove("lm_head.weight");
    let exported = load_weights(&out.join("model.safetensors"));
    assert_eq!(max_abs_diff(&trained, &exported), 0.0);
    t.ddpjob(&["export", "ft", "--hf", &out_s, "--jobs-dir", &jobs])
        .fails_with(2, "is not empty");
    t.ddpjob(&[
        "export",
        "ft",
        "--hf",
        &out_s,
        "--jobs-dir",
        &jobs,
        "--force",
    ])
    .success();

    // `sample` generates from the job with the model's own tokenizer.
    let sample = t.ddpjob(&[
        "sample",
        "ft",
        "--tokens",
        "7",
        "--json",
        "--jobs-dir",
        &jobs,
    ]);
    sample.success();
    let line: serde_json::Value = serde_json::from_str(sample.stdout.trim()).unwrap();
    assert_eq!(line["tokens"], 7);

    // The export is an HF directory in turn: a job continues from it.
    let again = format!("init_from = \"{out_s}\"\nblock_size = 16");
    let cfg = t.config(
        "again",
        &job(&text, &again, "").replace("max_steps = 30", "max_steps = 2"),
    );
    t.run(&cfg, &[]).success();
}

/// The fixture `name` fine-tuned, scored by `eval` as the run did (the directory at step 0, the
/// job at its end), exported with `export --hf`, the export scored with the job's loss, and
/// sampled; the export's `config.json`, weights and the `job.toml` it froze.
/// The fixture `name` (of `model_type` `name`) fine-tuned, evaluated (`eval` of the base and
/// of the job agree with the job's own validation losses), exported and scored again.
pub(crate) fn fine_tune_evaluate_and_export(
    name: &str,
) -> (
    serde_json::Value,
    std::collections::BTreeMap<String, Vec<f32>>,
    String,
) {
    let (t, config, weights, frozen) = fine_tune_evaluate_and_export_in(name, name, "");
    drop(t);
    (config, weights, frozen)
}

/// [`fine_tune_evaluate_and_export`] of the fixture directory `name`, whose `model_type` is
/// `model_type`, with `extra` lines in `[model]`; the test directory kept for more checks.
pub(crate) fn fine_tune_evaluate_and_export_in(
    name: &str,
    model_type: &str,
    extra: &str,
) -> (
    TestJob,
    serde_json::Value,
    std::collections::BTreeMap<String, Vec<f32>>,
    String,
) {
    let t = TestJob::new();
    let text = text(&t);
    let dir = fixture(name);
    let model = format!(
        "init_from = \"{}\"\nblock_size = 16\n{extra}",
        dir.display()
    );
    let file = job(&text, &model, "").replace("log_every = 1", "log_every = 1\neval_every = 10");
    let cfg = t.config("ft", &file);
    t.run(&cfg, &[]).success();
    let frozen = std::fs::read_to_string(t.job("ft").join("job.toml")).unwrap();
    assert!(
        frozen.contains(&format!("model_type = \"{model_type}\"")),
        "{frozen}"
    );
    let evals: Vec<(u64, f64)> = t
        .metrics("ft")
        .iter()
        .filter(|m| m["kind"] == "eval" || m["kind"] == "epoch")
        .filter_map(|m| Some((m["step"].as_u64()?, m["test_loss"].as_f64()?)))
        .collect();
    let (start, end) = (evals[0], *evals.last().unwrap());
    assert_eq!(start.0, 0, "{name}: {evals:?}");
    assert!(
        end.1 < start.1 - 0.3,
        "{name}: val loss {start:?} → {end:?}"
    );
    let cfg_s = cfg.display().to_string();
    let pretrained = eval_json(&t, &[dir.to_str().unwrap(), "--data", &cfg_s]);
    assert_eq!(pretrained["loss"].as_f64(), Some(start.1), "{name}");
    let trained = eval_json(&t, &["ft"]);
    assert_eq!(trained["loss"].as_f64(), Some(end.1), "{name}");

    let out = t.path("out");
    let out_s = out.display().to_string();
    let jobs = t.jobs_dir().display().to_string();
    t.ddpjob(&["export", "ft", "--hf", &out_s, "--jobs-dir", &jobs])
        .success();
    let again = eval_json(&t, &[&out_s, "--data", &cfg_s]);
    let (a, b) = (again["loss"].as_f64().unwrap(), end.1);
    assert!((a - b).abs() < 1e-5, "{name}: export {a} vs job {b}");
    let sample = t.ddpjob(&[
        "sample",
        "ft",
        "--tokens",
        "5",
        "--json",
        "--jobs-dir",
        &jobs,
    ]);
    sample.success();
    let config = t.json(&out.join("config.json"));
    let weights = load_weights(&out.join("model.safetensors"));
    (t, config, weights, frozen)
}

/// Qwen3 (per-head q/k norms, `head_dim` not hidden / heads): exported as `Qwen3ForCausalLM`
/// with its norms.
#[test]
fn a_qwen3_checkpoint_fine_tunes_evaluates_and_exports_back() {
    let (config, weights, frozen) = fine_tune_evaluate_and_export("qwen3");
    assert!(frozen.contains("head_dim = 16"), "{frozen}");
    assert_eq!(config["architectures"][0], "Qwen3ForCausalLM");
    assert_eq!(config["head_dim"], 16);
    assert_eq!(config["attention_bias"], false);
    assert!(weights.contains_key("model.layers.1.self_attn.k_norm.weight"));
}

/// SmolLM3 (layers 2 and 4 without positions): exported as `SmolLM3ForCausalLM` with its
/// `no_rope_layers`.
#[test]
fn a_smollm3_checkpoint_fine_tunes_evaluates_and_exports_back() {
    let (config, weights, frozen) = fine_tune_evaluate_and_export("smollm3");
    let frozen: toml::Table = toml::from_str(&frozen).unwrap();
    let layers = frozen["model"]["no_rope_layers"].as_array().unwrap();
    let layers: Vec<i64> = layers.iter().filter_map(toml::Value::as_integer).collect();
    assert_eq!(layers, [1, 0, 1, 0]);
    assert_eq!(config["architectures"][0], "SmolLM3ForCausalLM");
    assert_eq!(config["no_rope_layers"], serde_json::json!([1, 0, 1, 0]));
    assert_eq!(config["attention_bias"], true);
    // Not SmolLM3Config's defaults (its own tokenizer's ids, past this vocabulary).
    assert!(config["pad_token_id"].is_null(), "{config}");
    assert!(weights.contains_key("lm_head.weight"));
}

/// Gemma 3 (sliding and full layers, RoPE bases per type, (1 + w) norms, GeGLU): exported as
/// `Gemma3ForCausalLM` in transformers 5.x's layout, whichever layout it was read from.
#[test]
fn a_gemma3_checkpoint_fine_tunes_evaluates_and_exports_back() {
    let (_t, config, weights, frozen) =
        fine_tune_evaluate_and_export_in("gemma3-v4", "gemma3_text", "");
    assert!(
        frozen.contains("rope_local_base_freq = 10000.0"),
        "{frozen}"
    );
    assert_eq!(config["architectures"][0], "Gemma3ForCausalLM");
    assert_eq!(
        config["layer_types"],
        serde_json::json!(["sliding_attention", "full_attention", "sliding_attention"])
    );
    assert_eq!(
        config["rope_parameters"]["full_attention"]["rope_type"],
        "linear"
    );
    assert_eq!(config["rope_parameters"]["full_attention"]["factor"], 8.0);
    assert_eq!(config["query_pre_attn_scalar"], 24);
    assert_eq!(config["sliding_window"], 4);
    assert!(weights.contains_key("model.layers.2.post_feedforward_layernorm.weight"));
    assert!(!weights.contains_key("lm_head.weight"), "tied: left out");
}

/// `ddpjob eval ... --json`'s object.
pub(crate) fn eval_json(t: &TestJob, args: &[&str]) -> serde_json::Value {
    let jobs = t.jobs_dir().display().to_string();
    let mut all = vec!["eval"];
    all.extend(args);
    all.extend(["--json", "--jobs-dir", &jobs]);
    let run = t.ddpjob(&all);
    run.success();
    serde_json::from_str(run.stdout.trim()).unwrap()
}

#[test]
fn a_gpt2_checkpoint_fine_tunes_evaluates_and_exports_back() {
    let t = TestJob::new();
    let text = text(&t);
    // The Hub's layout (no `transformer.` prefix, mask buffers); dropout on, as fine-tunes do.
    let dir = fixture("gpt2-hub");
    let model = format!(
        "init_from = \"{}\"\nblock_size = 32\ndropout = 0.1",
        dir.display()
    );
    let file = job(&text, &model, "").replace("log_every = 1", "log_every = 1\neval_every = 10");
    let cfg = t.config("ft", &file);
    let run = t.run(&cfg, &[]);
    run.success();
    assert!(run.stdout.contains("step 0/30: val loss"), "{}", run.stdout);
    let frozen = std::fs::read_to_string(t.job("ft").join("job.toml")).unwrap();
    for line in [
        "arch = \"gpt\"",
        "activation = \"gelu_new\"",
        "n_embd = 32",
        "vocab_size = 320",
    ] {
        assert!(frozen.contains(line), "job.toml lacks `{line}`:\n{frozen}");
    }
    let evals: Vec<(u64, f64)> = t
        .metrics("ft")
        .iter()
        .filter(|m| m["kind"] == "eval" || m["kind"] == "epoch")
        .filter_map(|m| Some((m["step"].as_u64()?, m["test_loss"].as_f64()?)))
        .collect();
    let (start, end) = (evals[0], *evals.last().unwrap());
    assert_eq!(start.0, 0, "{evals:?}");
    assert!(end.1 < start.1 - 0.3, "val loss {start:?} → {end:?}");

    // eval scores as the run did: the pretrained directory on the job file's data gives the
    // step-0 figure, the job's final weights the last one, bit for bit.
    let cfg_s = cfg.display().to_string();
    let pretrained = eval_json(&t, &[dir.to_str().unwrap(), "--data", &cfg_s]);
    assert_eq!(pretrained["loss"].as_f64(), Some(start.1));
    let trained = eval_json(&t, &["ft"]);
    assert_eq!(trained["loss"].as_f64(), Some(end.1));
    // A bad key of the data file is named with both files: the text checked is put together
    // from them, so a line of it is no line of the data file (it said `bad.toml:14:16`).
    let bad = t.config("bad", &file.replace("[data]", "[data]\nval_fraction = 2.0"));
    let jobs = t.jobs_dir().display().to_string();
    let refused = t.ddpjob(&[
        "eval",
        "ft",
        "--data",
        bad.to_str().unwrap(),
        "--jobs-dir",
        &jobs,
    ]);
    refused.fails_with(
        2,
        &format!(
            "invalid `data.val_fraction` ({} with [data] from {}): ",
            t.job("ft").join("job.toml").display(),
            bad.display()
        ),
    );
    let tokens = trained["tokens"].as_u64().unwrap();
    let perplexity = trained["perplexity"].as_f64().unwrap();
    assert!(tokens > 100 && (perplexity - end.1.exp()).abs() < 1e-9);

    // Exported as GPT2LMHeadModel (Conv1D weights transposed back) and read in again: the
    // same loss, so load → export → load lost nothing.
    let out = t.path("out");
    let out_s = out.display().to_string();
    let jobs = t.jobs_dir().display().to_string();
    t.ddpjob(&["export", "ft", "--hf", &out_s, "--jobs-dir", &jobs])
        .success();
    let config = t.json(&out.join("config.json"));
    assert_eq!(config["architectures"][0], "GPT2LMHeadModel");
    assert_eq!(config["activation_function"], "gelu_new");
    assert_eq!(config["n_positions"], 32);
    assert!(out.join("tokenizer.json").is_file());
    let exported = eval_json(&t, &[&out_s, "--data", &cfg_s]);
    assert_eq!(exported["loss"], trained["loss"]);
    let sample = t.ddpjob(&[
        "sample",
        "ft",
        "--tokens",
        "5",
        "--json",
        "--jobs-dir",
        &jobs,
    ]);
    sample.success();
}

#[test]
fn eval_scores_a_classifier_as_its_run_did() {
    let t = TestJob::new();
    let cfg = t.config("tiny", crate::common::TINY);
    t.run(&cfg, &[]).success();
    let summary = t.json(&t.job("tiny").join("summary.json"));
    let line = eval_json(&t, &["tiny"]);
    assert_eq!(line["loss"], summary["test_loss"]);
    assert_eq!(line["accuracy"], summary["test_accuracy"]);
    assert_eq!(line["samples"], 256);
    assert!(line.get("perplexity").is_none(), "{line}");
}

#[test]
fn a_job_starts_from_another_jobs_weights_its_model_and_vocabulary() {
    let t = TestJob::new();
    let text = text(&t);
    let jobs = t.jobs_dir().display().to_string();
    let gpt = "arch = \"gpt\"\nn_layer = 2\nn_head = 2\nn_embd = 32\nblock_size = 32";
    for (pre, model) in [("gpt-pre", gpt), ("llama-pre", scratch())] {
        let cfg = t.config(
            pre,
            &job(&text, model, "").replace("max_steps = 30", "max_steps = 12"),
        );
        t.run(&cfg, &[]).success();
        let last_val = |name: &str| {
            let evals: Vec<f64> = t
                .metrics(name)
                .iter()
                .filter_map(|m| m["test_loss"].as_f64())
                .collect();
            *evals.last().unwrap()
        };
        // The whole job: its model (arch and sizes from its job.toml) and its char vocabulary,
        // so the first evaluation is where the source ended, bit for bit.
        let source = t.job(pre).display().to_string();
        let follow = format!("{pre}-ft");
        let model = format!("init_from = \"{source}\"");
        let file = job(&text, &model, "").replace("log_every = 1", "log_every = 1\neval_every = 4");
        let cfg = t.config(&follow, &file.replace("max_steps = 30", "max_steps = 4"));
        t.run(&cfg, &[]).success();
        let first = t
            .metrics(&follow)
            .iter()
            .find_map(|m| m["test_loss"].as_f64());
        assert_eq!(first, Some(last_val(pre)), "{follow}");
        assert_eq!(
            std::fs::read(t.job(pre).join("vocab.json")).unwrap(),
            std::fs::read(t.job(&follow).join("vocab.json")).unwrap()
        );
        t.ddpjob(&["sample", &follow, "--tokens", "3", "--jobs-dir", &jobs])
            .success();
    }
    // A checkpoint directory, with a shorter window (the gpt's position table is cut).
    let step = t.job("gpt-pre").join("checkpoints/step-00000012");
    let model = format!("init_from = \"{}\"\nblock_size = 16", step.display());
    let cfg = t.config(
        "from-step",
        &job(&text, &model, "").replace("max_steps = 30", "max_steps = 2"),
    );
    t.run(&cfg, &[]).success();
    let frozen = std::fs::read_to_string(t.job("from-step").join("job.toml")).unwrap();
    assert!(
        frozen.contains("n_embd = 32") && frozen.contains("block_size = 16"),
        "{frozen}"
    );
    // A size restated differently, and a model of another arch, are named.
    let source = t.job("gpt-pre").display().to_string();
    let bad = format!("init_from = \"{source}\"\nn_embd = 64");
    t.run(&t.config("bad", &job(&text, &bad, "")), &[])
        .fails_with(2, "model.n_embd = 64, but");
    let bad = format!("arch = \"llama\"\ninit_from = \"{source}\"");
    t.run(&t.config("bad2", &job(&text, &bad, "")), &[])
        .fails_with(2, "is not a llama job's");
}

#[test]
fn a_llama_from_scratch_resumes_bit_for_bit_and_two_workers_match_one() {
    let t = TestJob::new();
    let text = text(&t);
    let cfg = t.config(
        "job",
        &job(&text, scratch(), "").replace("log_every = 1", "log_every = 5"),
    );
    t.run(&cfg, &["--name", "whole"]).success();
    preempt_resume_and_compare(&t, &cfg, &[], "rank=0,step=17,kind=preempt");

    let half = job(&text, scratch(), "")
        .replace("batch_size = 8", "batch_size = 4")
        .replace("max_steps = 30", "max_steps = 10");
    let full = job(&text, scratch(), "").replace("max_steps = 30", "max_steps = 10");
    t.run(&t.config("one", &full), &["--nproc-per-node", "1"])
        .success();
    t.run(&t.config("two", &half), &["--nproc-per-node", "2"])
        .success();
    let diff = max_abs_diff(
        &load_weights(&t.job("one").join("model.safetensors")),
        &load_weights(&t.job("two").join("model.safetensors")),
    );
    assert!(diff < 1e-5, "1 x 8 and 2 x 4 differ by {diff}");
}

#[test]
fn bad_open_model_jobs_exit_2_before_anything_is_created() {
    let t = TestJob::new();
    let text = text(&t);
    let run = |name: &str, model: &str| {
        let cfg = t.config(name, &job(&text, model, ""));
        t.run(&cfg, &[])
    };
    // No `models/` folder here: read as a Hub id, which the Hub (none, in tests) cannot give.
    run("missing", "init_from = \"models/SmolLM2-135M\"")
        .fails_with(
            2,
            "\"models/SmolLM2-135M\" is no path here, so it names a Hub model: cannot download",
        )
        .fails_with(2, "`model.init_from` (");
    // With a `models/` folder it is a path, and its absence says how to make it.
    std::fs::create_dir_all(t.path("models")).unwrap();
    run("missing-dir", "init_from = \"models/SmolLM2-135M\"").fails_with(
        2,
        "the model directory `models/SmolLM2-135M` does not exist",
    );
    let llama = fixture("llama").display().to_string();
    run(
        "restated",
        &format!("init_from = \"{llama}\"\nnum_hidden_layers = 4"),
    )
    .fails_with(2, "model.num_hidden_layers = 4, but");
    run(
        "too-long",
        &format!("init_from = \"{llama}\"\nblock_size = 128"),
    )
    .fails_with(2, "model.block_size = 128 is longer than");
    run("unknown", &format!("{}\nnum_layers = 2", scratch())).fails_with(2, "num_layers");
    run(
        "lora-targets",
        &format!(
            "{}\n[model.lora]\nr = 4\ntarget_modules = [\"c_attn\"]",
            scratch()
        ),
    )
    .fails_with(
        2,
        "names \"c_attn\", which matches none of the model's linear layers",
    )
    .fails_with(
        2,
        "down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj",
    );
    run(
        "lora-off",
        &format!("{}\n[model.lora]\nalpha = 16", scratch()),
    )
    .fails_with(2, "is 0 (LoRA off)");
    let gpt2 = fixture("gpt2").display().to_string();
    run(
        "gpt2-restated",
        &format!("init_from = \"{gpt2}\"\nn_embd = 64\nblock_size = 128"),
    )
    .fails_with(2, "model.n_embd = 64, but")
    .fails_with(2, "has position embeddings for 64 tokens; use at most 64");
    let jobs = t.jobs_dir().display().to_string();
    t.ddpjob(&["eval", "nothing", "--jobs-dir", &jobs])
        .fails_with(2, "is neither a job in");
    t.ddpjob(&["eval", &gpt2, "--jobs-dir", &jobs])
        .fails_with(2, "say what to score");
    t.ddpjob(&["eval", &gpt2, "--checkpoint", "best", "--jobs-dir", &jobs])
        .fails_with(2, "--checkpoint picks a job's weights");
    let other = t.path("falcon");
    std::fs::create_dir(&other).unwrap();
    std::fs::write(other.join("config.json"), r#"{"model_type": "falcon"}"#).unwrap();
    std::fs::write(other.join("model.safetensors"), b"").unwrap();
    run("falcon", &format!("init_from = \"{}\"", other.display())).fails_with(
        2,
        "holds a \"falcon\" model: this ddpjob reads \"gpt2\" (model.arch = \"gpt\")",
    );
    // A newer family's feature is named by its key (Qwen3-Next's linear attention).
    let next = r#"{"model_type": "qwen3_next", "layer_types": ["linear_attention"]}"#;
    std::fs::write(other.join("config.json"), next).unwrap();
    run("next", &format!("init_from = \"{}\"", other.display()))
        .fails_with(2, "has linear-attention layers (`layer_types` holds");
    std::fs::write(other.join("config.json"), r#"{"model_type": "gpt2"}"#).unwrap();
    run("gpt2", &format!("init_from = \"{}\"", other.display()))
        .fails_with(2, "has no \"n_embd\", which is required");
    // A size of the checkpoint's own config.json is named there, not in the job file.
    let heads = t.path("llama-kv3");
    copy_dir(&fixture("llama"), &heads);
    let config = std::fs::read_to_string(heads.join("config.json")).unwrap();
    let mut config: serde_json::Value = serde_json::from_str(&config).unwrap();
    config["num_key_value_heads"] = 3.into();
    std::fs::write(heads.join("config.json"), config.to_string()).unwrap();
    run("kv3", &format!("init_from = \"{}\"", heads.display())).fails_with(
        2,
        &format!(
            "(the value of `{}`, the checkpoint model.init_from names)",
            heads.join("config.json").display()
        ),
    );
    // A tokenizer with more tokens than the model has rows.
    let small = format!("{}\nvocab_size = 100", scratch());
    let cfg = t.config(
        "vocab",
        &job(&text, &small, "").replace(
            "dataset = \"text\"",
            &format!(
                "dataset = \"text\"\ntokenizer = \"{}\"",
                fixture("llama").join("tokenizer.json").display()
            ),
        ),
    );
    t.run(&cfg, &[])
        .fails_with(2, "model.vocab_size = 100 is smaller than the vocabulary");
    // A checkpoint without its tokenizer: its embeddings are indexed by that tokenizer's ids,
    // which ddpjob's own character vocabulary would not give (it trained on them silently).
    let bare = t.path("llama-bare");
    std::fs::create_dir(&bare).unwrap();
    for file in ["config.json", "model.safetensors"] {
        std::fs::copy(fixture("llama").join(file), bare.join(file)).unwrap();
    }
    run("bare", &format!("init_from = \"{}\"", bare.display()))
        .fails_with(
            2,
            "tokenizer.json` does not exist: it is the tokenizer whose ids",
        )
        .fails_with(2, "set data.tokenizer");
    // Weights cut short (an interrupted download): refused by their header before the job
    // exists, not in a worker of a job left failed.
    std::fs::copy(
        fixture("llama").join("tokenizer.json"),
        bare.join("tokenizer.json"),
    )
    .unwrap();
    let weights = std::fs::read(bare.join("model.safetensors")).unwrap();
    std::fs::write(
        bare.join("model.safetensors"),
        &weights[..weights.len() / 2],
    )
    .unwrap();
    run("truncated", &format!("init_from = \"{}\"", bare.display()))
        .fails_with(2, "model.safetensors` is not a whole safetensors file")
        .fails_with(2, "fetch it again");
    // A config.json that does not describe its weights: refused from their headers, by
    // `validate` as by `run`, before the job exists.
    std::fs::write(bare.join("model.safetensors"), &weights).unwrap();
    let config = std::fs::read_to_string(bare.join("config.json")).unwrap();
    let wider = config.replace("\"hidden_size\": 32", "\"hidden_size\": 64");
    assert_ne!(wider, config);
    std::fs::write(bare.join("config.json"), wider).unwrap();
    let mismatched = format!("init_from = \"{}\"", bare.display());
    let expects = "tensor `model.embed_tokens.weight` has shape [320, 32], the model expects \
                   [320, 64]";
    run("mismatched", &mismatched).fails_with(2, expects);
    let cfg = t.config("mismatched", &job(&text, &mismatched, ""));
    t.ddpjob(&["validate", cfg.to_str().unwrap()])
        .fails_with(2, expects);
    assert!(!t.jobs_dir().exists() || std::fs::read_dir(t.jobs_dir()).unwrap().next().is_none());
}

/// LoRA on a pretrained checkpoint: only the adapters move (the base stays the checkpoint's,
/// bit for bit), two workers preempted and resumed end bit-identical, the adapters export in
/// PEFT's format, and the merged export scores what the job scores.
#[test]
fn a_lora_job_trains_its_adapters_resumes_and_exports_for_peft() {
    let t = TestJob::new();
    let text = text(&t);
    let dir = fixture("qwen2");
    let model = format!(
        "init_from = \"{}\"\nblock_size = 16\n[model.lora]\nr = 4\nalpha = 8\ndropout = 0.1\n\
         target_modules = [\"q_proj\", \"v_proj\", \"up_proj\"]",
        dir.display()
    );
    let cfg = t.config(
        "lora",
        &job(&text, &model, "").replace("log_every = 1", "log_every = 5"),
    );
    let two = ["--nproc-per-node", "2"];
    let whole = t.run(&cfg, &[&two[..], &["--name", "whole"]].concat());
    whole.success();
    assert!(whole.stdout.contains("frozen: "), "{}", whole.stdout);
    let trained = load_weights(&t.job("whole").join("model.safetensors"));
    let base = load_weights(&dir.join("model.safetensors"));
    let mut adapters = 0;
    for (name, values) in &trained {
        match base.get(name) {
            Some(b) => assert_eq!(b, values, "{name} moved"),
            None if name.contains(".lora_B.") => {
                adapters += 1;
                assert!(values.iter().any(|&v| v != 0.0), "{name} did not train");
            }
            None => assert!(
                name.contains(".lora_A.") || name == "lm_head.weight",
                "{name}"
            ),
        }
    }
    assert_eq!(adapters, 3 * 2, "q, v and up of the fixture's 2 layers");

    preempt_resume_and_compare(&t, &cfg, &two, "rank=1,step=17,kind=preempt");
    let jobs = t.jobs_dir().display().to_string();

    // Adapter dropout keyed by sample: one worker with the whole batch trains as two with
    // half of it each.
    let short = |batch: &str| {
        job(&text, &model, "")
            .replace("batch_size = 8", batch)
            .replace("max_steps = 30", "max_steps = 8")
    };
    t.run(&t.config("one", &short("batch_size = 8")), &[])
        .success();
    t.run(&t.config("two", &short("batch_size = 4")), &two)
        .success();
    let diff = max_abs_diff(
        &load_weights(&t.job("one").join("model.safetensors")),
        &load_weights(&t.job("two").join("model.safetensors")),
    );
    assert!(diff < 1e-5, "1 x 8 and 2 x 4 differ by {diff}");

    let peft = t.path("adapter");
    let peft_s = peft.display().to_string();
    // --merge-lora makes a whole model (--hf); beside --peft it is a mistake, not ignored.
    t.ddpjob(&[
        "export",
        "whole",
        "--peft",
        &peft_s,
        "--merge-lora",
        "--jobs-dir",
        &jobs,
    ])
    .fails_with(2, "--merge-lora goes with --hf");
    assert!(!peft.exists());
    t.ddpjob(&["export", "whole", "--peft", &peft_s, "--jobs-dir", &jobs])
        .success();
    let config = t.json(&peft.join("adapter_config.json"));
    assert_eq!(config["peft_type"], "LORA");
    assert_eq!(config["r"], 4);
    assert_eq!(config["lora_alpha"], 8.0);
    assert_eq!(config["lora_dropout"], 0.1);
    assert_eq!(
        config["target_modules"],
        serde_json::json!(["q_proj", "up_proj", "v_proj"])
    );
    assert_eq!(config["base_model_name_or_path"], dir.display().to_string());
    let saved = load_weights(&peft.join("adapter_model.safetensors"));
    assert_eq!(saved.len(), 12);
    let key = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight";
    assert_eq!(
        saved[key],
        trained["model.layers.0.self_attn.q_proj.lora_B.weight"]
    );

    let merged = t.path("merged");
    let merged_s = merged.display().to_string();
    t.ddpjob(&["export", "whole", "--hf", &merged_s, "--jobs-dir", &jobs])
        .fails_with(2, "pass --merge-lora");
    t.ddpjob(&[
        "export",
        "whole",
        "--hf",
        &merged_s,
        "--merge-lora",
        "--jobs-dir",
        &jobs,
    ])
    .success();
    let cfg_s = cfg.display().to_string();
    let job_loss = eval_json(&t, &["whole"])["loss"].as_f64().unwrap();
    let merged_loss = eval_json(&t, &[&merged_s, "--data", &cfg_s])["loss"]
        .as_f64()
        .unwrap();
    assert!(
        (job_loss - merged_loss).abs() < 1e-5,
        "job {job_loss} vs merged {merged_loss}"
    );
}

/// Pre-tokenised ids of a pretrained model (`data.dataset = "tokens"`) were made by its
/// tokenizer, which the job keeps: `sample` turns them into text with it.
#[test]
fn sample_of_a_pretrained_models_token_job_decodes_with_its_tokenizer() {
    let t = TestJob::new();
    let ids: Vec<u8> = (0..4000u16)
        .flat_map(|i| ((i * 7) % 300).to_le_bytes())
        .collect();
    std::fs::write(t.path("train.bin"), &ids).unwrap();
    std::fs::write(t.path("val.bin"), &ids[..1000]).unwrap();
    let text = format!(
        "[model]\ninit_from = \"{}\"\nblock_size = 16\n[data]\ndataset = \"tokens\"\n\
         train_path = \"{}\"\nval_path = \"{}\"\n[train]\nmax_steps = 2\nbatch_size = 4\n",
        fixture("llama").display(),
        t.path("train.bin").display(),
        t.path("val.bin").display()
    );
    t.run(&t.config("ids", &text), &[]).success();
    assert!(t.job("ids").join("tokenizer/tokenizer.json").is_file());
    let jobs = t.jobs_dir().display().to_string();
    let args = [
        "sample", "ids", "--prompt", "ROMEO:", "--tokens", "5", "--json",
    ];
    let sampled = t.ddpjob(&[&args[..], &["--jobs-dir", &jobs]].concat());
    sampled.success();
    let line: serde_json::Value = serde_json::from_str(sampled.stdout.trim()).unwrap();
    assert_eq!(line["tokens"], 5, "{line}");
}

/// A job that trained on token ids it was given (`data.dataset = "tokens"`, a scratch model)
/// kept no tokenizer and no vocabulary: `export --hf` writes the weights and says what to put
/// beside them.
#[test]
fn export_of_a_token_job_without_a_tokenizer_says_which_tokenizer_is_missing() {
    let t = TestJob::new();
    let ids: Vec<u8> = (0..2000u16)
        .flat_map(|i| ((i * 7) % 50).to_le_bytes())
        .collect();
    std::fs::write(t.path("train.bin"), &ids).unwrap();
    std::fs::write(t.path("val.bin"), &ids[..800]).unwrap();
    let text = format!(
        "[model]\narch = \"gpt\"\nn_layer = 1\nn_head = 1\nn_embd = 8\nblock_size = 8\n\
         vocab_size = 64\n[data]\ndataset = \"tokens\"\ntrain_path = \"{}\"\nval_path = \"{}\"\n\
         [train]\nmax_steps = 2\nbatch_size = 4\n",
        t.path("train.bin").display(),
        t.path("val.bin").display()
    );
    t.run(&t.config("ids", &text), &[]).success();
    let out = t.path("hf-ids").display().to_string();
    let jobs = t.jobs_dir().display().to_string();
    let exported = t.ddpjob(&["export", "ids", "--hf", &out, "--jobs-dir", &jobs]);
    exported.success();
    assert!(
        exported
            .stdout
            .contains("the job trained on token ids it was given and kept no vocabulary"),
        "{}",
        exported.stdout
    );
    assert!(t.path("hf-ids").join("model.safetensors").is_file());
}
