//! Conversations end to end with the real binary: parquet shards of `messages` (the Hub's
//! layout, written by pyarrow in tests/fixtures/chat/make_chat_fixtures.py) rendered through the
//! fixture model's own ChatML template: `preview` shows exactly the ids and labels
//! transformers' `apply_chat_template` gives, the job trains on the assistant's tokens, resumes
//! bit for bit and 2 workers × 4 match 1 × 8; bad files are refused before anything exists.

use std::path::PathBuf;

use crate::common::{TestJob, preempt_resume_and_compare};
use crate::finetune::one_worker_matches_two;

pub(crate) fn fixture(path: &str) -> String {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/chat")
        .join(path)
        .display()
        .to_string()
}

/// A job of the fixture model on `data` (the `[data]` table's keys).
pub(crate) fn job(data: &str, train: &str) -> String {
    format!(
        r#"
seed = 5
[model]
init_from = "{}"
block_size = 128
[data]
{data}
[train]
epochs = 1
batch_size = 8
lr = 3e-3
optimizer = "adamw"
log_every = 4
eval_batch_size = 16
eval_batches = 2
{train}
[checkpoint]
every_steps = 4
keep_last = 0
"#,
        fixture("model")
    )
}

fn parquet(extra: &str) -> String {
    format!(
        "dataset = \"parquet\"\ntrain_path = \"{}\"\nval_path = \"{}\"\n{extra}",
        fixture("data/train-*.parquet"),
        fixture("data/test-00000-of-00001.parquet")
    )
}

/// `preview --json` of the fixture's conversations (a jsonl file) gives transformers'
/// `input_ids` and labels (`return_assistant_tokens_mask`), then the counts; the parquet
/// shards preview as many examples as they hold rows.
#[test]
fn preview_shows_what_apply_chat_template_gives_and_what_is_trained() {
    let t = TestJob::new();
    let reference: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture("reference.json")).unwrap()).unwrap();
    let data = format!(
        "dataset = \"jsonl\"\ntrain_path = \"{}\"\nval_path = \"{}\"",
        fixture("conversations.jsonl"),
        fixture("conversations.jsonl")
    );
    let cfg = t.config("chat", &job(&data, ""));
    let run = t.ddpjob(&[
        "preview",
        &cfg.display().to_string(),
        "--json",
        "--examples",
        "6",
    ]);
    run.success();
    let lines: Vec<serde_json::Value> = run
        .stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 7, "{}", run.stdout);
    let chatml = reference["chatml"].as_array().unwrap();
    for (i, (got, want)) in lines.iter().zip(chatml).enumerate() {
        let (ids, labels) = (&got["input_ids"], &got["labels"]);
        let n = ids.as_array().unwrap().len();
        // Conversations past 129 tokens are cut (data.truncate): compare what is kept.
        let cut = |v: &serde_json::Value| v.as_array().unwrap()[..n].to_vec();
        assert_eq!(
            ids.as_array().unwrap().to_vec(),
            cut(&want["input_ids"]),
            "{i}"
        );
        assert_eq!(
            labels.as_array().unwrap().to_vec(),
            cut(&want["labels"]),
            "{i}"
        );
    }
    assert_eq!(lines[6]["examples"], 6);

    let cfg = t.config("shards", &job(&parquet(""), ""));
    let plain = t.ddpjob(&["preview", &cfg.display().to_string(), "--examples", "1"]);
    plain.success();
    assert!(
        plain.stdout.contains("<|im_start|>assistant\n⟦"),
        "{}",
        plain.stdout
    );
    assert!(
        plain.stdout.contains("training set: 960 examples"),
        "{}",
        plain.stdout
    );
    let v = t.ddpjob(&["validate", &cfg.display().to_string()]);
    v.success();
    assert!(
        v.stdout.contains("960 training") && v.stdout.contains("trained ("),
        "{}",
        v.stdout
    );
}

/// The parquet conversational job: loss on the assistant's turns, resumed bit for bit after a
/// preemption on 2 workers, and 2 × 4 (and 1 × 4 × 2 accumulated) the same as 1 × 8.
#[test]
fn a_parquet_conversation_job_resumes_bit_for_bit_and_two_workers_match_one() {
    let t = TestJob::new();
    let cfg = t.config("whole", &job(&parquet("pack = true"), "max_steps = 10"));
    let two = ["--nproc-per-node", "2"];
    let whole = t.run(&cfg, &[&two[..], &["--name", "whole"]].concat());
    whole.success();
    assert!(
        whole
            .stdout
            .contains("960 training and 40 validation examples"),
        "{}",
        whole.stdout
    );
    // `sample --chat`: the message through the job's template with its generation prompt,
    // as `apply_chat_template(messages, add_generation_prompt=True)` renders it.
    let jobs = t.jobs_dir().display().to_string();
    let chat = t.ddpjob(&[
        "sample",
        "whole",
        "--jobs-dir",
        &jobs,
        "--chat",
        "Speak, speak.",
        "--tokens",
        "4",
        "--json",
    ]);
    chat.success();
    let answer: serde_json::Value = serde_json::from_str(chat.stdout.trim()).unwrap();
    assert_eq!(
        answer["prompt"],
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n\
         Speak, speak.<|im_end|>\n<|im_start|>assistant\n"
    );
    preempt_resume_and_compare(&t, &cfg, &two, "rank=1,step=6,kind=preempt");
    one_worker_matches_two(&t, &job(&parquet(""), "max_steps = 3"));
}

/// A glob that matches nothing, a file without the columns (its columns listed) and a file
/// that is not parquet: exit 2 naming them, no job made.
#[test]
fn bad_parquet_sources_are_refused_before_a_job_exists() {
    let t = TestJob::new();
    let missing = format!(
        "dataset = \"parquet\"\ntrain_path = \"{}\"",
        fixture("data/nothing-*.parquet")
    );
    t.run(&t.config("glob", &job(&missing, "")), &[])
        .fails_with(2, "no file in");
    let columns = format!(
        "dataset = \"parquet\"\ntrain_path = \"{}\"\ntext_field = \"body\"",
        fixture("data/text.parquet")
    );
    t.run(&t.config("columns", &job(&columns, "")), &[])
        .fails_with(2, "its columns: id, text");
    let bad = t.path("bad.parquet");
    std::fs::write(&bad, b"PAR1 this is not a parquet file").unwrap();
    let corrupt = format!("dataset = \"parquet\"\ntrain_path = \"{}\"", bad.display());
    t.run(&t.config("corrupt", &job(&corrupt, "")), &[])
        .fails_with(2, "not a readable parquet file");
    for name in ["glob", "columns", "corrupt"] {
        assert!(!t.job(name).exists(), "{name}: a job was made");
    }
}
