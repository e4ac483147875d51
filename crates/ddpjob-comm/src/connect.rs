//! Backends built by name from the rendezvous: the worker says which collectives it wants
//! (`local`, `tcp`, `nccl`) and hands over the job's [`Rendezvous`]; each backend joins through
//! the store keys it owns (the tcp ring's addresses, the NCCL id), so no caller builds a backend
//! itself and no `cfg` on the GPU build leaves this crate. A build without GPU workers knows
//! the name `nccl` and says how to get it.

use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use candle_core::Device;
use ddpjob_store::StoreClient;

use crate::heartbeat::Beacon;
use crate::watchdog::Verdict;
use crate::{CommError, Communicator, Exercised, LocalCommunicator, TcpCommunicator, spin_for};

/// What a backend needs to join the job's collectives: the store, this rank's place, and how
/// long a peer may keep the others waiting.
pub struct Rendezvous<'a> {
    /// The job's rendezvous store, hosted by node 0's launcher.
    pub store: &'a StoreClient,
    /// The job's token (the ring's sockets check it).
    pub token: &'a str,
    pub rank: usize,
    pub world_size: usize,
    /// Workers on this node (their spin before sleeping, and messages naming a rank's node).
    pub local_world_size: usize,
    /// The restart attempt: each forms its communicator anew (NCCL's id is per attempt).
    pub attempt: usize,
    /// `distributed.timeout_s`: a collective that waits longer fails, naming who never came.
    pub timeout: Duration,
    /// Where this rank is, for the heartbeats and hang diagnosis.
    pub beacon: Arc<Beacon>,
}

/// How a backend is to run beyond the rendezvous.
pub struct Options<'a> {
    /// The worker's device: NCCL's GPU; the CPU for the others.
    pub device: &'a Device,
    /// A single rank still runs its collectives (`distributed.collectives = "always"`): the
    /// buckets and broadcasts of a multi-rank job, through the identity on the CPU.
    pub always: bool,
    /// The tcp ring also joins its butterfly partners, for world-size-invariant sums.
    pub tree: bool,
    /// What NCCL's watchdog reports (the failure record) when a collective hangs or fails,
    /// before it aborts the communicator and ends this process.
    pub on_nccl_failure: Box<dyn FnOnce(&Verdict) + Send + 'static>,
}

/// The backends a job may name, in `distributed.backend`'s words (`auto` picks one of them).
pub const BACKENDS: &[&str] = &["local", "tcp", "nccl"];

/// Where a rank runs, for [`choose`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Placement {
    /// On a GPU (not the CPU).
    pub gpu: bool,
    pub world_size: usize,
    /// A single rank still runs its collectives (`distributed.collectives = "always"`).
    pub always: bool,
}

/// The backend a rank joins when the job asks for `requested` (`auto`, or one of
/// [`BACKENDS`]): NCCL between GPUs unless `tcp` is asked for (on a single GPU only when its
/// collectives run anyway or `nccl` is named), nothing to connect for a single rank otherwise
/// (`local`), the tcp ring between CPU workers. Every backend's placement is decided here, so
/// the worker holds no test of its own.
pub fn choose(requested: &str, at: Placement) -> &'static str {
    let alone = at.world_size == 1;
    if at.gpu && requested != "tcp" && (!alone || at.always || requested == "nccl") {
        "nccl"
    } else if alone {
        "local"
    } else {
        "tcp"
    }
}

/// This rank's collectives through the backend `name` (one of [`BACKENDS`]).
pub fn connect(
    name: &str,
    rv: &Rendezvous<'_>,
    options: Options<'_>,
) -> Result<Box<dyn Communicator>, CommError> {
    let exercised = rv.world_size == 1 && options.always;
    match name {
        "local" if exercised => Ok(Box::new(Exercised(LocalCommunicator))),
        "local" => Ok(Box::new(LocalCommunicator)),
        "tcp" => {
            let bind = rv.store.local_addr().ip();
            Ok(Box::new(join_tcp(rv, bind, options.tree)?))
        }
        "nccl" => nccl(rv, options, exercised),
        other => Err(CommError::Setup {
            rank: rv.rank,
            problem: format!(
                "no collectives backend is named \"{other}\"; there are {}",
                BACKENDS.join(", ")
            ),
        }),
    }
}

/// The tcp ring between CPU workers (with its butterfly partners when `tree`), listening on
/// `bind`: what [`connect`] builds for `tcp`.
fn join_tcp(rv: &Rendezvous<'_>, bind: IpAddr, tree: bool) -> Result<TcpCommunicator, CommError> {
    let spin = spin_for(rv.local_world_size);
    let ring = TcpCommunicator::connect(
        rv.store,
        rv.token,
        rv.rank,
        rv.world_size,
        bind,
        rv.timeout,
        spin,
    )?
    .with_beacon(rv.beacon.clone())
    .with_ranks_per_node(rv.local_world_size);
    match tree {
        true => ring.with_tree(rv.store, rv.token, bind, spin),
        false => Ok(ring),
    }
}

/// NCCL between GPU workers; a single rank's exercised when `exercised`.
#[cfg(feature = "cuda")]
fn nccl(
    rv: &Rendezvous<'_>,
    options: Options<'_>,
    exercised: bool,
) -> Result<Box<dyn Communicator>, CommError> {
    let comm = join_nccl(rv, options.device, options.on_nccl_failure)?;
    match exercised {
        true => Ok(Box::new(Exercised(comm))),
        false => Ok(Box::new(comm)),
    }
}

#[cfg(not(feature = "cuda"))]
fn nccl(rv: &Rendezvous<'_>, _: Options<'_>, _: bool) -> Result<Box<dyn Communicator>, CommError> {
    Err(CommError::Setup {
        rank: rv.rank,
        problem: "the nccl backend needs GPU workers, which this ddpjob was built without; \
                  build it with `cargo build --release --features cuda`"
            .into(),
    })
}

/// NCCL on `device` (a GPU), every rank joining together: what [`connect`] builds for `nccl`.
/// A collective still queued after the rendezvous' timeout goes to `report`, then the
/// communicator is aborted and the process ends (exit status 1).
#[cfg(feature = "cuda")]
fn join_nccl(
    rv: &Rendezvous<'_>,
    device: &Device,
    report: impl FnOnce(&Verdict) + Send + 'static,
) -> Result<crate::NcclCommunicator, CommError> {
    crate::NcclCommunicator::connect(
        rv.store,
        rv.rank,
        rv.world_size,
        rv.attempt,
        device,
        rv.timeout,
        rv.beacon.clone(),
        report,
        || std::process::exit(1),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn options(device: &Device) -> Options<'_> {
        Options {
            device,
            always: false,
            tree: false,
            on_nccl_failure: Box::new(|_| {}),
        }
    }

    fn rendezvous(store: &StoreClient, rank: usize, world: usize) -> Rendezvous<'_> {
        Rendezvous {
            store,
            token: "tok",
            rank,
            world_size: world,
            local_world_size: world,
            attempt: 0,
            timeout: Duration::from_secs(20),
            beacon: Arc::default(),
        }
    }

    #[test]
    fn the_backend_follows_the_device_the_world_and_what_is_asked_for() {
        let at = |gpu, world_size, always| Placement {
            gpu,
            world_size,
            always,
        };
        // CPU workers: nothing to connect alone, the ring between several, whatever is asked.
        for asked in ["auto", "tcp"] {
            assert_eq!(choose(asked, at(false, 1, false)), "local");
            assert_eq!(choose(asked, at(false, 4, false)), "tcp");
        }
        // GPUs: NCCL between several, or alone when its collectives run or it is named; the
        // ring between GPU workers when asked for.
        assert_eq!(choose("auto", at(true, 2, false)), "nccl");
        assert_eq!(choose("auto", at(true, 1, false)), "local");
        assert_eq!(choose("auto", at(true, 1, true)), "nccl");
        assert_eq!(choose("nccl", at(true, 1, false)), "nccl");
        assert_eq!(choose("tcp", at(true, 2, false)), "tcp");
        assert_eq!(choose("tcp", at(true, 1, true)), "local");
    }

    /// Every named backend over one real store: `local` alone, `tcp` between two ranks, and an
    /// unknown name refused with the names there are.
    #[test]
    fn backends_are_built_by_name_from_the_rendezvous() {
        let server =
            ddpjob_store::StoreServer::bind("127.0.0.1:0".parse().unwrap(), "tok").unwrap();
        let addr = server.addr().to_string();
        let addr = addr.as_str();
        let store = StoreClient::connect(addr, "tok", Duration::from_secs(5)).unwrap();
        let cpu = Device::Cpu;
        let local = connect("local", &rendezvous(&store, 0, 1), options(&cpu)).unwrap();
        assert!(local.skips_collectives());
        let exercised = Options {
            always: true,
            ..options(&cpu)
        };
        let local = connect("local", &rendezvous(&store, 0, 1), exercised).unwrap();
        assert!(!local.skips_collectives());

        let sums: Vec<Vec<f64>> = std::thread::scope(|s| {
            let ranks: Vec<_> = (0..2)
                .map(|rank| {
                    s.spawn(move || {
                        let store =
                            StoreClient::connect(addr, "tok", Duration::from_secs(5)).unwrap();
                        let cpu = Device::Cpu;
                        let comm =
                            connect("tcp", &rendezvous(&store, rank, 2), options(&cpu)).unwrap();
                        let mut values = vec![rank as f64 + 1.0, 10.0];
                        comm.all_reduce_sum_f64(&mut values).unwrap();
                        values
                    })
                })
                .collect();
            ranks.into_iter().map(|r| r.join().unwrap()).collect()
        });
        assert_eq!(sums, vec![vec![3.0, 20.0]; 2]);

        let unknown = connect("gloo", &rendezvous(&store, 0, 1), options(&cpu));
        let err = unknown
            .err()
            .expect("an unknown backend is refused")
            .to_string();
        assert!(
            err.contains("\"gloo\"") && err.contains("local, tcp, nccl"),
            "{err}"
        );
        #[cfg(not(feature = "cuda"))]
        {
            let nccl = connect("nccl", &rendezvous(&store, 0, 1), options(&cpu));
            let err = nccl.err().expect("nccl without a GPU build").to_string();
            assert!(err.contains("--features cuda"), "{err}");
        }
    }
}
