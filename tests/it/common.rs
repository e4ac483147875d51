//! `TestJob`: a temp directory with a config in it, the real binary run on it, and the job
//! directory read back.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

pub struct TestJob {
    pub dir: tempfile::TempDir,
}

/// What a run of the binary did.
pub struct Run {
    pub code: i32,
    pub stdout: String,
    pub stderr: String,
}

impl From<Output> for Run {
    fn from(out: Output) -> Self {
        Run {
            code: out.status.code().unwrap_or(-1),
            stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        }
    }
}

impl Run {
    #[track_caller]
    pub fn success(&self) -> &Self {
        assert_eq!(
            self.code, 0,
            "expected success\nstdout:\n{}\nstderr:\n{}",
            self.stdout, self.stderr
        );
        self
    }

    #[track_caller]
    pub fn fails_with(&self, code: i32, message: &str) -> &Self {
        assert_eq!(
            self.code, code,
            "wrong exit code\nstdout:\n{}\nstderr:\n{}",
            self.stdout, self.stderr
        );
        assert!(
            self.stderr.contains(message),
            "stderr lacks {message:?}:\n{}",
            self.stderr
        );
        self
    }
}

/// A small, fast synthetic job.
pub const TINY: &str = r#"
seed = 3
[model]
arch = "mlp"
hidden = [32]
[data]
dataset = "synthetic"
[data.synthetic]
train_samples = 512
test_samples = 256
shape = [1, 8, 8]
classes = 4
noise = 0.8
[train]
epochs = 2
batch_size = 32
lr = 0.01
log_every = 4
"#;

impl TestJob {
    pub fn new() -> Self {
        TestJob {
            dir: tempfile::tempdir().expect("temp dir"),
        }
    }

    pub fn path(&self, rel: &str) -> PathBuf {
        self.dir.path().join(rel)
    }

    pub fn jobs_dir(&self) -> PathBuf {
        self.path("jobs")
    }

    /// Writes `text` as `<name>.toml` and returns its path.
    pub fn config(&self, name: &str, text: &str) -> PathBuf {
        let path = self.path(&format!("{name}.toml"));
        std::fs::write(&path, text).expect("write config");
        path
    }

    /// `ddpjob <args>` in the temp directory, plain output (not a terminal), with `env` added.
    pub fn command(&self, args: &[&str], env: &[(&str, &str)]) -> Command {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_ddpjob"));
        without_scheduler(&mut cmd);
        away_from_the_hub(&mut cmd, self.dir.path());
        cmd.args(args)
            .current_dir(self.dir.path())
            .env("DDPJOB_PLAIN", "1")
            .envs(env.iter().copied());
        cmd
    }

    /// Runs `ddpjob <args>` in the temp directory, plain output (not a terminal).
    pub fn ddpjob(&self, args: &[&str]) -> Run {
        self.command(args, &[])
            .output()
            .expect("spawn ddpjob")
            .into()
    }

    /// `ddpjob run <config> --jobs-dir <tmp>/jobs <extra>`.
    pub fn run(&self, config: &Path, extra: &[&str]) -> Run {
        self.run_env(config, extra, &[])
    }

    /// [`run`](Self::run) with environment variables (`DDPJOB_FAULT`, ...).
    pub fn run_env(&self, config: &Path, extra: &[&str], env: &[(&str, &str)]) -> Run {
        let config = config.to_string_lossy().into_owned();
        let jobs = self.jobs_dir().to_string_lossy().into_owned();
        let mut args = vec!["run", config.as_str(), "--jobs-dir", jobs.as_str()];
        args.extend_from_slice(extra);
        self.command(&args, env)
            .output()
            .expect("spawn ddpjob")
            .into()
    }

    pub fn job(&self, name: &str) -> PathBuf {
        self.jobs_dir().join(name)
    }

    pub fn json(&self, path: &Path) -> serde_json::Value {
        let text =
            std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
    }

    /// Lines in a job's `metrics.jsonl` so far (0 before it exists).
    pub fn metrics_lines(&self, name: &str) -> usize {
        std::fs::read_to_string(self.job(name).join("metrics.jsonl"))
            .map_or(0, |text| text.lines().count())
    }

    pub fn metrics(&self, name: &str) -> Vec<serde_json::Value> {
        let text =
            std::fs::read_to_string(self.job(name).join("metrics.jsonl")).expect("metrics.jsonl");
        text.lines()
            .map(|l| serde_json::from_str(l).expect("metrics line is JSON"))
            .collect()
    }
}

/// A few KB of text with structure a one-layer model can learn.
pub fn corpus() -> String {
    let subjects = ["the cat", "a dog", "my bird", "our fox"];
    let verbs = ["sat on", "ran to", "looked at", "slept by"];
    let objects = ["the mat.", "a tree.", "the door.", "my hat."];
    let mut text = String::new();
    for i in 0..240 {
        text += &format!(
            "{} {} {}\n",
            subjects[i % 4],
            verbs[(i / 4) % 4],
            objects[(i / 16) % 4]
        );
    }
    text
}

/// The tensors of a safetensors file, flattened to f32 (a 4-bit base's uint8 codes each
/// one value), by name.
pub fn load_weights(path: &Path) -> std::collections::BTreeMap<String, Vec<f32>> {
    let f32 = |t: candle_core::Tensor| {
        t.to_dtype(candle_core::DType::F32)?
            .flatten_all()?
            .to_vec1()
    };
    candle_core::safetensors::load(path, &candle_core::Device::Cpu)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .into_iter()
        .map(|(k, t)| (k, f32(t).unwrap()))
        .collect()
}

/// A launcher running in the background; killed (with its process group) if the test ends
/// before it does, so a failing test leaves nothing behind.
pub struct Background {
    pub child: std::process::Child,
}

impl Background {
    /// Waits up to `limit` for the launcher to exit; `None` if it is still running.
    pub fn wait_for(&mut self, limit: std::time::Duration) -> Option<Run> {
        let deadline = std::time::Instant::now() + limit;
        while std::time::Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                let mut stdout = String::new();
                let mut stderr = String::new();
                use std::io::Read;
                if let Some(mut s) = self.child.stdout.take() {
                    let _ = s.read_to_string(&mut stdout);
                }
                if let Some(mut s) = self.child.stderr.take() {
                    let _ = s.read_to_string(&mut stderr);
                }
                let status = self.child.wait().expect("reap launcher");
                return Some(Run {
                    code: status.code().unwrap_or(-1),
                    stdout,
                    stderr,
                });
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        None
    }
}

impl Drop for Background {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

impl TestJob {
    /// `ddpjob run <config> --jobs-dir <tmp>/<jobs_dir> <extra>` in the background, output piped.
    pub fn spawn_run(&self, config: &Path, jobs_dir: &str, extra: &[&str]) -> Background {
        self.spawn_run_env(config, jobs_dir, extra, &[])
    }

    /// [`spawn_run`](Self::spawn_run) with environment variables (a scheduler's).
    pub fn spawn_run_env(
        &self,
        config: &Path,
        jobs_dir: &str,
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> Background {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_ddpjob"));
        without_scheduler(&mut cmd);
        away_from_the_hub(&mut cmd, self.dir.path());
        let child = cmd
            .arg("run")
            .arg(config)
            .arg("--jobs-dir")
            .arg(self.path(jobs_dir))
            .args(extra)
            .current_dir(self.dir.path())
            .env("DDPJOB_PLAIN", "1")
            .envs(env.iter().copied())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("spawn ddpjob");
        Background { child }
    }
}

/// Points the Hugging Face Hub at a port where nothing listens and its cache into the test's
/// directory, so no test reads the machine's cache or reaches the real Hub (a Hub test sets its
/// own server and cache after this).
pub fn away_from_the_hub(cmd: &mut Command, dir: &Path) {
    for key in [
        "HF_HUB_CACHE",
        "HF_TOKEN",
        "HF_TOKEN_PATH",
        "HF_HUB_OFFLINE",
    ] {
        cmd.env_remove(key);
    }
    cmd.env("HF_ENDPOINT", "http://127.0.0.1:9")
        .env("HF_HOME", dir.join("hf-home"));
}

/// Removes the variables a scheduler sets (Slurm's, torchrun's, a PyTorchJob's), which
/// `ddpjob run` reads: a test run under Slurm or in a pod must not pick up its host's.
pub fn without_scheduler(cmd: &mut Command) {
    for (key, _) in std::env::vars() {
        let pod = ["MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK"].contains(&key.as_str());
        if key.starts_with("SLURM_") || key.starts_with("PET_") || pod {
            cmd.env_remove(key);
        }
    }
}

/// Live processes whose environment has `DDPJOB_JOB_DIR` under `dir`: (pid, RANK).
pub fn workers_under(dir: &Path) -> Vec<(u32, usize)> {
    let dir = dir.to_string_lossy().into_owned();
    let mut found = Vec::new();
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return found;
    };
    for entry in entries.flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(environ) = std::fs::read(entry.path().join("environ")) else {
            continue;
        };
        let vars: Vec<String> = environ
            .split(|&b| b == 0)
            .map(|v| String::from_utf8_lossy(v).into_owned())
            .collect();
        let in_dir = vars.iter().any(|v| {
            v.strip_prefix("DDPJOB_JOB_DIR=")
                .is_some_and(|d| d.starts_with(&dir))
        });
        // A zombie (already dead, not yet reaped) has an empty environ and is skipped.
        if in_dir {
            let rank = vars
                .iter()
                .find_map(|v| v.strip_prefix("RANK=")?.parse().ok())
                .unwrap_or(usize::MAX);
            found.push((pid, rank));
        }
    }
    found
}

/// Panics naming the first tensor whose bits differ between the weight files `a` and `b`.
pub fn assert_same_bits(a: &Path, b: &Path) {
    let (a, b) = (load_weights(a), load_weights(b));
    for (name, va) in &a {
        let same = va
            .iter()
            .zip(&b[name])
            .all(|(x, y)| x.to_bits() == y.to_bits());
        assert!(same, "`{name}` differs after resume");
    }
}

/// Largest absolute difference between two sets of weights with the same names.
pub fn max_abs_diff(
    a: &std::collections::BTreeMap<String, Vec<f32>>,
    b: &std::collections::BTreeMap<String, Vec<f32>>,
) -> f32 {
    assert_eq!(
        a.keys().collect::<Vec<_>>(),
        b.keys().collect::<Vec<_>>(),
        "different parameters"
    );
    a.iter()
        .flat_map(|(name, va)| va.iter().zip(&b[name]).map(|(x, y)| (x - y).abs()))
        .fold(0f32, f32::max)
}

/// A port that was free a moment ago.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("free port")
        .port()
}

/// torchrun's multi-node flags for node `rank` of two, on 127.0.0.1.
pub fn two_node_flags(rank: &str, port: &str) -> Vec<String> {
    [
        "--nnodes",
        "2",
        "--node-rank",
        rank,
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        port,
    ]
    .map(String::from)
    .to_vec()
}

/// Runs `cfg` as job `cut` (with `args`) preempted by `fault`, resumes it, and checks it ends
/// bit-identical to the uninterrupted job `whole`.
pub fn preempt_resume_and_compare(t: &TestJob, cfg: &Path, args: &[&str], fault: &str) {
    let cut = t.run_env(
        cfg,
        &[args, &["--name", "cut"]].concat(),
        &[("DDPJOB_FAULT", fault)],
    );
    cut.fails_with(143, "interrupted by SIGTERM");
    let jobs = t.jobs_dir().display().to_string();
    t.ddpjob(&["resume", "cut", "--jobs-dir", &jobs]).success();
    assert_same_bits(
        &t.job("whole").join("model.safetensors"),
        &t.job("cut").join("model.safetensors"),
    );
}

/// A copy of the files of directory `from` (a model fixture) as the new directory `to`, to
/// change or move under a job.
pub fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), to.join(entry.file_name())).unwrap();
    }
}

/// Whether `python` imports `modules` (`"mlflow, flask_wtf"`).
fn imports(python: &Path, modules: &str) -> bool {
    Command::new(python)
        .args(["-c", &format!("import {modules}")])
        .output()
        .is_ok_and(|o| o.status.success())
}

/// A Python that imports `modules`: `DDPJOB_TEST_PYTHON` when it does (`.ci/run` makes one with
/// every package the tests read back with), else `python3`, else a venv under `target/<venv>`
/// with `packages` installed from PyPI. `None`: no Python on this machine (the test skips).
pub fn python_with(modules: &str, packages: &[&str], venv: &str) -> Option<PathBuf> {
    let given = std::env::var_os("DDPJOB_TEST_PYTHON").map(PathBuf::from);
    if let Some(p) = given.filter(|p| imports(p, modules)) {
        return Some(p);
    }
    let system = PathBuf::from("python3");
    if Command::new(&system).arg("--version").output().is_err() {
        return None;
    }
    if imports(&system, modules) {
        return Some(system);
    }
    let venv = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("target")
        .join(venv);
    let python = venv.join("bin/python");
    // One install at a time: two tests making the same venv at once on a fresh checkout
    // (the two MLflow tests) broke each other's pip; the second finds the first's.
    static INSTALLING: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one = INSTALLING.lock().unwrap_or_else(|e| e.into_inner());
    if !imports(&python, modules) {
        eprintln!("installing {} into {}", packages.join(" "), venv.display());
        let made = Command::new(&system)
            .args(["-m", "venv"])
            .arg(&venv)
            .status();
        assert!(
            made.is_ok_and(|s| s.success()),
            "python3 -m venv failed (Debian: apt-get install python3-venv)"
        );
        let pip = Command::new(&python)
            .args(["-m", "pip", "install", "--quiet"])
            .args(packages)
            .status();
        assert!(
            pip.is_ok_and(|s| s.success()),
            "pip install {} failed; set DDPJOB_TEST_PYTHON to a Python that has it",
            packages.join(" ")
        );
    }
    Some(python)
}
