//! `ddpjob verify JOB.toml --world-sizes 1,2,4 --steps 50`: runs the job on each world size
//! with the same global batch and compares every step's weights, naming the first step and
//! tensor that differ. What it checks is what a user must otherwise take on trust: that a change
//! of worker count (or nothing at all, `--world-sizes 2,2`) leaves training as it was.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::anyhow;
use clap::Args;

use super::CliResult;
use crate::config;
use crate::train::{WEIGHT_DIGESTS, WeightDigests};

#[derive(Debug, Args)]
pub(super) struct VerifyArgs {
    /// The job file (TOML). Its `train.global_batch_size`, or else its `train.batch_size`, is
    /// the global batch here: each of W workers takes 1/W of it.
    config: PathBuf,
    /// The world sizes to run, each compared with the first: 1,2,4.
    #[arg(
        long,
        value_name = "W,W,...",
        value_delimiter = ',',
        default_value = "1,2"
    )]
    world_sizes: Vec<usize>,
    /// Optimizer steps each run takes (train.max_steps).
    #[arg(long, default_value_t = 20)]
    steps: usize,
    /// Override a config key, typed by the schema: --set train.lr=0.02 (repeatable).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    set: Vec<String>,
    /// Where the runs' job directories go (default: a temporary folder, removed afterwards
    /// unless a run differs or fails).
    #[arg(long, value_name = "DIR")]
    jobs_dir: Option<PathBuf>,
}

pub(super) fn verify(args: &VerifyArgs) -> CliResult {
    let usage = |e: anyhow::Error| (2, e);
    let loaded = config::load(&args.config, &args.set).map_err(|e| usage(anyhow!(e)))?;
    loaded.print_notes();
    // With train.global_batch_size each run derives its own share; else train.batch_size is
    // read as the global batch, and each run is given its share.
    let global = loaded.spec.train.global_batch_size;
    let batch = loaded.spec.train.batch_size;
    check_world_sizes(
        &args.world_sizes,
        global.is_none().then_some(batch),
        args.steps,
    )
    .map_err(usage)?;
    // Each world size's share, checked before anything runs.
    let shares = args
        .world_sizes
        .iter()
        .map(|&world| match global {
            Some(_) => loaded
                .spec
                .for_world_size(world)
                .map(|s| s.train.batch_size),
            None => Ok(batch / world),
        })
        .collect::<Result<Vec<usize>, String>>()
        .map_err(|e| usage(anyhow!(e)))?;
    steps_within_the_job(&loaded.spec, args, &shares).map_err(usage)?;
    crate::signals::install();
    let (dir, temporary) = match &args.jobs_dir {
        Some(dir) => (dir.clone(), false),
        None => (
            std::env::temp_dir().join(format!("ddpjob-verify-{}", std::process::id())),
            true,
        ),
    };
    let mut traces = Vec::new();
    for (i, &world) in args.world_sizes.iter().enumerate() {
        let name = format!("verify-{i}-w{world}");
        if dir.join(&name).exists() {
            return Err(usage(anyhow!(
                "{} already exists (an earlier verify's run): remove it or give another \
                 --jobs-dir",
                dir.join(&name).display()
            )));
        }
        let share = shares[i];
        outln!(
            "run {}: {world} worker(s) x batch {share}, {} steps",
            i + 1,
            args.steps
        );
        let given = global.is_none().then_some(share);
        let outcome = run_once(args, &dir, &name, world, given);
        // Interrupted: nothing to look at is left (a failed run's log stays).
        if crate::signals::received() > 0 {
            if temporary {
                std::fs::remove_dir_all(&dir).ok();
            }
            return Err(interrupted(world));
        }
        let status = outcome?;
        let path = dir.join(&name).join("logs").join(WEIGHT_DIGESTS);
        let trace = if path.is_file() {
            read_digests(&path)?
        } else {
            Vec::new()
        };
        // A run that finished (its summary written) may miss the job's [expect] thresholds
        // (exit 1), its epochs perhaps ending before --steps: what `verify` compares is there,
        // and a run short of steps is told apart below.
        let finished = missed_expectations_only(&dir.join(&name).join("summary.json"));
        if !status.success() && !finished && trace.len() < args.steps {
            let log = dir.join(format!("{name}.log"));
            return Err((
                1,
                anyhow!(
                    "the {world}-worker run failed ({status}) after {} of {} steps; its \
                     output: {}",
                    trace.len(),
                    args.steps,
                    log.display()
                ),
            ));
        }
        traces.push((world, trace));
    }
    match first_difference(&traces, args.steps) {
        Ok(summary) => {
            outln!("{summary}");
            if temporary {
                std::fs::remove_dir_all(&dir).ok();
            }
            Ok(())
        }
        Err(difference) => Err((
            1,
            anyhow!("{difference} (the runs are in {})", dir.display()),
        )),
    }
}

/// Refuses `--steps` beyond what the job's `train.epochs` hold on some world size before
/// anything runs: its runs would stop short, which is the job's length, not a difference.
fn steps_within_the_job(
    spec: &config::JobSpec,
    args: &VerifyArgs,
    shares: &[usize],
) -> anyhow::Result<()> {
    let samples = match crate::registry::Registry::current().train_samples(&spec.data) {
        Some((n, _)) => n,
        // Data that cannot be opened yet (a registered dataset that downloads when a job
        // starts) is the runs' to find: 0, not checked.
        None => crate::task::load(spec, None).map_or(0, |task| task.train_len()),
    };
    // Data not on disk yet (a download): the runs find it, and their length is told after.
    if samples == 0 {
        return Ok(());
    }
    for (&world, &share) in args.world_sizes.iter().zip(shares) {
        let mut run = spec.clone();
        (run.train.batch_size, run.train.max_steps) = (share, None);
        let held = run.plan(samples, world).total_steps;
        if args.steps > held {
            anyhow::bail!(
                "--steps {}: the job's train.epochs = {} hold {held} optimizer steps on {world} \
                 worker(s) ({samples} training samples); ask for --steps {held} or fewer, or \
                 give the job more epochs (--set train.epochs=N)",
                args.steps,
                spec.train.epochs
            );
        }
    }
    Ok(())
}

/// Whether a run that exited 1 did so only because its summary's `[expect]` was unmet (its
/// training finished): what `verify` compares is there.
fn missed_expectations_only(summary: &Path) -> bool {
    let Some(summary) = std::fs::read(summary)
        .ok()
        .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
    else {
        return false;
    };
    summary["expectations"]
        .as_array()
        .is_some_and(|e| e.iter().any(|r| r["met"] == false))
}

/// Every world size divides the global batch `batch` (when verify gives the shares), and there
/// are two runs to compare.
fn check_world_sizes(sizes: &[usize], batch: Option<usize>, steps: usize) -> anyhow::Result<()> {
    if sizes.len() < 2 || sizes.contains(&0) {
        anyhow::bail!("--world-sizes needs two or more worker counts of 1 or more, e.g. 1,2,4");
    }
    if steps == 0 {
        anyhow::bail!("--steps must be 1 or more");
    }
    let Some(batch) = batch else {
        return Ok(());
    };
    if let Some(w) = sizes.iter().find(|&&w| batch % w != 0) {
        let dividing: Vec<String> = (1..=batch)
            .filter(|d| batch % d == 0)
            .map(|d| d.to_string())
            .collect();
        anyhow::bail!(
            "train.batch_size = {batch} is the global batch in `verify`, which {w} workers do \
             not divide; world sizes that do: {}",
            dividing.join(", ")
        );
    }
    Ok(())
}

/// Runs the job with `world` workers for `--steps` steps, given `per_worker` samples each (or
/// their share of its `train.global_batch_size`), its weights traced; its output goes to
/// `<dir>/<name>.log`.
fn run_once(
    args: &VerifyArgs,
    dir: &Path,
    name: &str,
    world: usize,
    per_worker: Option<usize>,
) -> Result<std::process::ExitStatus, (u8, anyhow::Error)> {
    let failed = |e: std::io::Error| (1, anyhow!("cannot run the {world}-worker job: {e}"));
    std::fs::create_dir_all(dir).map_err(failed)?;
    let log = dir.join(format!("{name}.log"));
    let out = std::fs::File::create(&log).map_err(failed)?;
    let exe = std::env::current_exe().map_err(failed)?;
    let mut cmd = Command::new(exe);
    cmd.arg("run")
        .arg(&args.config)
        .args(["--name", name, "--nproc-per-node", &world.to_string()])
        .arg("--jobs-dir")
        .arg(dir);
    for set in &args.set {
        cmd.args(["--set", set]);
    }
    cmd.args(["--set", &format!("train.max_steps={}", args.steps)]);
    if let Some(per_worker) = per_worker {
        cmd.args(["--set", &format!("train.batch_size={per_worker}")]);
    }
    cmd.env(crate::worker::env::TRACE_WEIGHTS, "1")
        .stdout(out.try_clone().map_err(failed)?)
        .stderr(out);
    // SAFETY: prctl, getppid and _exit are async-signal-safe. The run dies with `verify`
    // (killed, it cannot stop the run; its workers die with the run's launcher), also when
    // `verify` died before the prctl.
    let verify = std::process::id() as libc::pid_t;
    unsafe {
        std::os::unix::process::CommandExt::pre_exec(&mut cmd, move || {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0);
            if libc::getppid() != verify {
                libc::_exit(1);
            }
            Ok(())
        });
    }
    let mut child = cmd.spawn().map_err(failed)?;
    let mut told = None;
    loop {
        let ended = child.try_wait().map_err(failed)?;
        // Stopped (Ctrl-C, a scheduler's SIGTERM to verify alone): the run is told the same
        // (its launcher stops its workers in order), and killed if it has not ended in time.
        if crate::signals::received() == 0 {
            if let Some(status) = ended {
                return Ok(status);
            }
        } else if ended.is_some() {
            return Err(interrupted(world));
        } else {
            match told {
                None => {
                    // SAFETY: a signal to our own child, not yet reaped.
                    unsafe { libc::kill(child.id() as libc::pid_t, crate::signals::last()) };
                    told = Some(std::time::Instant::now());
                }
                Some(at) if at.elapsed() >= STOP_GRACE => {
                    let _ = child.kill();
                    let _ = child.wait();
                    return Err(interrupted(world));
                }
                Some(_) => {}
            }
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

/// How long a run told to stop has before it is killed.
const STOP_GRACE: std::time::Duration = std::time::Duration::from_secs(10);

/// `verify` stopped by a signal while the `world`-worker run (or the comparison) went on.
fn interrupted(world: usize) -> (u8, anyhow::Error) {
    let signal = crate::signals::last();
    (
        128 + signal as u8,
        anyhow!(
            "interrupted by {} during the {world}-worker run, which was stopped",
            crate::launch::signal_name(signal)
        ),
    )
}

/// A run's digests in step order; a step written twice (a restarted worker redoes the steps
/// since its checkpoint) counts as its last line says.
fn read_digests(path: &Path) -> Result<Vec<WeightDigests>, (u8, anyhow::Error)> {
    let text = std::fs::read_to_string(path).map_err(|e| {
        (
            1,
            anyhow!("cannot read the weight digests {}: {e}", path.display()),
        )
    })?;
    let mut by_step = std::collections::BTreeMap::new();
    for line in text.lines() {
        let digests: WeightDigests = serde_json::from_str(line)
            .map_err(|e| (1, anyhow!("{}: a malformed line: {e}", path.display())))?;
        by_step.insert(digests.step, digests);
    }
    Ok(by_step.into_values().collect())
}

/// Compares every run's digests with the first run's, step by step: the summary when all are
/// equal, else the first step and tensor that differ.
fn first_difference(
    traces: &[(usize, Vec<WeightDigests>)],
    steps: usize,
) -> Result<String, String> {
    let (base_world, base) = &traces[0];
    // The steps every run has are compared first: a difference there is the finding, whatever
    // became of the runs after it.
    let common = traces
        .iter()
        .map(|(_, t)| t.len())
        .min()
        .unwrap_or(0)
        .min(steps);
    compare_steps(traces, common)?;
    if base.len() < steps && traces.iter().all(|(_, t)| t.len() == base.len()) {
        return Err(format!(
            "every run ended after step {} (the job's train.epochs hold no more): ask for \
             --steps {} or fewer, or give the job more epochs",
            base.len(),
            base.len()
        ));
    }
    for (world, trace) in &traces[1..] {
        if trace.len() < steps || base.len() < steps {
            let short = if trace.len() < steps {
                world
            } else {
                base_world
            };
            return Err(format!(
                "the {short}-worker run stopped before step {steps}"
            ));
        }
    }
    compare_steps(traces, steps)?;
    let sizes: Vec<String> = traces.iter().map(|(w, _)| w.to_string()).collect();
    Ok(format!(
        "bit-identical weights at every one of {steps} steps on {} worker(s) ({} tensors)",
        sizes.join(", "),
        base[0].tensors.len()
    ))
}

/// The first of `steps` steps at which a run's digests differ from the first run's.
fn compare_steps(traces: &[(usize, Vec<WeightDigests>)], steps: usize) -> Result<(), String> {
    let (base_world, base) = &traces[0];
    for step in 0..steps {
        for (world, trace) in &traces[1..] {
            let (a, b) = (&base[step], &trace[step]);
            let differing: Vec<&str> = a
                .tensors
                .iter()
                .zip(&b.tensors)
                .filter(|(x, y)| x != y)
                .map(|(x, _)| x.0.as_str())
                .collect();
            if let Some(first) = differing.first() {
                let more = match differing.len() {
                    1 => String::new(),
                    n => format!(" (and {} more of {} tensors)", n - 1, a.tensors.len()),
                };
                return Err(format!(
                    "step {}: `{first}` differs between {base_world} and {world} worker(s){more}",
                    a.step
                ));
            }
            if a.tensors.len() != b.tensors.len() {
                return Err(format!(
                    "step {}: {} tensors on {base_world} worker(s), {} on {world}",
                    a.step,
                    a.tensors.len(),
                    b.tensors.len()
                ));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn digests(step: usize, values: &[(&str, &str)]) -> WeightDigests {
        WeightDigests {
            step,
            tensors: values
                .iter()
                .map(|(n, h)| (n.to_string(), h.to_string()))
                .collect(),
        }
    }

    #[test]
    fn the_first_differing_step_and_tensor_are_named() {
        let same = vec![
            digests(1, &[("a", "01"), ("b", "02")]),
            digests(2, &[("a", "03"), ("b", "04")]),
        ];
        let late = vec![
            digests(1, &[("a", "01"), ("b", "02")]),
            digests(2, &[("a", "03"), ("b", "ff")]),
        ];
        let traces = vec![(1, same.clone()), (2, same), (4, late)];
        assert_eq!(
            first_difference(&traces, 2).unwrap_err(),
            "step 2: `b` differs between 1 and 4 worker(s)"
        );
        let equal = vec![(1, traces[0].1.clone()), (2, traces[1].1.clone())];
        assert_eq!(
            first_difference(&equal, 2).unwrap(),
            "bit-identical weights at every one of 2 steps on 1, 2 worker(s) (2 tensors)"
        );
        let short = vec![(1, traces[0].1.clone()), (2, traces[1].1[..1].to_vec())];
        // A difference at a step both runs have is the finding, even when they end early.
        let early = vec![
            (1, traces[0].1[..1].to_vec()),
            (2, vec![digests(1, &[("a", "ff"), ("b", "02")])]),
        ];
        assert_eq!(
            first_difference(&early, 2).unwrap_err(),
            "step 1: `a` differs between 1 and 2 worker(s)"
        );
        let ended = vec![(1, short[1].1.clone()), (2, short[1].1.clone())];
        assert!(
            first_difference(&ended, 2)
                .unwrap_err()
                .starts_with("every run ended after step 1 (the job's train.epochs"),
        );
        assert_eq!(
            first_difference(&short, 2).unwrap_err(),
            "the 2-worker run stopped before step 2"
        );
    }

    #[test]
    fn world_sizes_must_divide_the_global_batch() {
        let msg = check_world_sizes(&[1, 3], Some(8), 5)
            .unwrap_err()
            .to_string();
        assert!(
            msg.contains("3 workers do not divide; world sizes that do: 1, 2, 4, 8"),
            "{msg}"
        );
        assert!(check_world_sizes(&[1], Some(8), 5).is_err());
        assert!(check_world_sizes(&[1, 2], Some(8), 0).is_err());
        check_world_sizes(&[1, 2, 4], Some(8), 5).unwrap();
    }
}
