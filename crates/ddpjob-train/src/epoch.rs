//! One epoch of a run: its optimizer steps, each followed by the events due after it (see
//! [`Events`]: the log line, the stop vote, a mid-epoch evaluation, a checkpoint), then its
//! evaluation, record and checkpoint.

use std::sync::atomic::Ordering;
use std::time::Instant;

use super::events::Events;
use super::metrics::{LossTally, trace_samples, trace_weights};
use super::{Ending, EpochRun, RunState, TrainError, Trainer};
use crate::jobdir::record::TrainTerms;
use crate::task::BatchSource;

impl Trainer<'_> {
    /// The steps of one epoch (its `groups` of micro-batches, past those already done): log
    /// lines, mid-epoch evaluations and checkpoints, and the stop vote. `Some` when every rank
    /// agreed to stop (the checkpoint is written).
    pub(super) fn train_epoch(
        &mut self,
        run: &mut RunState,
        epoch_run: &mut EpochRun,
        groups: &[&[&[usize]]],
        batches: &dyn BatchSource,
    ) -> Result<Option<Ending>, TrainError> {
        let (t, world) = (&self.plan.train, self.comm.world_size());
        let events = Events::of(self.plan, self.hooks.vote_every);
        let epoch = epoch_run.epoch;
        let steps_now = groups
            .len()
            .saturating_sub(epoch_run.skip)
            .min(run.total_steps - run.step);
        self.reporter.epoch_start(epoch, t.epochs, steps_now);
        let mut interval = LossTally::default();
        let mut interval_first_step = run.step + 1;
        for (i, group) in groups[epoch_run.skip..].iter().take(steps_now).enumerate() {
            let started = Instant::now();
            let lr = run.schedule.lr(run.step, epoch);
            self.hooks.beacon.set_step(run.step + 1);
            if let Some(fault) = &self.hooks.fault {
                fault
                    .before_step(run.step + 1, self.hooks.stop)
                    .map_err(TrainError::Injected)?;
            }
            if let Some(path) = &self.hooks.trace_samples {
                trace_samples(path, epoch, run.step + 1, group)?;
            }
            let vote = self.hooks.stop.load(Ordering::SeqCst);
            let stepped = self.optimizer_step(
                batches,
                &mut run.optimizer,
                (epoch, run.step + 1),
                group,
                lr,
                vote,
            )?;
            let (samples, votes) = (stepped.samples, &stepped.stop);
            run.step += 1;
            let step = run.step;
            if let Some(path) = &self.hooks.trace_weights {
                // A collective with sharded parameters: every rank gathers, rank 0 writes.
                self.gather_parameters(&run.optimizer)?;
                if self.comm.rank() == 0 {
                    trace_weights(path, step, self.model.params())?;
                }
                self.release_parameters(&run.optimizer)?;
            }
            epoch_run.consumed += samples * world;
            let in_epoch = epoch_run.skip + i + 1;
            let due = events.after_step(step, i + 1 == steps_now);
            // Every rank reads the vote after the same steps, so all stop after the same one.
            // A rank's vote stays up once cast.
            let stop = due.vote && votes.read()?;
            // The step's time includes reading the vote, which on a GPU waits for the device
            // to finish the step's work so far (the rest is waited for with the loss).
            interval.add(
                stepped.loss_sum,
                samples,
                started.elapsed(),
                stepped.grad_norm,
            );
            let mut status = None;
            if due.log || stop {
                let steps = (interval_first_step, step);
                status = Some(self.log_interval(run, &mut interval, epoch, steps, lr)?);
                interval_first_step = step + 1;
            }
            self.reporter.step(i + 1, status.as_deref());
            let at = |me: &Self, run: &RunState| {
                me.position(epoch_run, in_epoch, step, &run.optimizer, lr, &run.metrics)
            };
            if due.eval {
                let eval = self.evaluate(batches, &run.optimizer)?;
                self.reporter.line(&format!(
                    "step {step}/{}: {}",
                    run.total_steps,
                    eval.describe()
                ));
                let position = at(self, run);
                if let Some(early) = self.record_eval(&eval, run, position, true)? {
                    // The epoch ends here: the steps since the last log line are logged and
                    // counted, and its end records this evaluation, not another.
                    if step >= interval_first_step {
                        let steps = (interval_first_step, step);
                        self.log_interval(run, &mut interval, epoch, steps, lr)?;
                    }
                    (run.stopped_early, run.fresh_eval) = (Some(early), Some(eval));
                    epoch_run.done = epoch_run.skip + i + 1;
                    return Ok(None);
                }
            }
            // After this step's evaluation, so a resumed run (which starts at the next step)
            // has it recorded as an uninterrupted run does: best loss, early stopping's count.
            if stop {
                self.reporter.epoch_end();
                self.save_checkpoint(&run.optimizer, &at(self, run))?;
                self.reporter.line(&format!(
                    "stopped on request after step {step}; continue with `ddpjob resume`"
                ));
                return Ok(Some(Ending::Stopped { step }));
            }
            if due.checkpoint {
                self.save_checkpoint(&run.optimizer, &at(self, run))?;
            }
        }
        epoch_run.done = epoch_run.skip + steps_now;
        Ok(None)
    }

    /// Logs the interval of optimizer `steps` (first, last) just ended, over all ranks (a
    /// collective): a metrics line and its loss added to the epoch's. Returns the progress
    /// bar's status text; a loss that is not finite fails the run.
    fn log_interval(
        &mut self,
        run: &mut RunState,
        interval: &mut LossTally,
        epoch: usize,
        (first_step, step): (usize, usize),
        lr: f64,
    ) -> Result<String, TrainError> {
        let reduced = interval.reduce(self.comm)?;
        let (loss, n, secs) = (reduced.mean(), reduced.samples, reduced.secs);
        if !loss.is_finite() {
            return Err(TrainError::NonFinite {
                value: loss,
                epoch,
                first_step,
                last_step: step,
            });
        }
        run.metrics.add_interval(&reduced.step_sums, n, secs);
        let rate = n / secs.max(1e-9);
        let names = self.model.loss_terms();
        let terms = TrainTerms(
            names
                .into_iter()
                .zip(reduced.terms.iter().copied())
                .collect(),
        );
        let shown: String = terms.iter().map(|(n, v)| format!("  {n} {v:.4}")).collect();
        let text = format!("loss {loss:.4}{shown}  lr {lr:.2e}  {rate:.0} samples/s");
        self.reporter.interval(&format!(
            "epoch {}/{} step {step}/{}  {text}",
            epoch + 1,
            self.plan.train.epochs,
            run.total_steps,
        ));
        if let Some(leader) = &self.leader {
            leader.log_step(epoch, step, (loss, lr, rate), reduced.grad_norm, terms)?;
        }
        Ok(text)
    }

    /// After an epoch's steps: its evaluation, its line and record, and its checkpoint.
    pub(super) fn end_epoch(
        &mut self,
        run: &mut RunState,
        epoch_run: &EpochRun,
        batches: &dyn BatchSource,
    ) -> Result<(), TrainError> {
        let (spec, t, epoch, step) = (self.plan, &self.plan.train, epoch_run.epoch, run.step);
        self.reporter.epoch_end();
        let (n, secs) = (run.metrics.epoch_samples, run.metrics.epoch_secs);
        let train_loss = run.metrics.finish_epoch();
        run.epochs_done = epoch + 1;

        let fresh = run.fresh_eval.take();
        let was_fresh = fresh.is_some();
        let eval = match fresh {
            Some(eval) => eval,
            None => self.evaluate(batches, &run.optimizer)?,
        };
        let lr = run.schedule.lr(step.saturating_sub(1), epoch);
        let rate = n / secs.max(1e-9);
        // An epoch that train.max_steps or early stopping cut short is said to be.
        let ended = match epoch_run.done < epoch_run.groups {
            true => format!(
                "ended after {} of its {} steps",
                epoch_run.done, epoch_run.groups
            ),
            false => "done".to_string(),
        };
        self.reporter.line(&format!(
            "epoch {}/{} {ended}: train loss {train_loss:.4}, {}, {rate:.0} samples/s, {secs:.1} s",
            epoch + 1,
            t.epochs,
            eval.describe(),
        ));
        if let Some(leader) = &self.leader {
            leader.log_epoch(
                epoch,
                step,
                train_loss,
                lr,
                rate,
                &eval,
                secs,
                run.total_steps,
            )?;
            if let Err(warning) = leader.draw_curves() {
                self.reporter.line(&format!("warning: {warning}"));
            }
        }
        let done = epoch_run.done;
        let at = self.epoch_end_position(epoch_run, done, step, &run.optimizer, lr, &run.metrics);
        if !was_fresh {
            run.stopped_early = self.record_eval(&eval, run, at, false)?;
        }
        run.last_eval = Some(eval);
        // The last step's mid-epoch checkpoint is taken here, after evaluation, as an epoch one.
        let events = Events::of(spec, self.hooks.vote_every);
        if events.checkpoint_after_epoch(epoch, step) {
            let position =
                self.epoch_end_position(epoch_run, done, step, &run.optimizer, lr, &run.metrics);
            self.save_checkpoint(&run.optimizer, &position)?;
        }
        Ok(())
    }
}
