//! MLflow's `log-batch` limits, kept here so no call is refused for its size: at most 1000
//! metrics, 100 params and 100 tags a call, 1000 entities in all (MLflow's
//! `MAX_METRICS_PER_BATCH`, `MAX_PARAMS_TAGS_PER_BATCH`, `MAX_ENTITIES_PER_BATCH`), a param's
//! value at most 6000 characters (`MAX_PARAM_VAL_LENGTH`), a tag's 5000 (older servers'), a
//! key 250.

use serde_json::{Value, json};

pub const MAX_METRICS: usize = 1000;
pub const MAX_PARAMS: usize = 100;
pub const MAX_TAGS: usize = 100;
pub const MAX_ENTITIES: usize = 1000;
pub const MAX_PARAM_VALUE: usize = 6000;
/// A tag's value: 8000 characters on MLflow 2.x and later servers, 5000 on older ones.
pub const MAX_TAG_VALUE: usize = 5000;
pub const MAX_KEY: usize = 250;

/// A metric's value at a step, at a time (Unix ms).
#[derive(Debug, Clone, PartialEq)]
pub struct Metric {
    pub key: String,
    pub value: f64,
    pub timestamp_ms: u64,
    pub step: u64,
}

/// What one `log-batch` call sends.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Batch {
    pub metrics: Vec<Metric>,
    pub params: Vec<(String, String)>,
    pub tags: Vec<(String, String)>,
}

impl Batch {
    fn len(&self) -> usize {
        self.metrics.len() + self.params.len() + self.tags.len()
    }

    /// Its JSON body for `run_id`.
    pub fn body(&self, run_id: &str) -> Value {
        let pairs = |v: &[(String, String)]| -> Vec<Value> {
            v.iter()
                .map(|(k, v)| json!({ "key": k, "value": v }))
                .collect()
        };
        let metrics: Vec<Value> = (self.metrics.iter())
            .map(|m| {
                json!({
                    "key": m.key, "value": m.value, "timestamp": m.timestamp_ms, "step": m.step
                })
            })
            .collect();
        json!({
            "run_id": run_id,
            "metrics": metrics,
            "params": pairs(&self.params),
            "tags": pairs(&self.tags),
        })
    }
}

/// `metrics`, `params` and `tags` cut into calls MLflow accepts, in order; params' values and
/// keys cut to MLflow's lengths (a long list flattened from the config, say).
pub fn batches(
    metrics: Vec<Metric>,
    params: Vec<(String, String)>,
    tags: Vec<(String, String)>,
) -> Vec<Batch> {
    let cut = |s: String, at: usize| match s.char_indices().nth(at) {
        Some((i, _)) => s[..i].to_string(),
        None => s,
    };
    let mut out: Vec<Batch> = Vec::new();
    let mut current = Batch::default();
    let mut flush = |current: &mut Batch| {
        if current.len() > 0 {
            out.push(std::mem::take(current));
        }
    };
    for (k, v) in params {
        if current.params.len() == MAX_PARAMS || current.len() == MAX_ENTITIES {
            flush(&mut current);
        }
        current
            .params
            .push((cut(k, MAX_KEY), cut(v, MAX_PARAM_VALUE)));
    }
    for (k, v) in tags {
        if current.tags.len() == MAX_TAGS || current.len() == MAX_ENTITIES {
            flush(&mut current);
        }
        current.tags.push((cut(k, MAX_KEY), cut(v, MAX_TAG_VALUE)));
    }
    for m in metrics {
        if current.metrics.len() == MAX_METRICS || current.len() == MAX_ENTITIES {
            flush(&mut current);
        }
        current.metrics.push(m);
    }
    flush(&mut current);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn metric(step: u64) -> Metric {
        Metric {
            key: "train/loss".into(),
            value: step as f64,
            timestamp_ms: 1000 + step,
            step,
        }
    }

    #[test]
    fn batches_keep_mlflows_limits_and_the_order() {
        let metrics: Vec<Metric> = (0..2500).map(metric).collect();
        let params: Vec<(String, String)> = (0..250)
            .map(|i| (format!("p{i}"), "v".repeat(if i == 0 { 7000 } else { 1 })))
            .collect();
        let tags = vec![("mlflow.source.name".to_string(), "ddpjob".to_string())];
        let out = batches(metrics.clone(), params.clone(), tags);
        for b in &out {
            assert!(b.metrics.len() <= MAX_METRICS, "{}", b.metrics.len());
            assert!(b.params.len() <= MAX_PARAMS);
            assert!(b.tags.len() <= MAX_TAGS);
            assert!(b.len() <= MAX_ENTITIES, "{}", b.len());
            assert!(b.params.iter().all(|(_, v)| v.len() <= MAX_PARAM_VALUE));
        }
        let sent: Vec<Metric> = out.iter().flat_map(|b| b.metrics.clone()).collect();
        assert_eq!(sent, metrics, "every metric once, in order");
        let keys: Vec<String> = out
            .iter()
            .flat_map(|b| b.params.clone())
            .map(|p| p.0)
            .collect();
        assert_eq!(keys.len(), 250);
        assert_eq!(out[0].params[0].1.len(), MAX_PARAM_VALUE);
        // 250 params: 3 calls of params, the third with a tag and 949 metrics.
        assert_eq!(out[2].params.len(), 50);
        assert_eq!(out[2].len(), MAX_ENTITIES);
        assert!(batches(Vec::new(), Vec::new(), Vec::new()).is_empty());
    }

    #[test]
    fn a_batch_is_the_body_log_batch_takes() {
        let b = Batch {
            metrics: vec![metric(3)],
            params: vec![("train.lr".into(), "0.001".into())],
            tags: vec![],
        };
        let body = b.body("abc");
        assert_eq!(body["run_id"], "abc");
        assert_eq!(body["metrics"][0]["step"], 3);
        assert_eq!(body["metrics"][0]["timestamp"], 1003);
        assert_eq!(body["params"][0]["key"], "train.lr");
    }
}
