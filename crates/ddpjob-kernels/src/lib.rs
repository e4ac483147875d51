//! ddpjob's kernels: the ops its models are made of, each with its CPU reference, its fused CPU
//! fast path and, behind the `cuda` feature, its CUDA source (compiled at run time by NVRTC,
//! `nvrtc`), plus the loss every task shares ([`loss`]). An op with a device kernel is a
//! folder (`causal_softmax/`, `conv/`, `cross_entropy/`, `dropout/`, `gelu/`, `layer_norm/`,
//! `optim/`, `rms_norm/`, `rope/`, `scored_mean/`, `swiglu/`): its CPU paths in `mod.rs`, the
//! op held to its host reference on a GPU in `device.rs` where it has one, its source and
//! launches in `cuda.rs`. Every launch goes through one helper (`launch`: a compiled module,
//! a call's arguments in order, the f32 or bf16 instance); `rows` holds the SIMD row loops
//! the CPU paths share.
//!
//! Fused CPU kernels for the layers ddpjob's models are made of. Candle's CPU ops allocate a
//! tensor per op and its autograd computes a gradient for every input of every op; a layer here
//! runs its forward in one pass and its backward as a few GEMMs, and skips the input gradient
//! when nothing upstream needs it (the first layer). Used for f32 on the CPU; other devices keep
//! candle's own ops, which the tests check these against.
//!
//! This crate sits at the bottom of the workspace: it depends on candle and numeric crates
//! only (and serde, for GELU's form, which job files name), never on another ddpjob crate (its tests use `ddpjob-rng`), so a model, an optimiser
//! or a loss can use any kernel without a circle.

mod bf16_products;
mod causal_softmax;
mod conv;
mod cross_entropy;
mod device_code;
pub mod dropout;
mod flash_attention;
mod gelu;
mod grouped_linear;
mod host;
#[cfg(feature = "cuda")]
pub mod launch;
mod layer_norm;
mod linear;
mod lora_linear;
pub mod loss;
#[cfg(feature = "cuda")]
pub mod nvrtc;
mod optim;
mod pool;
pub mod quant4;
mod rms_norm;
pub mod rope;
pub mod rows;
mod scored_mean;
pub mod scratch;
pub mod storage;
mod swap_middle;
mod swiglu;
#[doc(hidden)]
pub mod testing;
mod transpose;

pub use bf16_products::{bf16_products, set_bf16_products};
pub use causal_softmax::{causal_softmax, causal_softmax_with_ops};
pub use conv::unfolded::{applies as conv2d_unfolded_applies, bias_relu, conv2d_unfolded};
pub use conv::{ConvGeometry, Pooling, conv2d};
pub use conv::{ConvLayer, ConvOutput};
pub use cross_entropy::{applies as row_cross_entropy_applies, row_cross_entropy};
pub use flash_attention::{
    Attention, flash_attention, flash_attention_backward, flash_attention_forward,
};
pub use gelu::{Activation, gelu};
pub use grouped_linear::{
    applies as grouped_linear_applies, grouped_linear, grouped_linear_with_ops,
};
pub use host::*;
pub use layer_norm::{layer_norm, layer_norm_bwd_into, layer_norm_into, layer_norm_with_ops};
pub use linear::linear;
pub use linear::{
    Wanted, backward as linear_backward, forward as linear_forward, relu_grad, relu_in_place,
};
pub use lora_linear::{AdapterDropout, lora_linear, lora_linear_4bit};
#[cfg(feature = "cuda")]
pub use optim::cuda::adam_step_on_gpu;
pub use optim::{
    AdamStep, SgdStep, adam_step, add_pairs, overwrite_except, scaled, sgd_step, sum_of_squares,
};
pub use rms_norm::{rms_norm, rms_norm_with_ops};
pub use scored_mean::scored_mean;
pub use swap_middle::swap_middle;
pub use swiglu::swiglu;
#[doc(hidden)]
pub use testing::{max_difference, same_with_gradients};
pub use transpose::transpose;

/// Compiles (NVRTC) every kernel of this crate that a GPU worker may launch, so that the first
/// step finds them ready (a GPU worker calls it before its first step); an error is kept for
/// the first use to report.
#[cfg(feature = "cuda")]
pub fn compile_gpu_kernels() {
    drop(every_ptx());
}

/// The PTX of every kernel source (or NVRTC's error for it).
#[cfg(feature = "cuda")]
fn every_ptx() -> Vec<candle_core::Result<&'static str>> {
    vec![
        causal_softmax::cuda::ptx(),
        conv::cuda::ptx(),
        cross_entropy::cuda::ptx(),
        dropout::cuda::ptx(),
        dropout::residual::ptx(),
        gelu::cuda::ptx(),
        layer_norm::cuda::ptx(),
        optim::cuda::ptx(),
        rms_norm::cuda::ptx(),
        rope::cuda::ptx(),
        scored_mean::cuda::ptx(),
        swap_middle::cuda::ptx(),
        swiglu::cuda::ptx(),
    ]
}

/// NVRTC compiles every kernel source (it needs no GPU, only its library).
#[cfg(all(test, feature = "cuda"))]
#[test]
fn every_gpu_kernel_compiles() {
    for ptx in every_ptx() {
        assert!(ptx.is_ok(), "{}", ptx.err().unwrap());
    }
}

#[cfg(test)]
mod tests;
