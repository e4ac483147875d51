//! The trainer (`ddpjob-train`), as the rest of the root reaches it; its tests that build
//! models and open data through the registry are here.

pub use ddpjob_train::*;

#[cfg(test)]
mod tests;
