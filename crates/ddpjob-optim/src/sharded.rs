//! The optimizer of a job whose state is sharded (`distributed.sharding = "optimizer"`,
//! ZeRO-1): state kept only for this rank's pieces of the parameters (`comm::buckets`),
//! updated from the reduce-scattered gradients, and gathered into the ordinary per-parameter
//! layout for checkpoints, so a sharded job's checkpoint is an unsharded one's and resumes
//! with any sharding on any world size.
//!
//! Checkpoints are gathered (every rank's pieces all-gathered bucket by bucket, rank 0
//! streaming each into the file) rather than written as per-rank shards with an index: one
//! layout for every job keeps `resume` on another world size, `eval` and `export` unchanged.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{Result, Tensor};

use super::{Buffer, Optimizer, Slot};
use ddpjob_comm::buckets::ShardPlan;
use ddpjob_comm::{CommError, Communicator};
use ddpjob_seam::Params;
use ddpjob_spec::OptimizerSpec;
use ddpjob_storage::checkpoint::StreamedSafetensors;

/// What a sharded optimizer knows of the shards: the plan and the parameter index of each
/// trainable position (the plan counts trainable tensors only).
#[derive(Debug)]
pub struct Shards {
    plan: ShardPlan,
    trainable: Vec<usize>,
    /// With the parameters sharded too (`"full"`): this rank's pieces of them, by position in
    /// the plan, updated here; the parameters themselves are gathered only while read.
    held: Option<Vec<Tensor>>,
}

impl Optimizer {
    /// An optimizer that keeps state only for the pieces of `plan` (this rank's), one state
    /// slot per piece.
    pub fn sharded(spec: OptimizerSpec, plan: ShardPlan, params: &Params) -> Self {
        let mut optimizer = Optimizer::new(spec, plan.pieces.len());
        optimizer.shards = Some(Shards {
            plan,
            trainable: params.trainable().map(|(i, _)| i).collect(),
            held: None,
        });
        optimizer
    }

    /// The shard plan, when the state is sharded.
    pub fn plan(&self) -> Option<&ShardPlan> {
        self.shards.as_ref().map(|s| &s.plan)
    }

    /// From now on this optimizer keeps this rank's pieces of the parameters (copied from
    /// `params`, which must hold every value now) and updates them instead of the parameters:
    /// `distributed.sharding = "full"`, whose parameters are gathered from these pieces only
    /// while they are read (see `train::full`).
    pub fn hold_parameters(&mut self, params: &Params) -> Result<()> {
        let Some(shards) = &mut self.shards else {
            candle_core::bail!("hold_parameters on an optimizer that is not sharded");
        };
        let vars: Vec<_> = params.vars().collect();
        let held = shards
            .plan
            .pieces
            .iter()
            .map(|p| {
                let flat = vars[shards.trainable[p.tensor]].as_tensor().flatten_all()?;
                // A copy of its own: the parameter's storage is let go of.
                flat.narrow(0, p.within.start, p.within.len())?
                    .force_contiguous()
            })
            .collect::<Result<Vec<_>>>()?;
        shards.held = Some(held);
        Ok(())
    }

    /// This rank's pieces of the parameters, when it keeps them ([`Optimizer::hold_parameters`]).
    pub fn held_parameters(&self) -> Option<&[Tensor]> {
        self.shards.as_ref()?.held.as_deref()
    }

    /// Updates this rank's pieces of the parameters from their averaged gradients (`grads`,
    /// one per piece of the plan, 1-D). CPU f32 pieces are updated in place (inside the
    /// parameters, or the pieces held apart: [`Optimizer::hold_parameters`]); elsewhere the new
    /// values are written into them.
    pub fn step_pieces(&mut self, params: &Params, grads: &[Tensor], lr: f64) -> Result<()> {
        // Taken out while the state slots are updated, and put back whatever happens.
        let Some(mut shards) = self.shards.take() else {
            candle_core::bail!("step_pieces on an optimizer that is not sharded");
        };
        let result = self.update_pieces(&mut shards, params, grads, lr);
        self.shards = Some(shards);
        result
    }

    fn update_pieces(
        &mut self,
        shards: &mut Shards,
        params: &Params,
        grads: &[Tensor],
        lr: f64,
    ) -> Result<()> {
        self.steps += 1;
        let vars: Vec<_> = params.vars().collect();
        let views = match &shards.held {
            Some(held) => held.clone(),
            None => shards
                .plan
                .pieces
                .iter()
                .map(|p| {
                    let var = vars[shards.trainable[p.tensor]];
                    var.as_tensor()
                        .flatten_all()?
                        .narrow(0, p.within.start, p.within.len())
                })
                .collect::<Result<Vec<_>>>()?,
        };
        let slots = shards
            .plan
            .pieces
            .iter()
            .zip(&views)
            .zip(grads)
            .enumerate()
            .map(|(k, ((p, view), grad))| Slot {
                state: k,
                decays: params.decays(shards.trainable[p.tensor]),
                param: view,
                grad,
            })
            .collect();
        let updated = self.update(slots, lr)?;
        if let Some(held) = &mut shards.held {
            for (piece, new) in held.iter_mut().zip(updated) {
                if let Some(new) = new {
                    *piece = new;
                }
            }
            return Ok(());
        }
        for (p, new) in shards.plan.pieces.iter().zip(updated) {
            let Some(new) = new else { continue };
            let var = vars[shards.trainable[p.tensor]];
            let flat = var.as_tensor().flatten_all()?;
            let after = p.within.end..flat.elem_count();
            let whole = Tensor::cat(
                &[
                    flat.narrow(0, 0, p.within.start)?,
                    new,
                    flat.narrow(0, after.start, after.len())?,
                ],
                0,
            )?;
            var.set(&whole.reshape(var.shape())?)?;
        }
        Ok(())
    }

    /// The state in the unsharded layout ([`Optimizer::state`]'s) for rank 0's checkpoint
    /// (`None` on the other ranks). Every rank must call it: a sharded state is all-gathered
    /// bucket by bucket, and rank 0 streams each bucket into the safetensors file `staging`
    /// as it arrives, so it never holds more than a bucket of it.
    pub fn checkpoint_state(
        &self,
        comm: &dyn Communicator,
        params: &Params,
        staging: Option<&Path>,
    ) -> std::result::Result<Option<Gathered>, GatherError> {
        let Some(shards) = &self.shards else {
            return Ok(match comm.rank() {
                0 => Some(Gathered::Tensors(self.state(params)?.0)),
                _ => None,
            });
        };
        let names: Vec<&str> = params.iter().map(|(n, _)| n).collect();
        let vars: Vec<_> = params.vars().collect();
        let kept = self.kept_buffers();
        // The file's tensors in the order they are gathered: by buffer, bucket, tensor.
        let mut layout = Vec::new();
        for &(_, suffix) in &kept {
            for bucket in &shards.plan.buckets {
                for t in bucket.tensors.clone() {
                    let i = shards.trainable[t];
                    layout.push((format!("{}.{suffix}", names[i]), vars[i].dims().to_vec()));
                }
            }
        }
        // A failed write is reported once the gather is over: every rank runs every collective.
        let mut failed = None;
        let mut writer = match (comm.rank(), staging) {
            (0, Some(path)) => match StreamedSafetensors::create(path, &layout) {
                Ok(writer) => Some(writer),
                Err(e) => {
                    failed = Some(e);
                    None
                }
            },
            _ => None,
        };
        for &(kind, _) in &kept {
            for (b, bucket) in shards.plan.buckets.iter().enumerate() {
                let mut flat = vec![0f32; bucket.len];
                for (k, p) in shards.plan.pieces.iter().enumerate() {
                    if p.bucket != b {
                        continue;
                    }
                    let slot = match kind {
                        0 => &self.first[k],
                        _ => &self.second[k],
                    };
                    if let Some(values) = slot.as_ref().map(Buffer::values).transpose()? {
                        flat[p.at..p.at + values.len()].copy_from_slice(&values);
                    }
                }
                let device = vars[0].device();
                let mut gathered = Tensor::from_vec(flat, bucket.len, device)?;
                comm.all_gather(&mut gathered)?;
                if let Some(w) = writer.as_mut().filter(|_| failed.is_none()) {
                    let values = gathered.to_vec1::<f32>()?;
                    let n: usize = bucket
                        .tensors
                        .clone()
                        .map(|t| vars[shards.trainable[t]].elem_count())
                        .sum();
                    failed = w.append(&values[..n]).err();
                }
            }
        }
        if let Some(cause) = failed {
            return Err(GatherError::Io {
                path: staging.map(Path::to_path_buf).unwrap_or_default(),
                cause,
            });
        }
        match writer {
            Some(w) => {
                w.finish().map_err(|cause| GatherError::Io {
                    path: staging.map(Path::to_path_buf).unwrap_or_default(),
                    cause,
                })?;
                Ok(staging.map(|p| Gathered::Written(p.to_path_buf())))
            }
            None => Ok(None),
        }
    }

    /// Which state buffers every trainable parameter has by now (the first, the second), with
    /// torch's names: none before the first step, SGD's only with momentum.
    fn kept_buffers(&self) -> Vec<(usize, &'static str)> {
        let (first, second) = self.buffer_names();
        match self.spec {
            _ if self.steps == 0 => vec![],
            OptimizerSpec::Sgd { momentum, .. } if momentum > 0.0 => vec![(0, first)],
            OptimizerSpec::Sgd { .. } => vec![],
            _ => vec![(0, first), (1, second)],
        }
    }

    /// [`Optimizer::load_state`] for a sharded optimizer: each piece's part of the
    /// per-parameter state.
    pub fn load_pieces(
        &mut self,
        params: &Params,
        tensors: &HashMap<String, Tensor>,
    ) -> Result<()> {
        let Some(shards) = &self.shards else {
            return Ok(());
        };
        let (first, second) = self.buffer_names();
        let names: Vec<&str> = params.iter().map(|(n, _)| n).collect();
        for (k, p) in shards.plan.pieces.iter().enumerate() {
            let name = names[shards.trainable[p.tensor]];
            let part = |suffix: &str| -> Result<Option<Buffer>> {
                let Some(t) = tensors.get(&format!("{name}.{suffix}")) else {
                    return Ok(None);
                };
                let t = t.flatten_all()?.narrow(0, p.within.start, p.within.len())?;
                Ok(Some(Buffer::Tensor(t.force_contiguous()?)))
            };
            self.first[k] = part(first)?;
            self.second[k] = part(second)?;
        }
        Ok(())
    }
}

/// A checkpoint's optimizer state as [`Optimizer::checkpoint_state`] hands it to rank 0.
pub enum Gathered {
    /// An unsharded optimizer's own tensors.
    Tensors(HashMap<String, Tensor>),
    /// A sharded optimizer's, streamed into this safetensors file.
    Written(PathBuf),
}

impl Gathered {
    /// The state as a checkpoint writes it.
    pub fn as_checkpoint(&self) -> ddpjob_storage::checkpoint::TensorFile<'_> {
        match self {
            Gathered::Tensors(t) => ddpjob_storage::checkpoint::TensorFile::Tensors(t),
            Gathered::Written(path) => ddpjob_storage::checkpoint::TensorFile::Written(path),
        }
    }
}

/// Why gathering a sharded state for a checkpoint failed.
#[derive(Debug, thiserror::Error)]
pub enum GatherError {
    #[error(transparent)]
    Comm(#[from] CommError),
    #[error(transparent)]
    Tensor(#[from] candle_core::Error),
    #[error("cannot write the gathered optimizer state to `{}`: {cause}", path.display())]
    Io {
        path: PathBuf,
        cause: std::io::Error,
    },
}
