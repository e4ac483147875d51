use std::path::PathBuf;

use super::*;
use candle_core::Device;
use ddpjob_seam::task::{IGNORE_TARGET, Task};
use ddpjob_seam::{DatasetOptions, JobFile};
use ddpjob_spec::LanguageModelSpec;
use std::ops::Range;

/// The llama fixture's byte-level BPE (300 tokens, `<|endoftext|>` = 0).
fn tokenizer_path() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/hf/llama/tokenizer.json")
}

fn context(block: usize, job: Option<PathBuf>) -> DataContext {
    let language = LanguageModelSpec {
        block_size: block,
        vocab_size: Some(320),
        tokenizer: Some(tokenizer_path()),
        vocabulary: None,
        packed_rows: true,
    };
    let mut cx = DataContext::new(1, "llama", Some(language));
    cx.stored_job = job.is_some();
    cx.job = job;
    cx
}

fn options(dir: &Path, lines: &str) -> JsonlOptions {
    let path = dir.join("train.jsonl");
    std::fs::write(&path, lines).unwrap();
    let options = JsonlOptions {
        train_path: Some(path.display().to_string()),
        val_fraction: 0.3,
        ..JsonlOptions::default()
    };
    options.complete(&context(32, None)).unwrap()
}

fn encode(text: &str, special: bool) -> Vec<u32> {
    let t = HfTokenizer::load(&tokenizer_path()).unwrap();
    t.encode_one(text, special).unwrap()
}

const LINES: &str = r#"{"prompt": "ab", "completion": "cd"}

{"text": "hello world"}
{"prompt": "x", "completion": "y", "other": 1}
"#;

#[test]
fn examples_are_prompt_then_completion_then_eos_and_the_mask_starts_at_the_completion() {
    let dir = tempfile::tempdir().unwrap();
    let opts = options(dir.path(), LINES);
    assert_eq!(opts.eos_token.as_deref(), Some("<|endoftext|>"));
    let task = opts.open_examples(&context(32, None)).unwrap();
    // Three examples (the blank line skipped): the last third is validation.
    assert_eq!((task.train_len(), task.eval_len()), (2, 1));
    let (prompt, completion) = (encode("ab", true), encode("cd", false));
    let (tokens, spans) = task.train.get(0);
    assert_eq!(spans, [[prompt.len() as u32, tokens.len() as u32]]);
    assert_eq!(tokens, [&prompt[..], &completion[..], &[0]].concat());
    let (text, spans) = task.train.get(1);
    assert_eq!(
        spans,
        [[0, text.len() as u32]],
        "a text example has no prompt"
    );

    let batches = task.batches(&Device::Cpu).unwrap();
    let (xs, ys) = batches.train(0, &[0, 1]).unwrap();
    let text = task.train.get(1).0;
    let width = (tokens.len() - 1).max(text.len() - 1);
    assert_eq!(xs.dims(), [2, width]);
    let (xs, ys) = (xs.to_vec2::<u32>().unwrap(), ys.to_vec2::<u32>().unwrap());
    // Row 0: targets ignored until the last prompt token predicts the completion's first.
    for j in 0..width {
        let want = if j + 1 < prompt.len() || j + 1 >= tokens.len() {
            IGNORE_TARGET
        } else {
            tokens[j + 1]
        };
        assert_eq!(ys[0][j], want, "target {j}");
        let input = if j < tokens.len() - 1 { tokens[j] } else { 0 };
        assert_eq!(xs[0][j], input, "input {j}");
    }
    // Row 1, plain text: every real target scores, padding none.
    assert_eq!(&ys[1][..text.len() - 1], &text[1..]);
    assert!(ys[1][text.len() - 1..].iter().all(|&y| y == IGNORE_TARGET));

    // train_on_prompt: the prompt's targets score too.
    let all = JsonlOptions {
        train_on_prompt: true,
        ..opts
    };
    let task = all.open_examples(&context(32, None)).unwrap();
    let (_, ys) = task.batches(&Device::Cpu).unwrap().train(0, &[0]).unwrap();
    assert_eq!(ys.to_vec2::<u32>().unwrap()[0], tokens[1..]);
}

#[test]
fn bad_lines_name_the_file_and_line_or_are_counted_and_skipped() {
    let dir = tempfile::tempdir().unwrap();
    let lines = "{\"text\": \"one\"}\n{\"text\": \"two\"}\nnot json\n{\"title\": \"x\"}\n\
                 {\"text\": \"three\"}\n";
    let opts = options(dir.path(), lines);
    let err = opts
        .open_examples(&context(32, None))
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("train.jsonl` line 3"), "{err}");
    assert!(err.contains("data.skip_bad_lines"), "{err}");

    let skip = JsonlOptions {
        skip_bad_lines: true,
        ..opts.clone()
    };
    let task = skip.open_examples(&context(32, None)).unwrap();
    assert_eq!(task.train.counts.bad_lines, 2);
    assert_eq!(task.train_len() + task.eval_len(), 3);
    let note = task.batches(&Device::Cpu).unwrap().note().unwrap();
    assert!(note.contains("2 bad lines skipped"), "{note}");
    // Text examples only: no token is a prompt's, the loss is on all.
    assert!(
        note.contains("loss on every token (text examples)"),
        "{note}"
    );

    // Bytes that are not UTF-8 make a bad line like any other; a byte-order mark is no line's.
    let mut latin1 = b"\xEF\xBB\xBF{\"text\": \"one\"}\n{\"text\": \"caf\xE9\"}\n".to_vec();
    latin1.extend_from_slice(b"{\"text\": \"two\"}\n{\"text\": \"three\"}\n");
    std::fs::write(dir.path().join("train.jsonl"), &latin1).unwrap();
    let err = opts
        .open_examples(&context(32, None))
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains(
            "train.jsonl` line 2: it is not UTF-8 text (a byte that UTF-8 does not \
                      allow at byte 14 of the line); save the file as UTF-8"
        ),
        "{err}"
    );
    let task = skip.open_examples(&context(32, None)).unwrap();
    assert_eq!(task.train.counts.bad_lines, 1);
    assert_eq!(task.train_len() + task.eval_len(), 3);

    let fields = options(dir.path(), "{\"title\": \"x\"}\n");
    let err = fields
        .open_examples(&context(32, None))
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("line 1: it has neither \"messages\""), "{err}");
    assert!(err.contains("its fields: title"), "{err}");
    let no_prompt = options(dir.path(), "{\"completion\": \"x\"}\n");
    let err = no_prompt
        .open_examples(&context(32, None))
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("no \"prompt\" (data.prompt_field)"), "{err}");
}

#[test]
fn long_examples_are_cut_to_the_window_or_refused() {
    let dir = tempfile::tempdir().unwrap();
    let long = "the quick brown fox jumps over the lazy dog ".repeat(4);
    let lines = format!("{{\"text\": \"{long}\"}}\n{{\"text\": \"ok\"}}\n{{\"text\": \"fine\"}}\n");
    let opts = options(dir.path(), &lines);
    let task = opts.open_examples(&context(8, None)).unwrap();
    assert_eq!(task.train.counts.truncated, 1);
    assert_eq!(task.train.get(0).0.len(), 9, "block_size + 1 tokens");
    let strict = JsonlOptions {
        truncate: false,
        ..opts
    };
    let err = strict
        .open_examples(&context(8, None))
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("line 1: the example has"), "{err}");
    assert!(err.contains("model.block_size + 1 = 9"), "{err}");
}

#[test]
fn an_example_whose_prompt_fills_the_window_is_left_out_unless_prompts_are_trained_on() {
    let dir = tempfile::tempdir().unwrap();
    let long = "the quick brown fox jumps over the lazy dog ".repeat(4);
    let lines = format!(
        "{{\"prompt\": \"{long}\", \"completion\": \"yes\"}}\n\
         {{\"prompt\": \"a\", \"completion\": \"b\"}}\n{{\"text\": \"fine\"}}\n\
         {{\"text\": \"ok\"}}\n"
    );
    let opts = options(dir.path(), &lines);
    // Truncated to 9 tokens, all of them the prompt's: nothing left to score.
    let task = opts.open_examples(&context(8, None)).unwrap();
    let all = task.train.counts;
    assert_eq!((all.truncated, all.empty), (1, 1));
    assert_eq!(task.train_len() + task.eval_len(), 3);
    let source = task.batches(&Device::Cpu).unwrap();
    let note = source.note().unwrap();
    assert!(
        note.contains("1 examples with nothing to predict left out"),
        "{note}"
    );
    // When that leaves too few, the error says why they went.
    let only_long = format!(
        "{{\"prompt\": \"{long}\", \"completion\": \"yes\"}}\n\
         {{\"prompt\": \"{long}\", \"completion\": \"no\"}}\n"
    );
    let other = tempfile::tempdir().unwrap();
    let err = options(other.path(), &only_long)
        .open_examples(&context(8, None))
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains("0 usable example(s) (2 left out with nothing to predict")
            && err.contains("model.block_size = 8"),
        "{err}"
    );
    // Every row of what is left has targets.
    let (_, ys) = source.train(0, &[0, 1]).unwrap();
    let ys: Vec<Vec<u32>> = ys.to_vec2().unwrap();
    assert!(
        ys.iter().all(|row| row.iter().any(|&y| y != IGNORE_TARGET)),
        "{ys:?}"
    );
    let on_prompt = JsonlOptions {
        train_on_prompt: true,
        ..opts
    };
    let task = on_prompt.open_examples(&context(8, None)).unwrap();
    assert_eq!(task.train.counts.empty, 0);
    assert_eq!(task.train_len() + task.eval_len(), 4);
}

/// A job directory in `dir` as `run` leaves it: `files` kept, `opts` in its `job.toml`.
fn keep_in_job(dir: &Path, opts: &JsonlOptions, files: &[JobFile]) -> PathBuf {
    let job = dir.join("job");
    std::fs::create_dir(&job).unwrap();
    for f in files {
        std::fs::write(job.join(&f.name), &*f.read().unwrap()).unwrap();
    }
    let mut data = toml::Table::try_from(opts).unwrap();
    data.insert("dataset".into(), "jsonl".into());
    let mut doc = toml::Table::new();
    doc.insert("data".into(), data.into());
    std::fs::write(job.join("job.toml"), toml::to_string(&doc).unwrap()).unwrap();
    job
}

#[test]
fn the_job_keeps_its_examples_and_reads_them_back_whatever_the_file_does() {
    let dir = tempfile::tempdir().unwrap();
    let opts = options(dir.path(), LINES);
    let files = opts.prepare(&context(32, None)).unwrap();
    let job = keep_in_job(dir.path(), &opts, &files);
    let names: Vec<&str> = files.iter().map(|f| f.name.as_str()).collect();
    assert_eq!(names, ["jsonl-train.bin", "jsonl-val.bin", "vocab.json"]);
    let fresh = opts.open_examples(&context(32, None)).unwrap();
    // The file changes; the job reads what it stored.
    std::fs::write(dir.path().join("train.jsonl"), "{\"text\": \"zz\"}\n").unwrap();
    let kept = opts.open_examples(&context(32, Some(job.clone()))).unwrap();
    assert_eq!(kept.train, fresh.train);
    assert_eq!(kept.val, fresh.val);
    assert_eq!(kept.eos, fresh.eos);
    // Other data named for the job (`eval --data`) is read from its files, not the job's.
    let other = JsonlOptions {
        val_fraction: 0.5,
        ..opts.clone()
    };
    let read = other
        .open_examples(&context(32, Some(job.clone())))
        .err()
        .unwrap();
    assert!(read.to_string().contains("1 usable example"), "{read}");

    let stored = job.join("jsonl-train.bin");
    let mut bytes = std::fs::read(&stored).unwrap();
    bytes.truncate(bytes.len() - 4);
    std::fs::write(&stored, bytes).unwrap();
    let err = Examples::open(&stored).unwrap_err().to_string();
    assert!(err.contains("jsonl-train.bin"), "{err}");
    assert!(err.contains("length does not match"), "{err}");

    // A length or prompt that cannot be is named too (it made the batches index past the
    // example).
    let good = files[1].read().unwrap().into_owned();
    let at = 8 + 8 * 4; // the magic, then the header's eight words
    for (field, value) in [(1, 10_000u32), (0, 1)] {
        let mut bytes = good.clone();
        let offset = at + 4 * field;
        bytes[offset..offset + 4].copy_from_slice(&value.to_le_bytes());
        std::fs::write(&stored, bytes).unwrap();
        let err = Examples::open(&stored).unwrap_err().to_string();
        assert!(err.contains("example 0 has"), "{err}");
        assert!(err.contains("delete the job and run it again"), "{err}");
    }
}

#[test]
fn options_are_checked_before_anything_is_read() {
    let cx = context(32, None);
    let err = |o: JsonlOptions| o.complete(&cx).unwrap_err();
    assert!(err(JsonlOptions::default()).contains("data.train_path is required"));
    let missing = JsonlOptions {
        train_path: Some("t.jsonl".into()),
        tokenizer: Some("nope/tokenizer.json".into()),
        ..JsonlOptions::default()
    };
    let missing = err(missing);
    assert!(
        missing.contains("data.tokenizer `nope/tokenizer.json` does not exist (relative to `"),
        "{missing}"
    );
    let empty_val = JsonlOptions {
        train_path: Some("t.jsonl".into()),
        val_path: Some(String::new()),
        ..JsonlOptions::default()
    };
    assert!(err(empty_val).contains("data.val_path is empty"));
    let with_path = JsonlOptions {
        train_path: Some("t.jsonl".into()),
        ..JsonlOptions::default()
    };
    let packed = JsonlOptions {
        pack: true,
        ..with_path.clone()
    };
    let mut other_lm = context(32, None);
    other_lm.arch = "my-lm".into();
    if let Some(language) = other_lm.language.as_mut() {
        language.packed_rows = false;
    }
    let refused = packed.clone().complete(&other_lm).unwrap_err();
    assert!(
        refused.contains("model.arch = \"my-lm\" does not") && refused.contains("pack = false"),
        "{refused}"
    );
    assert!(packed.complete(&cx).is_ok());
    let fraction = JsonlOptions {
        val_fraction: 1.5,
        ..with_path.clone()
    };
    assert!(err(fraction).contains("data.val_fraction = 1.5"));
    let mut image = context(32, None);
    image.language = None;
    image.arch = "cnn".into();
    assert!(
        with_path
            .complete(&image)
            .unwrap_err()
            .contains("not \"cnn\"")
    );
}

#[test]
fn packed_rows_hold_whole_examples_in_order_with_positions_restarted() {
    let dir = tempfile::tempdir().unwrap();
    let lines: String = ["ab", "cde", "fg", "hijk", "lm", "no", "pq"]
        .iter()
        .map(|w| format!("{{\"prompt\": \"{w}\", \"completion\": \"{w}\"}}\n"))
        .collect();
    let opts = JsonlOptions {
        pack: true,
        val_fraction: 0.2,
        ..options(dir.path(), &lines)
    };
    let block = 12;
    let task = opts.open_examples(&context(block, None)).unwrap();
    let packs = task.packs.clone().unwrap();
    // Every training example once, in order, each row within the window.
    let flat: Vec<usize> = packs[0].iter().flat_map(|r| r.clone()).collect();
    assert_eq!(flat, (0..task.train.len()).collect::<Vec<_>>());
    assert_eq!(task.train_len(), packs[0].len());
    assert!(task.train_len() < task.train.len(), "{packs:?}");
    let positions =
        |r: &Range<usize>| -> usize { r.clone().map(|i| task.train.get(i).0.len() - 1).sum() };
    assert!(packs[0].iter().all(|r| positions(r) <= block));

    let (xs, ys) = task.batches(&Device::Cpu).unwrap().train(0, &[0]).unwrap();
    let t = positions(&packs[0][0]);
    assert_eq!(xs.dims(), [1, t, 2]);
    let xs = xs.to_vec3::<u32>().unwrap().remove(0);
    let ys = ys.to_vec2::<u32>().unwrap().remove(0);
    let mut at = 0;
    for i in packs[0][0].clone() {
        let (tokens, spans) = task.train.get(i);
        let prompt = spans[0][0] as usize;
        for (j, pair) in xs[at..at + tokens.len() - 1].iter().enumerate() {
            assert_eq!(*pair, [tokens[j], j as u32], "example {i} position {j}");
            let want = if j + 1 < prompt {
                IGNORE_TARGET
            } else {
                tokens[j + 1]
            };
            assert_eq!(ys[at + j], want);
        }
        at += tokens.len() - 1;
    }
    let note = task.batches(&Device::Cpu).unwrap().note().unwrap();
    assert!(note.contains("packed into"), "{note}");
}

/// The chat fixture's model directory (a tokenizer with ChatML's tokens and its template).
fn chat_fixture(path: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/chat")
        .join(path)
}

fn chat_context(block: usize) -> DataContext {
    let language = LanguageModelSpec {
        block_size: block,
        vocab_size: Some(320),
        tokenizer: Some(chat_fixture("model/tokenizer.json")),
        vocabulary: None,
        packed_rows: true,
    };
    DataContext::new(1, "llama", Some(language))
}

/// Conversations in a jsonl file go through the model's own template: each example's tokens
/// are `apply_chat_template`'s, its targets scored on the assistant's tokens only (the
/// reference's labels, shifted), and `train_on_prompt` scores them all. No eos is appended
/// (the template writes the end of each turn).
#[test]
fn conversations_become_examples_trained_on_the_assistants_tokens() {
    let reference: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(chat_fixture("reference.json")).unwrap())
            .unwrap();
    let opts = JsonlOptions {
        train_path: Some(chat_fixture("conversations.jsonl").display().to_string()),
        val_path: Some(chat_fixture("conversations.jsonl").display().to_string()),
        ..JsonlOptions::default()
    }
    .complete(&chat_context(512))
    .unwrap();
    assert_eq!(opts.eos_token.as_deref(), Some("<|im_end|>"));
    let task = opts.open_examples(&chat_context(512)).unwrap();
    assert_eq!(task.train_len(), 6);
    let batches = task.batches(&Device::Cpu).unwrap();
    for (i, want) in reference["chatml"].as_array().unwrap().iter().enumerate() {
        let ids: Vec<u32> = (want["input_ids"].as_array().unwrap().iter())
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        assert_eq!(task.train.get(i).0, &ids[..], "conversation {i}");
        let (_, ys) = batches.train(0, &[i]).unwrap();
        let ys = ys.to_vec2::<u32>().unwrap().remove(0);
        // HF labels are unshifted: target j is label j + 1.
        let labels = want["labels"].as_array().unwrap();
        for (j, y) in ys.iter().enumerate() {
            let label = labels[j + 1].as_i64().unwrap();
            let expected = if label < 0 {
                IGNORE_TARGET
            } else {
                label as u32
            };
            assert_eq!(*y, expected, "conversation {i} target {j}");
        }
    }
    let note = batches.note().unwrap();
    assert!(note.contains("the assistant's turns"), "{note}");

    let all = JsonlOptions {
        train_on_prompt: true,
        ..opts.clone()
    };
    let task = all.open_examples(&chat_context(512)).unwrap();
    let (_, ys) = task.batches(&Device::Cpu).unwrap().train(0, &[0]).unwrap();
    let ys = ys.to_vec2::<u32>().unwrap().remove(0);
    assert_eq!(ys, task.train.get(0).0[1..]);
}

/// A conversation without a template, a bad message and an unknown role are named with the
/// file and line; `skip_bad_lines` counts them instead.
#[test]
fn bad_conversations_are_named_by_file_and_line() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("train.jsonl");
    let good = r#"{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}"#;
    let bad =
        r#"{"messages": [{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}]}"#;
    std::fs::write(&path, format!("{good}\n{good}\n{bad}\n{good}\n")).unwrap();
    let opts = JsonlOptions {
        train_path: Some(path.display().to_string()),
        val_fraction: 0.3,
        ..JsonlOptions::default()
    }
    .complete(&chat_context(64))
    .unwrap();
    let err = opts
        .open_examples(&chat_context(64))
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains("line 3") && err.contains("\"robot\"") && err.contains("skip_bad_lines"),
        "{err}"
    );
    let skipping = JsonlOptions {
        skip_bad_lines: true,
        ..opts.clone()
    };
    let task = skipping.open_examples(&chat_context(64)).unwrap();
    assert_eq!(task.train.counts.bad_lines, 1);

    // The llama fixture's tokenizer has no chat template beside it.
    std::fs::write(&path, format!("{good}\n{good}\n")).unwrap();
    let plain = JsonlOptions {
        train_path: Some(path.display().to_string()),
        ..JsonlOptions::default()
    }
    .complete(&context(32, None))
    .unwrap();
    let err = plain
        .open_examples(&context(32, None))
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains("line 1")
            && err.contains("no chat template")
            && err.contains("data.chat_template"),
        "{err}"
    );
}

/// `text_rows = "windows"`: every row's tokens whole (a prompt and completion too), each
/// ended by the end-of-sequence token, end to end; the last `val_fraction` of the tokens
/// validates; the job keeps them and reads them back whatever the file does.
#[test]
fn rows_as_windows_are_the_rows_end_to_end_and_the_job_keeps_them() {
    let dir = tempfile::tempdir().unwrap();
    let texts: Vec<String> = (0..10)
        .map(|i| format!("{i} the quick brown fox jumps over the lazy dog"))
        .collect();
    let mut lines: String = (texts.iter())
        .map(|t| format!("{{\"text\": \"{t}\"}}\n"))
        .collect();
    lines.push_str("{\"prompt\": \"ab\", \"completion\": \"cd\"}\n");
    let path = dir.path().join("train.jsonl");
    std::fs::write(&path, &lines).unwrap();
    let opts = JsonlOptions {
        train_path: Some(path.display().to_string()),
        val_fraction: 0.2,
        text_rows: Some(TextRows::Windows),
        ..JsonlOptions::default()
    }
    .complete(&context(8, None))
    .unwrap();
    let mut want = Vec::new();
    for text in &texts {
        want.extend(encode(text, true));
        want.push(0);
    }
    want.extend(encode("ab", true));
    want.extend(encode("cd", false));
    want.push(0);
    let files = opts.prepare(&context(8, None)).unwrap();
    let names: Vec<&str> = files.iter().map(|f| f.name.as_str()).collect();
    assert_eq!(
        names,
        ["rows-train.tokens", "rows-val.tokens", "vocab.json"]
    );
    let ids = |bytes: &[u8]| -> Vec<u32> {
        (bytes.chunks_exact(4))
            .map(|b| u32::from_le_bytes(b.try_into().unwrap()))
            .collect()
    };
    let split = (want.len() as f64 * 0.8) as usize;
    assert_eq!(ids(&files[0].read().unwrap()), want[..split]);
    assert_eq!(ids(&files[1].read().unwrap()), want[split..]);

    let job = keep_in_job(dir.path(), &opts, &files);
    std::fs::write(&path, "{\"text\": \"zz\"}\n").unwrap();
    let task = opts.open(&context(8, Some(job))).unwrap();
    assert_eq!(task.train_len(), (split - 8) / 8);
    assert_eq!(task.eval_len(), (want.len() - split - 1) / 8);
    assert!(
        !task.masks_targets(),
        "every position of a window is a target"
    );
    let batches = task.batches(&Device::Cpu).unwrap();
    let (x, y) = batches.eval(&[1]).unwrap();
    let row = |t: candle_core::Tensor| t.flatten_all().unwrap().to_vec1::<u32>().unwrap();
    assert_eq!(row(x), want[split + 8..split + 16]);
    assert_eq!(row(y), want[split + 9..split + 17]);
}

/// A job stored before `data.text_rows` existed (its job.toml without the key) keeps reading
/// its stored examples: completed as a stored job, its rows stay examples and the stored files
/// are its own.
#[test]
fn a_job_stored_before_text_rows_keeps_its_examples() {
    let dir = tempfile::tempdir().unwrap();
    let opts = options(dir.path(), LINES);
    let files = opts.prepare(&context(32, None)).unwrap();
    let old = JsonlOptions {
        text_rows: None,
        ..opts.clone()
    };
    let job = keep_in_job(dir.path(), &old, &files);
    let text = std::fs::read_to_string(job.join("job.toml")).unwrap();
    assert!(!text.contains("text_rows"), "{text}");
    let stored = context(32, Some(job.clone()));
    let resumed = old.clone().complete(&stored).unwrap();
    assert_eq!(resumed.text_rows, Some(TextRows::Examples));
    // The file changes; the job reads what it stored.
    std::fs::write(dir.path().join("train.jsonl"), "{\"text\": \"zz\"}\n").unwrap();
    let kept = resumed.open_examples(&stored).unwrap();
    assert_eq!(kept.train_len(), 2);
}
