//! The job file as serde reads it: every key optional, defaults filled in, unknown keys rejected.
//! Values are not checked here; `spec.rs` turns this into a validated [`crate::config::JobSpec`].

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawConfig {
    pub name: Option<String>,
    pub seed: i64,
    pub model: RawModel,
    pub data: RawData,
    pub train: RawTrain,
    pub checkpoint: RawCheckpoint,
    pub distributed: RawDistributed,
    pub logging: RawLogging,
    #[serde(skip_serializing_if = "RawExpect::is_empty")]
    pub expect: RawExpect,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawModel {
    pub arch: String,
    pub hidden: Vec<i64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub n_layer: Option<i64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub n_head: Option<i64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub n_embd: Option<i64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub block_size: Option<i64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dropout: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bias: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub vocab_size: Option<i64>,
}

impl Default for RawModel {
    fn default() -> Self {
        Self {
            arch: "mlp".into(),
            hidden: vec![256, 256],
            n_layer: None,
            n_head: None,
            n_embd: None,
            block_size: None,
            dropout: None,
            bias: None,
            vocab_size: None,
        }
    }
}

impl RawModel {
    /// The `gpt` keys with their defaults written out (nanoGPT's CPU recipe's shape), so a gpt
    /// job's `job.toml` says what it trained; other archs leave them out.
    pub fn resolve_gpt(&mut self) {
        self.n_layer.get_or_insert(4);
        self.n_head.get_or_insert(4);
        self.n_embd.get_or_insert(128);
        self.block_size.get_or_insert(64);
        self.dropout.get_or_insert(0.0);
        self.bias.get_or_insert(true);
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawData {
    pub dataset: String,
    pub root: Option<String>,
    pub download: bool,
    pub drop_last: bool,
    pub mirrors: Vec<String>,
    pub checksums: BTreeMap<String, String>,
    pub mean: Vec<f64>,
    pub std: Vec<f64>,
    // `text` and `tokens` data; absent for image datasets.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tokenizer: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub val_fraction: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub train_path: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub val_path: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token_dtype: Option<String>,
    pub synthetic: RawSynthetic,
}

impl Default for RawData {
    fn default() -> Self {
        Self {
            dataset: "mnist".into(),
            root: None,
            download: false,
            drop_last: false,
            mirrors: Vec::new(),
            checksums: BTreeMap::new(),
            mean: Vec::new(),
            std: Vec::new(),
            synthetic: RawSynthetic::default(),
            path: None,
            tokenizer: None,
            val_fraction: None,
            train_path: None,
            val_path: None,
            token_dtype: None,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawSynthetic {
    pub train_samples: i64,
    pub test_samples: i64,
    pub shape: Vec<i64>,
    pub classes: i64,
    pub noise: f64,
}

impl Default for RawSynthetic {
    fn default() -> Self {
        Self {
            train_samples: 4096,
            test_samples: 1024,
            shape: vec![1, 28, 28],
            classes: 10,
            noise: 0.5,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawTrain {
    pub epochs: i64,
    pub batch_size: i64,
    pub accumulation: i64,
    pub lr: f64,
    pub optimizer: String,
    pub momentum: f64,
    pub nesterov: bool,
    pub betas: Vec<f64>,
    pub eps: f64,
    pub weight_decay: f64,
    pub grad_clip_norm: f64,
    pub max_steps: i64,
    pub eval_batch_size: i64,
    pub eval_every: i64,
    pub eval_batches: i64,
    pub log_every: i64,
    pub precision: String,
    pub flush_denormals: bool,
    pub scheduler: RawScheduler,
}

impl Default for RawTrain {
    fn default() -> Self {
        Self {
            epochs: 1,
            batch_size: 64,
            accumulation: 1,
            lr: 1e-3,
            optimizer: "adam".into(),
            momentum: 0.0,
            nesterov: false,
            betas: vec![0.9, 0.999],
            eps: 1e-8,
            weight_decay: 0.0,
            grad_clip_norm: 0.0,
            max_steps: 0,
            eval_batch_size: 1000,
            eval_every: 0,
            eval_batches: 0,
            log_every: 50,
            precision: "f32".into(),
            flush_denormals: true,
            scheduler: RawScheduler::default(),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawScheduler {
    pub kind: String,
    pub step_size: i64,
    pub gamma: f64,
    pub min_lr: f64,
    pub warmup_steps: i64,
}

impl Default for RawScheduler {
    fn default() -> Self {
        Self {
            kind: "constant".into(),
            step_size: 1,
            gamma: 0.1,
            min_lr: 0.0,
            warmup_steps: 0,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawCheckpoint {
    pub every_epochs: i64,
    pub every_steps: i64,
    pub keep_last: i64,
    pub keep_best: bool,
    pub on_write_error: String,
}

impl Default for RawCheckpoint {
    fn default() -> Self {
        Self {
            every_epochs: 1,
            every_steps: 0,
            keep_last: 3,
            keep_best: false,
            on_write_error: "fail".into(),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawDistributed {
    pub nproc_per_node: toml::Value,
    pub backend: String,
    pub max_restarts: i64,
    pub timeout_s: i64,
    pub bucket_mb: f64,
    pub device: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub devices: Option<Vec<i64>>,
}

impl Default for RawDistributed {
    fn default() -> Self {
        Self {
            nproc_per_node: toml::Value::String("auto".into()),
            backend: "auto".into(),
            max_restarts: 0,
            timeout_s: 300,
            bucket_mb: 25.0,
            device: "auto".into(),
            devices: None,
        }
    }
}

/// `[logging]`: where rank 0's metrics go besides `metrics.jsonl`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawLogging {
    pub tensorboard: bool,
}

/// `[expect]`: thresholds checked after the run; absent keys are not checked.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawExpect {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub min_test_accuracy: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_test_loss: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_final_loss: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_wall_s: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub min_train_samples_per_s: Option<f64>,
}

impl RawExpect {
    pub fn is_empty(&self) -> bool {
        *self == RawExpect::default()
    }
}
