//! Training objectives beyond a task's own loss, each a [`ddpjob_seam::Model`] that wraps the
//! model being trained (the policy) so the trainer, evaluation, checkpoints and reports run
//! unchanged: an objective declares what its batches hold (a task of the data crate makes
//! them), computes its loss and logged terms, and fills the evaluation sums its task's
//! metrics read. Direct Preference Optimization is the first ([`Dpo`], as TRL's
//! `DPOTrainer`); another (ORPO, KTO, a reward model) is a module here and a
//! `train.objective` name.
//!
//! It depends on the seams (`ddpjob-seam`), the spec and candle only: never on a model family,
//! a dataset or the trainer.

mod dpo;
pub mod dpo_loss;
mod logps;
pub mod precompute;
pub mod reference;
mod row_passes;

pub use dpo::Dpo;
pub use dpo_loss::DpoSettings;
pub use reference::{Reference, ReferenceTable};
