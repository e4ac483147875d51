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

    /// Runs `ddpjob <args>` in the temp directory, plain output (not a terminal).
    pub fn ddpjob(&self, args: &[&str]) -> Run {
        Command::new(env!("CARGO_BIN_EXE_ddpjob"))
            .args(args)
            .current_dir(self.dir.path())
            .env("DDPJOB_PLAIN", "1")
            .output()
            .expect("spawn ddpjob")
            .into()
    }

    /// `ddpjob run <config> --jobs-dir <tmp>/jobs <extra>`.
    pub fn run(&self, config: &Path, extra: &[&str]) -> Run {
        let config = config.to_string_lossy().into_owned();
        let jobs = self.jobs_dir().to_string_lossy().into_owned();
        let mut args = vec!["run", config.as_str(), "--jobs-dir", jobs.as_str()];
        args.extend_from_slice(extra);
        self.ddpjob(&args)
    }

    pub fn job(&self, name: &str) -> PathBuf {
        self.jobs_dir().join(name)
    }

    pub fn json(&self, path: &Path) -> serde_json::Value {
        let text =
            std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
    }

    pub fn metrics(&self, name: &str) -> Vec<serde_json::Value> {
        let text =
            std::fs::read_to_string(self.job(name).join("metrics.jsonl")).expect("metrics.jsonl");
        text.lines()
            .map(|l| serde_json::from_str(l).expect("metrics line is JSON"))
            .collect()
    }
}

/// The tensors of a safetensors file, flattened to f32, by name.
pub fn load_weights(path: &Path) -> std::collections::BTreeMap<String, Vec<f32>> {
    candle_core::safetensors::load(path, &candle_core::Device::Cpu)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .into_iter()
        .map(|(k, t)| (k, t.flatten_all().unwrap().to_vec1::<f32>().unwrap()))
        .collect()
}
