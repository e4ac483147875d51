//! `datasets`' `save_to_disk` directories with the real binary: the fixture's parquet shards
//! as `datasets` saves them (tests/fixtures/chat/make_saved_dataset.py: a DatasetDict, its
//! training split in two Arrow IPC streams) preview and train exactly what the shards do; a
//! DatasetDict's root is refused naming its splits, a file that is not Arrow is refused.

use crate::chat::{fixture, job};
use crate::common::{TestJob, assert_same_bits};

fn data(dataset: &str, train: &str, val: &str) -> String {
    format!(
        "dataset = \"{dataset}\"\ntrain_path = \"{}\"\nval_path = \"{}\"",
        fixture(train),
        fixture(val)
    )
}

#[test]
fn a_saved_dataset_trains_what_its_parquet_shards_train() {
    let t = TestJob::new();
    let parquet = data(
        "parquet",
        "data/train-*.parquet",
        "data/test-00000-of-00001.parquet",
    );
    let arrow = data("arrow", "data/saved/train", "data/saved/test");
    let preview = |name: &str, data: &str| {
        let cfg = t.config(name, &job(data, "max_steps = 3"));
        let run = t.ddpjob(&["preview", &cfg.display().to_string(), "--json"]);
        run.success();
        run.stdout
    };
    assert_eq!(preview("p", &parquet), preview("a", &arrow));
    t.run(&t.config("parquet", &job(&parquet, "max_steps = 3")), &[])
        .success();
    let run = t.run(&t.config("arrow", &job(&arrow, "max_steps = 3")), &[]);
    run.success();
    assert!(
        run.stdout
            .contains("960 training and 40 validation examples"),
        "{}",
        run.stdout
    );
    assert_same_bits(
        &t.job("parquet").join("model.safetensors"),
        &t.job("arrow").join("model.safetensors"),
    );

    // Refused before a job exists: the DatasetDict's root, a file that is not Arrow.
    let root = format!(
        "dataset = \"arrow\"\ntrain_path = \"{}\"",
        fixture("data/saved")
    );
    t.run(&t.config("root", &job(&root, "")), &[]).fails_with(
        2,
        "a DatasetDict saved by `save_to_disk` (splits: train, test)",
    );
    let bad = t.path("bad.arrow");
    std::fs::write(&bad, b"ARROW1 not really").unwrap();
    let corrupt = format!("dataset = \"arrow\"\ntrain_path = \"{}\"", bad.display());
    t.run(&t.config("corrupt", &job(&corrupt, "")), &[])
        .fails_with(2, "not a readable Arrow IPC file");
    for name in ["root", "corrupt"] {
        assert!(!t.job(name).exists(), "{name}: a job was made");
    }
}
