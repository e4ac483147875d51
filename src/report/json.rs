//! `ddpjob list --json` and `ddpjob show NAME --json`: what `list` and `show` print, as JSON for
//! scripts and dashboards (as `kubectl get -o json` or `gh ... --json`), one object per job.

use serde_json::{Value, json};

use super::view::JobView;

/// `list --json`: every job's object, most recently updated first (as `list` prints them).
pub fn list(views: &[JobView]) -> Value {
    Value::Array(views.iter().map(job).collect())
}

/// One job: its state, where training stands, its best evaluation, its checkpoints and, once
/// it has ended, `summary.json` whole. A figure not known is `null`.
pub fn job(v: &JobView) -> Value {
    let s = &v.state;
    let spec = v.spec.as_ref();
    let metrics = v.metrics();
    let headline = metrics.first().map(|m| m.name.clone());
    // The best evaluation's every metric as a `test_<name>` field (`null` when not a number),
    // `test_loss` and `test_accuracy` always there.
    let best = v.best().map(|b| {
        let mut best = json!({
            "step": b.step,
            "epoch": b.epoch.map(|e| e + 1),
            "test_loss": finite(b.metrics.value("loss")),
            "test_accuracy": finite(b.metrics.value("accuracy")),
        });
        for (name, value) in b.metrics.iter() {
            best[format!("test_{name}")] = json!(finite(value));
        }
        best
    });
    let checkpoints: Vec<Value> = v
        .checkpoints
        .iter()
        .map(|c| {
            json!({
                "name": c.name,
                "step": c.position.as_ref().map(|p| p.step),
                "bytes": c.bytes,
                "latest": v.latest.as_deref() == Some(c.name.as_str()),
            })
        })
        .collect();
    json!({
        "name": v.name,
        "dir": v.dir.display().to_string(),
        "status": v.status(),
        // A stale job's pid is gone, and may be another process's by now.
        "launcher_pid": v.launcher.filter(|&(_, alive)| alive).map(|(pid, _)| pid),
        "error": s.error,
        "restarts": s.restarts,
        "updated_unix": s.updated_unix,
        "model": v.model(),
        "arch": spec.map(|spec| spec.model.arch()),
        "data": v.data(),
        "world_size": s.world_size,
        "global_batch": v.global_batch(),
        "epoch": s.epoch,
        "epochs": spec.map(|spec| spec.train.epochs),
        "step": v.step(),
        "total_steps": (s.total_steps > 0).then_some(s.total_steps),
        "last_train_loss": v.history.last_train_loss().or(s.last_loss).and_then(finite),
        "metric": headline,
        "metrics": metrics,
        "best": best,
        "checkpoints": checkpoints,
        "summary": v.summary,
    })
}

/// JSON has no NaN: a figure that is not a number is `null`.
fn finite(x: f64) -> Option<f64> {
    x.is_finite().then_some(x)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::jobdir::{JobState, Status};
    use crate::report::history::History;

    fn view() -> JobView {
        JobView {
            name: "lm".into(),
            dir: "/jobs/lm".into(),
            state: JobState {
                status: Status::Failed,
                epoch: 1,
                step: 40,
                total_steps: 0,
                world_size: 2,
                updated_unix: 1_700_000_000,
                last_loss: Some(f64::NAN),
                error: Some("rank 1 exited".into()),
                restarts: 1,
                metrics: Vec::new(),
            },
            launcher: None,
            spec: None,
            history: History::default(),
            summary: None,
            checkpoints: Vec::new(),
            latest: None,
        }
    }

    #[test]
    fn a_job_without_config_or_summary_has_nulls_not_guesses() {
        let j = job(&view());
        assert_eq!(j["name"], "lm");
        assert_eq!(j["status"], "failed");
        assert_eq!(j["error"], "rank 1 exited");
        assert_eq!(j["restarts"], 1);
        assert_eq!(j["step"], 40);
        // Unknown: no total, no config, a NaN loss, nothing evaluated, no summary.
        for key in [
            "total_steps",
            "epochs",
            "arch",
            "last_train_loss",
            "best",
            "summary",
            "launcher_pid",
        ] {
            assert!(j[key].is_null(), "{key}: {}", j[key]);
        }
        assert_eq!(j["model"], "?");
        assert_eq!(list(&[view(), view()]).as_array().unwrap().len(), 2);
    }
}
