//! The model kit: the layers every family builds from, so that a family is a file or a small
//! folder of its own wiring. Parameters come from a `ParamBuilder`, which a `WeightSource`
//! gives and then fills (drawn, blank for a checkpoint, or read from what `init_from`
//! names); `Linear` (with its LoRA adapter), `LayerNorm` and the residual addition are the
//! layers; `attention` is the
//! causal self-attention (one fused CPU op for f32, q, k and v apart on a GPU, candle's ops
//! elsewhere), `head` the output projection with its cross-entropy by vocabulary blocks,
//! `packed` packed rows (attention restarted at each example), `layered` the block-by-block
//! passes of activation checkpointing and gradient sharding. The ops themselves (norms, RoPE,
//! SwiGLU, softmax, dropout) are `ddpjob_kernels`'.
//!
//! It must not know a family: gpt and llama import it, never the other way round.

pub(crate) mod attention;
pub(crate) mod head;
pub(crate) mod layered;
mod linear;
pub(crate) mod lora;
mod norm;
pub mod packed;
mod params;
mod source;

pub(crate) use linear::Linear;
pub(crate) use norm::{LayerNorm, add_residual};
pub(crate) use params::ParamBuilder;
pub(crate) use source::{Reading, WeightSource};
