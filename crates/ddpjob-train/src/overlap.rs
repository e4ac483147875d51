//! `distributed.sharding = "full"` with its collectives overlapping the passes
//! (`distributed.overlap_comm`, as DeepSpeed's; FSDP's forward and backward prefetch). While
//! a training step's passes run, a thread of the step's own, lent the communicator, answers
//! what they ask in the order they ask it: a unit's parameters (gathered), a unit let go, a
//! bucket of gradients complete (reduce-scattered). Having answered a block's gather, it
//! gathers the block the passes will ask for next (the one above in a forward, below in a
//! backward) while they compute with the first, and posts that answer ahead, so the passes
//! need not wait for the reductions queued before their next ask. The backward hands its
//! buckets over without waiting, up to [`BUCKETS_IN_FLIGHT`] not yet reduced.
//!
//! The collectives run in the order the requests came, each gather followed by its
//! prefetch: the passes' own order, the same on every rank, so they match across ranks as
//! the inline ones do, and the values are the same bit for bit.
//!
//! The passes stay on the step's thread: with one thread a worker, that thread is the
//! kernels' rayon pool (see `shards::start_global_pool`). So the collectives' thread must make
//! no rayon call (the pool would run it only once the passes wait inside it, which they never
//! do): it only copies, moves bytes and sums them in the ring's own loops.
//!
//! What it buys is the collectives' waiting on a network. It costs a core's share where the
//! passes already fill every core, and memory: three blocks gathered at once, buckets waiting,
//! and what the allocator keeps apart for the second thread (measured in docs/src/sharding.md).
//! Only on the CPU: on a GPU, collectives and kernels go into the worker's one stream in order, so a
//! thread of their own would buy nothing; they stay inline there.

use std::collections::VecDeque;
use std::sync::{Condvar, Mutex, MutexGuard, mpsc};

use candle_core::Tensor;

use super::full::{Sharded, Units};
use super::sharded::{ReducedBucket, reduce_bucket};
use super::step::StepError;
use super::streamed::{BucketVia, Reduced};
use crate::models::Params;
use crate::models::gate::{self, BlockGate, Unit};
use crate::optim::Optimizer;
use ddpjob_comm::Communicator;
use ddpjob_comm::buckets::ShardPlan;

/// What a pass asks of the step's thread.
enum Request {
    /// The unit's parameters (the passes' gathers are numbered from 0, the answers on the
    /// [`Board`] by that number).
    Gather(Unit),
    Release(Unit),
    /// A bucket complete: its summed gradients, in order.
    Reduce {
        bucket: usize,
        parts: Vec<Tensor>,
    },
}

/// Buckets handed over and not reduced yet, at most: the backward waits for the oldest
/// beyond that, so the gradients waiting stay bounded however far the collectives lag.
const BUCKETS_IN_FLIGHT: usize = 2;

/// How the passes reach the collectives' thread.
pub(super) struct Courier {
    requests: mpsc::Sender<Request>,
    /// One message per bucket reduced.
    reduced: mpsc::Receiver<()>,
    in_flight: std::cell::Cell<usize>,
}

impl Courier {
    fn send(&self, request: Request) -> candle_core::Result<()> {
        self.requests.send(request).map_err(|_| stopped())
    }
}

fn stopped() -> candle_core::Error {
    candle_core::Error::Msg("sharding = \"full\": the step's thread stopped answering".into())
}

impl BucketVia for Courier {
    fn reduce(
        &self,
        _: &ShardPlan,
        bucket: usize,
        parts: Vec<Tensor>,
        _: bool,
    ) -> Result<Option<ReducedBucket>, StepError> {
        while self.in_flight.get() >= BUCKETS_IN_FLIGHT {
            self.reduced.recv().map_err(|_| stopped())?;
            self.in_flight.set(self.in_flight.get() - 1);
        }
        self.send(Request::Reduce { bucket, parts })?;
        self.in_flight.set(self.in_flight.get() + 1);
        Ok(None)
    }
}

/// Where the collectives' thread answers the passes' gathers.
#[derive(Default)]
struct Board {
    state: Mutex<Answers>,
    changed: Condvar,
}

#[derive(Default)]
struct Answers {
    /// `(n, unit)`: the passes' gather number n, if it asks for `unit`, has its answer
    /// already: the unit was gathered ahead, after gather n - 1 was answered (so after
    /// every request before it), from released (so no release of it can be queued since).
    ahead: Option<(usize, Unit)>,
    /// Answers by gather number, in order, those not taken yet.
    answered: VecDeque<(usize, Result<(), String>)>,
    /// The collectives' thread is done: no more answers.
    closed: bool,
}

impl Board {
    fn lock(&self) -> MutexGuard<'_, Answers> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn post(&self, f: impl FnOnce(&mut Answers)) {
        f(&mut self.lock());
        self.changed.notify_all();
    }

    /// Waits for gather `n`'s answer (of `unit`).
    fn wait(&self, n: usize, unit: Unit) -> candle_core::Result<()> {
        let mut answers = self.lock();
        loop {
            if answers.ahead == Some((n, unit)) {
                answers.ahead = None;
                return Ok(());
            }
            // Answers to gathers answered ahead, left behind.
            while answers.answered.front().is_some_and(|&(k, _)| k < n) {
                answers.answered.pop_front();
            }
            if answers.answered.front().is_some_and(|&(k, _)| k == n) {
                let (_, answer) = answers.answered.pop_front().expect("just seen");
                return answer.map_err(candle_core::Error::Msg);
            }
            if answers.closed {
                return Err(stopped());
            }
            answers = self
                .changed
                .wait(answers)
                .unwrap_or_else(|e| e.into_inner());
        }
    }
}

/// Closes the board however the collectives' thread ends.
struct Closing<'b>(&'b Board);

impl Drop for Closing<'_> {
    fn drop(&mut self) {
        self.0.post(|answers| answers.closed = true);
    }
}

/// The passes' gate: each call carried to the collectives' thread, a gather waiting for its
/// answer (which a block gathered ahead has at once).
struct Forwarding<'c> {
    courier: &'c Courier,
    board: &'c Board,
    gathers: usize,
}

impl BlockGate for Forwarding<'_> {
    fn gather(&mut self, unit: Unit) -> candle_core::Result<()> {
        let n = self.gathers;
        self.gathers += 1;
        self.courier.send(Request::Gather(unit))?;
        self.board.wait(n, unit)
    }

    fn release(&mut self, unit: Unit) -> candle_core::Result<()> {
        self.courier.send(Request::Release(unit))
    }
}

/// Runs `passes` here with the trainable parameters of `params` sharded as `units` and
/// `optimizer` say, their gates answered by a thread lent `comm`, which also reduce-scatters
/// the buckets of `plan` they hand over (the vote `stop` riding the last). Gives what `passes`
/// gave and this rank's pieces of the buckets reduced (`None` when none was handed over); a
/// failure of the collectives' thread before the passes' own error.
pub(super) fn overlapped<R>(
    comm: &(dyn Communicator + Sync),
    (optimizer, params, units): (&Optimizer, &Params, &Units),
    (plan, stop): (Option<&ShardPlan>, bool),
    passes: impl FnOnce(&Courier) -> R,
) -> Result<(R, Option<Reduced>), StepError> {
    let (requests, arriving) = mpsc::channel();
    let (reduced, reductions) = mpsc::channel();
    let board = Board::default();
    std::thread::scope(|scope| {
        let board = &board;
        let serving = scope.spawn(move || {
            let _closing = Closing(board);
            let sharded = Sharded::new(comm, optimizer, params, units, false)?;
            let mut server = Server {
                blocks: sharded.blocks(),
                sharded,
                comm,
                plan,
                stop,
                last_block: None,
                broken: None,
                pieces: vec![None; plan.map_or(0, |p| p.pieces.len())],
                vote: None,
                reduced_any: false,
                reduced,
                board,
                gathers: 0,
            };
            // Ends when the passes are done (the courier dropped), however they end.
            for request in arriving {
                server.serve(request);
            }
            server.finish()
        });
        let courier = Courier {
            requests,
            reduced: reductions,
            in_flight: std::cell::Cell::new(0),
        };
        let mut forwarding = Forwarding {
            courier: &courier,
            board,
            gathers: 0,
        };
        let ran = gate::run_with(&mut forwarding, || passes(&courier));
        drop(courier);
        let served = serving
            .join()
            .unwrap_or_else(|panic| std::panic::resume_unwind(panic))?;
        Ok((ran, served))
    })
}

/// The collectives' thread's side: answers requests in order, gathering ahead.
struct Server<'a> {
    sharded: Sharded<'a>,
    comm: &'a dyn Communicator,
    blocks: usize,
    plan: Option<&'a ShardPlan>,
    stop: bool,
    /// The block gathered last (`None` at a pass's start, when the rest is gathered): a
    /// block above it is a forward's, at or below it a backward's.
    last_block: Option<usize>,
    /// The first failure's message: every later gather is answered with it, and no further
    /// collective runs (the failure itself is in `sharded.error`).
    broken: Option<String>,
    pieces: Vec<Option<Tensor>>,
    vote: Option<f32>,
    reduced_any: bool,
    /// Tells the passes of each bucket reduced (or given up on).
    reduced: mpsc::Sender<()>,
    board: &'a Board,
    /// Gathers answered so far.
    gathers: usize,
}

impl Server<'_> {
    fn serve(&mut self, request: Request) {
        match request {
            Request::Gather(unit) => {
                let n = self.gathers;
                self.gathers += 1;
                let gathered = self.gather(unit);
                let ok = gathered.is_ok();
                self.board
                    .post(|answers| answers.answered.push_back((n, gathered)));
                if ok && let Some(next) = self.gather_ahead(unit) {
                    self.board
                        .post(|answers| answers.ahead = Some((n + 1, Unit::Block(next))));
                }
            }
            Request::Release(unit) => {
                if let Err(e) = self.sharded.answer(unit, true) {
                    self.fail(e.into());
                }
            }
            Request::Reduce { bucket, parts } => self.reduce(bucket, parts),
        }
    }

    fn gather(&mut self, unit: Unit) -> Result<(), String> {
        if let Some(said) = &self.broken {
            return Err(said.clone());
        }
        self.sharded.answer(unit, false).map_err(|e| {
            let said = e.to_string();
            self.fail(e.into());
            said
        })
    }

    /// Gathers the block the passes will ask for after `unit`, if it is a block and one
    /// follows in its direction: which, when this gathered it (a failure is answered to the
    /// next gather).
    fn gather_ahead(&mut self, unit: Unit) -> Option<usize> {
        let Unit::Block(i) = unit else {
            self.last_block = None;
            return None;
        };
        let next = block_ahead(self.last_block.replace(i), i, self.blocks)?;
        // One still held from an earlier gather may have its release queued already (after
        // this gather's request): its answer then waits for its turn, after that release.
        if self.sharded.holds(Unit::Block(next)) {
            return None;
        }
        self.gather(Unit::Block(next)).ok().map(|()| next)
    }

    fn reduce(&mut self, bucket: usize, parts: Vec<Tensor>) {
        self.reduce_now(bucket, parts);
        // The passes may have failed and gone meanwhile: nobody to tell then.
        let _ = self.reduced.send(());
    }

    fn reduce_now(&mut self, bucket: usize, parts: Vec<Tensor>) {
        let Some(plan) = self.plan.filter(|_| self.broken.is_none()) else {
            return;
        };
        self.reduced_any = true;
        match reduce_bucket(self.comm, plan, bucket, parts, self.stop) {
            Ok(reduced) => {
                for (k, piece) in reduced.pieces {
                    self.pieces[k] = Some(piece);
                }
                self.vote = self.vote.or(reduced.vote);
            }
            Err(e) => self.fail(e),
        }
    }

    /// The first failure is the step's (a collective's whole, as `answer` kept it); no
    /// collective runs after it.
    fn fail(&mut self, e: StepError) {
        if self.broken.is_none() {
            self.broken = Some(e.to_string());
        }
        self.sharded.error.get_or_insert(e);
    }

    /// Every parameter let go again, and this rank's pieces of the buckets reduced; or the
    /// first failure.
    fn finish(mut self) -> Result<Option<Reduced>, StepError> {
        if let Some(e) = self.sharded.error.take() {
            return Err(e);
        }
        self.sharded.release_all()?;
        if !self.reduced_any {
            return Ok(None);
        }
        let missing = self.pieces.iter().filter(|p| p.is_none()).count();
        match self.pieces.into_iter().collect::<Option<Vec<_>>>() {
            Some(pieces) => Ok(Some((pieces, self.vote))),
            None => Err(candle_core::Error::Msg(format!(
                "sharding = \"full\": {missing} piece(s) of the gradients never reduced"
            ))
            .into()),
        }
    }
}

/// The block a pass asks for after block `i` of `blocks`, `last` having been asked for
/// before it (`None`: `i` is the pass's first): the one above in a forward, below in a
/// backward (which starts at the forward's last block again).
fn block_ahead(last: Option<usize>, i: usize, blocks: usize) -> Option<usize> {
    match last {
        Some(last) if last >= i => i.checked_sub(1),
        _ => Some(i + 1).filter(|&next| next < blocks),
    }
}

#[cfg(test)]
mod tests {
    use super::block_ahead;

    /// A layered pass over 3 blocks asks 0 1 2 (forward), then 2 1 0 (backward): each ask
    /// but the two turns' is foreseen, and nothing past either end.
    #[test]
    fn the_block_ahead_follows_the_pass_up_then_down() {
        let asked = [0, 1, 2, 2, 1, 0];
        let mut last = None;
        let mut ahead = Vec::new();
        for i in asked {
            ahead.push(block_ahead(last, i, 3));
            last = Some(i);
        }
        assert_eq!(ahead, [Some(1), Some(2), None, Some(1), Some(0), None]);
        // The next micro-batch's forward (asking for the rest first resets `last`).
        assert_eq!(block_ahead(None, 0, 3), Some(1));
        assert_eq!(block_ahead(None, 0, 1), None, "one block: nothing ahead");
    }
}
