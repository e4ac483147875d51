//! The optimizer of a job whose state is sharded (`distributed.sharding = "optimizer"`,
//! ZeRO-1): state kept only for this rank's pieces of the parameters (`comm::buckets`),
//! updated from the reduce-scattered gradients, and gathered into the ordinary per-parameter
//! layout for checkpoints, so a sharded job's checkpoint is an unsharded one's and resumes
//! with any sharding on any world size.
//!
//! Checkpoints are gathered (every rank's pieces all-gathered bucket by bucket, rank 0 writing)
//! rather than written as per-rank shards with an index: one layout for every job keeps
//! `resume` on another world size, `eval` and `export` unchanged, at the cost of rank 0
//! holding the whole state while it writes.

use std::collections::HashMap;

use candle_core::{Result, Tensor};

use super::{Buffer, Optimizer, Slot};
use crate::comm::buckets::ShardPlan;
use crate::comm::{CommError, Communicator};
use crate::config::OptimizerSpec;
use crate::models::Params;

/// What a sharded optimizer knows of the shards: the plan and the parameter index of each
/// trainable position (the plan counts trainable tensors only).
#[derive(Debug, Clone)]
pub(super) struct Shards {
    plan: ShardPlan,
    trainable: Vec<usize>,
}

impl Optimizer {
    /// An optimizer that keeps state only for the pieces of `plan` (this rank's), one state
    /// slot per piece.
    pub fn sharded(spec: OptimizerSpec, plan: ShardPlan, params: &Params) -> Self {
        let mut optimizer = Optimizer::new(spec, plan.pieces.len());
        optimizer.shards = Some(Shards {
            plan,
            trainable: params.trainable().map(|(i, _)| i).collect(),
        });
        optimizer
    }

    /// The shard plan, when the state is sharded.
    pub fn plan(&self) -> Option<&ShardPlan> {
        self.shards.as_ref().map(|s| &s.plan)
    }

    /// Updates this rank's pieces of the parameters from their averaged gradients (`grads`,
    /// one per piece of the plan, 1-D). CPU f32 pieces are updated in place inside the
    /// parameters; elsewhere the new values are written into them.
    pub fn step_pieces(&mut self, params: &Params, grads: &[Tensor], lr: f64) -> Result<()> {
        let Some(shards) = self.shards.clone() else {
            candle_core::bail!("step_pieces on an optimizer that is not sharded");
        };
        self.steps += 1;
        let vars: Vec<_> = params.vars().collect();
        let views = shards
            .plan
            .pieces
            .iter()
            .map(|p| {
                let var = vars[shards.trainable[p.tensor]];
                var.as_tensor()
                    .flatten_all()?
                    .narrow(0, p.within.start, p.within.len())
            })
            .collect::<Result<Vec<_>>>()?;
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

    /// The state in the unsharded layout ([`Optimizer::state`]'s), for rank 0's checkpoint
    /// (`None` on the other ranks). Every rank must call it: a sharded state is all-gathered
    /// bucket by bucket.
    pub fn checkpoint_state(
        &self,
        comm: &dyn Communicator,
        params: &Params,
    ) -> std::result::Result<Option<HashMap<String, Tensor>>, CommError> {
        let Some(shards) = &self.shards else {
            return Ok(match comm.rank() {
                0 => Some(self.state(params)?.0),
                _ => None,
            });
        };
        let mut out = HashMap::new();
        let names: Vec<&str> = params.iter().map(|(n, _)| n).collect();
        let vars: Vec<_> = params.vars().collect();
        for (kind, suffix) in self.kept_buffers() {
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
                if comm.rank() != 0 {
                    continue;
                }
                let mut offset = 0;
                for t in bucket.tensors.clone() {
                    let i = shards.trainable[t];
                    let var = vars[i];
                    let n = var.elem_count();
                    let value = gathered.narrow(0, offset, n)?.reshape(var.shape())?;
                    out.insert(format!("{}.{suffix}", names[i]), value);
                    offset += n;
                }
            }
        }
        Ok((comm.rank() == 0).then_some(out))
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
    pub(super) fn load_pieces(
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
