//! Hub ids as `model.init_from`, against a local server on 127.0.0.1 that answers as the Hub's
//! file API does (`fake_hub`): downloaded into the Hugging Face cache, read from it again offline, pinned to a commit, sharded checkpoints;
//! the failures refused before anything is created. No test reaches the real Hub.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use crate::common::TestJob;
use crate::fake_hub::{Hub, Repo, TOKEN, serve};

const A: &str = "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";
const B: &str = "bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb";

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/hf")
        .join(name)
}

/// The files of a fixture directory (its reference outputs left out).
fn files_of(dir: &Path) -> HashMap<String, Vec<u8>> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.file_name().unwrap() != "reference.safetensors")
        .map(|p| {
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            (name, std::fs::read(&p).unwrap())
        })
        .collect()
}

/// The llama fixture with its weights in two shards and an index, as large checkpoints are.
fn sharded(t: &TestJob) -> HashMap<String, Vec<u8>> {
    let mut files = files_of(&fixture("llama"));
    let weights = candle_core::safetensors::load(
        fixture("llama").join("model.safetensors"),
        &candle_core::Device::Cpu,
    )
    .unwrap();
    let mut names: Vec<&String> = weights.keys().collect();
    names.sort();
    let mut map = serde_json::Map::new();
    let mut shards: [HashMap<String, candle_core::Tensor>; 2] = Default::default();
    for (i, name) in names.iter().enumerate() {
        let shard = i % 2;
        shards[shard].insert((*name).clone(), weights[*name].clone());
        let file = format!("model-0000{}-of-00002.safetensors", shard + 1);
        map.insert((*name).clone(), file.into());
    }
    for (i, shard) in shards.iter().enumerate() {
        let file = format!("model-0000{}-of-00002.safetensors", i + 1);
        let path = t.path(&file);
        candle_core::safetensors::save(shard, &path).unwrap();
        files.insert(file, std::fs::read(&path).unwrap());
    }
    files.remove("model.safetensors");
    let index = serde_json::json!({"metadata": {}, "weight_map": map});
    files.insert(
        "model.safetensors.index.json".into(),
        index.to_string().into_bytes(),
    );
    files
}

/// `(key, value)` pairs as `TestJob::command` takes them.
fn pairs<'a>(env: &'a [(&'a str, String)]) -> Vec<(&'a str, &'a str)> {
    env.iter().map(|(k, v)| (*k, v.as_str())).collect()
}

fn repo(commit: &str, files: HashMap<String, Vec<u8>>, gated: bool) -> Repo {
    Repo {
        branches: HashMap::from([("main".to_string(), commit.to_string())]),
        commits: HashMap::from([(commit.to_string(), files)]),
        gated,
    }
}

fn job(t: &TestJob, init_from: &str) -> String {
    let text = t.path("corpus.txt");
    std::fs::write(&text, include_str!("../fixtures/hf/sample.txt")).unwrap();
    format!(
        "seed = 3\n[model]\ninit_from = \"{init_from}\"\nblock_size = 16\n[data]\n\
         dataset = \"text\"\npath = \"{}\"\n[train]\nepochs = 1\nmax_steps = 3\nbatch_size = 4\n\
         lr = 1e-3\n",
        text.display()
    )
}

#[test]
fn hub_ids_download_into_the_cache_then_read_it_pinned_and_offline() {
    let t = TestJob::new();
    let hub = Arc::new(Mutex::new(Hub::default()));
    {
        let mut h = hub.lock().unwrap();
        h.repos.insert(
            "tiny/qwen3".into(),
            repo(A, files_of(&fixture("qwen3")), false),
        );
        h.repos
            .insert("tiny/sharded".into(), repo(A, sharded(&t), false));
        h.repos.insert(
            "tiny/gated".into(),
            repo(A, files_of(&fixture("qwen3")), true),
        );
    }
    let url = serve(hub.clone());
    let home = t.path("hf-home");
    let home_s = home.display().to_string();
    let env = |offline: &str| {
        vec![
            ("HF_ENDPOINT", url.clone()),
            ("HF_HOME", home_s.clone()),
            ("HF_HUB_OFFLINE", offline.to_string()),
            ("HF_TOKEN", String::new()),
            ("HF_HUB_CACHE", String::new()),
        ]
    };
    let run = |name: &str, init_from: &str, extra: &[&str], offline: &str| {
        let cfg = t.config(name, &job(&t, init_from));
        let env = env(offline);
        let env = pairs(&env);
        t.run_env(&cfg, extra, &env)
    };
    let requests = |hub: &Arc<Mutex<Hub>>| hub.lock().unwrap().requests.len();

    // Downloaded: the snapshot of main's commit, refs/main naming it, job.toml recording both.
    run("ft", "tiny/qwen3", &[], "0").success();
    let repo_dir = home.join("hub/models--tiny--qwen3");
    let snapshot = repo_dir.join("snapshots").join(A);
    for file in ["config.json", "model.safetensors", "tokenizer.json"] {
        assert!(
            snapshot.join(file).is_file(),
            "no {file} in {}",
            snapshot.display()
        );
    }
    let refs = std::fs::read_to_string(repo_dir.join("refs/main")).unwrap();
    assert_eq!(refs.trim(), A);
    let frozen = std::fs::read_to_string(t.job("ft").join("job.toml")).unwrap();
    assert!(
        frozen.contains(&format!("init_from = \"{}\"", snapshot.display()))
            && frozen.contains(&format!("revision = \"{A}\""))
            && frozen.contains("model_type = \"qwen3\""),
        "{frozen}"
    );
    // No partial download is left looking like a file.
    let blobs: Vec<_> = std::fs::read_dir(repo_dir.join("blobs")).unwrap().collect();
    assert!(blobs.iter().all(|b| {
        !b.as_ref()
            .unwrap()
            .path()
            .to_string_lossy()
            .ends_with(".part")
    }));

    // The same job preempted (SIGTERM at step 2, its checkpoint written) ...
    let mut cut_env = env("0");
    cut_env.push(("DDPJOB_FAULT", "rank=0,step=2,kind=preempt".into()));
    let cut_env = pairs(&cut_env);
    let cfg = t.config("cut", &job(&t, "tiny/qwen3"));
    t.run_env(&cfg, &[], &cut_env)
        .fails_with(143, "interrupted by SIGTERM");

    // ... then main moves to a new commit upstream: the jobs' own job.toml still read commit A,
    // from the cache, without asking the Hub, and the preempted one resumes offline to the bits
    // of the run never interrupted.
    hub.lock()
        .unwrap()
        .repos
        .get_mut("tiny/qwen3")
        .unwrap()
        .branches
        .insert("main".into(), B.into());
    let jobs = t.jobs_dir().display().to_string();
    let offline = env("1");
    let offline = pairs(&offline);
    crate::common::Run::from(
        t.command(&["resume", "cut", "--jobs-dir", &jobs], &offline)
            .output()
            .unwrap(),
    )
    .success();
    crate::common::assert_same_bits(
        &t.job("ft").join("model.safetensors"),
        &t.job("cut").join("model.safetensors"),
    );
    let before = requests(&hub);
    let frozen_path = t.job("ft").join("job.toml").display().to_string();
    let envs = env("0");
    let envs = pairs(&envs);
    crate::common::Run::from(
        t.command(&["validate", &frozen_path], &envs)
            .output()
            .unwrap(),
    )
    .success();
    // A commit sha already in the cache: no request either.
    run(
        "pinned",
        "tiny/qwen3",
        &["--set", &format!("model.revision=\"{A}\"")],
        "0",
    )
    .success();
    assert_eq!(requests(&hub), before, "the cache was enough");
    // The Hub out of reach (nothing listens there): the cached revision, with a warning.
    let cfg = t.config("unreached", &job(&t, "tiny/qwen3"));
    let mut unreached = env("0");
    unreached.retain(|(k, _)| *k != "HF_ENDPOINT");
    unreached.push(("HF_ENDPOINT", "http://127.0.0.1:9".into()));
    let unreached = t.run_env(&cfg, &[], &pairs(&unreached));
    unreached.success();
    assert!(
        unreached.stderr.contains("is out of reach") && unreached.stderr.contains(A),
        "{}",
        unreached.stderr
    );
    // Offline: refs/main, as cached, is read (and the Hub is never asked).
    run("offline", "tiny/qwen3", &[], "1").success();
    assert_eq!(requests(&hub), before);

    // Offline with nothing cached, a repository the Hub does not have, a revision it does not
    // have, a gated one without the token: exit 2, nothing created, the fix named.
    run("none", "tiny/sharded", &[], "1").fails_with(2, "HF_HUB_OFFLINE forbids downloading it");
    run("nope", "tiny/nope", &[], "0").fails_with(2, "hf auth login");
    run(
        "rev",
        "tiny/qwen3",
        &["--set", "model.revision=\"v9\""],
        "0",
    )
    .fails_with(2, "has no `config.json` for `tiny/qwen3` at revision v9");
    run("gated", "tiny/gated", &[], "0").fails_with(2, "private or gated");
    for name in ["none", "nope", "rev", "gated"] {
        assert!(!t.job(name).exists(), "{name} was created");
    }
    // With the token, the gated repository downloads.
    let cfg = t.config("gated-ok", &job(&t, "tiny/gated"));
    let mut envs = env("0");
    envs.retain(|(k, _)| *k != "HF_TOKEN");
    envs.push(("HF_TOKEN", TOKEN.into()));
    let envs = pairs(&envs);
    let cfg_s = cfg.display().to_string();
    crate::common::Run::from(t.command(&["validate", &cfg_s], &envs).output().unwrap()).success();

    // A download that breaks off leaves a `.part` beside the blobs and no file in the snapshot
    // (exit 2, nothing created); the next run resumes it and gets the whole file.
    let smol = files_of(&fixture("smollm3"));
    let weights = smol["model.safetensors"].clone();
    {
        let mut h = hub.lock().unwrap();
        h.repos.insert("tiny/smol".into(), repo(A, smol, false));
        h.cut = Some("model.safetensors".into());
    }
    run("broken", "tiny/smol", &[], "0").fails_with(2, "cannot download `model.safetensors`");
    assert!(!t.job("broken").exists());
    let smol_dir = home.join("hub/models--tiny--smol");
    assert!(
        !smol_dir
            .join("snapshots")
            .join(A)
            .join("model.safetensors")
            .exists()
    );
    let parts: Vec<PathBuf> = std::fs::read_dir(smol_dir.join("blobs"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.to_string_lossy().ends_with(".part"))
        .collect();
    assert_eq!(parts.len(), 1, "{parts:?}");
    hub.lock().unwrap().cut = None;
    run("mended", "tiny/smol", &[], "0").success();
    let got = std::fs::read(smol_dir.join("snapshots").join(A).join("model.safetensors")).unwrap();
    assert!(got == weights, "the resumed download differs");

    // Sharded: the index and every shard it names, and the job trains from them.
    run("shards", "tiny/sharded", &[], "0").success();
    let snapshot = home.join("hub/models--tiny--sharded/snapshots").join(A);
    for file in [
        "model.safetensors.index.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ] {
        assert!(snapshot.join(file).is_file(), "no {file}");
    }
    // `eval` takes a Hub id as it takes a model directory: from the cache, offline here.
    let cfg = t
        .config("scored", &job(&t, "tiny/qwen3"))
        .display()
        .to_string();
    let jobs = t.jobs_dir().display().to_string();
    let envs = env("1");
    let envs = pairs(&envs);
    let args = [
        "eval",
        "tiny/qwen3",
        "--data",
        &cfg,
        "--json",
        "--jobs-dir",
        &jobs,
    ];
    let eval = t.command(&args, &envs).output().unwrap();
    assert!(
        eval.status.success(),
        "{}",
        String::from_utf8_lossy(&eval.stderr)
    );
    let scored: serde_json::Value = serde_json::from_slice(&eval.stdout).unwrap();
    assert!(scored["loss"].as_f64().is_some_and(|l| l > 5.0), "{scored}");

    // A path that exists wins over an id of the same spelling.
    std::fs::create_dir_all(t.path("tiny")).unwrap();
    crate::common::copy_dir(&fixture("qwen2"), &t.path("tiny/qwen3"));
    let before = requests(&hub);
    run("local", "tiny/qwen3", &[], "0").success();
    assert_eq!(requests(&hub), before);
    let frozen = std::fs::read_to_string(t.job("local").join("job.toml")).unwrap();
    assert!(frozen.contains("model_type = \"qwen2\""), "{frozen}");
}
