//! What a run tells its users besides its weights: `[expect]` checked against the summary, the
//! JUnit report for CI, the curves drawn from `metrics.jsonl`, and the job views of `show`/`list`
//! (as text and as JSON).

pub mod curves;
pub mod expect;
pub mod history;
pub mod json;
pub mod junit;
/// The `metrics.jsonl` records: the job directory's format, read and written in the storage
/// crate.
pub use crate::jobdir::record;
pub mod show;
pub mod view;

pub use expect::{check, unmet_report};
pub use view::JobView;
