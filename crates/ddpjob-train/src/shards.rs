//! Data parallelism inside one CPU worker: each micro-batch is cut into row shards that run
//! forward and backward side by side, one per thread of rayon's global pool.
//!
//! Splitting every matrix product and element-wise op over the threads (intra-op parallelism)
//! costs a synchronisation per op; a small model's ops are too short for that to pay (a GPT of
//! 128 channels ran 1.25× faster on 2 threads than on 1). Shards synchronise once per
//! micro-batch, as the workers of a job do once per step. Inside a shard the kernels still cut
//! their loops for the pool's threads, but a thread runs its own pieces unless another thread
//! is idle: a shard that finishes first then takes work from the one still running, instead of
//! waiting for it (the pieces are fixed by the thread count, never by timing, so the sums are
//! the same whoever runs them).

use std::ops::Range;
use std::sync::{Mutex, OnceLock};

use candle_core::Device;

use rayon::ThreadPoolBuilder;

/// How a micro-batch's rows are cut into shards, and the pool that runs them: rayon's global
/// pool (the kernels' own, so a worker has one set of threads; separate shard threads measured
/// 5–8% slower, their idle spinning taking cores from the other set's work).
#[derive(Debug)]
pub struct ShardPool {
    shards: usize,
}

impl ShardPool {
    /// The process's shards for steps on `device`: one per thread of rayon's global pool (the
    /// worker's share of the cores) on the CPU; none on an accelerator, or with 1 thread.
    pub fn for_device(device: &Device) -> Option<&'static ShardPool> {
        static POOL: OnceLock<Option<ShardPool>> = OnceLock::new();
        match device {
            Device::Cpu => POOL
                .get_or_init(|| ShardPool::new(rayon::current_num_threads()))
                .as_ref(),
            _ => None,
        }
    }

    /// `shards` shards on the global pool; `None` below 2 (nothing to run side by side).
    pub fn new(shards: usize) -> Option<ShardPool> {
        (shards >= 2).then_some(ShardPool { shards })
    }

    /// The shards `rows` rows are cut into: as many as there are threads (at most one per
    /// row), contiguous, the first ones one row longer when they do not divide evenly.
    pub fn split(&self, rows: usize) -> Vec<Range<usize>> {
        let parts = self.shards.min(rows).max(1);
        let mut start = 0;
        (0..parts)
            .map(|part| {
                let end = start + (rows - start).div_ceil(parts - part);
                let range = start..end;
                start = end;
                range
            })
            .collect()
    }

    /// Runs `f(0..parts)` side by side on the current rayon pool (the global one, outside any
    /// pool), shard i on its thread i (and i + n, i + 2n, ... when there are more shards than
    /// its n threads), and returns the results in order. A panic in a shard is re-raised here,
    /// once every shard has ended.
    pub fn run<R: Send>(&self, parts: usize, f: impl Fn(usize) -> R + Sync) -> Vec<R> {
        side_by_side(parts, |_, i| f(i))
    }
}

/// `f(thread, i)` for i in 0..parts on the current rayon pool's threads (the global one,
/// outside any pool), part i on thread i mod n, the results in order. A panic in a part is
/// re-raised here, once every part has ended.
pub(crate) fn side_by_side<R: Send>(parts: usize, f: impl Fn(usize, usize) -> R + Sync) -> Vec<R> {
    let slots: Vec<Mutex<Option<R>>> = (0..parts).map(|_| Mutex::new(None)).collect();
    let work = |ctx: rayon::BroadcastContext<'_>| {
        for i in (ctx.index()..parts).step_by(ctx.num_threads()) {
            let r = f(ctx.index(), i);
            *slots[i].lock().unwrap_or_else(|e| e.into_inner()) = Some(r);
        }
    };
    rayon::broadcast(work);
    slots
        .into_iter()
        .map(|s| {
            s.into_inner()
                .unwrap_or_else(|e| e.into_inner())
                .expect("every part ran")
        })
        .collect()
}

/// Starts rayon's global pool, which the kernels' parallel loops use, with `threads` threads
/// (`None`: `RAYON_NUM_THREADS`, which the launcher sets, else one per core, as rayon would).
/// With one thread, the calling thread is made the pool's thread: its parallel loops then run
/// on it, instead of being handed to a pool thread while it sleeps, a wake-up and a switch
/// per loop, with that thread spinning between loops beside the job's other workers
/// (measured: a GPT step on one thread 107, 107, 94 → 85, 87, 69 ms). Called once, before
/// anything else uses rayon, from the thread that runs the training loop. (No other thread of
/// a worker uses the global pool, which with one thread only runs when this one is inside it.)
pub fn start_global_pool(threads: Option<usize>) -> Result<(), rayon::ThreadPoolBuildError> {
    let from_env = || {
        std::env::var("RAYON_NUM_THREADS")
            .ok()
            .and_then(|v| v.trim().parse::<usize>().ok())
            .filter(|&n| n > 0)
    };
    let threads = threads.or_else(from_env).unwrap_or_else(|| {
        std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get)
    });
    pool_builder(threads).build_global()
}

/// A pool of `threads`; with one, the calling thread is it (see [`start_global_pool`]).
fn pool_builder(threads: usize) -> ThreadPoolBuilder {
    let builder = ThreadPoolBuilder::new().num_threads(threads.max(1));
    match threads {
        0 | 1 => builder.use_current_thread(),
        _ => builder,
    }
}

/// The shards of `rows` rows: [`ShardPool::split`], or all rows in one without a pool.
pub fn ranges(pool: Option<&ShardPool>, rows: usize) -> Vec<Range<usize>> {
    match pool {
        Some(pool) => pool.split(rows),
        None => std::iter::once(0..rows).collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_rows_evenly_and_never_into_empty_shards() {
        let pool = ShardPool::new(3).unwrap();
        assert_eq!(pool.split(7), vec![0..3, 3..5, 5..7]);
        assert_eq!(pool.split(2), vec![0..1, 1..2]);
        assert_eq!(pool.split(0), vec![0..0]);
        assert!(ShardPool::new(1).is_none());
    }

    #[test]
    fn a_one_thread_pool_runs_parallel_loops_on_the_thread_that_started_it() {
        use rayon::prelude::*;
        std::thread::spawn(|| {
            // Leaks the pool (rayon cannot unregister a thread yet); this test thread ends here.
            pool_builder(1).build().unwrap();
            assert_eq!(
                (rayon::current_thread_index(), rayon::current_num_threads()),
                (Some(0), 1)
            );
            let me = std::thread::current().id();
            let ran_on: Vec<_> = (0..64)
                .into_par_iter()
                .map(|_| std::thread::current().id())
                .collect();
            assert!(ran_on.iter().all(|&id| id == me));
        })
        .join()
        .unwrap();
        std::thread::spawn(|| {
            let pool = pool_builder(2).build().unwrap();
            assert_eq!(pool.current_num_threads(), 2);
            assert_eq!(
                rayon::current_thread_index(),
                None,
                "the caller stays outside"
            );
        })
        .join()
        .unwrap();
    }

    #[test]
    fn runs_shard_i_on_thread_i_and_returns_the_results_in_order() {
        let pool = pool_builder(3).build().unwrap();
        let shards = ShardPool::new(3).unwrap();
        let seen = pool.install(|| shards.run(3, |i| (i, rayon::current_thread_index())));
        assert_eq!(seen, vec![(0, Some(0)), (1, Some(1)), (2, Some(2))]);
        // More shards than threads: thread i also runs i + 3, i + 6.
        let seen = pool.install(|| shards.run(7, |i| (i, rayon::current_thread_index())));
        let expected: Vec<_> = (0..7).map(|i| (i, Some(i % 3))).collect();
        assert_eq!(seen, expected);
        // Fewer: the other threads have nothing to do.
        assert_eq!(pool.install(|| shards.run(2, |i| i * 10)), vec![0, 10]);
    }

    #[test]
    fn a_panicking_shard_panics_the_caller_after_the_others_end() {
        let pool = pool_builder(2).build().unwrap();
        let shards = ShardPool::new(2).unwrap();
        let finished = std::sync::atomic::AtomicBool::new(false);
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            pool.install(|| {
                shards.run(2, |i| {
                    if i == 0 {
                        panic!("shard 0 failed");
                    }
                    std::thread::sleep(std::time::Duration::from_millis(50));
                    finished.store(true, std::sync::atomic::Ordering::SeqCst);
                })
            })
        }));
        assert!(outcome.is_err());
        assert!(finished.load(std::sync::atomic::Ordering::SeqCst));
    }
}
