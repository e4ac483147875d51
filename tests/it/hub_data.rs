//! Hub dataset ids as `data.hub`, against the fake Hub (`fake_hub`): the conversational parquet
//! shards of tests/fixtures/chat/data laid out as `push_to_hub` writes them, and a dataset
//! stored as jsonl whose parquet export (`refs/convert/parquet`) holds the same rows. Each
//! trains exactly what the same files named by path train, is pinned to its commit in
//! `job.toml`, resumes offline after the Hub moved on, and every mistake is refused before a
//! job exists. No test reaches the real Hub.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use crate::chat::{fixture, job};
use crate::common::{Run, TestJob, assert_same_bits};
use crate::fake_hub::{Hub, Repo, serve};

const A: &str = "a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1";
const B: &str = "b2b2b2b2b2b2b2b2b2b2b2b2b2b2b2b2b2b2b2b2";
const EXPORT: &str = "c3c3c3c3c3c3c3c3c3c3c3c3c3c3c3c3c3c3c3c3";

fn bytes(path: &str) -> Vec<u8> {
    std::fs::read(fixture(path)).unwrap()
}

/// `files` as `(repository path, fixture path)`.
fn files(list: &[(&str, &str)]) -> HashMap<String, Vec<u8>> {
    let mut files: HashMap<String, Vec<u8>> = (list.iter())
        .map(|(at, from)| (at.to_string(), bytes(from)))
        .collect();
    files.insert("README.md".into(), b"---\nlicense: mit\n---\n".to_vec());
    files
}

fn hub() -> Hub {
    let shards = files(&[
        (
            "data/train-00000-of-00002.parquet",
            "data/train-00000-of-00002.parquet",
        ),
        (
            "data/train-00001-of-00002.parquet",
            "data/train-00001-of-00002.parquet",
        ),
        (
            "data/test-00000-of-00001.parquet",
            "data/test-00000-of-00001.parquet",
        ),
    ]);
    // What main moves to later: other rows (the text shard) in the same names.
    let moved = files(&[
        ("data/train-00000-of-00001.parquet", "data/text.parquet"),
        ("data/test-00000-of-00001.parquet", "data/text.parquet"),
    ]);
    let sft = Repo {
        branches: HashMap::from([("main".into(), A.into())]),
        commits: HashMap::from([(A.into(), shards), (B.into(), moved)]),
        gated: false,
    };
    let export = files(&[
        (
            "default/train/0000.parquet",
            "data/train-00000-of-00002.parquet",
        ),
        (
            "default/train/0001.parquet",
            "data/train-00001-of-00002.parquet",
        ),
        (
            "default/test/0000.parquet",
            "data/test-00000-of-00001.parquet",
        ),
    ]);
    let jsonl = Repo {
        branches: HashMap::from([
            ("main".into(), B.into()),
            ("refs/convert/parquet".into(), EXPORT.into()),
        ]),
        commits: HashMap::from([
            (
                B.into(),
                files(&[("conversations.jsonl", "conversations.jsonl")]),
            ),
            (EXPORT.into(), export),
        ]),
        gated: false,
    };
    let mut hub = Hub::default();
    hub.repos.insert("datasets/chat/sft".into(), sft);
    hub.repos.insert("datasets/chat/jsonl".into(), jsonl);
    hub
}

fn data(hub: &str, extra: &str) -> String {
    format!("dataset = \"parquet\"\nhub = \"{hub}\"\nval_split = \"test\"\n{extra}")
}

#[test]
fn hub_datasets_train_what_their_files_train_pinned_resumable_offline_and_checked() {
    let t = TestJob::new();
    let hub = Arc::new(Mutex::new(hub()));
    let url = serve(hub.clone());
    let home = t.path("hf-home");
    let env = |offline: &str| {
        vec![
            ("HF_ENDPOINT", url.clone()),
            ("HF_HOME", home.display().to_string()),
            ("HF_HUB_OFFLINE", offline.to_string()),
            ("HF_TOKEN", String::new()),
            ("HF_HUB_CACHE", String::new()),
        ]
    };
    let run = |name: &str, data: &str, offline: &str, fault: Option<&str>| -> Run {
        let cfg = t.config(name, &job(data, "max_steps = 6"));
        let mut env = env(offline);
        if let Some(fault) = fault {
            env.push(("DDPJOB_FAULT", fault.into()));
        }
        let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
        t.run_env(&cfg, &["--name", name], &env)
    };
    let requests = || hub.lock().unwrap().requests.len();

    // The same shards by path: what the Hub jobs must train, bit for bit.
    let local = format!(
        "dataset = \"parquet\"\ntrain_path = \"{}\"\nval_path = \"{}\"\n",
        fixture("data/train-*.parquet"),
        fixture("data/test-00000-of-00001.parquet")
    );
    run("local", &local, "0", None).success();

    // push_to_hub's layout: downloaded into the cache, the commit and the files recorded.
    let whole = run("whole", &data("chat/sft", ""), "0", None);
    whole.success();
    assert!(
        whole
            .stdout
            .contains("960 training and 40 validation examples")
            && whole
                .stderr
                .contains(&format!("downloaded dataset chat/sft (commit {A})")),
        "{}\n{}",
        whole.stdout,
        whole.stderr
    );
    assert_same_bits(
        &t.job("local").join("model.safetensors"),
        &t.job("whole").join("model.safetensors"),
    );
    let repo = home.join("hub/datasets--chat--sft");
    let snapshot = repo.join("snapshots").join(A);
    assert!(snapshot.join("data/train-00001-of-00002.parquet").is_file());
    assert!(
        !snapshot.join("README.md").exists(),
        "only the splits' files are fetched"
    );
    assert_eq!(
        std::fs::read_to_string(repo.join("refs/main"))
            .unwrap()
            .trim(),
        A
    );
    let frozen = std::fs::read_to_string(t.job("whole").join("job.toml")).unwrap();
    for line in [
        format!("revision = \"{A}\""),
        "config = \"default\"".into(),
        "split = \"train\"".into(),
        format!(
            "train_path = \"{}\"",
            snapshot.join("data/train-0000*-of-00002.parquet").display()
        ),
    ] {
        assert!(frozen.contains(&line), "no {line} in\n{frozen}");
    }

    // Preempted at step 3, then main moves upstream to other rows: the job resumes offline from
    // what it stored, to the bits of the run never interrupted, without a request.
    run(
        "cut",
        &data("chat/sft", ""),
        "0",
        Some("rank=0,step=3,kind=preempt"),
    )
    .fails_with(143, "interrupted by SIGTERM");
    let mut moved = hub.lock().unwrap();
    let sft = moved.repos.get_mut("datasets/chat/sft").unwrap();
    sft.branches.insert("main".into(), B.into());
    drop(moved);
    let before = requests();
    let jobs = t.jobs_dir().display().to_string();
    let offline = env("1");
    let offline: Vec<(&str, &str)> = offline.iter().map(|(k, v)| (*k, v.as_str())).collect();
    Run::from(
        t.command(&["resume", "cut", "--jobs-dir", &jobs], &offline)
            .output()
            .unwrap(),
    )
    .success();
    assert_same_bits(
        &t.job("whole").join("model.safetensors"),
        &t.job("cut").join("model.safetensors"),
    );
    // A new job offline reads refs/main as cached (commit A), never asking the Hub.
    run("offline", &data("chat/sft", ""), "1", None).success();
    assert_eq!(requests(), before);
    // Pinned to commit A while main is B: A's files, from the cache.
    let pinned = run(
        "pinned",
        &data("chat/sft", &format!("revision = \"{A}\"")),
        "0",
        None,
    );
    pinned.success();
    assert_same_bits(
        &t.job("whole").join("model.safetensors"),
        &t.job("pinned").join("model.safetensors"),
    );

    // Stored as jsonl: read through the Hub's parquet export, the same rows, the same model.
    let export = run("export", &data("chat/jsonl", ""), "0", None);
    export.success();
    assert!(
        export
            .stderr
            .contains("its parquet export, refs/convert/parquet"),
        "{}",
        export.stderr
    );
    assert_same_bits(
        &t.job("whole").join("model.safetensors"),
        &t.job("export").join("model.safetensors"),
    );
    let frozen = std::fs::read_to_string(t.job("export").join("job.toml")).unwrap();
    assert!(
        frozen.contains(&format!("revision = \"{EXPORT}\"")),
        "{frozen}"
    );
    let export_ref = home.join("hub/datasets--chat--jsonl/refs/refs/convert/parquet");
    assert_eq!(std::fs::read_to_string(export_ref).unwrap().trim(), EXPORT);

    // Mistakes: exit 2 before anything exists, each naming its fix.
    let refused = [
        (
            "no-repo",
            data("chat/none", ""),
            "0",
            "it does not exist (check data.hub)",
        ),
        (
            "no-config",
            data("chat/jsonl", "config = \"fr\""),
            "0",
            "its configs: default",
        ),
        (
            "no-rev",
            data("chat/sft", "revision = \"v9\""),
            "0",
            "no dataset `chat/sft` at revision v9",
        ),
        (
            "uncached",
            data("chat/jsonl", "revision = \"v2\""),
            "1",
            "HF_HUB_OFFLINE forbids",
        ),
        (
            "both",
            data("chat/sft", "train_path = \"x.parquet\""),
            "0",
            "both name the data",
        ),
        (
            "jsonl",
            "dataset = \"jsonl\"\nhub = \"chat/sft\"".into(),
            "0",
            "set data.dataset = \"parquet\"",
        ),
        (
            "split-alone",
            local.clone() + "split = \"train\"",
            "0",
            "data.hub names none",
        ),
    ];
    for (name, data, offline, message) in refused {
        run(name, &data, offline, None).fails_with(2, message);
        assert!(!t.job(name).exists(), "{name} was created");
    }
    // The splits there are named when the one asked is not.
    run("listed", &data("chat/sft", "split = \"dev\""), "0", None).fails_with(
        2,
        "no split \"dev\" in config \"default\"; its splits: test, train",
    );
    assert!(!t.job("listed").exists());
}
