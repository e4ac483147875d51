use std::path::Path;
use std::time::Instant;

use candle_core::Device;

use super::shards::ShardPool;
use super::*;
use crate::comm::LocalCommunicator;
use crate::config::load_str;
use crate::models;
use crate::progress::Silent;

fn spec(overrides: &[&str]) -> JobSpec {
    let base = "[data]\ndataset = \"synthetic\"\n[data.synthetic]\ntrain_samples = 100\ntest_samples = 37\n\
                shape = [1, 4, 4]\nclasses = 3\n[model]\nhidden = [8]\n[train]\nbatch_size = 16\nlog_every = 2\n";
    let overrides: Vec<String> = overrides.iter().map(|s| s.to_string()).collect();
    load_str(Path::new("t.toml"), base.into(), &overrides)
        .unwrap()
        .spec
}

fn train(spec: &JobSpec) -> Summary {
    match train_with(spec, None).unwrap() {
        Ending::Completed(summary) => summary,
        other => panic!("{other:?}"),
    }
}

fn train_with(spec: &JobSpec, leader: Option<Leader>) -> Result<Ending, TrainError> {
    train_hooked(spec, leader, false, 1)
}

/// As [`train_with`], with a stop request up from the start (or not) and the stop vote read
/// every `vote_every` steps.
fn train_hooked(
    spec: &JobSpec,
    leader: Option<Leader>,
    stop: bool,
    vote_every: usize,
) -> Result<Ending, TrainError> {
    let data = crate::task::load(spec, None).unwrap();
    let model = models::build(
        &spec.model,
        data.input(),
        spec.seed,
        &Device::Cpu,
        spec.train.precision,
        false,
    )
    .unwrap();
    let mut reporter = Silent;
    let mut trainer = Trainer {
        spec,
        data: data.as_ref(),
        comm: &LocalCommunicator,
        model,
        device: Device::Cpu,
        reporter: &mut reporter,
        leader,
        started: Instant::now(),
        resume: None,
        hooks: Hooks {
            vote_every,
            stop: &AtomicBool::new(stop),
            fault: None,
            beacon: Default::default(),
            trace_samples: None,
        },
    };
    trainer.run()
}

#[test]
fn a_checkpoint_that_cannot_be_written_fails_or_warns_as_configured() {
    for (policy, trains_on) in [("fail", false), ("warn", true)] {
        let root =
            std::env::temp_dir().join(format!("ddpjob-write-{}-{policy}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(&root).unwrap();
        // A file where the checkpoint directory should be: no checkpoint can be made in it,
        // whoever runs the test.
        std::fs::write(root.join("checkpoints"), b"not a directory").unwrap();
        let leader = Leader::new(
            crate::jobdir::JobDir { root: root.clone() },
            None,
            1,
            0,
            false,
        );
        let set = format!("checkpoint.on_write_error=\"{policy}\"");
        let spec = spec(&["checkpoint.every_steps=2", &set]);
        let result = train_with(&spec, Some(leader));
        match (trains_on, result) {
            (true, Ok(Ending::Completed(s))) => assert_eq!(s.steps, 7),
            (false, Err(TrainError::Checkpoint(e))) => {
                assert!(
                    e.to_string()
                        .contains("the previous checkpoint is untouched"),
                    "{e}"
                )
            }
            (_, other) => panic!("{policy}: {other:?}"),
        }
        std::fs::remove_dir_all(&root).unwrap();
    }
}

#[test]
fn a_stop_request_is_read_only_at_the_vote_schedule_or_a_log_line() {
    // 7 steps an epoch; log lines every 5 steps.
    let spec = spec(&["train.epochs=3", "train.log_every=5"]);
    for (vote_every, stops_after) in [(1, 1), (2, 2), (3, 3), (8, 5)] {
        match train_hooked(&spec, None, true, vote_every).unwrap() {
            Ending::Stopped { step } => assert_eq!(step, stops_after, "every {vote_every}"),
            other => panic!("every {vote_every}: {other:?}"),
        }
    }
    // Without a request the vote is read on schedule and never stops the job.
    match train_hooked(&spec, None, false, 2).unwrap() {
        Ending::Completed(summary) => assert_eq!(summary.steps, 21),
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_trailing_partial_accumulation_group_still_steps() {
    // 100 samples / batch 16 = 7 micro-batches; accumulation 3 → groups of 3, 3 and 1.
    let s = train(&spec(&["train.accumulation=3", "train.epochs=2"]));
    assert_eq!(s.steps, 6);
    assert_eq!(s.samples, 200);
    assert_eq!(s.epochs, 2);
}

#[test]
fn max_steps_stops_mid_epoch_and_still_evaluates() {
    let s = train(&spec(&["train.max_steps=3", "train.epochs=5"]));
    assert_eq!((s.steps, s.epochs, s.samples), (3, 1, 48));
    assert!(s.test_loss.is_finite() && (0.0..=1.0).contains(&s.test_accuracy));
}

#[test]
fn evaluation_counts_every_test_sample_once() {
    let spec = spec(&[]);
    let data = crate::task::load(&spec, None).unwrap();
    let model = models::build(
        &spec.model,
        data.input(),
        0,
        &Device::Cpu,
        spec.train.precision,
        false,
    )
    .unwrap();
    let batches = data.batches(&Device::Cpu).unwrap();
    let eval = |limit| {
        evaluate(
            model.as_ref(),
            data.as_ref(),
            batches.as_ref(),
            &LocalCommunicator,
            10,
            limit,
            ShardPool::new(3).as_ref(),
        )
        .unwrap()
    };
    let r = eval(None);
    assert_eq!(r.samples, 37);
    // An untrained 3-class model's loss is near ln 3.
    assert!((r.loss - 3f64.ln()).abs() < 0.5, "{r:?}");
    // Two batches of 10, spread over the split: 20 samples, and never more than the split.
    assert_eq!(eval(Some(2)).samples, 20);
    assert_eq!(eval(Some(9)).samples, 37);
    assert_eq!(eval(Some(9)).loss, r.loss);
}

#[test]
fn training_is_deterministic_for_a_seed() {
    let a = train(&spec(&["train.epochs=2"]));
    let b = train(&spec(&["train.epochs=2"]));
    assert_eq!(
        (a.final_train_loss, a.test_loss),
        (b.final_train_loss, b.test_loss)
    );
    let c = train(&spec(&["train.epochs=2", "seed=1"]));
    assert_ne!(a.final_train_loss, c.final_train_loss);
}
