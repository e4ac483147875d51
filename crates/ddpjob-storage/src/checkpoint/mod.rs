//! Checkpoints that are complete or absent: written to a temp directory, fsynced, described by a
//! MANIFEST (sha256 per file), renamed to `step-NNNNNNNN`, then `latest` is replaced; older ones
//! are pruned only after the new one is in place.

pub mod base;
mod dir;
pub mod layout;
mod streamed;
mod trained;
pub use dir::{Checkpoints, FORMAT, read_position};
pub use streamed::StreamedSafetensors;
pub use trained::Trained;

use std::collections::HashMap;
use std::fs;
use std::io::Read;
use std::path::{Path, PathBuf};

use candle_core::Tensor;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use thiserror::Error;

use crate::jobdir::hex;
use crate::jobdir::{sync_dir, write_atomic};

#[derive(Debug, Error)]
pub enum CheckpointError {
    #[error("checkpoint write to `{}` failed: {cause}; any earlier checkpoint is untouched", path.display())]
    Io {
        path: PathBuf,
        cause: std::io::Error,
    },
    #[error("checkpoint write to `{}` failed: {cause}; any earlier checkpoint is untouched", path.display())]
    Tensor {
        path: PathBuf,
        cause: candle_core::Error,
    },
    #[error("cannot read checkpoint `{}`: {problem}", path.display())]
    Unreadable { path: PathBuf, problem: String },
}

mod restore;
pub use restore::{Choice, Restored, choose, load};

/// Where training stood when a checkpoint was taken: everything resume needs besides tensors.
/// Training draws no randomness of its own (the sampler's permutation is a pure function of
/// seed and epoch, and the models have no dropout), so the position is the whole RNG state.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainPosition {
    /// Epoch in progress (0-based); `step_in_epoch` optimizer steps of it are done.
    pub epoch: usize,
    pub step_in_epoch: usize,
    /// Optimizer steps done in the whole run.
    pub step: usize,
    pub optimizer_steps: u64,
    pub world_size: usize,
    pub seed: u64,
    pub lr: f64,
    /// Samples of this epoch's (padded) permutation consumed by all ranks: where a run on
    /// another world size picks up.
    #[serde(default)]
    pub consumed_in_epoch: usize,
    /// The metric history a resumed run continues.
    #[serde(default)]
    pub metrics: MetricState,
    /// The checkpoint format ([`FORMAT`] when written by this build).
    #[serde(default = "dir::first_format")]
    pub format: u32,
    /// When parameters are frozen: the checkpoint holds only what trains, and this is the
    /// SHA-256 of the frozen (base) weights it was trained over (see [`base`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub base_sha256: Option<String>,
    /// World-size-invariant training (`distributed.deterministic`): the pieces each step's
    /// batch was cut into (`distributed.virtual_shards`), whose tree sets every sum. `None`:
    /// ordinary training, or a checkpoint written before this was recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub virtual_shards: Option<usize>,
}

/// Running sums behind the epoch's train loss and the summary's throughput.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct MetricState {
    /// Σ loss·samples, samples and training seconds of the epoch in progress.
    pub epoch_loss_x_n: f64,
    pub epoch_samples: f64,
    pub epoch_secs: f64,
    /// Samples and training seconds of the epochs already completed.
    pub total_samples: f64,
    pub train_s: f64,
    /// The last completed epoch's mean train loss (none before the first).
    pub last_epoch_loss: Option<f64>,
    /// The lowest evaluation loss so far and the optimizer step it was measured after.
    #[serde(default)]
    pub best_eval: Option<(f64, usize)>,
    /// `train.early_stopping`: the figure an evaluation must beat by more than `min_delta`,
    /// the evaluations in a row that have not, and the figure counted (a count of another's,
    /// after `job.toml`'s monitor was edited, starts over; none: the loss, as before it was
    /// recorded).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub early_stopping_best: Option<f64>,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub evals_without_improvement: usize,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub early_stopping_on: Option<ddpjob_spec::Monitor>,
    /// Steps were counted since the last epoch's end: a run stopped after an epoch's last
    /// step, before that epoch's evaluation and train loss, has them still to do. `None` in
    /// a checkpoint of an older build: see [`MetricState::is_epoch_open`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub epoch_open: Option<bool>,
}

fn is_zero(n: &usize) -> bool {
    *n == 0
}

impl MetricState {
    /// Clears the epoch-in-progress sums.
    pub fn start_epoch(&mut self) {
        (self.epoch_loss_x_n, self.epoch_samples, self.epoch_secs) = (0.0, 0.0, 0.0);
    }

    /// Adds a logging interval: each step's sum of loss × samples (in step order, so the
    /// epoch's sum does not depend on how steps were grouped into intervals), over `samples`
    /// samples, taking `secs`.
    pub fn add_interval(&mut self, step_sums: &[f64], samples: f64, secs: f64) {
        for sum in step_sums {
            self.epoch_loss_x_n += sum;
        }
        self.epoch_samples += samples;
        self.epoch_secs += secs;
        self.epoch_open = Some(true);
    }

    /// Whether the epoch in progress has steps its end has not closed. An older build's
    /// checkpoint does not say: its epoch is open when it counted samples whose mean is not
    /// the last epoch's loss, which closing it stores exactly (the JSON round trip keeps every
    /// bit).
    pub fn is_epoch_open(&self) -> bool {
        self.epoch_open.unwrap_or_else(|| {
            self.epoch_samples > 0.0
                && self.last_epoch_loss != Some(self.epoch_loss_x_n / self.epoch_samples.max(1.0))
        })
    }

    /// Counts an evaluation's `value` of `monitor` for early stopping (Lightning's rule: an
    /// improvement beats the best by more than `min_delta`; a first finite value always
    /// does). Returns the evaluations in a row without one, this one included.
    pub fn count_for_early_stopping(
        &mut self,
        value: f64,
        monitor: ddpjob_spec::Monitor,
        min_delta: f64,
    ) -> usize {
        if self.early_stopping_on.unwrap_or_default() != monitor {
            (self.early_stopping_best, self.evals_without_improvement) = (None, 0);
        }
        self.early_stopping_on = Some(monitor);
        let improved = value.is_finite()
            && self
                .early_stopping_best
                .is_none_or(|best| monitor.improves(value, best, min_delta));
        if improved {
            self.early_stopping_best = Some(value);
            self.evals_without_improvement = 0;
        } else {
            self.evals_without_improvement += 1;
        }
        self.evals_without_improvement
    }

    /// Closes the epoch: returns its mean train loss and adds it to the totals.
    pub fn finish_epoch(&mut self) -> f64 {
        let loss = self.epoch_loss_x_n / self.epoch_samples.max(1.0);
        self.total_samples += self.epoch_samples;
        self.train_s += self.epoch_secs;
        self.last_epoch_loss = Some(loss);
        self.epoch_open = Some(false);
        loss
    }
}

/// A checkpoint's weights or optimizer state: tensors to write, or the safetensors file
/// already written elsewhere on the same filesystem (sharded state is streamed there, bucket
/// by bucket, so rank 0 never holds all of it), moved into the checkpoint.
pub enum TensorFile<'a> {
    Tensors(&'a HashMap<String, Tensor>),
    Written(&'a Path),
}

impl TensorFile<'_> {
    /// Puts the tensors at `path`: written there, or the file moved there.
    fn put(self, path: &Path) -> Result<(), CheckpointError> {
        match self {
            TensorFile::Tensors(tensors) => {
                crate::jobdir::save_tensors(tensors, path).map_err(|cause| {
                    CheckpointError::Tensor {
                        path: path.to_path_buf(),
                        cause,
                    }
                })
            }
            TensorFile::Written(file) => fs::rename(file, path).map_err(io(file)),
        }
    }
}

/// Writes checkpoints into one job's `checkpoints/` directory.
pub struct Checkpointer {
    dir: PathBuf,
    keep_last: Option<usize>,
}

pub fn step_dir_name(step: usize) -> String {
    format!("step-{step:08}")
}

impl Checkpointer {
    pub fn new(dir: PathBuf, keep_last: Option<usize>) -> Self {
        Checkpointer { dir, keep_last }
    }

    /// Writes model and optimizer tensors and the position; returns the checkpoint's directory.
    /// A checkpoint of the same step that already exists is kept as it is.
    pub fn save(
        &self,
        model: TensorFile,
        optimizer: TensorFile,
        position: &TrainPosition,
    ) -> Result<PathBuf, CheckpointError> {
        let name = step_dir_name(position.step);
        let final_dir = self.dir.join(&name);
        if final_dir.exists() {
            return Ok(final_dir);
        }
        let tmp = self.dir.join(format!(".tmp-{name}-{}", std::process::id()));
        let result = self
            .write_into(&tmp, model, optimizer, position)
            .and_then(|()| {
                fs::rename(&tmp, &final_dir).map_err(io(&final_dir))?;
                sync_dir(&self.dir).map_err(io(&self.dir))?;
                write_atomic(&self.dir.join("latest"), format!("{name}\n").as_bytes())
                    .map_err(io(&self.dir.join("latest")))
            });
        if let Err(e) = result {
            let _ = fs::remove_dir_all(&tmp);
            return Err(e);
        }
        self.prune()?;
        Ok(final_dir)
    }

    /// Replaces `checkpoints/best` with these weights (a complete checkpoint, MANIFEST
    /// included, never pruned and never chosen by `resume`, which takes `step-*` only).
    pub fn save_best(
        &self,
        model: TensorFile,
        optimizer: TensorFile,
        position: &TrainPosition,
    ) -> Result<PathBuf, CheckpointError> {
        let pid = std::process::id();
        let best = self.dir.join("best");
        let tmp = self.dir.join(format!(".tmp-best-{pid}"));
        let old = self.dir.join(format!(".tmp-best-old-{pid}"));
        let result = self
            .write_into(&tmp, model, optimizer, position)
            .and_then(|()| {
                if best.exists() {
                    fs::rename(&best, &old).map_err(io(&best))?;
                }
                fs::rename(&tmp, &best).map_err(io(&best))?;
                sync_dir(&self.dir).map_err(io(&self.dir))
            });
        let _ = fs::remove_dir_all(&old);
        if let Err(e) = result {
            let _ = fs::remove_dir_all(&tmp);
            return Err(e);
        }
        Ok(best)
    }

    fn write_into(
        &self,
        tmp: &Path,
        model: TensorFile,
        optimizer: TensorFile,
        position: &TrainPosition,
    ) -> Result<(), CheckpointError> {
        fs::create_dir_all(tmp).map_err(io(tmp))?;
        model.put(&tmp.join("model.safetensors"))?;
        optimizer.put(&tmp.join("optimizer.safetensors"))?;
        let state_path = tmp.join("state.json");
        let state = serde_json::to_vec_pretty(position).unwrap_or_default();
        fs::write(&state_path, state).map_err(io(&state_path))?;
        let mut manifest = String::new();
        for file in ["model.safetensors", "optimizer.safetensors", "state.json"] {
            let path = tmp.join(file);
            fs::File::open(&path)
                .and_then(|f| f.sync_all())
                .map_err(io(&path))?;
            manifest.push_str(&format!(
                "{}  {file}\n",
                sha256_file(&path).map_err(io(&path))?
            ));
        }
        let manifest_path = tmp.join("MANIFEST");
        write_atomic(&manifest_path, manifest.as_bytes()).map_err(io(&manifest_path))?;
        sync_dir(tmp).map_err(io(tmp))
    }

    /// Removes the oldest complete checkpoints beyond `keep_last`, and stale temp directories.
    fn prune(&self) -> Result<(), CheckpointError> {
        // Left by a writer that died mid-checkpoint; never a complete checkpoint.
        for entry in fs::read_dir(&self.dir)
            .map_err(io(&self.dir))?
            .filter_map(|e| e.ok())
        {
            if entry.file_name().to_string_lossy().starts_with(".tmp-") {
                let path = entry.path();
                let _ = match path.is_dir() {
                    true => fs::remove_dir_all(&path),
                    false => fs::remove_file(&path),
                };
            }
        }
        let mut steps = list_checkpoints(&self.dir).map_err(io(&self.dir))?;
        if let Some(keep) = self.keep_last {
            while steps.len() > keep {
                let oldest = steps.remove(0);
                fs::remove_dir_all(&oldest).map_err(io(&oldest))?;
            }
        }
        Ok(())
    }
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> CheckpointError + '_ {
    move |cause| CheckpointError::Io {
        path: path.to_path_buf(),
        cause,
    }
}

/// Complete checkpoint directories (`step-*`), oldest first.
pub fn list_checkpoints(dir: &Path) -> std::io::Result<Vec<PathBuf>> {
    let mut found: Vec<PathBuf> = fs::read_dir(dir)?
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .filter(|p| {
            p.is_dir()
                && p.file_name()
                    .is_some_and(|n| n.to_string_lossy().starts_with("step-"))
        })
        .collect();
    found.sort();
    Ok(found)
}

pub fn sha256_file(path: &Path) -> std::io::Result<String> {
    let mut f = fs::File::open(path)?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 16];
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            return Ok(hex(&hasher.finalize()));
        }
        hasher.update(&buf[..n]);
    }
}

/// Checks every file a checkpoint's MANIFEST lists; `Err` says which one is wrong.
pub fn verify(checkpoint: &Path) -> Result<(), String> {
    let manifest = fs::read_to_string(checkpoint.join("MANIFEST"))
        .map_err(|e| format!("MANIFEST unreadable: {e}"))?;
    let mut seen = 0;
    for line in manifest.lines().filter(|l| !l.trim().is_empty()) {
        let (digest, file) = line
            .split_once("  ")
            .ok_or_else(|| format!("malformed MANIFEST line `{line}`"))?;
        let actual = sha256_file(&checkpoint.join(file)).map_err(|e| format!("{file}: {e}"))?;
        if actual != digest {
            return Err(format!(
                "{file}: checksum mismatch (file changed or truncated)"
            ));
        }
        seen += 1;
    }
    if seen < 3 {
        return Err(format!("MANIFEST lists {seen} files, expected 3"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// Whether an epoch's end is still to come, as recorded, and as read from an older
    /// build's checkpoint that does not record it (its JSON without the field).
    #[test]
    fn an_epoch_is_open_between_its_steps_and_its_end_in_old_checkpoints_too() {
        let older = |m: &MetricState| -> MetricState {
            let mut json = serde_json::to_value(m).unwrap();
            json.as_object_mut().unwrap().remove("epoch_open");
            serde_json::from_value(json).unwrap()
        };
        let mut m = MetricState::default();
        assert!(!m.is_epoch_open() && !older(&m).is_epoch_open());
        m.add_interval(&[3.0 * 8.0, 2.5 * 8.0], 16.0, 1.0);
        assert!(m.is_epoch_open() && older(&m).is_epoch_open());
        m.finish_epoch();
        assert!(!m.is_epoch_open() && !older(&m).is_epoch_open());
        m.start_epoch();
        m.add_interval(&[2.0 * 8.0], 8.0, 1.0);
        assert!(m.is_epoch_open() && older(&m).is_epoch_open());
    }

    /// A position after `step` steps of epoch 0, 8 samples a step.
    pub(super) fn position(step: usize) -> TrainPosition {
        TrainPosition {
            epoch: 0,
            step_in_epoch: step,
            step,
            optimizer_steps: step as u64,
            world_size: 1,
            seed: 0,
            lr: 0.1,
            consumed_in_epoch: step * 8,
            metrics: MetricState::default(),
            format: FORMAT,
            base_sha256: None,
            virtual_shards: None,
        }
    }

    #[test]
    fn writes_verifiable_checkpoints_and_prunes_old_ones() {
        let dir = std::env::temp_dir().join(format!("ddpjob-ckpt-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        let ck = Checkpointer::new(dir.clone(), Some(2));
        let model = HashMap::from([(
            "fc1.weight".to_string(),
            Tensor::ones((2, 2), candle_core::DType::F32, &Device::Cpu).unwrap(),
        )]);
        for step in [10, 20, 30] {
            ck.save(
                TensorFile::Tensors(&model),
                TensorFile::Tensors(&HashMap::new()),
                &position(step),
            )
            .unwrap();
        }
        let names: Vec<String> = list_checkpoints(&dir)
            .unwrap()
            .iter()
            .map(|p| p.file_name().unwrap().to_string_lossy().into())
            .collect();
        assert_eq!(names, vec!["step-00000020", "step-00000030"]);
        assert_eq!(
            fs::read_to_string(dir.join("latest")).unwrap().trim(),
            "step-00000030"
        );
        let newest = dir.join("step-00000030");
        verify(&newest).unwrap();
        let model_file = newest.join("model.safetensors");
        let bytes = fs::read(&model_file).unwrap();
        fs::write(&model_file, &bytes[..bytes.len() - 3]).unwrap();
        assert!(verify(&newest).unwrap_err().contains("model.safetensors"));
        assert!(
            !fs::read_dir(&dir).unwrap().any(|e| e
                .unwrap()
                .file_name()
                .to_string_lossy()
                .starts_with(".tmp"))
        );
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn early_stopping_counts_evaluations_that_do_not_beat_the_best_by_min_delta() {
        use ddpjob_spec::Monitor::{Accuracy, Loss};
        let mut m = MetricState::default();
        let counts: Vec<usize> = [1.0, 0.95, 0.97, 0.96, f64::NAN, 0.5]
            .iter()
            .map(|&loss| m.count_for_early_stopping(loss, Loss, 0.05))
            .collect();
        // 0.95, 0.97 and 0.96 do not beat 1.0 by more than min_delta; NaN never improves; 0.5 does.
        assert_eq!(counts, [0, 1, 2, 3, 4, 0]);
        assert_eq!(m.early_stopping_best, Some(0.5));
        // An equal loss is no improvement without min_delta either (Lightning's strict `<`).
        let mut m = MetricState::default();
        assert_eq!(m.count_for_early_stopping(f64::INFINITY, Loss, 0.0), 1);
        assert_eq!(m.count_for_early_stopping(0.7, Loss, 0.0), 0);
        assert_eq!(m.count_for_early_stopping(0.7, Loss, 0.0), 1);
        // An accuracy must rise by more than min_delta (Lightning's mode="max").
        let mut acc = MetricState::default();
        let counts: Vec<usize> = [0.5, 0.505, 0.52, 0.4, 0.6]
            .iter()
            .map(|&a| acc.count_for_early_stopping(a, Accuracy, 0.01))
            .collect();
        assert_eq!(counts, [0, 1, 0, 1, 0]);
        // Counting another figure than the state's (job.toml's monitor edited) starts over.
        assert_eq!(acc.count_for_early_stopping(3.0, Loss, 0.0), 0);
        assert_eq!(acc.early_stopping_best, Some(3.0));
        // The count travels in a checkpoint's state.json; older ones without it read as none.
        let json = serde_json::to_string(&m).unwrap();
        assert_eq!(serde_json::from_str::<MetricState>(&json).unwrap(), m);
        let mut old: serde_json::Value = serde_json::from_str(&json).unwrap();
        let fields = old.as_object_mut().unwrap();
        fields.remove("early_stopping_best");
        fields.remove("evals_without_improvement");
        let old: MetricState = serde_json::from_value(old).unwrap();
        assert_eq!(
            (old.early_stopping_best, old.evals_without_improvement),
            (None, 0)
        );
    }
}
