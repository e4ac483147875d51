//! Language models end to end: a tiny GPT on a few KB of text the test writes (and on a token
//! file), trained by the real binary, then sampled; DDP equivalence with dropout, bit-exact
//! resume after SIGTERM, and the bad inputs a user meets first.

use std::path::Path;

use crate::common::{Run, TestJob, assert_same_bits, corpus, load_weights};

fn gpt_job(text_path: &Path, extra: &str) -> String {
    format!(
        r#"
seed = 11
[model]
arch = "gpt"
n_layer = 1
n_head = 2
n_embd = 16
block_size = 16
bias = false
[data]
dataset = "text"
path = "{}"
[train]
epochs = 3
max_steps = 60
batch_size = 8
lr = 0.01
optimizer = "adamw"
betas = [0.9, 0.99]
weight_decay = 0.1
grad_clip_norm = 1.0
log_every = 5
eval_batch_size = 32
[train.scheduler]
kind = "cosine"
warmup_steps = 5
min_lr = 0.001
[checkpoint]
every_epochs = 1
keep_last = 0
{extra}
"#,
        text_path.display()
    )
}

fn write_corpus(t: &TestJob) -> std::path::PathBuf {
    let path = t.path("corpus.txt");
    std::fs::write(&path, corpus()).unwrap();
    path
}

#[test]
fn a_tiny_gpt_learns_text_and_samples_from_it() {
    let t = TestJob::new();
    let text = write_corpus(&t);
    let cfg = t.config("lm", &gpt_job(&text, "keep_best = true\n[train.x]\n"));
    // An unknown key inside a table still names itself (the [train.x] above).
    t.run(&cfg, &[]).fails_with(2, "unknown key `x`");
    let cfg = t.config(
        "lm",
        &gpt_job(&text, "keep_best = true")
            .replace("[train]", "[train]\neval_every = 20")
            .replace("max_steps = 60", "max_steps = 200"),
    );
    t.run(&cfg, &[]).success();
    let job = t.job("lm");
    let summary = t.json(&job.join("summary.json"));
    let vocab = 30f64; // distinct characters of the corpus, about
    let val = summary["test_loss"].as_f64().unwrap();
    assert!(val < 0.5 * vocab.ln(), "validation loss {val} vs ln(vocab)");
    assert!(summary["train_tokens_per_s"].as_f64().unwrap() > 0.0);
    let best = summary["best_test_loss"].as_f64().unwrap();
    assert!(best <= val, "{summary}");
    assert!(job.join("checkpoints/best/model.safetensors").is_file());
    let evals = t.metrics("lm");
    let mid: Vec<u64> = evals
        .iter()
        .filter(|l| l["kind"] == "eval")
        .map(|l| l["step"].as_u64().unwrap())
        .collect();
    assert!(mid.contains(&20) && mid.contains(&40), "{mid:?}");
    // The task reports perplexity: every evaluation line and the summary carry e^loss, and
    // `show` and `list` judge the job by its lowest validation loss.
    for l in evals
        .iter()
        .filter(|l| l["kind"] == "eval" || l["kind"] == "epoch")
    {
        let (loss, ppl) = (
            l["test_loss"].as_f64().unwrap(),
            l["test_perplexity"].as_f64(),
        );
        assert!((ppl.unwrap() - loss.exp()).abs() < 1e-9 * loss.exp(), "{l}");
    }
    let ppl = summary["test_perplexity"].as_f64().unwrap();
    assert!((ppl - val.exp()).abs() < 1e-9 * ppl, "{summary}");
    // What the task declared travels with the job: in `state.json` as it trains, in the
    // summary at the end, the headline first.
    let state = t.json(&job.join("state.json"));
    for declared in [&summary["metrics"], &state["metrics"]] {
        let names: Vec<&str> = declared
            .as_array()
            .unwrap_or_else(|| panic!("no declared metrics: {summary} / {state}"))
            .iter()
            .map(|m| m["name"].as_str().unwrap())
            .collect();
        assert_eq!(names, ["loss", "perplexity", "accuracy"]);
    }
    assert_eq!(summary["metrics"][2]["label"], "next-token accuracy");
    let jobs = t.jobs_dir().to_string_lossy().into_owned();
    let show = t.ddpjob(&["show", "lm", "--jobs-dir", &jobs]);
    show.success();
    let best_line = format!("best        val loss {best:.4} at ");
    assert!(show.stdout.contains(&best_line), "{}", show.stdout);
    assert!(
        show.stdout.contains(&format!(
            "val loss {val:.4}, perplexity {ppl:.3}, next-token accuracy"
        )),
        "{}",
        show.stdout
    );
    let list = t.ddpjob(&["list", "--jobs-dir", &jobs]);
    assert!(
        list.stdout.contains(&format!(" {best:.4} ")),
        "{}",
        list.stdout
    );
    // The data's absolute path (as job.toml holds it) fits its column: `text …/corpus.txt`.
    assert!(
        list.stdout.contains(" text …/corpus.txt "),
        "{}",
        list.stdout
    );
    // nanoGPT's parameter names; the tied head is there under its own name too.
    let weights = load_weights(&job.join("model.safetensors"));
    for name in [
        "transformer.wte.weight",
        "transformer.wpe.weight",
        "transformer.h.0.attn.c_attn.weight",
        "transformer.h.0.mlp.c_proj.weight",
        "transformer.ln_f.weight",
        "lm_head.weight",
    ] {
        assert!(weights.contains_key(name), "{name} missing");
    }
    assert_eq!(weights["lm_head.weight"], weights["transformer.wte.weight"]);
    assert!(!weights.contains_key("transformer.h.0.attn.c_attn.bias"));

    let jobs = t.jobs_dir().to_string_lossy().into_owned();
    let sample = |extra: &[&str]| {
        let mut args = vec![
            "sample",
            "lm",
            "--jobs-dir",
            jobs.as_str(),
            "--tokens",
            "80",
        ];
        args.extend_from_slice(extra);
        t.ddpjob(&args)
    };
    let a = sample(&["--prompt", "the cat", "--seed", "3"]);
    a.success();
    let b = sample(&["--prompt", "the cat", "--seed", "3"]);
    assert_eq!(a.stdout, b.stdout, "same seed, same text");
    assert!(a.stdout.starts_with("the cat"), "{}", a.stdout);
    let allowed = corpus();
    assert!(
        a.stdout.chars().all(|c| allowed.contains(c)),
        "{}",
        a.stdout
    );
    assert_ne!(
        a.stdout,
        sample(&["--prompt", "the cat", "--seed", "4"]).stdout
    );
    sample(&["--checkpoint", "best", "--json"]).success();
    // `show` counts and lists the `best` checkpoint beside the steps.
    let shown = t.ddpjob(&["show", "lm", "--jobs-dir", &jobs]);
    shown.success();
    assert!(
        shown
            .stdout
            .lines()
            .any(|l| l.trim_start().starts_with("best           step ")),
        "{}",
        shown.stdout
    );
    let refused = sample(&["--prompt", "Zebra"]);
    refused.fails_with(2, "'Z'");
    assert_eq!(refused.stdout, "", "a refused prompt is not echoed");
    // The job has finished: its final weights are there to sample, not a step-999.
    sample(&["--checkpoint", "step-999"])
        .fails_with(2, "no checkpoint for --checkpoint step-999")
        .fails_with(2, "leave out --checkpoint for its final weights");
}

/// A model whose vocabulary is padded past the text's symbols (as nanoGPT pads GPT-2's) never
/// samples the padding, which stands for no character (it was printed as U+FFFD).
#[test]
fn sampling_never_draws_the_padding_of_a_padded_vocabulary() {
    let t = TestJob::new();
    let text = write_corpus(&t);
    let job = gpt_job(&text, "")
        .replace("bias = false", "bias = false\nvocab_size = 256")
        .replace("max_steps = 60", "max_steps = 2");
    t.run(&t.config("padded", &job), &[]).success();
    let jobs = t.jobs_dir().display().to_string();
    // Barely trained and sampled hot: nearly uniform over all 256 rows.
    let args = ["sample", "padded", "--jobs-dir", &jobs, "--tokens", "400"];
    let hot = ["--temperature", "3", "--top-k", "256", "--seed", "7"];
    let out = t.ddpjob(&[&args[..], &hot[..]].concat());
    out.success();
    let allowed = corpus() + "\n";
    let strays: String = out
        .stdout
        .chars()
        .filter(|c| !allowed.contains(*c))
        .collect();
    assert!(strays.is_empty(), "drew {strays:?} in {:?}", out.stdout);
    assert!(out.stdout.chars().count() >= 400, "{}", out.stdout);
    // A negative temperature is told what is allowed (not to write `-- -1`).
    t.ddpjob(&[&args[..], &["--temperature", "-1"][..]].concat())
        .fails_with(
            2,
            "--temperature must be a finite number, 0 or more, got -1",
        );
}

/// A byte-level BPE (GPT-2's kind of tokenizer) of about `size` tokens learned from `text`,
/// saved as `path` the way the tokenizers library saves one.
fn train_bpe(text: &str, size: usize, path: &Path) {
    use tokenizers::decoders::byte_level::ByteLevel as Decoder;
    use tokenizers::models::bpe::{BPE, BpeTrainerBuilder};
    use tokenizers::pre_tokenizers::byte_level::ByteLevel;
    let mut trainer: tokenizers::models::TrainerWrapper = BpeTrainerBuilder::new()
        .vocab_size(size)
        .show_progress(false)
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
        .build()
        .into();
    let mut tokenizer = tokenizers::Tokenizer::new(BPE::default());
    tokenizer
        .with_pre_tokenizer(Some(ByteLevel::default().add_prefix_space(false)))
        .with_decoder(Some(Decoder::default()));
    let file = path.with_extension("txt");
    std::fs::write(&file, text).unwrap();
    let files = vec![file.display().to_string()];
    tokenizer.train_from_files(&mut trainer, files).unwrap();
    tokenizer.save(path, false).unwrap();
}

#[test]
fn a_gpt_trains_and_samples_with_a_hugging_face_tokenizer() {
    let t = TestJob::new();
    let text = write_corpus(&t);
    let tokenizer = t.path("tokenizer.json");
    train_bpe(&corpus(), 300, &tokenizer);
    let job = gpt_job(&text, "")
        .replace(
            "dataset = \"text\"",
            &format!(
                "dataset = \"text\"\ntokenizer = \"{}\"",
                tokenizer.display()
            ),
        )
        .replace("epochs = 3", "epochs = 40")
        .replace("max_steps = 60", "max_steps = 150");
    t.run(&t.config("bpe", &job), &[]).success();
    let dir = t.job("bpe");
    let vocab = t.json(&dir.join("vocab.json"));
    assert_eq!(vocab["tokenizer"], "huggingface", "{vocab}");
    let size = vocab["definition"]["model"]["vocab"]
        .as_object()
        .unwrap()
        .len();
    let summary = t.json(&dir.join("summary.json"));
    let val = summary["test_loss"].as_f64().unwrap();
    assert!(
        val < 0.5 * (size as f64).ln(),
        "validation loss {val}, {size} tokens"
    );
    // The job keeps the whole tokenizer: sampling needs nothing else.
    std::fs::remove_file(&tokenizer).unwrap();
    let jobs = t.jobs_dir().to_string_lossy().into_owned();
    let sample = |seed: &str| {
        let args = [
            "sample",
            "bpe",
            "--jobs-dir",
            jobs.as_str(),
            "--tokens",
            "40",
        ];
        t.ddpjob(&[&args[..], &["--prompt", "the cat", "--seed", seed]].concat())
    };
    let a = sample("5");
    a.success();
    assert_eq!(a.stdout, sample("5").stdout, "same seed, same text");
    assert!(a.stdout.starts_with("the cat "), "{}", a.stdout);
    // 40 tokens of a word-level BPE are several words of the corpus's.
    let words = a.stdout.split_whitespace().count();
    assert!(words > 12, "{}", a.stdout);
    assert!(
        a.stdout
            .split_whitespace()
            .any(|w| ["mat.", "tree.", "door.", "hat."].contains(&w)),
        "{}",
        a.stdout
    );
}

#[test]
fn two_workers_with_half_the_batch_match_one_with_dropout() {
    let t = TestJob::new();
    let text = write_corpus(&t);
    // Without biases: the key bias of attention has a gradient of exactly 0 in exact
    // arithmetic (it adds the same q·b to every score of a row), so Adam turns its rounding
    // noise into full-size steps that no two summation orders share.
    let job = |batch: usize| {
        gpt_job(&text, "")
            .replace("batch_size = 8", &format!("batch_size = {batch}"))
            .replace("bias = false", "bias = false\ndropout = 0.2")
            .replace("max_steps = 60", "max_steps = 12")
    };
    t.run(&t.config("one", &job(8)), &["--nproc-per-node", "1"])
        .success();
    t.run(&t.config("two", &job(4)), &["--nproc-per-node", "2"])
        .success();
    let (a, b) = (
        load_weights(&t.job("one").join("model.safetensors")),
        load_weights(&t.job("two").join("model.safetensors")),
    );
    for (name, va) in &a {
        let worst = va
            .iter()
            .zip(&b[name])
            .map(|(x, y)| (x - y).abs())
            .fold(0f32, f32::max);
        assert!(worst < 1e-5, "`{name}` differs by {worst}");
    }
}

/// The job `text` run whole (job `whole`), then again as job `cut` with `fault` injected.
fn whole_then_cut(t: &TestJob, text: &str, fault: &str) -> Run {
    let cfg = t.config("job", text);
    t.run(&cfg, &["--name", "whole"]).success();
    t.run_env(&cfg, &["--name", "cut"], &[("DDPJOB_FAULT", fault)])
}

#[test]
fn sigterm_then_resume_is_bit_identical_for_a_gpt() {
    let t = TestJob::new();
    let text = write_corpus(&t);
    let text = gpt_job(&text, "keep_best = true")
        .replace("bias = false", "dropout = 0.1")
        .replace("[train]", "[train]\neval_every = 7");
    whole_then_cut(&t, &text, "rank=0,step=23,kind=preempt")
        .fails_with(143, "interrupted by SIGTERM");
    let jobs = t.jobs_dir().to_string_lossy().into_owned();
    // The text changed meanwhile (its characters still in the vocabulary): every window and
    // the split would move, so the job is not continued on it.
    let corpus_path = t.path("corpus.txt");
    let original = std::fs::read(&corpus_path).unwrap();
    std::fs::write(&corpus_path, &original[..original.len() - 100]).unwrap();
    t.ddpjob(&["resume", "cut", "--jobs-dir", &jobs])
        .fails_with(2, "corpus.txt` changed since the job began")
        .fails_with(2, "restore the file");
    std::fs::write(&corpus_path, &original).unwrap();
    t.ddpjob(&["resume", "cut", "--jobs-dir", &jobs]).success();
    assert_same_bits(
        &t.job("whole").join("model.safetensors"),
        &t.job("cut").join("model.safetensors"),
    );
    let (sa, sb) = (
        t.json(&t.job("whole").join("summary.json")),
        t.json(&t.job("cut").join("summary.json")),
    );
    assert_eq!(sa["test_loss"], sb["test_loss"]);
    assert_eq!(sa["best_test_loss"], sb["best_test_loss"]);
    assert_eq!(sa["best_step"], sb["best_step"]);
}

/// A run that dies after `best` was written past its newest checkpoint: the resume sets that
/// `best` aside (its evaluation is rewound out of the job's record) and earns it again.
#[test]
fn a_best_past_the_resumed_checkpoint_is_set_aside_and_earned_again() {
    let t = TestJob::new();
    let text = write_corpus(&t);
    let text = gpt_job(&text, "keep_best = true\nevery_steps = 10")
        .replace("[train]", "[train]\neval_every = 7");
    whole_then_cut(&t, &text, "rank=0,step=16,kind=exit").fails_with(1, "injected");
    let best_step = |name: &str| {
        let state = t.job(name).join("checkpoints/best/state.json");
        t.json(&state)["step"].as_u64().unwrap()
    };
    // Evaluated after step 14, past `step-00000010`.
    assert_eq!(best_step("cut"), 14);
    let jobs = t.jobs_dir().to_string_lossy().into_owned();
    let resumed = t.ddpjob(&["resume", "cut", "--jobs-dir", &jobs]);
    resumed.success();
    assert!(
        resumed
            .stderr
            .contains("`best` holds the weights evaluated after step 14, past step 10"),
        "{}",
        resumed.stderr
    );
    assert!(
        t.job("cut")
            .join("checkpoints/discarded-best-step-00000014/model.safetensors")
            .is_file()
    );
    // The best the finished job records is the one `best` holds, as in the run never cut.
    let summary = t.json(&t.job("cut").join("summary.json"));
    assert_eq!(summary["best_step"].as_u64(), Some(best_step("cut")));
    assert_eq!(best_step("cut"), best_step("whole"));
    assert_same_bits(
        &t.job("whole").join("checkpoints/best/model.safetensors"),
        &t.job("cut").join("checkpoints/best/model.safetensors"),
    );
}

#[test]
fn memory_mapped_tokens_train_and_bad_tokens_are_named() {
    let t = TestJob::new();
    let write = |name: &str, tokens: &[u16]| {
        let bytes: Vec<u8> = tokens.iter().flat_map(|v| v.to_le_bytes()).collect();
        std::fs::write(t.path(name), bytes).unwrap();
    };
    // A repeating pattern over 50 token ids.
    let pattern: Vec<u16> = (0..6000).map(|i| ((i * 7) % 50) as u16).collect();
    write("train.bin", &pattern);
    write("val.bin", &pattern[..600]);
    let job = |val: &str| {
        format!(
            r#"
[model]
arch = "gpt"
n_layer = 1
n_head = 1
n_embd = 16
block_size = 8
vocab_size = 64
[data]
dataset = "tokens"
train_path = "train.bin"
val_path = "{val}"
[train]
max_steps = 40
epochs = 5
batch_size = 8
lr = 0.01
optimizer = "adamw"
"#
        )
    };
    t.run(&t.config("toks", &job("val.bin")), &[]).success();
    let s = t.json(&t.job("toks").join("summary.json"));
    assert!(s["test_loss"].as_f64().unwrap() < 1.0, "{s}");
    assert!(!t.job("toks").join("vocab.json").exists());

    let mut bad = pattern[..600].to_vec();
    bad[300] = 64;
    write("bad.bin", &bad);
    t.run(&t.config("badtoks", &job("bad.bin")), &[])
        .fails_with(1, "token 64 at byte offset 600");
    // A damaged token file is refused before the job exists.
    std::fs::write(t.path("odd.bin"), [0u8; 601]).unwrap();
    t.run(&t.config("odd", &job("odd.bin")), &[])
        .fails_with(1, "601 bytes, is not a multiple of 2");
    assert!(!t.job("odd").exists());
    // A path that leads nowhere is the config's mistake: exit 2, naming the key.
    let nope = t.config("nope", &job("nope.bin"));
    t.run(&nope, &[])
        .fails_with(2, "data.val_path `nope.bin` does not exist (relative to `");
    assert!(!t.job("nope").exists());
    // `validate` names it the same way (it was a bare "cannot read `nope.bin`").
    t.ddpjob(&["validate", nope.to_str().unwrap()])
        .fails_with(2, "data.val_path `nope.bin` does not exist (relative to `");
}

#[test]
fn bad_text_jobs_are_refused_before_anything_is_created() {
    let t = TestJob::new();
    let text = write_corpus(&t);
    let run = |name: &str, job: String| {
        let r = t.run(&t.config(name, &job), &[]);
        assert!(!t.job(name).exists(), "{name}: job directory created");
        r
    };
    run(
        "heads",
        gpt_job(&text, "").replace("n_embd = 16", "n_embd = 15"),
    )
    .fails_with(2, "`model.n_embd`")
    .fails_with(2, "divisible by model.n_head = 2");
    run(
        "block",
        gpt_job(&text, "").replace("block_size = 16", "block_size = 0"),
    )
    .fails_with(2, "`model.block_size`");
    run(
        "images",
        gpt_job(&text, "").replace("dataset = \"text\"", "dataset = \"mnist\""),
    )
    .fails_with(2, "learns from token sequences");
    std::fs::write(t.path("latin1.txt"), b"caf\xe9 au lait, ".repeat(100)).unwrap();
    run("latin1", gpt_job(&t.path("latin1.txt"), ""))
        .fails_with(1, "not UTF-8")
        .fails_with(1, "offset 3");
    std::fs::write(t.path("short.txt"), "tiny text").unwrap();
    run("short", gpt_job(&t.path("short.txt"), "")).fails_with(2, "fewer than one window");
    run("missing", gpt_job(&t.path("nowhere.txt"), "")).fails_with(2, "does not exist");
    std::fs::create_dir(t.path("a-dir")).unwrap();
    run("dir", gpt_job(&t.path("a-dir"), "")).fails_with(2, "is a directory; name the text file");
    let with_tokenizer = |tokenizer: &str| {
        gpt_job(&text, "").replace(
            "dataset = \"text\"",
            &format!("dataset = \"text\"\ntokenizer = \"{tokenizer}\""),
        )
    };
    let nowhere = t.path("nowhere.json").display().to_string();
    run("no-tokenizer", with_tokenizer(&nowhere))
        .fails_with(2, &format!("data.tokenizer `{nowhere}` does not exist"));
    run("gpt2", with_tokenizer("gpt2"))
        .fails_with(2, "`data.tokenizer`")
        .fails_with(2, "ending in .json");
    std::fs::write(t.path("vocab.json"), "{\"a\": 0, \"b\": 1}").unwrap();
    let not_one = t.path("vocab.json").display().to_string();
    run("not-hf", with_tokenizer(&not_one))
        .fails_with(1, "vocab.json")
        .fails_with(1, "not a Hugging Face tokenizer");
}
