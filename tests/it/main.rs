//! End-to-end tests of the real `ddpjob` binary: real processes, files and sockets.

mod common;

mod accumulation;
mod arrow_data;
mod bench;
mod chat;
mod ci;
mod cluster;
mod compat;
mod devices;
mod distributed;
mod download;
mod early_stopping;
mod fake_hub;
mod finetune;
mod full_sharding;
mod gpu_check;
mod hangs;
mod hub;
mod hub_data;
mod invariant;
mod language;
mod mlflow;
mod moe;
mod nodes;
mod open_models;
mod recompute;
mod resume;
mod run;
mod sharding;
mod shell;
mod show;
mod tensorboard;
mod text_rows;
mod validate;
mod verify;
