use std::path::{Path, PathBuf};

use candle_core::Device;
use ddpjob_seam::DatasetOptions;
use ddpjob_seam::task::{IGNORE_TARGET, Task};
use ddpjob_spec::{DataContext, LanguageModelSpec};

use super::super::jsonl::JsonlOptions;
use super::PairsTask;

fn fixture(path: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(path)
}

/// The chat fixture's Qwen3 (its tokenizer and ChatML template), reading pairs.
fn pairs_context(block: usize) -> DataContext {
    let language = LanguageModelSpec {
        block_size: block,
        vocab_size: Some(320),
        tokenizer: Some(fixture("chat/model/tokenizer.json")),
        vocabulary: None,
        packed_rows: true,
    };
    let mut cx = DataContext::new(1, "llama", Some(language));
    cx.pairs = true;
    cx
}

fn open(train: &Path, val: Option<&Path>, block: usize) -> Result<PairsTask, String> {
    let cx = pairs_context(block);
    let opts = JsonlOptions {
        train_path: Some(train.display().to_string()),
        val_path: val.map(|v| v.display().to_string()),
        val_fraction: 0.25,
        ..JsonlOptions::default()
    }
    .complete(&cx)?;
    // What `JsonlOptions::open` makes of pairs.
    let examples = opts.open_examples(&cx).map_err(|e| e.to_string())?;
    Ok(PairsTask::new(examples))
}

fn ids(v: &serde_json::Value) -> Vec<u32> {
    (v.as_array().unwrap().iter())
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

/// Every pair's tokens are TRL's (`DPOTrainer._prepare_dataset`, trl 1.16, in
/// `tests/fixtures/dpo/reference.json`): the prompt's then each completion's, for strings
/// (eos appended) and for conversations (through the model's chat template), and the loss is
/// on the completion's tokens alone.
#[test]
fn pairs_are_tokenised_as_trl_tokenises_them() {
    let reference: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture("dpo/reference.json")).unwrap())
            .unwrap();
    for (name, file) in [
        ("strings", "dpo/prefs.jsonl"),
        ("chat", "dpo/prefs-chat.jsonl"),
    ] {
        let task = open(&fixture(file), Some(&fixture("dpo/prefs-val.jsonl")), 512).unwrap();
        let want = reference["tokens"][name].as_array().unwrap();
        assert_eq!(task.train_len(), want.len(), "{name}");
        let batches = task.batches(&Device::Cpu).unwrap();
        for (i, row) in want.iter().enumerate() {
            let prompt = ids(&row["prompt_ids"]);
            for (k, completion) in ["chosen_ids", "rejected_ids"].iter().enumerate() {
                let completion = ids(&row[*completion]);
                let whole: Vec<u32> = prompt.iter().chain(&completion).copied().collect();
                let example = task.examples.example(2 * i + k);
                assert_eq!(example.ids, whole, "{name} pair {i} row {k}");
                let trained: Vec<bool> = (0..whole.len()).map(|j| j >= prompt.len()).collect();
                assert_eq!(example.trained, trained, "{name} pair {i} row {k}");
            }
            // Batched: [1, 2, t], the targets the completions' tokens, shifted.
            let (xs, ys) = batches.train(0, &[i]).unwrap();
            assert_eq!(xs.dims()[..2], [1, 2]);
            let ys = ys.squeeze(0).unwrap().to_vec2::<u32>().unwrap();
            let chosen = ids(&row["chosen_ids"]);
            let scored: Vec<u32> = ys[0]
                .iter()
                .copied()
                .filter(|&y| y != IGNORE_TARGET)
                .collect();
            assert_eq!(scored, chosen, "{name} pair {i}");
        }
        assert_eq!(task.eval_len(), 6);
        assert!(
            task.batches(&Device::Cpu)
                .unwrap()
                .note()
                .unwrap()
                .contains("24 training")
        );
    }
}

#[test]
fn without_a_validation_file_the_last_pairs_are_validation() {
    let task = open(&fixture("dpo/prefs.jsonl"), None, 512).unwrap();
    // 24 pairs, a quarter kept: 18 and 6, never a pair cut in two.
    assert_eq!((task.train_len(), task.eval_len()), (18, 6));
}

#[test]
fn bad_pairs_are_named_counted_or_refused() {
    let dir = tempfile::tempdir().unwrap();
    let write = |name: &str, text: &str| {
        let path = dir.path().join(name);
        std::fs::write(&path, text).unwrap();
        path
    };
    let good = r#"{"prompt": "Q: hi\n", "chosen": "yes", "rejected": "no"}"#;
    let same = r#"{"prompt": "Q: hi\n", "chosen": "yes", "rejected": "yes"}"#;
    let missing = write(
        "missing.jsonl",
        &format!("{good}\n{{\"prompt\": \"a\", \"chosen\": \"b\"}}\n"),
    );
    let e = open(&missing, None, 64).err().unwrap();
    assert!(
        e.contains("missing.jsonl` line 2") && e.contains("no \"rejected\""),
        "{e}"
    );
    // Identical pairs teach nothing: left out and counted; all identical is refused.
    let val = write("val.jsonl", &format!("{good}\n"));
    let some = write("some.jsonl", &format!("{good}\n{same}\n{good}\n"));
    let task = open(&some, Some(&val), 64).unwrap();
    assert_eq!(task.train_len(), 2);
    let note = task.batches(&Device::Cpu).unwrap().note().unwrap();
    assert!(note.contains("1 pairs with nothing to learn"), "{note}");
    let all = write("all.jsonl", &format!("{same}\n{same}\n"));
    let e = open(&all, Some(&val), 64).err().unwrap();
    assert!(
        e.contains("no usable example") && e.contains("left out"),
        "{e}"
    );
    // A prompt that fills the context leaves no completion: left out too.
    let long = format!(
        "{{\"prompt\": \"{}\", \"chosen\": \"yes\", \"rejected\": \"no\"}}",
        "word ".repeat(200)
    );
    let cut = write("cut.jsonl", &format!("{long}\n{good}\n"));
    let task = open(&cut, Some(&val), 64).unwrap();
    assert_eq!(task.train_len(), 1);
    // Strings beside messages, and pairs packed, are refused.
    let mixed = write(
        "mixed.jsonl",
        r#"{"prompt": "a", "chosen": "b", "rejected": [{"role": "assistant", "content": "c"}]}"#,
    );
    let e = open(&mixed, Some(&val), 64).err().unwrap();
    assert!(e.contains("both strings or both lists"), "{e}");
    let packed = JsonlOptions {
        train_path: Some(some.display().to_string()),
        pack: true,
        ..JsonlOptions::default()
    }
    .complete(&pairs_context(64))
    .err()
    .unwrap();
    assert!(packed.contains("drop pack"), "{packed}");
}
