use std::path::Path;

use serde::Deserialize;

use super::*;
use crate::text_options::{TextOptions, TokensOptions};
use ddpjob_seam::DatasetOptions;
use ddpjob_spec::{LanguageModelSpec, TokenizerKind};
use ddpjob_storage::jobdir::JobDir;

/// A job's `[data]` as its loaded spec holds it: the dataset, its options completed as
/// validation completes them, and the context of the model it feeds.
struct DataSpec {
    name: String,
    options: toml::Table,
    cx: DataContext,
}

/// The `text` or `tokens` data of `spec`, with `job`'s stored vocabulary if any.
fn load(spec: &DataSpec, job: Option<&JobDir>) -> Result<TextTask, DataError> {
    let mut cx = spec.cx.clone();
    cx.job = job.map(|j| j.root.clone());
    cx.stored_job = job.is_some();
    let options = toml::Value::Table(spec.options.clone());
    let source = match spec.name.as_str() {
        "text" => TextSource::Text(TextOptions::deserialize(options).unwrap().spec()),
        _ => TextSource::Tokens(TokensOptions::deserialize(options).unwrap().spec()),
    };
    TextTask::open(&source, &cx)
}

/// The `[data]` table `data` of a job (seed 3) training a scratch gpt of window `block` (its
/// vocabulary 100 for token files), as `ddpjob validate` completes it.
fn spec_for(_dir: &Path, data: &str, block: usize) -> DataSpec {
    let mut table: toml::Table = data.parse().unwrap();
    let name = table
        .remove("dataset")
        .unwrap()
        .as_str()
        .unwrap()
        .to_string();
    let language = LanguageModelSpec {
        block_size: block,
        vocab_size: (name == "tokens").then_some(100),
        tokenizer: None,
        vocabulary: None,
        packed_rows: true,
    };
    let cx = DataContext::new(3, "gpt", Some(language));
    let value = toml::Value::Table(table);
    let options = match name.as_str() {
        "text" => toml::Table::try_from(
            TextOptions::deserialize(value)
                .unwrap()
                .complete(&cx)
                .unwrap(),
        )
        .unwrap(),
        _ => toml::Table::try_from(
            TokensOptions::deserialize(value)
                .unwrap()
                .complete(&cx)
                .unwrap(),
        )
        .unwrap(),
    };
    DataSpec { name, options, cx }
}

fn ids(t: &Tensor) -> Vec<Vec<u32>> {
    t.to_vec2::<u32>().unwrap()
}

#[test]
fn windows_are_inputs_and_targets_shifted_by_one() {
    let dir = tempfile::tempdir().unwrap();
    let text: String = (0..100)
        .map(|i| char::from(b'a' + (i % 26) as u8))
        .collect();
    std::fs::write(dir.path().join("in.txt"), &text).unwrap();
    let data = format!(
        "dataset = \"text\"\npath = \"{}\"\nval_fraction = 0.2\n",
        dir.path().join("in.txt").display()
    );
    let task = load(&spec_for(dir.path(), &data, 8), None).unwrap();
    // 80 training tokens: (80 - 8) / 8 = 9 windows; 20 validation tokens: 19 / 8 = 2 windows.
    assert_eq!((task.train_len(), task.eval_len()), (9, 2));
    assert_eq!(task.vocab.as_ref().unwrap().size(), 26);
    let batches = task.batches(&Device::Cpu).unwrap();
    let (x, y) = batches.eval(&[1]).unwrap();
    // Validation starts at token 80 ('c'): window 1 is tokens 88..97.
    let want: Vec<u32> = (88..96).map(|i| (i % 26) as u32).collect();
    assert_eq!(ids(&x)[0], want);
    assert_eq!(
        ids(&y)[0],
        (89..97).map(|i| (i % 26) as u32).collect::<Vec<_>>()
    );
    // An epoch's windows are every 8 tokens from its phase; phases vary over epochs.
    let phases: Vec<usize> = (0..20).map(|e| task.phase(e)).collect();
    assert!(phases.iter().all(|&p| p < 8));
    assert!(phases.iter().any(|&p| p != phases[0]), "{phases:?}");
    let (x, _) = batches.train(5, &[0, 8]).unwrap();
    let p = task.phase(5) as u32;
    assert_eq!(ids(&x)[0][0], p % 26);
    assert_eq!(ids(&x)[1][0], (p + 64) % 26);
    assert_eq!(x.dims(), &[2, 8]);
}

#[test]
fn mapped_tokens_are_read_in_place_and_range_checked() {
    let dir = tempfile::tempdir().unwrap();
    let write = |name: &str, tokens: &[u16]| {
        let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
        std::fs::write(dir.path().join(name), bytes).unwrap();
    };
    let mut train: Vec<u16> = (0..50).collect();
    train[30] = 100;
    write("train.bin", &train);
    write("val.bin", &(0..20).collect::<Vec<u16>>());
    let data = format!(
        "dataset = \"tokens\"\ntrain_path = \"{0}/train.bin\"\nval_path = \"{0}/val.bin\"\n",
        dir.path().display()
    );
    let task = load(&spec_for(dir.path(), &data, 4), None).unwrap();
    assert!(matches!(task.train, Tokens::Mapped { .. }));
    assert_eq!(task.train_len(), 11);
    let batches = task.batches(&Device::Cpu).unwrap();
    let (x, y) = batches.eval(&[0]).unwrap();
    assert_eq!(ids(&x)[0], vec![0, 1, 2, 3]);
    assert_eq!(ids(&y)[0], vec![1, 2, 3, 4]);
    // The training split (possibly many GB) is checked as its windows are read.
    let read_all = (0..task.train_len()).collect::<Vec<_>>();
    let err = batches.train(0, &read_all).unwrap_err().to_string();
    assert!(
        err.contains("train.bin")
            && err.contains("token 100 at byte offset 60")
            && err.contains("model.vocab_size = 100"),
        "{err}"
    );
    // The validation split, read whole by every evaluation, is checked when the data opens:
    // not at the first evaluation, after the training before it.
    let mut val: Vec<u16> = (0..20).collect();
    val[13] = 100;
    write("val.bin", &val);
    let err = load(&spec_for(dir.path(), &data, 4), None)
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains("val.bin") && err.contains("token 100 at byte offset 26"),
        "{err}"
    );
}

#[test]
fn odd_lengths_and_short_files_are_named() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("train.bin"), [0u8; 7]).unwrap();
    std::fs::write(dir.path().join("val.bin"), [0u8; 8]).unwrap();
    let data = format!(
        "dataset = \"tokens\"\ntrain_path = \"{0}/train.bin\"\nval_path = \"{0}/val.bin\"\n",
        dir.path().display()
    );
    let err = load(&spec_for(dir.path(), &data, 4), None)
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains("train.bin") && err.contains("7 bytes"),
        "{err}"
    );

    std::fs::write(dir.path().join("short.txt"), "abcdefgh").unwrap();
    let data = format!(
        "dataset = \"text\"\npath = \"{}/short.txt\"\n",
        dir.path().display()
    );
    let err = load(&spec_for(dir.path(), &data, 16), None).err().unwrap();
    // The config and the text disagree (a usage error, exit 2), nothing is damaged.
    assert!(matches!(err, DataError::Mismatch(_)), "{err:?}");
    let err = err.to_string();
    assert!(
        err.contains("short.txt") && err.contains("fewer than one window"),
        "{err}"
    );
}

#[test]
fn a_stored_vocabulary_that_no_longer_covers_the_text_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("in.txt");
    std::fs::write(&path, "abcabcabcabcabcabcabcabcabcabcabcabcabcabc").unwrap();
    let job = JobDir {
        root: dir.path().join("job"),
    };
    std::fs::create_dir_all(&job.root).unwrap();
    let vocab = Vocab::build(&TokenizerKind::Char, "ab").unwrap();
    std::fs::write(Vocab::path_in(&job.root), vocab.to_json()).unwrap();
    let data = format!("dataset = \"text\"\npath = \"{}\"\n", path.display());
    let err = load(&spec_for(dir.path(), &data, 2), Some(&job))
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("'c'") && err.contains("vocab.json"), "{err}");
    // Either the job's text changed or other text is being scored (`eval --set data.path`):
    // both are named, not only the first.
    assert!(
        err.contains("if it is the job's own text, it changed")
            && err.contains("other text to score with the job must use only the job's"),
        "{err}"
    );
}

#[test]
fn a_job_keeps_the_kind_of_tokenizer_it_started_with() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("in.txt");
    std::fs::write(&path, "ab".repeat(40)).unwrap();
    let job = JobDir {
        root: dir.path().join("job"),
    };
    std::fs::create_dir_all(&job.root).unwrap();
    let vocab = Vocab::build(&TokenizerKind::Char, "ab").unwrap();
    std::fs::write(Vocab::path_in(&job.root), vocab.to_json()).unwrap();
    let data = |tokenizer: &str| {
        let text = format!(
            "dataset = \"text\"\npath = \"{}\"\ntokenizer = \"{tokenizer}\"\n",
            path.display()
        );
        load(&spec_for(dir.path(), &text, 2), Some(&job))
    };
    let err = data("byte").err().unwrap().to_string();
    assert!(
        err.contains("is \"char\"") && err.contains("vocab.json"),
        "{err}"
    );
    assert_eq!(data("char").unwrap().vocab, Some(vocab));
}

/// A pretrained model's vocabulary is its checkpoint's: a tokenizer larger than it is named as
/// not the model's, not met with advice to set `model.vocab_size` (which it refuses).
#[test]
fn a_tokenizer_larger_than_a_pretrained_models_vocabulary_is_not_its_own() {
    let dir = tempfile::tempdir().unwrap();
    let tokenizer = dir.path().join("tokenizer.json");
    let text = "the cat sat on the mat. the dog sat on the log.\n".repeat(20);
    crate::hf_tokenizer::testing::train_bpe(&text, 300, &tokenizer);
    let path = dir.path().join("in.txt");
    std::fs::write(&path, &text).unwrap();
    let data = format!(
        "dataset = \"text\"\npath = \"{}\"\ntokenizer = \"{}\"\n",
        path.display(),
        tokenizer.display()
    );
    let spec = spec_for(dir.path(), &data, 4);
    let options = toml::Value::Table(spec.options.clone());
    let source = TextSource::Text(TextOptions::deserialize(options).unwrap().spec());
    let mut cx = spec.cx.clone();
    let model_dir = |name: &str| Some(dir.path().join(name).join("tokenizer.json"));
    let pretrained = |own| {
        Some(LanguageModelSpec {
            block_size: 4,
            vocab_size: Some(50),
            tokenizer: own,
            vocabulary: None,
            packed_rows: true,
        })
    };
    cx.language = pretrained(model_dir("model"));
    let err = TextTask::open(&source, &cx).err().unwrap().to_string();
    assert!(
        err.contains("does not belong to this model (its checkpoint's vocabulary: 50")
            && !err.contains("make it at least"),
        "{err}"
    );
    cx.language = pretrained(Some(tokenizer.clone()));
    let err = TextTask::open(&source, &cx).err().unwrap().to_string();
    assert!(
        err.contains("the model directory's") && err.contains("config.json's vocab_size: 50"),
        "{err}"
    );
}
