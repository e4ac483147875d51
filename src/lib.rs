//! ddpjob: data-parallel training jobs for Candle, driven by TOML job files — what torchrun and
//! DistributedDataParallel do for PyTorch, in one binary.
//!
//! `ddpjob run job.toml` validates the config, creates the job directory, hosts the rendezvous
//! store and spawns one worker process per slot; each worker trains with gradients averaged
//! over the ranks once per optimizer step (a [`Communicator`]: NCCL on GPUs, a TCP ring between
//! CPU workers), checkpoints, and resumes.
//!
//! # Your own model
//!
//! The library's surface is what a trainer of your own needs: implement [`Model`] for your
//! network (built with `candle_nn` through a [`ParamStore`]), optionally [`Task`] for your data
//! (or return a [`TensorDataset`]), register both in a [`Registry`] and hand it to
//! [`cli::main_with`], which gives your binary the whole command line (`run`, `resume`,
//! `validate`, `show`, `list`, `bench step`). Workers re-execute your binary, so they use the
//! same registry.
//!
//! ```
//! use candle_core::{Result, Tensor};
//! use candle_nn::{Linear, Module};
//! use ddpjob::{BuildError, Mode, Model, ModelContext, ModelInput, ParamStore, Params, Registry};
//! use serde::{Deserialize, Serialize};
//!
//! /// `[model]` keys besides `arch = "linear"`.
//! #[derive(Serialize, Deserialize)]
//! struct Options {
//!     #[serde(default)]
//!     bias: bool,
//! }
//!
//! struct LinearClassifier {
//!     fc: Linear,
//!     params: Params,
//! }
//!
//! impl LinearClassifier {
//!     fn build(o: &Options, cx: &ModelContext) -> std::result::Result<Self, BuildError> {
//!         let ModelInput::Image { shape, classes } = cx.input else {
//!             return Err("this model learns from images".into());
//!         };
//!         let store = ParamStore::new(cx);
//!         let inputs = shape.iter().product();
//!         let vb = store.var_builder().pp("fc");
//!         let fc = if o.bias {
//!             candle_nn::linear(inputs, classes, vb)?
//!         } else {
//!             candle_nn::linear_no_bias(inputs, classes, vb)?
//!         };
//!         Ok(LinearClassifier { fc, params: store.finish() })
//!     }
//! }
//!
//! impl Model for LinearClassifier {
//!     fn forward(&self, xs: &Tensor, _: &Mode) -> Result<Tensor> {
//!         self.fc.forward(&xs.flatten_from(1)?)
//!     }
//!     fn params(&self) -> &Params {
//!         &self.params
//!     }
//! }
//!
//! let registry = Registry::builtin().model("linear", LinearClassifier::build);
//! assert_eq!(registry.model_names(), ["cnn", "gpt", "linear", "llama", "mlp"]);
//! // fn main() -> ddpjob::ExitCode { ddpjob::cli::main_with(registry) }
//! ```

#![warn(missing_docs)]

// Printing that never panics (`outln!`, `out!`, `errln!`: a closed pipe drops the line), as
// the trainer prints; in scope for every module below.
#[macro_use]
extern crate ddpjob_train;

mod bench;
use ddpjob_data as data;
use ddpjob_optim as optim;
use ddpjob_storage::{checkpoint, hf, jobdir};
use ddpjob_train::{fault, progress};
pub mod cli;
mod config;
mod device;
mod evaluate;
mod generate;
mod launch;
mod memory;
mod models;
mod numerics;
mod objective;
mod registry;
mod report;
mod signals;
mod task;
mod train;
mod worker;

/// candle's backward pass as patched in `vendor/candle-core` (see its PATCHES.md).
#[cfg(test)]
mod backprop_tests;

pub use std::process::ExitCode;

pub use data::{DataError, TensorDataset};
pub use ddpjob_comm::{CommError, Communicator};

pub use models::gate::{self as block_gate, BlockGate, Unit as BlockUnit};
pub use models::{GradientSink, Mode, Model, ParamStore, Params, TrainPass};
pub use registry::{
    BuildError, DataContext, DatasetOptions, JobFile, LanguageModelOptions, LanguageModelSpec,
    ModelContext, Registry,
};
pub use task::{BatchSource, EvalSums, IGNORE_TARGET, Metric, MetricInfo, ModelInput, Task};

/// What the end-to-end tests compare against; not part of the API.
#[doc(hidden)]
pub mod testing {
    pub use crate::report::curves::{ACCURACY_COLOR, LR_COLOR, TEST_COLOR, TRAIN_COLOR};
}
