//! Everything ddpjob keeps on disk and reads back: the job directory, its records and where
//! rank 0 sends them (`metrics.jsonl`, TensorBoard event files) ([`jobdir`]), checkpoints that are complete or absent ([`checkpoint`], the only code that
//! knows their layout), Hugging Face model directories and PEFT adapters in and out ([`hf`]),
//! and the vocabularies and tokenizers text is encoded with ([`vocab`], [`hf_tokenizer`]).
//!
//! It depends on the seams (`ddpjob-seam`: a model's named [`ddpjob_seam::Params`]) and the job
//! spec only: never on a model family, a dataset, the trainer or the registry. A family reads
//! its `config.json` fields itself; this crate finds the files and moves the tensors.

pub mod checkpoint;
pub mod hf;
pub mod hf_tokenizer;
pub mod jobdir;
pub mod vocab;
