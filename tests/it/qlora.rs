//! QLoRA end to end (`[model.quantize]`): LoRA adapters trained over a base kept in 4 bits, on
//! the tiny Qwen2 of `tests/fixtures/hf/qwen2` (made by `transformers`): the job trains,
//! resumes bit for bit, two workers match one, its final weights hold the base as
//! bitsandbytes saves it, `sample` reads them, its adapters export for PEFT and its merged export (de-quantised)
//! scores what the job scores; bad keys are refused before anything is created.

use std::path::Path;

use crate::common::{TestJob, load_weights, preempt_resume_and_compare};
use crate::open_models::{eval_json, fixture, job, text};

/// The fixture's hidden size is 32: blocks of 32 keep every row whole.
fn qlora_model(dir: &Path, quantize: &str) -> String {
    format!(
        "init_from = \"{}\"\nblock_size = 16\n[model.lora]\nr = 4\nalpha = 8\ndropout = 0.1\n\
         target_modules = \"all-linear\"\n[model.quantize]\n{quantize}",
        dir.display()
    )
}

const NF4: &str = "bits = 4\ntype = \"nf4\"\nblock_size = 32\ndouble_quant = true";

fn first_loss(t: &TestJob, name: &str) -> f64 {
    t.metrics(name)
        .iter()
        .find_map(|m| m.get("loss").and_then(|l| l.as_f64()))
        .expect("a logged loss")
}

#[test]
fn a_qlora_job_trains_over_a_4bit_base_resumes_and_two_workers_match_one() {
    let t = TestJob::new();
    let text = text(&t);
    let dir = fixture("qwen2");
    let model = qlora_model(&dir, NF4);
    let cfg = t.config(
        "qlora",
        &job(&text, &model, "").replace("log_every = 1", "log_every = 5"),
    );
    let two = ["--nproc-per-node", "2"];
    let whole = t.run(&cfg, &[&two[..], &["--name", "whole"]].concat());
    whole.success();
    assert!(whole.stdout.contains("4-bit nf4"), "{}", whole.stdout);

    // The final weights: the base as bitsandbytes saves it (uint8 codes, nested absmaxes,
    // the JSON state), the adapters trained.
    let saved = candle_core::safetensors::load(
        t.job("whole").join("model.safetensors"),
        &candle_core::Device::Cpu,
    )
    .unwrap();
    let q = "model.layers.0.self_attn.q_proj.weight";
    assert_eq!(saved[q].dtype(), candle_core::DType::U8);
    assert_eq!(saved[q].dims(), [32 * 32 / 2, 1]);
    for part in [
        ".absmax",
        ".quant_map",
        ".nested_absmax",
        ".nested_quant_map",
    ] {
        assert!(saved.contains_key(&format!("{q}{part}")), "{part}");
    }
    assert!(saved.contains_key(&format!("{q}.quant_state.bitsandbytes__nf4")));
    let b = saved["model.layers.1.mlp.down_proj.lora_B.weight"]
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    assert!(b.iter().any(|&v| v != 0.0), "the adapters did not train");

    // Over the f32 base the same job starts from almost the same loss: the 4-bit base is
    // the model, rounded.
    let lora = job(
        &text,
        &model.replace(&format!("[model.quantize]\n{NF4}"), ""),
        "",
    );
    t.run(
        &t.config("lora", &lora.replace("max_steps = 30", "max_steps = 1")),
        &[],
    )
    .success();
    let (q4, f32_base) = (first_loss(&t, "whole"), first_loss(&t, "lora"));
    assert!(
        (q4 - f32_base).abs() < 0.05 && q4 != f32_base,
        "first losses: 4-bit base {q4}, f32 base {f32_base}"
    );

    preempt_resume_and_compare(&t, &cfg, &two, "rank=1,step=17,kind=preempt");

    // Adapter dropout keyed by sample: one worker with the whole batch trains as two with
    // half of it each, and as one accumulating two halves.
    let short = job(&text, &model, "").replace("max_steps = 30", "max_steps = 8");
    crate::finetune::one_worker_matches_two(&t, &short);

    let jobs = t.jobs_dir().display().to_string();
    // `sample` generates from the final weights (the 4-bit base read back as saved).
    let sample = t.ddpjob(&[
        "sample",
        "whole",
        "--tokens",
        "7",
        "--json",
        "--jobs-dir",
        &jobs,
    ]);
    sample.success();
    let line: serde_json::Value = serde_json::from_str(sample.stdout.trim()).unwrap();
    assert_eq!(line["tokens"], 7);

    let peft = t.path("adapter");
    let peft_s = peft.display().to_string();
    t.ddpjob(&["export", "whole", "--peft", &peft_s, "--jobs-dir", &jobs])
        .success();
    let config = t.json(&peft.join("adapter_config.json"));
    assert_eq!(config["r"], 4);
    assert_eq!(
        load_weights(&peft.join("adapter_model.safetensors")).len(),
        2 * 7 * 2
    );

    // The merged export de-quantises the base and folds the adapters in: a plain f32 model
    // that scores what the job scores.
    let merged = t.path("merged");
    let merged_s = merged.display().to_string();
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
    let exported = load_weights(&merged.join("model.safetensors"));
    assert_eq!(exported[q].len(), 32 * 32, "q_proj de-quantised");
    let cfg_s = cfg.display().to_string();
    let job_loss = eval_json(&t, &["whole"])["loss"].as_f64().unwrap();
    let merged_loss = eval_json(&t, &[&merged_s, "--data", &cfg_s])["loss"]
        .as_f64()
        .unwrap();
    assert!(
        (job_loss - merged_loss).abs() < 1e-5,
        "job {job_loss} vs merged {merged_loss}"
    );

    // A job started from this one with adapters of another rank starts from its adapters
    // folded into the base (de-quantised, folded, quantised again).
    let next = qlora_model(&t.job("whole"), NF4).replace("r = 4", "r = 8");
    let next = job(&text, &next, "").replace("max_steps = 30", "max_steps = 1");
    t.run(&t.config("next", &next), &[]).success();
    let started = eval_json(&t, &["next"])["loss"].as_f64().unwrap();
    assert!(
        (started - job_loss).abs() < 0.05,
        "started at {started}, the job it continues scores {job_loss}"
    );
}

#[test]
fn bad_quantize_keys_exit_2_before_anything_is_created() {
    let t = TestJob::new();
    let text = text(&t);
    let dir = fixture("qwen2");
    let cases: Vec<(&str, String, &str)> = vec![
        ("bits", qlora_model(&dir, "bits = 8"), "model.quantize.bits"),
        (
            "type",
            qlora_model(&dir, "bits = 4\ntype = \"int4\""),
            "expected one of \"nf4\", \"fp4\"",
        ),
        (
            "block",
            qlora_model(&dir, "bits = 4\nblock_size = 48"),
            "bitsandbytes' block sizes are",
        ),
        (
            "straddle",
            qlora_model(&dir, "bits = 4\nblock_size = 64"),
            "not a multiple of it",
        ),
        (
            "no-lora",
            format!(
                "init_from = \"{}\"\nblock_size = 16\n[model.quantize]\nbits = 4",
                dir.display()
            ),
            "add [model.lora]",
        ),
        (
            "off",
            qlora_model(&dir, "type = \"fp4\""),
            "is 0 (off), but other [model.quantize] keys are set",
        ),
        (
            "gpt",
            "arch = \"gpt\"\nn_layer = 1\nn_head = 2\nn_embd = 64\nblock_size = 16\n\
             [model.lora]\nr = 4\n[model.quantize]\nbits = 4"
                .to_string(),
            "not `gpt`",
        ),
    ];
    for (name, model, said) in cases {
        let cfg = t.config(name, &job(&text, &model, ""));
        t.run(&cfg, &[]).fails_with(2, said);
        assert!(!t.job(name).exists(), "{name}: a job directory was made");
    }
    let sharded = job(
        &text,
        &qlora_model(&dir, NF4),
        "[distributed]\nsharding = \"full\"",
    );
    t.run(&t.config("full", &sharded), &[])
        .fails_with(2, "distributed.sharding");

    // A checkpoint quantised another way is named as not supported.
    let gptq = t.path("gptq");
    crate::common::copy_dir(&dir, &gptq);
    let config_path = gptq.join("config.json");
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&config_path).unwrap()).unwrap();
    config["quantization_config"] = serde_json::json!({"quant_method": "gptq", "bits": 4});
    std::fs::write(&config_path, config.to_string()).unwrap();
    let cfg = t.config("gptq", &job(&text, &qlora_model(&gptq, NF4), ""));
    t.run(&cfg, &[]).fails_with(2, "quantised by \"gptq\"");
    assert!(!t.job("gptq").exists());
}

/// A checkpoint transformers + bitsandbytes saved in 4 bits (`qwen2-h64-nf4`, made by
/// make_nf4_fixture.py) trains as saved, its codes kept as bitsandbytes wrote them, which are
/// the codes ddpjob makes of the same model's f32 weights (`qwen2-h64`); without
/// `[model.quantize]` it is taken as saved, with another format or without adapters refused
/// naming the key; the estimate counts the 4-bit base, not an f32 one.
#[test]
fn a_checkpoint_bitsandbytes_saved_in_4_bits_trains_as_saved() {
    let t = TestJob::new();
    let text = text(&t);
    let nf4 = "bits = 4\ntype = \"nf4\"\nblock_size = 64\ndouble_quant = true";
    let short = |dir: &Path, quantize: &str| {
        let model = qlora_model(&fixture(dir.to_str().unwrap()), quantize);
        job(&text, &model, "").replace("max_steps = 30", "max_steps = 3")
    };
    let saved_dir = fixture("qwen2-h64-nf4");
    let bnb = candle_core::safetensors::load(
        saved_dir.join("model.safetensors"),
        &candle_core::Device::Cpu,
    )
    .unwrap();
    for (name, dir) in [("saved", "qwen2-h64-nf4"), ("quantised", "qwen2-h64")] {
        t.run(&t.config(name, &short(Path::new(dir), nf4)), &[])
            .success();
        let ours = load_weights(&t.job(name).join("model.safetensors"));
        let mut compared = 0;
        for (tensor, theirs) in &bnb {
            // The JSON state says the same in its own spelling; every other part bit for bit.
            if tensor.contains(".quant_state.") || !tensor.contains("_proj.weight") {
                continue;
            }
            let theirs: Vec<f32> = theirs
                .to_dtype(candle_core::DType::F32)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap();
            assert_eq!(ours[tensor], theirs, "{name}: {tensor}");
            compared += 1;
        }
        assert_eq!(compared, 2 * 7 * 5, "{name}: 14 layers of 5 parts each");
    }

    // Without [model.quantize] the base is taken as saved, as `from_pretrained` takes it
    // (its config.json's quantization_config); a job that asks for another type, or gives
    // the 4-bit base no adapters to train, is refused naming the key.
    let lora_only = job(&text, &qlora_model(&saved_dir, ""), "")
        .replace("[model.quantize]\n", "")
        .replace("max_steps = 30", "max_steps = 2");
    let run = t.run(&t.config("as-saved", &lora_only), &[]);
    run.success();
    assert!(
        run.stdout
            .contains("base in 4 bits ([model.quantize]): 14 linear layers"),
        "{}",
        run.stdout
    );
    assert!(
        std::fs::read_to_string(t.job("as-saved").join("job.toml"))
            .unwrap()
            .contains("[model.quantize]"),
        "job.toml records the quantisation taken"
    );
    let fp4 = short(Path::new("qwen2-h64-nf4"), "bits = 4\ntype = \"fp4\"");
    t.run(&t.config("fp4", &fp4), &[])
        .fails_with(2, "was saved in 4 bits by bitsandbytes with \"nf4\"");
    let no_lora = format!("init_from = \"{}\"\nblock_size = 16", saved_dir.display());
    t.run(&t.config("no-lora", &job(&text, &no_lora, "")), &[])
        .fails_with(2, "add [model.lora]");
    let block = short(Path::new("qwen2-h64-nf4"), "block_size = 32");
    t.run(&t.config("block", &block), &[])
        .fails_with(2, "set [model.quantize] as it was saved");
    for name in ["fp4", "no-lora", "block"] {
        assert!(!t.job(name).exists(), "{name}: a job directory was made");
    }
    // Scoring needs no adapters: `eval` of the 4-bit checkpoint itself, and of the adapter
    // `peft` made over it (`qwen2-h64-nf4-lora`), which changes its loss.
    let data = t
        .config("data", &job(&text, "block_size = 16", ""))
        .display()
        .to_string();
    let score = |dir: &str| {
        let dir = fixture(dir).display().to_string();
        eval_json(&t, &[&dir, "--data", &data])["loss"]
            .as_f64()
            .unwrap()
    };
    let (base, adapted) = (score("qwen2-h64-nf4"), score("qwen2-h64-nf4-lora"));
    assert!(
        base.is_finite() && adapted.is_finite() && base != adapted,
        "{base} {adapted}"
    );

    // The estimate counts the base's codes and scales instead of its f32 weights: 2 layers
    // of q, k, v, o (64 x 64, 32 x 64, 32 x 64, 64 x 64) and gate, up, down (128 x 64 each),
    // 73,728 values: 4 bytes each in f32, half a byte and an f32 scale per 64 in 4 bits.
    let dense = short(Path::new("qwen2-h64"), nf4).replace(&format!("[model.quantize]\n{nf4}"), "");
    t.run(&t.config("dense", &dense), &[]).success();
    let peak = |name: &str| {
        t.json(&t.job(name).join("summary.json"))["estimated_peak_bytes"]
            .as_u64()
            .unwrap()
    };
    let values = 73_728;
    assert_eq!(
        peak("dense") - peak("quantised"),
        4 * values - (values / 2 + 4 * values / 64)
    );
}

/// `configs/qlora-smollm2.toml` as written, its model and text swapped for the fixtures (no
/// Hub here): every key of it is read and the job runs.
#[test]
fn the_shipped_qlora_recipe_runs() {
    let t = TestJob::new();
    let text = text(&t);
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let config = root.join("configs/qlora-smollm2.toml");
    let sets = [
        format!("model.init_from={}", fixture("qwen2-h64").display()),
        "model.block_size=16".into(),
        format!("data.path={}", text.display()),
        "data.download=false".into(),
        "train.max_steps=2".into(),
        "train.eval_every=0".into(),
        "checkpoint.every_steps=0".into(),
    ];
    let mut args = vec![];
    for s in &sets {
        args.extend(["--set", s.as_str()]);
    }
    let run = t.run(&config, &args);
    run.success();
    assert!(
        run.stdout
            .contains("base in 4 bits ([model.quantize]): 14 linear layers"),
        "{}",
        run.stdout
    );
}
