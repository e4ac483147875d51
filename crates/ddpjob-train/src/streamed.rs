//! `distributed.sharding = "gradients"` (ZeRO-2): the step's last micro-batch hands each
//! parameter's gradient over as soon as its backward has formed it
//! ([`crate::models::TrainPass::backward_to`]), and each bucket is reduce-scattered as soon as
//! every gradient in it is in, while the backward goes on with the blocks below; only this
//! rank's pieces are kept. A model that hands its gradients over block by block
//! ([`crate::models::Model::stream_gradients`]) so never holds the whole gradient; one that
//! forms them all at the end of its backward runs as `"optimizer"` does.
//!
//! Buckets are reduced in the order they complete, which is the same on every rank: a pass
//! hands its gradients over in a fixed order, a gradient is final when the last of the
//! worker's row shards has handed it over, so gradients become final in that order whatever
//! the shards' pace. Each is summed as the unsharded step sums it (earlier micro-batches',
//! then each shard's in shard order) and every bucket holds the same tensors as the
//! all-reduce's: the weights are bit-identical to `"none"` and `"optimizer"`. Row shards run
//! on the worker's pool while the thread that runs the step reduces the buckets they
//! complete (collectives stay on that thread); without shards the pass's own thread reduces
//! each bucket as it completes.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard};

use candle_core::Tensor;

use super::sharded::{ReducedBucket, reduce_bucket};
use super::shards::ShardPool;
use super::step::{ShardResult, StepError, accumulate};
use crate::models::{GradientSink, Params};
use ddpjob_comm::Communicator;
use ddpjob_comm::buckets::ShardPlan;

/// This rank's averaged pieces (in plan order) and, when it owns it, the mean stop vote: what
/// `sharded::reduce_scatter_gradients` gives.
pub(super) type Reduced = (Vec<Tensor>, Option<f32>);

/// Runs the last micro-batch's `parts` shards (`shard(i, sink)`: forward and backward of
/// shard i, its gradients handed to `sink`; on `pool` side by side when there is more than
/// one), `earlier` holding the step's earlier micro-batches' gradients by parameter, and
/// reduce-scatters every bucket of `plan` as it completes.
///
/// `via` reduces each bucket: here ([`Here`]), or hands it to the collectives' own thread
/// (`overlap`'s courier; the pieces are then that thread's, and this gives `None` for them).
pub(super) fn last_micro_batch<F, V: BucketVia>(
    params: &Params,
    (plan, via): (&ShardPlan, &V),
    earlier: Vec<Option<Tensor>>,
    stop: bool,
    pool: Option<&ShardPool>,
    parts: usize,
    shard: F,
) -> Result<(Vec<ShardResult>, Option<Reduced>), StepError>
where
    F: Fn(usize, &mut dyn GradientSink) -> Result<ShardResult, StepError> + Sync,
{
    let stream = Stream::new(params, plan, earlier, parts);
    let reducer = Reducer {
        via,
        plan,
        stop,
        stream: &stream,
        vars: params.trainable().map(|(_, v)| v).collect(),
        forwarded: AtomicBool::new(false),
    };
    let run = |i: usize, reducer: Option<&Reducer<V>>| {
        let mut sink = ShardSink {
            stream: &stream,
            shard: i,
            reducer,
        };
        // Ends the shard however its pass ends, a panic included (the reducer waits for it).
        let mut ending = Ending {
            stream: &stream,
            shard: i,
            ok: false,
        };
        let result = shard(i, &mut sink);
        ending.ok = result.is_ok();
        result
    };
    let results = match pool {
        // Collectives stay on this thread: the shards run on the pool from another.
        Some(pool) if parts > 1 => std::thread::scope(|scope| {
            let computing = scope.spawn(|| pool.run(parts, |i| run(i, None)));
            let reduced = reducer.reduce_until_ended();
            let results = computing
                .join()
                .unwrap_or_else(|panic| std::panic::resume_unwind(panic));
            reduced.map(|()| results)
        })?,
        _ => {
            let result = run(0, Some(&reducer));
            reducer.reduce_until_ended()?;
            vec![result]
        }
    };
    if let Some(error) = stream.lock().error.take() {
        return Err(error);
    }
    let results = results.into_iter().collect::<Result<Vec<_>, _>>()?;
    let forwarded = reducer.forwarded.into_inner();
    let reduced = match forwarded {
        true => None,
        false => Some(stream.into_reduced()?),
    };
    Ok((results, reduced))
}

/// How a complete bucket is reduce-scattered.
pub(super) trait BucketVia {
    /// Reduce-scatters bucket `b` of `plan` (its summed gradients `parts`, the vote `stop`):
    /// this rank's pieces of it, or `None` when another thread reduces it.
    fn reduce(
        &self,
        plan: &ShardPlan,
        b: usize,
        parts: Vec<Tensor>,
        stop: bool,
    ) -> Result<Option<ReducedBucket>, StepError>;
}

/// On this thread, which holds the communicator.
pub(super) struct Here<'a>(pub(super) &'a dyn Communicator);

impl BucketVia for Here<'_> {
    fn reduce(
        &self,
        plan: &ShardPlan,
        b: usize,
        parts: Vec<Tensor>,
        stop: bool,
    ) -> Result<Option<ReducedBucket>, StepError> {
        reduce_bucket(self.0, plan, b, parts, stop).map(Some)
    }
}

/// What the shards have handed over and the reduction has made of it, shared by the shards'
/// threads and the one that reduces.
struct Stream {
    state: Mutex<State>,
    /// Signalled when a bucket completes or a shard ends.
    changed: Condvar,
}

struct State {
    /// Each parameter's trainable position (`None`: frozen, its gradient dropped).
    position: Vec<Option<usize>>,
    /// By trainable position: the sum so far (earlier micro-batches'), and each shard's
    /// gradient once handed over (`Some(None)`: none), emptied when the sum is final.
    sums: Vec<Option<Tensor>>,
    arrived: Vec<Vec<Option<Option<Tensor>>>>,
    /// By bucket: its gradients not final yet.
    waiting: Vec<usize>,
    bucket_of: Vec<usize>,
    /// Buckets complete and not reduced yet, in the order they completed.
    ready: VecDeque<usize>,
    /// Shards, those ended, and whether one failed.
    parts: usize,
    ended: usize,
    failed: bool,
    /// What went wrong outside a shard's own error: a collective run from a shard's sink, a
    /// sum formed when a shard ended. The step's error, before the shard's.
    error: Option<StepError>,
    /// This rank's pieces, by position in the plan, and the vote.
    pieces: Vec<Option<Tensor>>,
    vote: Option<f32>,
}

impl Stream {
    fn new(params: &Params, plan: &ShardPlan, earlier: Vec<Option<Tensor>>, parts: usize) -> Self {
        let mut position = vec![None; params.len()];
        let mut sums = Vec::new();
        let mut earlier = earlier;
        for (t, (i, _)) in params.trainable().enumerate() {
            position[i] = Some(t);
            sums.push(earlier[i].take());
        }
        let mut bucket_of = vec![0; sums.len()];
        for (b, bucket) in plan.buckets.iter().enumerate() {
            bucket.tensors.clone().for_each(|t| bucket_of[t] = b);
        }
        let state = State {
            position,
            arrived: vec![vec![None; parts]; sums.len()],
            sums,
            waiting: plan.buckets.iter().map(|b| b.tensors.len()).collect(),
            bucket_of,
            ready: VecDeque::new(),
            parts,
            ended: 0,
            failed: false,
            error: None,
            pieces: vec![None; plan.pieces.len()],
            vote: None,
        };
        Stream {
            state: Mutex::new(state),
            changed: Condvar::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Shard `shard`'s gradient of parameter `index`.
    fn arrive(&self, shard: usize, index: usize, grad: Option<Tensor>) -> candle_core::Result<()> {
        let mut state = self.lock();
        let Some(Some(t)) = state.position.get(index).copied() else {
            return Ok(()); // frozen: never averaged
        };
        // Already here, or already summed (its arrivals taken).
        if !matches!(state.arrived[t].get(shard), Some(None)) {
            candle_core::bail!("a training pass handed over parameter {index}'s gradient twice");
        }
        state.arrived[t][shard] = Some(grad);
        if state.arrived[t].iter().all(Option::is_some) {
            self.finalize(&mut state, t)?;
        }
        Ok(())
    }

    /// Sums gradient `t` in shard order onto the earlier micro-batches', and queues its bucket
    /// if that completes it.
    fn finalize(&self, state: &mut State, t: usize) -> candle_core::Result<()> {
        let mut sum = [state.sums[t].take()];
        for grad in std::mem::take(&mut state.arrived[t]) {
            accumulate(&mut sum, vec![grad.flatten()])?;
        }
        let [sum] = sum;
        state.sums[t] = sum;
        let b = state.bucket_of[t];
        state.waiting[b] -= 1;
        if state.waiting[b] == 0 {
            state.ready.push_back(b);
            self.changed.notify_all();
        }
        Ok(())
    }

    /// Shard `shard`'s pass has ended: what it did not hand over it has no gradient for.
    fn end_shard(&self, shard: usize, ok: bool) {
        let mut state = self.lock();
        state.ended += 1;
        state.failed |= !ok;
        if ok {
            for t in 0..state.arrived.len() {
                // Final already (its arrivals taken), or handed over by this shard.
                if state.arrived[t].is_empty() || state.arrived[t][shard].is_some() {
                    continue;
                }
                state.arrived[t][shard] = Some(None);
                if state.arrived[t].iter().all(Option::is_some)
                    && let Err(e) = self.finalize(&mut state, t)
                {
                    state.error.get_or_insert(e.into());
                    state.failed = true;
                }
            }
        }
        self.changed.notify_all();
    }

    /// The pieces, once every bucket is reduced.
    fn into_reduced(self) -> Result<Reduced, StepError> {
        let state = self.state.into_inner().unwrap_or_else(|e| e.into_inner());
        let pieces = state.pieces.into_iter().collect::<Option<Vec<_>>>();
        let unreduced = || {
            candle_core::Error::Msg(format!(
                "sharding = \"gradients\": {} bucket(s) never completed",
                state.waiting.iter().filter(|&&w| w > 0).count()
            ))
        };
        Ok((pieces.ok_or_else(unreduced)?, state.vote))
    }
}

/// Reduces the stream's complete buckets, on the thread that runs the step (which alone may
/// use the communicator, or hands them to the one that does).
struct Reducer<'s, 'a, V> {
    via: &'a V,
    plan: &'a ShardPlan,
    stop: bool,
    stream: &'s Stream,
    /// The trainable parameters (a missing gradient is their shape's zeros).
    vars: Vec<&'a candle_core::Var>,
    /// Whether a bucket went to another thread.
    forwarded: AtomicBool,
}

impl<V: BucketVia> Reducer<'_, '_, V> {
    /// Reduces the buckets complete so far, in the order they completed.
    fn reduce_ready(&self) -> Result<(), StepError> {
        loop {
            let next = self.stream.lock().ready.pop_front();
            match next {
                Some(b) => self.reduce(b)?,
                None => return Ok(()),
            }
        }
    }

    /// Reduces buckets as they complete until every shard has ended and every bucket is
    /// reduced; stops at once if a shard failed (its error is the step's).
    fn reduce_until_ended(&self) -> Result<(), StepError> {
        loop {
            let next = {
                let mut state = self.stream.lock();
                loop {
                    if state.failed {
                        return Ok(());
                    }
                    if let Some(b) = state.ready.pop_front() {
                        break Some(b);
                    }
                    if state.ended == state.parts {
                        break None;
                    }
                    state = self
                        .stream
                        .changed
                        .wait(state)
                        .unwrap_or_else(|e| e.into_inner());
                }
            };
            match next {
                Some(b) => self.reduce(b)?,
                None => return Ok(()),
            }
        }
    }

    /// Reduce-scatters bucket `b`, whose gradients are all final.
    fn reduce(&self, b: usize) -> Result<(), StepError> {
        let parts = {
            let mut state = self.stream.lock();
            self.plan.buckets[b]
                .tensors
                .clone()
                .map(|t| state.sums[t].take())
                .collect::<Vec<_>>()
        };
        let parts = self.plan.buckets[b]
            .tensors
            .clone()
            .zip(parts)
            .map(|(t, g)| g.map_or_else(|| self.vars[t].zeros_like(), Ok))
            .collect::<candle_core::Result<Vec<_>>>()?;
        let Some(reduced) = self.via.reduce(self.plan, b, parts, self.stop)? else {
            self.forwarded.store(true, Ordering::Relaxed);
            return Ok(());
        };
        let mut state = self.stream.lock();
        for (k, piece) in reduced.pieces {
            state.pieces[k] = Some(piece);
        }
        state.vote = state.vote.or(reduced.vote);
        Ok(())
    }
}

/// Tells the stream, when dropped, that its shard's pass has ended, and whether well.
struct Ending<'s> {
    stream: &'s Stream,
    shard: usize,
    ok: bool,
}

impl Drop for Ending<'_> {
    fn drop(&mut self) {
        self.stream.end_shard(self.shard, self.ok);
    }
}

/// A shard's sink: hands each gradient to the stream; with the `reducer` (the only shard, on
/// the step's thread), reduces each bucket it completes at once.
struct ShardSink<'s, 'r, 'a, V> {
    stream: &'s Stream,
    shard: usize,
    reducer: Option<&'r Reducer<'s, 'a, V>>,
}

impl<V: BucketVia> GradientSink for ShardSink<'_, '_, '_, V> {
    fn put(&mut self, index: usize, grad: Option<Tensor>) -> candle_core::Result<()> {
        self.stream.arrive(self.shard, index, grad)?;
        if let Some(reducer) = self.reducer
            && let Err(e) = reducer.reduce_ready()
        {
            // Kept whole (a collective's error says which rank and collective) for the step
            // to return; the pass only needs to stop.
            let said = e.to_string();
            self.stream.lock().error.get_or_insert(e);
            candle_core::bail!("{said}");
        }
        Ok(())
    }
}
