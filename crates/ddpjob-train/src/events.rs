//! When things happen in a run: after which optimizer steps the trainer logs an interval, reads
//! the stop vote, evaluates and checkpoints, and after which epochs it checkpoints. Each is a
//! function of the step's number and whether it is the last its epoch runs, and nothing else,
//! so every rank finds the same events due and joins the same collectives (a log interval's
//! reduce, the vote's read, the evaluation's sums, a sharded checkpoint's gather). The epoch
//! loop asks [`Events::after_step`] what is due and does it; each policy is tested here, alone.

use crate::config::TrainPlan;

/// The schedule of a run's events, from `[train]` and `[checkpoint]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Events {
    /// `train.log_every`: a log interval ends every that many steps.
    pub log_every: usize,
    /// How often the stop vote is read between log lines (`Hooks::vote_every`).
    pub vote_every: usize,
    /// `train.eval_every`: a mid-epoch evaluation every that many steps.
    pub eval_every: Option<usize>,
    /// `checkpoint.every_steps` and `checkpoint.every_epochs`.
    pub checkpoint_every_steps: Option<usize>,
    pub checkpoint_every_epochs: Option<usize>,
}

/// What is due after one optimizer step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Due {
    /// The log interval ends: its loss is reduced over ranks, logged and recorded.
    pub log: bool,
    /// The stop vote is read (every rank's, so all stop after the same step).
    pub vote: bool,
    /// A mid-epoch evaluation.
    pub eval: bool,
    /// A mid-epoch checkpoint.
    pub checkpoint: bool,
}

impl Events {
    /// The events of `plan`, the stop vote read every `vote_every` steps.
    pub fn of(plan: TrainPlan<'_>, vote_every: usize) -> Self {
        Events {
            log_every: plan.train.log_every,
            vote_every,
            eval_every: plan.train.eval_every,
            checkpoint_every_steps: plan.checkpoint.every_steps,
            checkpoint_every_epochs: plan.checkpoint.every_epochs,
        }
    }

    /// What is due after optimizer step `step` (counted from 1 over the run); `last`: it is
    /// the last step its epoch runs, whose evaluation and checkpoint are the epoch end's
    /// ([`Self::checkpoint_after_epoch`]), so none is due mid-epoch there.
    pub fn after_step(&self, step: usize, last: bool) -> Due {
        let every = |n: Option<usize>| n.is_some_and(|n| step.is_multiple_of(n));
        let checkpoint = !last && every(self.checkpoint_every_steps);
        // A checkpoint ends a log interval, so the steps it holds are logged before it, and a
        // resume from it starts a fresh interval as the uninterrupted run does.
        let log = last || checkpoint || every(Some(self.log_every));
        // Every log line reads the vote too: a stop request is never left waiting past one.
        let vote = log || every(Some(self.vote_every.max(1)));
        Due {
            log,
            vote,
            eval: !last && every(self.eval_every),
            checkpoint,
        }
    }

    /// Whether a checkpoint is due at the end of epoch `epoch` (counted from 0), whose last
    /// step was `step`: every `checkpoint.every_epochs` epochs, or a step checkpoint that fell
    /// on the epoch's last step (taken after the epoch's evaluation, as an epoch one).
    pub fn checkpoint_after_epoch(&self, epoch: usize, step: usize) -> bool {
        let epochs = self
            .checkpoint_every_epochs
            .is_some_and(|n| (epoch + 1).is_multiple_of(n));
        epochs
            || self
                .checkpoint_every_steps
                .is_some_and(|n| step.is_multiple_of(n))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn events() -> Events {
        Events {
            log_every: 5,
            vote_every: 2,
            eval_every: Some(3),
            checkpoint_every_steps: Some(4),
            checkpoint_every_epochs: None,
        }
    }

    /// The steps of 1..=n at which `what` is due, the epoch's last step being `n`.
    fn due_at(e: &Events, n: usize, what: fn(Due) -> bool) -> Vec<usize> {
        (1..=n).filter(|&s| what(e.after_step(s, s == n))).collect()
    }

    #[test]
    fn a_log_interval_ends_on_schedule_at_a_checkpoint_and_at_the_epochs_last_step() {
        let e = events();
        assert_eq!(due_at(&e, 12, |d| d.log), [4, 5, 8, 10, 12]);
        let plain = Events {
            checkpoint_every_steps: None,
            ..e
        };
        assert_eq!(due_at(&plain, 7, |d| d.log), [5, 7]);
    }

    #[test]
    fn the_vote_is_read_on_its_schedule_and_at_every_log_line() {
        let e = events();
        assert_eq!(due_at(&e, 9, |d| d.vote), [2, 4, 5, 6, 8, 9]);
        // Read every step when asked to; never less often than the log.
        let every = Events { vote_every: 1, ..e };
        assert_eq!(due_at(&every, 4, |d| d.vote), [1, 2, 3, 4]);
        let zero = Events { vote_every: 0, ..e };
        assert_eq!(due_at(&zero, 3, |d| d.vote), [1, 2, 3]);
    }

    #[test]
    fn mid_epoch_evaluations_and_checkpoints_leave_the_last_step_to_the_epoch_end() {
        let e = events();
        assert_eq!(due_at(&e, 12, |d| d.eval), [3, 6, 9]);
        assert_eq!(due_at(&e, 12, |d| d.checkpoint), [4, 8]);
        // Step 12 is a step checkpoint's, taken as the epoch's.
        assert!(e.checkpoint_after_epoch(0, 12) && !e.checkpoint_after_epoch(0, 11));
        let none = Events {
            eval_every: None,
            checkpoint_every_steps: None,
            ..e
        };
        assert!(due_at(&none, 12, |d| d.eval || d.checkpoint).is_empty());
    }

    #[test]
    fn epoch_checkpoints_count_epochs_from_one() {
        let e = Events {
            checkpoint_every_epochs: Some(5),
            checkpoint_every_steps: Some(100),
            ..events()
        };
        assert!(e.checkpoint_after_epoch(4, 37) && !e.checkpoint_after_epoch(0, 37));
        assert!(e.checkpoint_after_epoch(0, 200) && !e.checkpoint_after_epoch(0, 150));
    }
}
