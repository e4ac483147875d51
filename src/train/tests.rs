use std::path::Path;
use std::sync::atomic::AtomicBool;
use std::time::Instant;

use candle_core::{Device, Tensor};

use super::shards::ShardPool;
use super::*;
use crate::config::{JobSpec, load_str};
use crate::models;
use crate::progress::Silent;
use ddpjob_comm::LocalCommunicator;

fn spec(overrides: &[&str]) -> JobSpec {
    let base = "[data]\ndataset = \"synthetic\"\n[data.synthetic]\ntrain_samples = 100\ntest_samples = 37\n\
                shape = [1, 4, 4]\nclasses = 3\n[model]\nhidden = [8]\n[train]\nbatch_size = 16\nlog_every = 2\n";
    let overrides: Vec<String> = overrides.iter().map(|s| s.to_string()).collect();
    load_str(Path::new("t.toml"), base.into(), &overrides)
        .unwrap()
        .spec
}

/// The job's data and its model, built from seed 0 on the CPU.
fn data_and_model(spec: &JobSpec) -> (Box<dyn crate::task::Task>, Box<dyn models::Model>) {
    let data = crate::task::load(spec, None).unwrap();
    let input = data.input();
    let model = models::build(
        &spec.model,
        input,
        0,
        &Device::Cpu,
        spec.train.precision,
        false,
    );
    (data, model.unwrap())
}

fn train(spec: &JobSpec) -> Summary {
    match train_with(spec, None).unwrap() {
        Ending::Completed(summary) => *summary,
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
        plan: spec.train_plan(),
        data: data.as_ref(),
        comm: &LocalCommunicator,
        model,
        device: Device::Cpu,
        reporter: &mut reporter,
        leader,
        started: Instant::now(),
        resume: None,
        base_sha256: None,
        sharded_parameters: None,
        hooks: Hooks {
            vote_every,
            stop: &AtomicBool::new(stop),
            fault: None,
            beacon: Default::default(),
            trace_samples: None,
            trace_weights: None,
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
                        .contains("any earlier checkpoint is untouched"),
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
    let (data, model) = data_and_model(&spec);
    let batches = data.batches(&Device::Cpu).unwrap();
    let pool = ShardPool::new(3);
    let run = |limit, threads| {
        let (model, data) = (model.as_ref(), data.as_ref());
        evaluate(
            model,
            data,
            batches.as_ref(),
            &LocalCommunicator,
            (10, limit),
            threads,
        )
        .unwrap()
    };
    let eval = |limit| run(limit, EvalThreads::Rows(pool.as_ref()));
    let r = eval(None);
    assert_eq!(r.samples, 37);
    // An untrained 3-class model's loss is near ln 3.
    assert!((r.loss - 3f64.ln()).abs() < 0.5, "{r:?}");
    // Two batches of 10, spread over the split: 20 samples, and never more than the split.
    assert_eq!(eval(Some(2)).samples, 20);
    // Batch by batch, each alone on one thread (world-size-invariant training): the same
    // samples, each once.
    let pieces = |limit| run(limit, EvalThreads::Pieces { cpu: true });
    assert_eq!(pieces(None).samples, 37);
    assert_eq!(pieces(Some(2)).samples, 20);
    assert!(
        (pieces(None).loss - r.loss).abs() < 1e-6,
        "{:?} vs {r:?}",
        pieces(None)
    );
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

/// A rank of one that runs its collectives, counting the values it all-reduces and gathers.
#[derive(Default)]
struct CountingComm {
    reduced: std::cell::Cell<usize>,
    gathered: std::cell::Cell<usize>,
}

impl ddpjob_comm::Communicator for CountingComm {
    fn rank(&self) -> usize {
        0
    }
    fn world_size(&self) -> usize {
        1
    }
    fn all_reduce_mean(
        &self,
        flat: &mut candle_core::Tensor,
    ) -> Result<(), ddpjob_comm::CommError> {
        self.reduced.set(self.reduced.get() + flat.elem_count());
        Ok(())
    }
    fn reduce_scatter_mean(
        &self,
        flat: &mut candle_core::Tensor,
    ) -> Result<(), ddpjob_comm::CommError> {
        self.reduced.set(self.reduced.get() + flat.elem_count());
        Ok(())
    }
    fn all_gather(&self, flat: &mut candle_core::Tensor) -> Result<(), ddpjob_comm::CommError> {
        self.gathered.set(self.gathered.get() + flat.elem_count());
        Ok(())
    }
    fn all_reduce_sum_f64(&self, _: &mut [f64]) -> Result<(), ddpjob_comm::CommError> {
        Ok(())
    }
    fn broadcast(
        &self,
        _: &mut candle_core::Tensor,
        _: usize,
    ) -> Result<(), ddpjob_comm::CommError> {
        Ok(())
    }
    fn barrier(&self) -> Result<(), ddpjob_comm::CommError> {
        Ok(())
    }
    fn skips_collectives(&self) -> bool {
        false
    }
}

/// Optimizer steps on samples 0..8 of `data` through a [`CountingComm`].
struct Counted<'a> {
    spec: &'a crate::config::JobSpec,
    data: &'a dyn crate::task::Task,
    model: &'a dyn crate::models::Model,
    comm: &'a CountingComm,
}

impl Counted<'_> {
    fn steps(&self, optimizer: &mut crate::optim::Optimizer, pieces: Option<usize>, n: usize) {
        let batches = self.data.batches(&Device::Cpu).unwrap();
        let (inputs, targets) = batches.train(0, &[0, 1, 2, 3, 4, 5, 6, 7]).unwrap();
        let cx = step::StepContext {
            model: self.model,
            comm: self.comm,
            device: &Device::Cpu,
            grad_clip_norm: self.spec.train.grad_clip_norm,
            bucket_bytes: 64,
            shards: None,
            masked_targets: false,
            virtual_shards: pieces,
            scrambled_pieces: false,
            stream_gradients: false,
            sharded_parameters: None,
            overlap_comm: false,
        };
        for _ in 0..n {
            let batch = step::MicroBatch {
                inputs: inputs.clone(),
                targets: targets.clone(),
                mode: crate::models::Mode::Train {
                    row_seeds: vec![0; 8],
                },
            };
            step::optimizer_step(&cx, optimizer, &[batch], 0.01, false, None).unwrap();
        }
    }
}

/// A world-size-invariant step on one worker whose collectives are exercised
/// (`distributed.collectives = "always"`) runs its tree sum's collective: every gradient value
/// and the stop vote go through the backend's all-gather.
#[test]
fn an_exercised_single_worker_runs_the_invariant_steps_collective() {
    let spec = spec(&[]);
    let (data, model) = data_and_model(&spec);
    let comm = CountingComm::default();
    let mut optimizer = crate::optim::Optimizer::new(spec.train.optimizer, model.params().len());
    let on = Counted {
        spec: &spec,
        data: data.as_ref(),
        model: model.as_ref(),
        comm: &comm,
    };
    on.steps(&mut optimizer, Some(2), 1);
    let trainable = model.params().trainable_element_count();
    assert_eq!(comm.gathered.get(), trainable + 1);
}

/// `model.freeze`: frozen parameters keep their values, get no optimizer state, and their
/// gradients never reach the all-reduce; the others train as without it.
#[test]
fn frozen_parameters_stay_put_keep_no_state_and_are_not_reduced() {
    let steps = |freeze: &str| {
        let spec = spec(&[
            &format!("model.freeze={freeze}"),
            "train.grad_clip_norm=0.5",
        ]);
        let (data, model) = data_and_model(&spec);
        // Values, not tensors: the update writes the parameters' storage in place.
        let values = |m: &dyn crate::models::Model| -> std::collections::HashMap<String, Vec<f32>> {
            let named = m.params().named_tensors();
            let flat = |t: &candle_core::Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            named.iter().map(|(n, t)| (n.clone(), flat(t))).collect()
        };
        let before = values(model.as_ref());
        let comm = CountingComm::default();
        let mut optimizer =
            crate::optim::Optimizer::new(spec.train.optimizer, model.params().len());
        let on = Counted {
            spec: &spec,
            data: data.as_ref(),
            model: model.as_ref(),
            comm: &comm,
        };
        on.steps(&mut optimizer, None, 3);
        let after = values(model.as_ref());
        let mut changed: Vec<String> = before
            .keys()
            .filter(|n| before[*n] != after[*n])
            .cloned()
            .collect();
        changed.sort();
        let (state, _) = optimizer.state(model.params()).unwrap();
        let mut state: Vec<String> = state.into_keys().collect();
        state.sort();
        (changed, state, comm.reduced.get())
    };
    // mlp [16] -> 8 -> 3: fc1 is 8x16 + 8, fc2 3x8 + 3; one more value is the stop vote.
    let (changed, state, reduced) = steps("[]");
    assert_eq!(
        changed,
        ["fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight"]
    );
    assert_eq!(state.len(), 8, "{state:?}");
    assert_eq!(reduced, 3 * (136 + 27 + 1));
    let (changed, state, reduced) = steps("[\"fc1\"]");
    assert_eq!(changed, ["fc2.bias", "fc2.weight"]);
    assert_eq!(
        state,
        [
            "fc2.bias.exp_avg",
            "fc2.bias.exp_avg_sq",
            "fc2.weight.exp_avg",
            "fc2.weight.exp_avg_sq"
        ]
    );
    assert_eq!(reduced, 3 * (27 + 1));
}

/// ZeRO-1 and ZeRO-2 over real sockets: 2 and 3 ranks, a sharded optimizer (its gradients
/// reduce-scattered after the backward or handed over by it) and an unsharded one give
/// the same weights bit for bit (each rank's own batch), the sharded one keeps about 1/W of
/// the state, and it sends exactly the all-reduce's bytes.
#[test]
fn a_sharded_optimizer_moves_the_all_reduces_bytes_and_gives_its_bits() {
    use ddpjob_comm::buckets::ShardPlan;
    let spec = spec(&["train.optimizer=\"adamw\"", "model.hidden=[24]"]);
    // (sharded, streamed): "none", "optimizer", "gradients".
    let run = |world: usize, (sharded, streamed): (bool, bool)| {
        ddpjob_comm::tcp_ranks(world, |rank, comm| {
            let (data, model) = data_and_model(&spec);
            let params = model.params();
            let mut optimizer = match sharded {
                true => {
                    let sizes: Vec<usize> = params.vars().map(|v| v.elem_count()).collect();
                    let plan = ShardPlan::new(&sizes, 200, &comm);
                    crate::optim::Optimizer::sharded(spec.train.optimizer, plan, params)
                }
                false => crate::optim::Optimizer::new(spec.train.optimizer, params.len()),
            };
            let cx = step::StepContext {
                model: model.as_ref(),
                comm: &comm,
                device: &Device::Cpu,
                grad_clip_norm: None,
                bucket_bytes: 200,
                shards: None,
                masked_targets: false,
                virtual_shards: None,
                scrambled_pieces: false,
                stream_gradients: streamed,
                sharded_parameters: None,
                overlap_comm: false,
            };
            let batches = data.batches(&Device::Cpu).unwrap();
            for step in 0..3 {
                let rows: Vec<usize> = (0..8).map(|i| (step * 24 + rank * 8 + i) % 100).collect();
                let (inputs, targets) = batches.train(0, &rows).unwrap();
                let mode = crate::models::Mode::Train {
                    row_seeds: vec![0; 8],
                };
                let batch = step::MicroBatch {
                    inputs,
                    targets,
                    mode,
                };
                let r = step::optimizer_step(&cx, &mut optimizer, &[batch], 0.01, false, None);
                assert!(!r.unwrap().stop.read().unwrap());
            }
            let bits: Vec<Vec<u32>> = params
                .vars()
                .map(|v| {
                    let values = v
                        .as_tensor()
                        .flatten_all()
                        .unwrap()
                        .to_vec1::<f32>()
                        .unwrap();
                    values.iter().map(|x| x.to_bits()).collect()
                })
                .collect();
            let kept = optimizer
                .plan()
                .map_or(params.element_count(), |p| p.owned_elements());
            (bits, comm.bytes_sent(), kept)
        })
    };
    for world in [2, 3] {
        let plain = run(world, (false, false));
        let total = plain[0].2;
        for mode in [(true, false), (true, true)] {
            let sharded = run(world, mode);
            for rank in 0..world {
                assert_eq!(
                    plain[rank].0, sharded[rank].0,
                    "world {world}, rank {rank}, {mode:?}: weights"
                );
                assert_eq!(
                    plain[rank].1, sharded[rank].1,
                    "world {world}, rank {rank}, {mode:?}: bytes"
                );
                let kept = sharded[rank].2 as f64;
                let share = total as f64 / world as f64;
                assert!(
                    (kept - share).abs() <= 8.0,
                    "rank {rank} keeps {kept} of {total}"
                );
            }
            // Every rank ends with the same weights, so the pieces really were gathered.
            assert!(sharded.iter().all(|r| r.0 == sharded[0].0));
        }
    }
}

/// A row shard that panics while its step streams gradients (`sharding = "gradients"`) ends
/// the step with the panic once the other shard is done, instead of leaving the thread that
/// reduces waiting for a shard that will never hand anything over.
#[test]
fn a_panicking_shard_of_a_streamed_step_panics_the_step_instead_of_hanging() {
    use crate::models::{Mode, Model, Params};
    use ddpjob_comm::buckets::ShardPlan;
    /// The spec's model, whose shard of 3 rows panics.
    struct Panicky(Box<dyn Model>);
    impl Model for Panicky {
        fn forward(&self, xs: &Tensor, mode: &Mode) -> candle_core::Result<Tensor> {
            self.0.forward(xs, mode)
        }
        fn params(&self) -> &Params {
            self.0.params()
        }
        fn loss(&self, xs: &Tensor, ys: &Tensor, mode: &Mode) -> candle_core::Result<Tensor> {
            assert_ne!(xs.dims()[0], 3, "the shard of 3 rows fails");
            self.0.loss(xs, ys, mode)
        }
    }
    let spec = spec(&["train.optimizer=\"adamw\""]);
    let (data, model) = data_and_model(&spec);
    let model = Panicky(model);
    let comm = CountingComm::default();
    let sizes: Vec<usize> = model.params().vars().map(|v| v.elem_count()).collect();
    let plan = ShardPlan::new(&sizes, 64, &comm);
    let mut optimizer =
        crate::optim::Optimizer::sharded(spec.train.optimizer, plan, model.params());
    let pool = ShardPool::new(2).unwrap();
    let cx = step::StepContext {
        model: &model,
        comm: &comm,
        device: &Device::Cpu,
        grad_clip_norm: None,
        bucket_bytes: 64,
        shards: Some(&pool),
        masked_targets: false,
        virtual_shards: None,
        scrambled_pieces: false,
        stream_gradients: true,
        sharded_parameters: None,
        overlap_comm: false,
    };
    let batches = data.batches(&Device::Cpu).unwrap();
    let (inputs, targets) = batches.train(0, &[0, 1, 2, 3, 4, 5, 6]).unwrap();
    let batch = step::MicroBatch {
        inputs,
        targets,
        mode: Mode::Train {
            row_seeds: vec![0; 7],
        },
    };
    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        step::optimizer_step(&cx, &mut optimizer, &[batch], 0.01, false, None)
    }));
    let panic = outcome.err().expect("the step panics");
    let said = panic.downcast_ref::<String>().cloned().unwrap_or_default();
    assert!(said.contains("the shard of 3 rows fails"), "{said}");
}

/// The synthetic task, declaring a metric of its own in place of the built-in ones.
struct Declaring(Box<dyn crate::task::Task>);

/// 1 − accuracy, in percent, lower being better: a metric no report knows by name.
struct ErrorRate;

impl crate::task::Metric for ErrorRate {
    fn info(&self) -> crate::task::MetricInfo {
        crate::task::MetricInfo::new("error_rate", "error rate").in_percent()
    }
    fn value(&self, sums: &crate::task::EvalSums) -> f64 {
        1.0 - sums.accuracy()
    }
}

impl crate::task::Task for Declaring {
    fn train_len(&self) -> usize {
        self.0.train_len()
    }
    fn eval_len(&self) -> usize {
        self.0.eval_len()
    }
    fn targets_per_sample(&self) -> usize {
        self.0.targets_per_sample()
    }
    fn input(&self) -> crate::task::ModelInput {
        self.0.input()
    }
    fn batches<'a>(
        &'a self,
        device: &Device,
    ) -> Result<Box<dyn crate::task::BatchSource + 'a>, crate::task::DataError> {
        self.0.batches(device)
    }
    fn metrics(&self) -> Vec<Box<dyn crate::task::Metric>> {
        vec![
            Box::new(ErrorRate),
            Box::new(crate::task::MeanLoss { label: "test loss" }),
        ]
    }
}

#[test]
fn a_metric_the_task_declares_is_recorded_summarised_plotted_and_shown() {
    let jobs = std::env::temp_dir().join(format!("ddpjob-declared-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&jobs);
    let root = jobs.join("declared");
    std::fs::create_dir_all(&root).unwrap();
    let spec = spec(&["train.epochs=2"]);
    let (data, model) = data_and_model(&spec);
    let data = Declaring(data);
    let job = crate::jobdir::JobDir { root: root.clone() };
    let leader = Leader::new(job.clone(), None, 1, 0, true).declaring(declared_metrics(&data));
    let mut reporter = Silent;
    let mut trainer = Trainer {
        plan: spec.train_plan(),
        data: &data,
        comm: &LocalCommunicator,
        model,
        device: Device::Cpu,
        reporter: &mut reporter,
        leader: Some(leader),
        started: Instant::now(),
        resume: None,
        base_sha256: None,
        sharded_parameters: None,
        hooks: Hooks {
            vote_every: 1,
            stop: &AtomicBool::new(false),
            fault: None,
            beacon: Default::default(),
            trace_samples: None,
            trace_weights: None,
        },
    };
    let Ending::Completed(summary) = trainer.run().unwrap() else {
        panic!("not completed")
    };
    // The records carry what the task declared, and nothing it did not.
    let history = crate::report::history::History::read(&job.metrics_path()).unwrap();
    assert_eq!(history.metric_names, ["loss", "error_rate"]);
    let last = history.last_epoch().unwrap();
    let rate = last.metrics.value("error_rate");
    assert!(
        (rate - (1.0 - summary.test_accuracy)).abs() < 1e-12,
        "{rate}"
    );
    // The summary keeps its contract fields, the declared metric beside them, and how to
    // read it; TensorBoard gets it under its own tag.
    assert_eq!(summary.more_metrics.get("error_rate"), Some(rate));
    assert_eq!(summary.metrics[0].name, "error_rate");
    let line = std::fs::read_to_string(job.metrics_path()).unwrap();
    assert!(line.contains("\"test_error_rate\":"), "{line}");
    let epoch_line = line
        .lines()
        .rev()
        .find(|l| l.contains("\"epoch\","))
        .unwrap();
    let record = crate::jobdir::record::Record::parse(epoch_line).unwrap();
    let tags: Vec<String> = crate::jobdir::tensorboard::scalars(&record)
        .into_iter()
        .map(|(tag, _)| tag)
        .collect();
    assert!(tags.contains(&"test/error_rate".to_string()), "{tags:?}");
    // `show` and `list` read what is declared from `state.json`: the best by error rate
    // (lower is better), worded as the task words it; the curves plot it.
    let view = crate::report::JobView::load(&jobs, "declared").unwrap();
    assert_eq!(view.best().unwrap().headline.name, "error_rate");
    let shown = crate::report::show::show(&view, crate::jobdir::now_unix());
    assert!(
        shown.contains(&format!("error rate {:.2}%", rate * 100.0)),
        "{shown}"
    );
    crate::report::curves::draw(&job).unwrap();
    let svg = std::fs::read_to_string(job.curves_path()).unwrap();
    assert!(
        svg.contains("Error rate"),
        "the middle panel plots the declared metric"
    );
    std::fs::remove_dir_all(&jobs).unwrap();
}
