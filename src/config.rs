//! The job file as this binary reads it: `ddpjob-spec`'s validated types (re-exported whole),
//! loaded with the models and datasets of the installed [`Registry`].

use std::path::Path;

pub use ddpjob_spec::*;

use crate::registry::Registry;

/// Reads and validates the job file at `path`, with `--set key.path=value` overrides applied.
pub fn load(path: &Path, overrides: &[String]) -> Result<LoadedConfig, ConfigError> {
    load_with(path, overrides, Registry::current())
}

/// As [`load`], from text already read (`path` is used for messages and the default name).
#[cfg(test)]
pub fn load_str(
    path: &Path,
    text: String,
    overrides: &[String],
) -> Result<LoadedConfig, ConfigError> {
    load_str_with(path, text, overrides, Registry::current())
}

/// As [`load_str`], for `text` put together from the files `label` names (`path` is the
/// file it stands for): messages name `label` rather than lines of `text`.
pub fn load_composed(
    path: &Path,
    label: String,
    text: String,
    overrides: &[String],
) -> Result<LoadedConfig, ConfigError> {
    load_composed_with(path, label, text, overrides, Registry::current())
}

#[cfg(test)]
mod custom_tests;
#[cfg(test)]
mod tests;
