//! Data parallelism inside one CPU worker: each micro-batch is cut into row shards that run
//! forward and backward side by side, one thread each, with single-threaded kernels.
//!
//! Splitting every matrix product and element-wise op over the threads (intra-op parallelism)
//! costs a synchronisation per op; a small model's ops are too short for that to pay (a GPT of
//! 128 channels ran 1.25× faster on 2 threads than on 1). Shards synchronise once per
//! micro-batch, as the workers of a job do once per step.

use std::ops::Range;
use std::sync::{Mutex, OnceLock};

use candle_core::Device;

use rayon::{ThreadPool, ThreadPoolBuilder};

/// One single-threaded rayon pool per shard: inside a shard, `rayon::current_num_threads()` is
/// 1, so the kernels run their work inline instead of splitting it again.
pub struct ShardPool {
    pools: Vec<ThreadPool>,
}

impl ShardPool {
    /// The process's pool for steps on `device`: one shard per thread of rayon's global pool
    /// (the worker's share of the cores) on the CPU; none on an accelerator, or with 1 thread.
    pub fn for_device(device: &Device) -> Option<&'static ShardPool> {
        static POOL: OnceLock<Option<ShardPool>> = OnceLock::new();
        match device {
            Device::Cpu => POOL
                .get_or_init(|| ShardPool::new(rayon::current_num_threads()))
                .as_ref(),
            _ => None,
        }
    }

    /// Pools for `threads` shards; `None` below 2 threads (nothing to run side by side) or
    /// when the threads cannot be started (the step then runs unsharded).
    pub fn new(threads: usize) -> Option<ShardPool> {
        if threads < 2 {
            return None;
        }
        let pools = (0..threads)
            .map(|i| {
                ThreadPoolBuilder::new()
                    .num_threads(1)
                    .thread_name(move |_| format!("ddpjob-shard-{i}"))
                    .build()
                    .ok()
            })
            .collect::<Option<Vec<_>>>()?;
        Some(ShardPool { pools })
    }

    /// The pools, one per shard.
    pub fn pools(&self) -> impl Iterator<Item = &ThreadPool> {
        self.pools.iter()
    }

    /// The shards `rows` rows are cut into: as many as there are threads (at most one per
    /// row), contiguous, the first ones one row longer when they do not divide evenly.
    pub fn split(&self, rows: usize) -> Vec<Range<usize>> {
        let parts = self.pools.len().min(rows).max(1);
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

    /// Runs `f(0..parts)` side by side, shard i on pool i, and returns the results in order.
    /// A panic in a shard is re-raised here.
    pub fn run<R: Send>(&self, parts: usize, f: impl Fn(usize) -> R + Sync) -> Vec<R> {
        assert!(
            parts <= self.pools.len(),
            "{parts} shards, {} pools",
            self.pools.len()
        );
        let slots: Vec<Mutex<Option<R>>> = (0..parts).map(|_| Mutex::new(None)).collect();
        let work = |i: usize| {
            let r = f(i);
            *slots[i].lock().unwrap_or_else(|e| e.into_inner()) = Some(r);
        };
        run_from(&self.pools[..parts], 0, &work);
        slots
            .into_iter()
            .map(|s| {
                s.into_inner()
                    .unwrap_or_else(|e| e.into_inner())
                    .expect("every shard ran")
            })
            .collect()
    }
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

/// Hands shard `first` to `pools[0]`, `first + 1` to `pools[1]`, ..., and returns when all are
/// done; the calling thread only waits.
fn run_from(pools: &[ThreadPool], first: usize, work: &(dyn Fn(usize) + Sync)) {
    match pools {
        [] => {}
        [last] => last.install(|| work(first)),
        [head, rest @ ..] => head.in_place_scope(|scope| {
            scope.spawn(move |_| work(first));
            run_from(rest, first + 1, work);
        }),
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
    fn runs_every_shard_on_its_own_single_threaded_pool() {
        let pool = ShardPool::new(3).unwrap();
        let seen = pool.run(3, |i| {
            let name = std::thread::current().name().map(str::to_owned);
            (i, rayon::current_num_threads(), name)
        });
        for (i, (shard, threads, name)) in seen.into_iter().enumerate() {
            assert_eq!((shard, threads), (i, 1));
            assert_eq!(name.as_deref(), Some(format!("ddpjob-shard-{i}").as_str()));
        }
        assert_eq!(pool.run(2, |i| i * 10), vec![0, 10]);
    }
}
