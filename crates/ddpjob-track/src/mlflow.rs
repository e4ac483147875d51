//! MLflow's REST API (2.0), the calls a run needs: the experiment found or made by name, the
//! run created, metrics, params and tags logged in batches, artifacts put through the
//! server's artifact proxy, the status set. Over ureq, as ddpjob's other HTTP is; auth as
//! MLflow's own clients read it (`MLFLOW_TRACKING_TOKEN`, or `MLFLOW_TRACKING_USERNAME` and
//! `MLFLOW_TRACKING_PASSWORD`); https verified against the system's roots or MLflow's
//! `MLFLOW_TRACKING_SERVER_CERT_PATH`. It knows nothing of jobs (see `run`).

use std::path::Path;
use std::time::Duration;

use base64::Engine;
use serde_json::{Value, json};

use super::batch::Batch;

/// What a call met: the server out of reach (worth trying again later), or a refusal.
#[derive(Debug, thiserror::Error)]
pub enum MlflowError {
    #[error("the MLflow server at {uri} is unreachable ({cause})")]
    Unreachable { uri: String, cause: String },
    #[error("{left} metric values were not sent to {uri} in the time there was")]
    Behind { uri: String, left: usize },
    #[error("the MLflow server at {uri} refused {what}: HTTP {status}{}", hint(*status, message))]
    Refused {
        uri: String,
        what: String,
        status: u16,
        message: String,
    },
}

fn hint(status: u16, message: &str) -> String {
    let fix = match status {
        401 | 403 => {
            " (check MLFLOW_TRACKING_TOKEN, or MLFLOW_TRACKING_USERNAME and \
             MLFLOW_TRACKING_PASSWORD)"
        }
        404 => " (is it an MLflow tracking server? check logging.mlflow_uri)",
        _ => "",
    };
    match message.is_empty() {
        true => fix.to_string(),
        false => format!(": {message}{fix}"),
    }
}

impl MlflowError {
    /// Whether to try again later: the server is down or overloaded, not refusing.
    pub fn is_transient(&self) -> bool {
        match self {
            MlflowError::Unreachable { .. } | MlflowError::Behind { .. } => true,
            MlflowError::Refused { status, .. } => *status >= 500 || *status == 429,
        }
    }
}

/// How requests say who sends them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Auth {
    None,
    /// `Authorization: Bearer <token>` (`MLFLOW_TRACKING_TOKEN`).
    Token(String),
    /// `Authorization: Basic` (`MLFLOW_TRACKING_USERNAME`, `MLFLOW_TRACKING_PASSWORD`).
    Basic {
        user: String,
        password: String,
    },
}

impl Auth {
    /// As MLflow's clients read the environment: a token first, else a user and password.
    pub fn from_env() -> Auth {
        let var = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
        if let Some(token) = var("MLFLOW_TRACKING_TOKEN") {
            return Auth::Token(token);
        }
        match (
            var("MLFLOW_TRACKING_USERNAME"),
            var("MLFLOW_TRACKING_PASSWORD"),
        ) {
            (Some(user), Some(password)) => Auth::Basic { user, password },
            _ => Auth::None,
        }
    }

    fn header(&self) -> Option<String> {
        match self {
            Auth::None => None,
            Auth::Token(token) => Some(format!("Bearer {token}")),
            Auth::Basic { user, password } => Some(format!(
                "Basic {}",
                base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}"))
            )),
        }
    }
}

/// A tracking server.
pub struct Client {
    uri: String,
    auth: Option<String>,
    agent: ureq::Agent,
    /// For artifacts (a model of gigabytes): no bound on the whole call, only on a stall.
    uploads: ureq::Agent,
}

/// A run as the server made it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunInfo {
    pub run_id: String,
    pub experiment_id: String,
    pub artifact_uri: String,
}

impl Client {
    /// The server at `uri` (`http://host:5000`, https with the system's roots), or why that
    /// is not a tracking URI ddpjob can talk to.
    pub fn new(uri: &str, auth: Auth) -> Result<Client, String> {
        let uri = uri.trim_end_matches('/').to_string();
        if !(uri.starts_with("http://") || uri.starts_with("https://")) {
            return Err(format!(
                "the MLflow tracking URI \"{uri}\" is not an http(s) server: ddpjob logs to a \
                 tracking server (`mlflow server`), e.g. \"http://127.0.0.1:5000\"; a local \
                 ./mlruns store is uploaded with `ddpjob sync NAME --mlflow-uri ...` once a \
                 server runs"
            ));
        }
        let agent = ureq::Agent::config_builder()
            .tls_config(tls())
            .http_status_as_error(false)
            .timeout_connect(Some(Duration::from_secs(5)))
            .timeout_global(Some(Duration::from_secs(30)))
            .build()
            .into();
        let uploads = ureq::Agent::config_builder()
            .tls_config(tls())
            .http_status_as_error(false)
            .timeout_connect(Some(Duration::from_secs(5)))
            .timeout_send_body(Some(Duration::from_secs(3600)))
            .timeout_recv_response(Some(Duration::from_secs(120)))
            .build()
            .into();
        Ok(Client {
            uri,
            auth: auth.header(),
            agent,
            uploads,
        })
    }

    pub fn uri(&self) -> &str {
        &self.uri
    }

    /// `method` of `path` (under the server's root) with a JSON `body`: the answer's JSON.
    fn call(
        &self,
        method: &str,
        path: &str,
        body: Option<&Value>,
        what: &str,
    ) -> Result<Value, MlflowError> {
        let url = format!("{}/{path}", self.uri);
        let unreachable = |e: ureq::Error| MlflowError::Unreachable {
            uri: self.uri.clone(),
            cause: e.to_string(),
        };
        let response = match (method, body) {
            ("GET", _) => {
                let mut request = self.agent.get(&url);
                if let Some(auth) = &self.auth {
                    request = request.header("Authorization", auth);
                }
                request.call()
            }
            (_, body) => {
                let mut request = match method {
                    "PUT" => self.agent.put(&url),
                    _ => self.agent.post(&url),
                };
                if let Some(auth) = &self.auth {
                    request = request.header("Authorization", auth);
                }
                let text = body.map_or(String::from("{}"), Value::to_string);
                request.content_type("application/json").send(text)
            }
        }
        .map_err(unreachable)?;
        self.answer(response, what)
    }

    fn answer(
        &self,
        response: ureq::http::Response<ureq::Body>,
        what: &str,
    ) -> Result<Value, MlflowError> {
        let status = response.status().as_u16();
        let text = response.into_body().read_to_string().unwrap_or_default();
        if !(200..300).contains(&status) {
            let message = serde_json::from_str::<Value>(&text)
                .ok()
                .and_then(|v| v.get("message")?.as_str().map(String::from))
                .unwrap_or_else(|| text.chars().take(200).collect());
            return Err(MlflowError::Refused {
                uri: self.uri.clone(),
                what: what.into(),
                status,
                message,
            });
        }
        Ok(serde_json::from_str(&text).unwrap_or(Value::Null))
    }

    /// The id of the experiment `name`, made if it is not there.
    pub fn experiment_id(&self, name: &str) -> Result<String, MlflowError> {
        let query = format!(
            "api/2.0/mlflow/experiments/get-by-name?experiment_name={}",
            encode(name)
        );
        match self.call("GET", &query, None, "the experiment lookup") {
            Ok(found) => Ok(string(&found["experiment"]["experiment_id"])),
            Err(MlflowError::Refused { status: 404, .. }) => {
                let made = self.call(
                    "POST",
                    "api/2.0/mlflow/experiments/create",
                    Some(&json!({ "name": name })),
                    "a new experiment",
                );
                match made {
                    Ok(made) => Ok(string(&made["experiment_id"])),
                    // Another job made it meanwhile (RESOURCE_ALREADY_EXISTS).
                    Err(MlflowError::Refused { status: 400, .. }) => {
                        let found = self.call("GET", &query, None, "the experiment lookup")?;
                        Ok(string(&found["experiment"]["experiment_id"]))
                    }
                    Err(e) => Err(e),
                }
            }
            Err(e) => Err(e),
        }
    }

    /// A new run named `name` in `experiment_id`, started at `start_ms` (Unix ms).
    pub fn create_run(
        &self,
        experiment_id: &str,
        name: &str,
        start_ms: u64,
        tags: &[(String, String)],
    ) -> Result<RunInfo, MlflowError> {
        let tags: Vec<Value> = (tags.iter())
            .map(|(k, v)| json!({ "key": k, "value": v }))
            .collect();
        let body = json!({
            "experiment_id": experiment_id,
            "run_name": name,
            "start_time": start_ms,
            "tags": tags,
        });
        let made = self.call(
            "POST",
            "api/2.0/mlflow/runs/create",
            Some(&body),
            "a new run",
        )?;
        Ok(info(&made["run"]["info"]))
    }

    /// The run `run_id`; `None` when the server has no such run (another server) or it was
    /// deleted (MLflow keeps a deleted run, refusing what is logged to it).
    pub fn run(&self, run_id: &str) -> Result<Option<RunInfo>, MlflowError> {
        let path = format!("api/2.0/mlflow/runs/get?run_id={}", encode(run_id));
        match self.call("GET", &path, None, "the run lookup") {
            Ok(found) if found["run"]["info"]["lifecycle_stage"] == "deleted" => Ok(None),
            Ok(found) => Ok(Some(info(&found["run"]["info"]))),
            Err(MlflowError::Refused { status: 404, .. }) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// One `log-batch` call (see `batch` for MLflow's limits).
    pub fn log_batch(&self, run_id: &str, batch: &Batch) -> Result<(), MlflowError> {
        let body = batch.body(run_id);
        self.call(
            "POST",
            "api/2.0/mlflow/runs/log-batch",
            Some(&body),
            "a batch",
        )
        .map(drop)
    }

    /// Sets the run's status (`RUNNING`, `FINISHED`, `FAILED`, `KILLED`), and its end time.
    pub fn update_run(
        &self,
        run_id: &str,
        status: &str,
        end_ms: Option<u64>,
    ) -> Result<(), MlflowError> {
        let mut body = json!({ "run_id": run_id, "status": status });
        if let Some(end) = end_ms {
            body["end_time"] = json!(end);
        }
        self.call(
            "POST",
            "api/2.0/mlflow/runs/update",
            Some(&body),
            "the status",
        )
        .map(drop)
    }

    /// Puts the file `path` as the run's artifact of its name, streamed, through the server's
    /// artifact proxy (`mlflow server` serves artifacts by default); `artifact_uri` is the
    /// run's.
    pub fn upload_artifact(&self, artifact_uri: &str, path: &Path) -> Result<(), MlflowError> {
        let name = path
            .file_name()
            .map_or(String::new(), |n| n.to_string_lossy().into_owned());
        let refused = |message: String| MlflowError::Refused {
            uri: self.uri.clone(),
            what: format!("the artifact {name}"),
            status: 0,
            message,
        };
        let Some(place) = artifact_uri.strip_prefix("mlflow-artifacts:/") else {
            return Err(refused(format!(
                "the run's artifacts go to \"{artifact_uri}\", which the server does not \
                 proxy; start it with --serve-artifacts (the default of `mlflow server`)"
            )));
        };
        let url = format!(
            "{}/api/2.0/mlflow-artifacts/artifacts/{}/{name}",
            self.uri,
            place.trim_start_matches('/')
        );
        let file =
            std::fs::File::open(path).map_err(|e| refused(format!("`{}`: {e}", path.display())))?;
        let mut request = self.uploads.put(&url);
        if let Some(auth) = &self.auth {
            request = request.header("Authorization", auth);
        }
        let response =
            (request.content_type("application/octet-stream").send(file)).map_err(|e| {
                MlflowError::Unreachable {
                    uri: self.uri.clone(),
                    cause: e.to_string(),
                }
            })?;
        self.answer(response, &format!("the artifact {name}"))
            .map(drop)
    }
}

/// https as MLflow's clients verify it: `MLFLOW_TRACKING_SERVER_CERT_PATH` (a CA bundle),
/// else the system's roots (`SSL_CERT_FILE`, or the distribution's bundle), else Mozilla's;
/// `MLFLOW_TRACKING_INSECURE_TLS=true` verifies nothing.
fn tls() -> ureq::tls::TlsConfig {
    use ureq::tls::{PemItem, RootCerts, TlsConfig, parse_pem};
    let var = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
    let insecure =
        var("MLFLOW_TRACKING_INSECURE_TLS").is_some_and(|v| v.eq_ignore_ascii_case("true"));
    let bundles = [
        "/etc/ssl/certs/ca-certificates.crt",
        "/etc/pki/tls/certs/ca-bundle.crt",
        "/etc/ssl/cert.pem",
    ];
    let bundle = (var("MLFLOW_TRACKING_SERVER_CERT_PATH"))
        .or_else(|| var("SSL_CERT_FILE"))
        .or_else(|| {
            bundles
                .iter()
                .find(|p| Path::new(p).is_file())
                .map(|p| p.to_string())
        });
    let certs: Vec<_> = (bundle.and_then(|path| std::fs::read(path).ok()))
        .map(|pem| {
            parse_pem(&pem)
                .filter_map(|item| match item {
                    Ok(PemItem::Certificate(c)) => Some(c.to_owned()),
                    _ => None,
                })
                .collect()
        })
        .unwrap_or_default();
    let roots = match certs.is_empty() {
        true => RootCerts::WebPki,
        false => RootCerts::new_with_certs(&certs),
    };
    TlsConfig::builder()
        .root_certs(roots)
        .disable_verification(insecure)
        .build()
}

fn string(v: &Value) -> String {
    v.as_str().unwrap_or_default().to_string()
}

fn info(v: &Value) -> RunInfo {
    RunInfo {
        run_id: string(&v["run_id"]),
        experiment_id: string(&v["experiment_id"]),
        artifact_uri: string(&v["artifact_uri"]),
    }
}

/// `s` percent-encoded for a query string.
fn encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}
