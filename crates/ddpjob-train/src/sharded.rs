//! The end of a step when the optimizer state is sharded (`distributed.sharding =
//! "optimizer"`, ZeRO-1): each bucket of gradients is reduce-scattered and only this rank's
//! pieces of it kept (the bucket's full gradients freed at once, so the update runs beside
//! 1/W of the averaged gradient, not all of it), clipped by the global norm, applied to this
//! rank's pieces of the parameters, whose new values are then all-gathered.
//!
//! The buckets are those of the unsharded all-reduce and a rank owns exactly the segment its
//! reduce-scatter completes, so every averaged gradient has the all-reduce's bits and every
//! parameter is updated by the same element-wise formula: without clipping, the weights are
//! bit-identical to an unsharded job's. The traffic is the all-reduce's too (its two halves,
//! with parameters instead of gradients in the second).

use candle_core::Tensor;

use super::step::{StepContext, StepError};
use crate::optim::Optimizer;
use ddpjob_comm::buckets::ShardPlan;
use ddpjob_comm::{Communicator, StopVote, flat_bucket};

/// This rank's averaged gradient pieces (one per piece of the plan, 1-D) and, when it owns
/// it, the ranks' mean stop vote. `grads` (one per trainable tensor) are consumed bucket by
/// bucket, so no full gradient outlives its bucket's reduce-scatter.
pub(super) fn reduce_scatter_gradients(
    cx: &StepContext,
    plan: &ShardPlan,
    grads: Vec<Tensor>,
    stop: bool,
) -> Result<(Vec<Tensor>, Option<f32>), StepError> {
    let mut grads: Vec<Option<Tensor>> = grads.into_iter().map(Some).collect();
    let mut pieces = Vec::with_capacity(plan.pieces.len());
    let mut vote = None;
    for (b, bucket) in plan.buckets.iter().enumerate() {
        let parts: Vec<Tensor> = bucket
            .tensors
            .clone()
            .map(|t| grads[t].take().expect("each gradient in one bucket"))
            .collect();
        let reduced = reduce_bucket(cx.comm, plan, b, parts, stop)?;
        pieces.extend(reduced.pieces.into_iter().map(|(_, piece)| piece));
        vote = vote.or(reduced.vote);
    }
    Ok((pieces, vote))
}

/// This rank's share of one reduced bucket: its pieces, by their position in the plan, and
/// the ranks' mean stop vote when it rode in this bucket and this rank owns it.
pub(super) struct ReducedBucket {
    pub(super) pieces: Vec<(usize, Tensor)>,
    pub(super) vote: Option<f32>,
}

/// Reduce-scatters bucket `b` of `plan` made of `parts` (its gradients, in order), the stop
/// vote riding on the last bucket: this rank's pieces of it (by their position in the plan)
/// and, when this rank owns it, the ranks' mean vote. The parts are freed here.
pub(super) fn reduce_bucket(
    comm: &dyn Communicator,
    plan: &ShardPlan,
    b: usize,
    parts: Vec<Tensor>,
    stop: bool,
) -> Result<ReducedBucket, StepError> {
    let last = plan.buckets.len().saturating_sub(1);
    let mine = (b == last).then_some(u8::from(stop) as f32);
    let mut flat = flat_bucket(&parts, mine)?;
    drop(parts);
    comm.reduce_scatter_mean(&mut flat)?;
    let mut pieces = Vec::new();
    for (k, p) in plan
        .pieces
        .iter()
        .enumerate()
        .filter(|(_, p)| p.bucket == b)
    {
        // A copy of the piece alone (`copy` would clone the whole bucket), so the bucket is
        // freed when this returns.
        pieces.push((k, flat.narrow(0, p.at, p.within.len())?.force_contiguous()?));
    }
    let mut vote = None;
    if b == last && plan.owns_vote() {
        let reduced = flat.narrow(0, plan.buckets[b].len - 1, 1)?;
        vote = Some(
            reduced
                .to_dtype(candle_core::DType::F32)?
                .to_vec1::<f32>()?[0],
        );
    }
    Ok(ReducedBucket { pieces, vote })
}

/// Scales the pieces so the global gradient norm (over every rank's pieces) is at most
/// `max_norm`, as `clip_grad_norm_` on the whole gradient would; the norm's squares are
/// summed in f64 per rank and all-reduced, so the coefficient may differ from an unsharded
/// job's in its last bits. Returns the norm before clipping.
pub(super) fn clip_pieces(
    cx: &StepContext,
    pieces: &mut [Tensor],
    max_norm: f64,
) -> Result<f64, StepError> {
    let mut squares = [crate::optim::sum_of_squares(pieces)?];
    cx.comm.all_reduce_sum_f64(&mut squares)?;
    let norm = squares[0].sqrt();
    let coef = (max_norm / (norm + 1e-6)).min(1.0);
    if coef < 1.0 {
        crate::optim::scale(pieces, coef)?;
    }
    Ok(norm)
}

/// Updates this rank's pieces, then gives every rank every rank's updated pieces, bucket by
/// bucket, with the stop vote riding in the last bucket as it does in the all-reduce.
pub(super) fn update_and_gather(
    cx: &StepContext,
    optimizer: &mut Optimizer,
    pieces: &[Tensor],
    lr: f64,
    vote: Option<f32>,
) -> Result<StopVote, StepError> {
    let params = cx.model.params();
    optimizer.step_pieces(params, pieces, lr)?;
    let plan = optimizer.plan().expect("a sharded optimizer");
    let on_host = params
        .vars()
        .all(|v| ddpjob_kernels::applies(v.as_tensor()));
    gather_parameters(cx, plan, vote, on_host)
}

/// Gives every rank every rank's pieces of the parameters, bucket by bucket, on the host
/// (CPU f32: buckets built from this rank's pieces, written back around them) or through
/// tensor ops (whole buckets, whole parameters set).
pub(super) fn gather_parameters(
    cx: &StepContext,
    plan: &ShardPlan,
    vote: Option<f32>,
    on_host: bool,
) -> Result<StopVote, StepError> {
    let params = cx.model.params();
    let vars: Vec<&Tensor> = params.trainable().map(|(_, v)| v.as_tensor()).collect();
    let mut verdict = StopVote::Known(false);
    let last = plan.buckets.len().saturating_sub(1);
    for (b, bucket) in plan.buckets.iter().enumerate() {
        let vote = (b == last).then_some(vote.unwrap_or(0.0));
        let mut flat = match on_host {
            true => host_bucket(plan, b, &vars, vote)?,
            false => {
                let values: Vec<Tensor> = bucket.tensors.clone().map(|t| vars[t].clone()).collect();
                // A parameter alone in its bucket would be its own bucket, gathered in place
                // and then set from itself, which a variable refuses: a copy.
                match (values.len(), vote) {
                    (1, None) => values[0].flatten_all()?.copy()?,
                    _ => flat_bucket(&values, vote)?,
                }
            }
        };
        cx.comm.all_gather(&mut flat)?;
        write_back(plan, b, &vars, &flat, params, on_host)?;
        if b == last {
            let reduced = flat.narrow(0, bucket.len - 1, 1)?.force_contiguous()?;
            verdict = StopVote::Reduced(reduced);
        }
    }
    Ok(verdict)
}

/// Bucket `b` for the all-gather, on the host: this rank's pieces in place, zeros where the
/// other ranks' go (the all-gather overwrites them), the vote last.
fn host_bucket(
    plan: &ShardPlan,
    b: usize,
    vars: &[&Tensor],
    vote: Option<f32>,
) -> Result<Tensor, StepError> {
    let bucket = &plan.buckets[b];
    let mut flat = vec![0f32; bucket.len];
    for p in plan.pieces.iter().filter(|p| p.bucket == b) {
        ddpjob_kernels::with_values(vars[p.tensor], |v| {
            flat[p.at..p.at + p.within.len()].copy_from_slice(&v[p.within.clone()]);
            Ok(())
        })?;
    }
    if let Some(vote) = vote {
        flat[bucket.len - 1] = vote;
    }
    Ok(Tensor::from_vec(
        flat,
        bucket.len,
        &candle_core::Device::Cpu,
    )?)
}

/// Sets bucket `b`'s parameters from the all-gathered `flat`: on the host in place, around
/// the piece this rank updated itself; elsewhere whole.
fn write_back(
    plan: &ShardPlan,
    b: usize,
    vars: &[&Tensor],
    flat: &Tensor,
    params: &crate::models::Params,
    on_host: bool,
) -> Result<(), StepError> {
    let bucket = &plan.buckets[b];
    if on_host {
        return Ok(ddpjob_kernels::with_values(flat, |all| {
            let mut offset = 0;
            for t in bucket.tensors.clone() {
                let n = vars[t].elem_count();
                let mine = plan.pieces.iter().find(|p| p.tensor == t);
                let keep = mine.map_or(0..0, |p| p.within.clone());
                ddpjob_kernels::overwrite_except(vars[t], &all[offset..offset + n], keep)?;
                offset += n;
            }
            Ok(())
        })?);
    }
    let trainable: Vec<_> = params.trainable().map(|(_, v)| v).collect();
    let mut offset = 0;
    for t in bucket.tensors.clone() {
        let var = trainable[t];
        let n = var.elem_count();
        var.set(&flat.narrow(0, offset, n)?.reshape(var.shape())?)?;
        offset += n;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Tensor};

    use super::*;

    /// The sharded parameters' all-gather gives every rank the same weights, each value from the
    /// rank that owns it, on the host and through tensor ops (a GPU's way) alike, parameters
    /// alone in their buckets included; the vote reaches every rank.
    #[test]
    fn sharded_parameters_gather_alike_on_the_host_and_through_tensor_ops() {
        let gathered = |on_host: bool| {
            ddpjob_comm::tcp_ranks(2, |rank, comm| {
                // The MLP of 1×4×4 images, 8 hidden units, 3 classes, from seed 0.
                let mlp = ddpjob_models::Mlp::new([1, 4, 4], &[8], 3, 0, &Device::Cpu);
                let model: Box<dyn crate::models::Model> = Box::new(mlp.unwrap());
                let params = model.params();
                let sizes: Vec<usize> = params.vars().map(|v| v.elem_count()).collect();
                // 4 bytes a bucket: every tensor alone in its own.
                let plan = ShardPlan::new(&sizes, 4, &comm);
                let vars: Vec<_> = params.vars().collect();
                for p in &plan.pieces {
                    let var = vars[p.tensor];
                    let mut v = var.flatten_all().unwrap().to_vec1::<f32>().unwrap();
                    for i in p.within.clone() {
                        v[i] = (1000 * (rank + 1) + i) as f32;
                    }
                    let v = Tensor::from_vec(v, var.shape(), &Device::Cpu).unwrap();
                    var.set(&v).unwrap();
                }
                let cx = StepContext {
                    model: model.as_ref(),
                    comm: &comm,
                    device: &Device::Cpu,
                    grad_clip_norm: None,
                    bucket_bytes: 4,
                    shards: None,
                    masked_targets: false,
                    virtual_shards: None,
                    scrambled_pieces: false,
                    stream_gradients: false,
                    sharded_parameters: None,
                    overlap_comm: false,
                };
                let vote = plan.owns_vote().then_some(1.0);
                let stop = gather_parameters(&cx, &plan, vote, on_host).unwrap();
                assert!(stop.read().unwrap(), "rank {rank}: the vote was lost");
                let values =
                    |v: &&candle_core::Var| v.flatten_all().unwrap().to_vec1::<f32>().unwrap();
                vars.iter().map(values).collect::<Vec<Vec<f32>>>()
            })
        };
        let (host, ops) = (gathered(true), gathered(false));
        assert_eq!(host[0], host[1]);
        assert_eq!(host, ops);
        // Every value is its owner's: 1000 or 2000 plus its index, and both ranks own some.
        let owners: std::collections::BTreeSet<usize> = host[0]
            .iter()
            .flat_map(|t| t.iter().enumerate().map(|(i, &v)| (v as usize - i) / 1000))
            .collect();
        assert_eq!(owners, [1, 2].into());
    }
}
