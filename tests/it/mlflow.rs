//! `[logging] mlflow = true` against a real MLflow tracking server (`mlflow server` with a
//! sqlite store, started here on 127.0.0.1): one run per job with its params, every metric by
//! step equal to `metrics.jsonl`, its artifacts and status (FAILED with the error as a tag);
//! a restart and SIGTERM then `resume` each stay one run with no step twice; a server killed
//! mid-run and started again loses nothing; a job that ran with its server out of reach warns
//! once, finishes, and `ddpjob sync` uploads it. Skipped, with the reason printed, only where
//! there is no Python at all; `.ci/run` installs mlflow.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::common::{TINY, TestJob, python_with};

/// A tracking server on 127.0.0.1, its store in `dir` (kept across a restart).
struct Server {
    python: PathBuf,
    dir: PathBuf,
    port: u16,
    /// With MLflow's basic-auth app, this admin password.
    admin_password: Option<&'static str>,
    child: Option<Child>,
}

impl Server {
    fn start(python: &Path, dir: &Path, admin_password: Option<&'static str>) -> Server {
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let mut server = Server {
            python: python.into(),
            dir: dir.into(),
            port,
            admin_password,
            child: None,
        };
        server.up();
        server
    }

    fn uri(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Starts it (again) and waits until it answers.
    fn up(&mut self) {
        std::fs::create_dir_all(&self.dir).unwrap();
        let log = std::fs::File::create(self.dir.join("server.log")).unwrap();
        let mut command = Command::new(&self.python);
        if let Some(password) = self.admin_password {
            command
                .args(["-m", "mlflow", "server", "--app-name", "basic-auth"])
                .env("MLFLOW_AUTH_ADMIN_PASSWORD", password)
                .env("MLFLOW_FLASK_SERVER_SECRET_KEY", "ddpjob-tests");
        } else {
            command.args(["-m", "mlflow", "server"]);
        }
        let child = command
            .args(["--host", "127.0.0.1", "--workers", "1"])
            .args(["--port", &self.port.to_string()])
            .arg("--backend-store-uri")
            .arg(format!(
                "sqlite:///{}",
                self.dir.join("db.sqlite").display()
            ))
            .arg("--artifacts-destination")
            .arg(self.dir.join("artifacts"))
            .current_dir(&self.dir)
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("start mlflow server");
        self.child = Some(child);
        let until = Instant::now() + Duration::from_secs(120);
        while Instant::now() < until {
            let health = ureq::get(&format!("{}/health", self.uri())).call();
            if health.is_ok() || matches!(health, Err(ureq::Error::StatusCode(_))) {
                return;
            }
            std::thread::sleep(Duration::from_millis(300));
        }
        panic!(
            "mlflow server did not answer: {}",
            std::fs::read_to_string(self.dir.join("server.log")).unwrap_or_default()
        );
    }

    /// Stops it (and the workers it started).
    fn down(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = Command::new("pkill")
                .args(["-TERM", "-P", &child.id().to_string()])
                .status();
            let _ = child.kill();
            let _ = child.wait();
        }
        // Until the port is free again.
        let until = Instant::now() + Duration::from_secs(30);
        while TcpListener::bind(("127.0.0.1", self.port)).is_err() && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    fn get(&self, path: &str) -> Value {
        let mut response = ureq::get(&format!("{}/api/2.0/mlflow/{path}", self.uri()))
            .call()
            .unwrap_or_else(|e| panic!("GET {path}: {e}"));
        serde_json::from_str(&response.body_mut().read_to_string().unwrap()).unwrap()
    }

    fn post(&self, path: &str, body: &Value) -> Value {
        let mut response = ureq::post(&format!("{}/api/2.0/mlflow/{path}", self.uri()))
            .content_type("application/json")
            .send(body.to_string())
            .unwrap();
        serde_json::from_str(&response.body_mut().read_to_string().unwrap()).unwrap()
    }

    /// The runs of the experiment `name` (none while it is not there).
    fn runs(&self, experiment: &str) -> Vec<Value> {
        let url = format!(
            "{}/api/2.0/mlflow/experiments/get-by-name?experiment_name={experiment}",
            self.uri()
        );
        let Ok(mut response) = ureq::get(&url).call() else {
            return Vec::new();
        };
        let found: Value =
            serde_json::from_str(&response.body_mut().read_to_string().unwrap()).unwrap();
        let id = found["experiment"]["experiment_id"].clone();
        let runs = self.post("runs/search", &json!({ "experiment_ids": [id] }));
        runs["runs"].as_array().cloned().unwrap_or_default()
    }

    /// A metric's history: (step, value) by step.
    fn history(&self, run_id: &str, key: &str) -> Vec<(u64, f64)> {
        let h = self.get(&format!(
            "metrics/get-history?run_id={run_id}&metric_key={key}&max_results=100000"
        ));
        let mut out: Vec<(u64, f64)> = (h["metrics"].as_array().cloned().unwrap_or_default())
            .iter()
            .map(|m| (m["step"].as_u64().unwrap(), m["value"].as_f64().unwrap()))
            .collect();
        out.sort_by(|a, b| a.partial_cmp(b).unwrap());
        out
    }

    fn artifacts(&self, run_id: &str) -> Vec<String> {
        let listed = self.get(&format!("artifacts/list?run_id={run_id}"));
        (listed["files"].as_array().cloned().unwrap_or_default())
            .iter()
            .map(|f| f["path"].as_str().unwrap().to_string())
            .collect()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.down();
    }
}

/// `metrics.jsonl`'s training losses by step.
fn losses(job: &Path) -> Vec<(u64, f64)> {
    let text = std::fs::read_to_string(job.join("metrics.jsonl")).unwrap();
    let mut out: Vec<(u64, f64)> = text
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|r| r["kind"] == "train")
        .map(|r| (r["step"].as_u64().unwrap(), r["loss"].as_f64().unwrap()))
        .collect();
    out.sort_by(|a, b| a.partial_cmp(b).unwrap());
    out
}

/// The one run of job `name` (its experiment is the job's name): its info, data and the
/// history of its training loss, which must be `metrics.jsonl`'s, every step once.
fn the_run(server: &Server, t: &TestJob, name: &str) -> (Value, Vec<(u64, f64)>) {
    let runs = server.runs(name);
    assert_eq!(runs.len(), 1, "one run for job {name}: {runs:?}");
    let run = runs[0].clone();
    let id = run["info"]["run_id"].as_str().unwrap().to_string();
    let history = server.history(&id, "train/loss");
    let want = losses(&t.job(name));
    assert!(!want.is_empty());
    assert_eq!(history.len(), want.len(), "every step once: {history:?}");
    for ((s, v), (ws, wv)) in history.iter().zip(&want) {
        assert_eq!(s, ws);
        assert!(
            (v - wv).abs() <= 1e-9 * wv.abs().max(1.0),
            "step {s}: {v} vs {wv}"
        );
    }
    (run, history)
}

fn param(run: &Value, key: &str) -> Option<String> {
    (run["data"]["params"].as_array()?.iter())
        .find(|p| p["key"] == key)
        .and_then(|p| p["value"].as_str().map(String::from))
}

fn tracked(uri: &str, extra: &str) -> String {
    TINY.replace("[train]", "[train]\nlog_every = 1")
        .replace("log_every = 4\n", "")
        + &format!("[logging]\nmlflow = true\nmlflow_uri = \"{uri}\"\n{extra}")
}

#[test]
fn jobs_are_mlflow_runs_resumed_as_one_and_synced_when_they_ran_offline() {
    let Some(python) = python_with("mlflow, flask_wtf", &["mlflow[auth]"], "mlflow-venv") else {
        eprintln!("skipped: no python3 on this machine to run an MLflow server");
        return;
    };
    let t = TestJob::new();
    let mut server = Server::start(&python, &t.path("mlflow"), None);
    let uri = server.uri();

    // A whole job on two workers: params, metrics, artifacts, FINISHED.
    let cfg = t.config("whole", &tracked(&uri, ""));
    let run = t.run(&cfg, &["--nproc-per-node", "2"]);
    run.success();
    assert!(
        run.stderr.contains("mlflow: logging to run"),
        "{}",
        run.stderr
    );
    let (whole, _) = the_run(&server, &t, "whole");
    assert_eq!(whole["info"]["status"], "FINISHED");
    assert_eq!(whole["info"]["run_name"], "whole");
    assert_eq!(param(&whole, "train.lr").as_deref(), Some("0.01"));
    assert_eq!(param(&whole, "model.arch").as_deref(), Some("mlp"));
    assert_eq!(param(&whole, "world_size").as_deref(), Some("2"));
    let id = whole["info"]["run_id"].as_str().unwrap();
    assert!(!server.history(id, "test/accuracy").is_empty());
    let mut artifacts = server.artifacts(id);
    artifacts.sort();
    assert_eq!(artifacts, ["curves.svg", "job.toml", "summary.json"]);

    // A worker killed and the group restarted from its checkpoint: the steps trained again are
    // not logged twice.
    let restarts = tracked(&uri, "").replace("[train]", "[distributed]\nmax_restarts = 1\n[train]");
    let cfg = t.config("restarted", &restarts);
    t.run_env(&cfg, &[], &[("DDPJOB_FAULT", "rank=0,step=20,kind=kill")])
        .success();
    let (restarted, _) = the_run(&server, &t, "restarted");
    assert_eq!(restarted["info"]["status"], "FINISHED");

    // A job that fails: FAILED, with its error as a tag.
    let cfg = t.config("failed", &tracked(&uri, ""));
    t.run_env(&cfg, &[], &[("DDPJOB_FAULT", "rank=0,step=6,kind=exit")])
        .fails_with(1, "");
    let (failed, _) = the_run(&server, &t, "failed");
    assert_eq!(failed["info"]["status"], "FAILED");
    let tags = failed["data"]["tags"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    assert!(
        tags.iter()
            .any(|t| t["key"] == "ddpjob.error"
                && t["value"].as_str().is_some_and(|v| !v.is_empty())),
        "{tags:?}"
    );

    // Preempted (KILLED), then resumed: one run, FINISHED, no step twice.
    let cut = t.config("cut", &tracked(&uri, ""));
    t.run_env(
        &cut,
        &[],
        &[("DDPJOB_FAULT", "rank=0,step=20,kind=preempt")],
    )
    .fails_with(143, "interrupted by SIGTERM");
    let (killed, _) = the_run(&server, &t, "cut");
    assert_eq!(killed["info"]["status"], "KILLED");
    let jobs = t.jobs_dir().display().to_string();
    t.ddpjob(&["resume", "cut", "--jobs-dir", &jobs]).success();
    let (resumed, _) = the_run(&server, &t, "cut");
    assert_eq!(resumed["info"]["status"], "FINISHED");
    assert_eq!(resumed["info"]["run_id"], killed["info"]["run_id"]);

    // The server killed mid-run and started again: the job finishes, nothing is lost.
    let long = tracked(&uri, "").replace("epochs = 2", "epochs = 30");
    let cfg = t.config("outage", &long);
    let jobs_dir = t.jobs_dir().display().to_string();
    let cfg_path = cfg.display().to_string();
    let job = t
        .command(&["run", &cfg_path, "--jobs-dir", &jobs_dir], &[])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let until = Instant::now() + Duration::from_secs(120);
    while server.runs("outage").is_empty() && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(200));
    }
    server.down();
    std::thread::sleep(Duration::from_secs(2));
    server.up();
    let done = job.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&done.stderr);
    assert!(done.status.success(), "{stderr}");
    let (outage, _) = the_run(&server, &t, "outage");
    assert_eq!(outage["info"]["status"], "FINISHED", "{stderr}");

    // Out of reach the whole run: one warning, the job unharmed; `sync` uploads it after.
    let closed = TcpListener::bind("127.0.0.1:0").unwrap();
    let dead = format!("http://{}", closed.local_addr().unwrap());
    drop(closed);
    let cfg = t.config("offline", &tracked(&dead, ""));
    let offline = t.run(&cfg, &[]);
    offline.success();
    assert_eq!(
        offline.stderr.matches("is unreachable").count(),
        2,
        "one warning while it trains, one at the end: {}",
        offline.stderr
    );
    assert!(
        offline.stderr.contains("ddpjob sync offline"),
        "{}",
        offline.stderr
    );
    let sync = t.ddpjob(&["sync", "offline", "--jobs-dir", &jobs, "--mlflow-uri", &uri]);
    sync.success();
    assert!(
        sync.stdout.contains("synced job `offline` (finished)"),
        "{}",
        sync.stdout
    );
    let (synced, _) = the_run(&server, &t, "offline");
    assert_eq!(synced["info"]["status"], "FINISHED");
    // Again: nothing twice.
    t.ddpjob(&["sync", "offline", "--jobs-dir", &jobs, "--mlflow-uri", &uri])
        .success();
    the_run(&server, &t, "offline");

    // Refused before a job exists: mlflow without a server, a URI that is not http.
    let none = TINY.to_string() + "[logging]\nmlflow = true\n";
    t.command(
        &[
            "run",
            &t.config("none", &none).display().to_string(),
            "--jobs-dir",
            &jobs,
        ],
        &[],
    )
    .env_remove("MLFLOW_TRACKING_URI")
    .output()
    .map(crate::common::Run::from)
    .unwrap()
    .fails_with(2, "logging.mlflow = true needs a tracking server");
    let file = tracked("./mlruns", "");
    t.run(&t.config("file", &file), &[])
        .fails_with(2, "is not an http(s) tracking server");
    for name in ["none", "file"] {
        assert!(!t.job(name).exists(), "{name}: a job was made");
    }
}

/// A server that asks who logs (MLflow's basic-auth app): the right user and password from
/// MLflow's variables log the run; a wrong password is one warning naming them, the job
/// unharmed.
#[test]
fn the_tracking_credentials_are_mlflows_and_a_wrong_one_harms_no_job() {
    let Some(python) = python_with("mlflow, flask_wtf", &["mlflow[auth]"], "mlflow-venv") else {
        eprintln!("skipped: no python3 on this machine to run an MLflow server");
        return;
    };
    let t = TestJob::new();
    let server = Server::start(&python, &t.path("mlflow"), Some("right-pass-123"));
    let cfg = t.config("authed", &tracked(&server.uri(), ""));
    let right = t.run_env(
        &cfg,
        &[],
        &[
            ("MLFLOW_TRACKING_USERNAME", "admin"),
            ("MLFLOW_TRACKING_PASSWORD", "right-pass-123"),
        ],
    );
    right.success();
    assert!(
        right.stderr.contains("mlflow: logging to run"),
        "{}",
        right.stderr
    );
    assert!(!right.stderr.contains("warning"), "{}", right.stderr);
    let cfg = t.config("refused", &tracked(&server.uri(), ""));
    let wrong = t.run_env(
        &cfg,
        &[],
        &[
            ("MLFLOW_TRACKING_USERNAME", "admin"),
            ("MLFLOW_TRACKING_PASSWORD", "wrong"),
        ],
    );
    wrong.success();
    assert!(wrong.stderr.contains("HTTP 401"), "{}", wrong.stderr);
    assert!(
        wrong
            .stderr
            .contains("MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD"),
        "{}",
        wrong.stderr
    );
    assert!(t.job("refused").join("model.safetensors").is_file());
}
