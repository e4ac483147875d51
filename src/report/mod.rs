//! What a run tells its users besides its weights: `[expect]` checked against the summary, the
//! JUnit report for CI, the curves drawn from `metrics.jsonl`, and the job views of `show`/`list`.

pub mod curves;
pub mod expect;
pub mod history;
pub mod junit;
pub mod show;
pub mod view;

pub use expect::{ExpectationResult, check, unmet_report};
pub use view::JobView;
