//! The seams every other room of ddpjob meets at: the [`Model`] a trainer drives and the
//! [`Params`] it names, the [`Task`] a job learns from with its metrics and batches, and what a
//! model or dataset builder is handed ([`ModelContext`]) and may return. The model families,
//! the storage (checkpoints, Hugging Face directories), the data sets, the trainer and the
//! registry all depend on these types and on nothing of each other's through them.
//!
//! It depends on candle, the job spec (`ddpjob-spec`: precision, LoRA), the seeded RNG and the
//! shared loss (`ddpjob-kernels`) only: never on a model family, a dataset, a checkpoint or
//! the registry.

pub mod adapters;
mod context;
pub mod freeze;
pub mod gate;
pub mod metric;
mod model;
pub mod packed;
mod params;
pub mod row_passes;
mod store;
pub mod task;
mod thread_switch;

pub use context::{BuildError, Contents, DatasetOptions, JobFile, ModelContext, compute_dtype};
pub use freeze::FrozenSet;
pub use metric::{EvalSums, Metric, MetricInfo, MetricValues};
pub use model::{
    CollectedGradients, GradientSink, KvCache, KvDecoder, Mode, Model, TrainPass,
    chain_train_flops, hand_over_all, log_likelihoods,
};
pub use packed::PackedWeight;
pub use params::{Params, parameter_values, set_parameter, zeroed_parameter_values};
pub use store::ParamStore;
pub use task::{BatchSource, DataError, ModelInput, Task};
