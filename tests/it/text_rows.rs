//! Rows of text as token windows, with the real binary: the play's speeches in a parquet
//! `text` column (tests/fixtures/chat/data/text.parquet) become one corpus by default, its tokens
//! exactly those transformers' tokenizer gives each row, with the end-of-sequence token after
//! each (tests/fixtures/chat/make_windows_reference.py wrote the reference), split and cut into
//! windows as text data is; the job resumes bit for bit after a preemption and 2 × 4 = 1 × 8;
//! packing windows is refused before a job exists.

use sha2::{Digest, Sha256};

use crate::chat::{fixture, job};
use crate::common::{TestJob, preempt_resume_and_compare};
use crate::finetune::one_worker_matches_two;

fn text_rows(extra: &str) -> String {
    format!(
        "dataset = \"parquet\"\ntrain_path = \"{}\"\n{extra}",
        fixture("data/text.parquet")
    )
}

#[test]
fn parquet_text_rows_train_as_windows_of_the_tokens_transformers_gives() {
    let t = TestJob::new();
    let cfg = t.config("whole", &job(&text_rows(""), "max_steps = 8"));
    let two = ["--nproc-per-node", "2"];
    let whole = t.run(&cfg, &[&two[..], &["--name", "whole"]].concat());
    whole.success();
    let reference: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture("data/text-windows.json")).unwrap())
            .unwrap();
    let n = reference["tokens"].as_u64().unwrap() as usize;
    let val_start = reference["val_start"].as_u64().unwrap() as usize;
    // As text data cuts (`text::train_windows`): a window's worth of slack for the phase.
    let (train_windows, val_windows) = ((val_start - 128) / 128, (n - val_start - 1) / 128);
    assert!(
        whole.stderr.contains(&format!(
            "as {train_windows} training and {val_windows} validation windows of 128 tokens"
        )),
        "{}",
        whole.stderr
    );
    let dir = t.job("whole");
    let train = std::fs::read(dir.join("rows-train.tokens")).unwrap();
    let val = std::fs::read(dir.join("rows-val.tokens")).unwrap();
    assert_eq!(train.len() / 4, val_start, "where validation starts");
    assert_eq!((train.len() + val.len()) / 4, n, "the tokens of all rows");
    let first: Vec<u64> = (train.chunks_exact(4).take(64))
        .map(|b| u32::from_le_bytes(b.try_into().unwrap()) as u64)
        .collect();
    let want: Vec<u64> = (reference["first"].as_array().unwrap().iter())
        .map(|v| v.as_u64().unwrap())
        .collect();
    assert_eq!(first, want, "the first ids");
    let digest = Sha256::new()
        .chain_update(&train)
        .chain_update(&val)
        .finalize();
    let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
    assert_eq!(
        hex,
        reference["sha256"].as_str().unwrap(),
        "the whole stream"
    );
    // The job pins how it read its rows; no examples are kept.
    let frozen = std::fs::read_to_string(dir.join("job.toml")).unwrap();
    assert!(frozen.contains("text_rows = \"windows\""), "{frozen}");
    assert!(!dir.join("jsonl-train.bin").exists());
    preempt_resume_and_compare(&t, &cfg, &two, "rank=1,step=5,kind=preempt");
    one_worker_matches_two(&t, &job(&text_rows(""), "max_steps = 3"));
}

/// `text_rows = "examples"` keeps one example a row; packing windows is refused (exit 2, no
/// job); a job refused after its tokens were staged leaves no file behind.
#[test]
fn text_rows_can_be_examples_and_windows_are_not_packed() {
    let t = TestJob::new();
    let cfg = t.config(
        "rows",
        &job(&text_rows("text_rows = \"examples\""), "max_steps = 2"),
    );
    let rows = t.run(&cfg, &[]);
    rows.success();
    assert!(t.job("rows").join("jsonl-train.bin").is_file());
    assert!(!t.job("rows").join("rows-train.tokens").exists());
    let packed = t.config("packed", &job(&text_rows("pack = true"), ""));
    t.run(&packed, &[])
        .fails_with(2, "drop pack, or set text_rows = \"examples\"");
    assert!(!t.job("packed").exists());
    // Refused after its tokens were written (beside the jobs, to move in): nothing is left.
    let frozen = job(&text_rows(""), "").replace("[data]", "freeze = [\"no_such_tensor\"]\n[data]");
    t.run(&t.config("frozen", &frozen), &[])
        .fails_with(2, "no_such_tensor");
    assert!(!t.job("frozen").exists());
    let left: Vec<_> = std::fs::read_dir(t.jobs_dir())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|name| name.starts_with(".ddpjob-"))
        .collect();
    assert!(left.is_empty(), "staged files left behind: {left:?}");
}
