//! The checks a key's declaration names (`=> field: Type by check`), and the [`Checker`] that
//! collects every problem of a job file instead of stopping at the first. A check is called
//! as `check(checker, "section.key", &value, &section)` and returns the typed value, which is
//! used only when no check failed.

use super::error::ConfigError;
use super::source::Source;

/// Collects every invalid value, each with the key and where it was written.
pub struct Checker<'a> {
    pub source: &'a Source,
    pub errors: Vec<ConfigError>,
}

impl Checker<'_> {
    pub fn fail(&mut self, key: &str, problem: impl Into<String>) {
        self.errors.push(ConfigError::Invalid {
            key: key.to_string(),
            at: self.source.value_origin(key),
            problem: problem.into(),
        });
    }

    pub fn at_least(&mut self, key: &str, value: i64, min: i64) -> usize {
        if value < min {
            self.fail(key, format!("must be at least {min}, got {value}"));
        }
        value.max(min).max(0) as usize
    }

    pub fn in_int_range(&mut self, key: &str, value: i64, min: i64, max: i64) -> usize {
        if !(min..=max).contains(&value) {
            self.fail(key, format!("must be between {min} and {max}, got {value}"));
        }
        value.clamp(min, max).max(0) as usize
    }

    pub fn positive(&mut self, key: &str, value: f64) -> f64 {
        if !(value.is_finite() && value > 0.0) {
            self.fail(key, format!("must be a number greater than 0, got {value}"));
        }
        value
    }

    pub fn non_negative(&mut self, key: &str, value: f64, zero_means: &str) -> f64 {
        if !(value.is_finite() && value >= 0.0) {
            self.fail(key, format!("must be 0{zero_means} or more, got {value}"));
        }
        value
    }

    pub fn in_range(&mut self, key: &str, value: f64, lo: f64, hi_exclusive: f64) -> f64 {
        if !(value >= lo && value < hi_exclusive) {
            self.fail(
                key,
                format!("must be in [{lo}, {hi_exclusive}), got {value}"),
            );
        }
        value
    }

    pub fn one_of(&mut self, key: &str, value: &str, choices: &[&str]) {
        if !choices.contains(&value) {
            let quoted: Vec<String> = choices.iter().map(|c| format!("\"{c}\"")).collect();
            self.fail(
                key,
                format!(
                    "unknown value \"{value}\"; expected one of {}",
                    quoted.join(", ")
                ),
            );
        }
    }
}

/// LoRA's target modules, a regular expression checked to be one.
pub fn target_modules<S>()
-> impl Fn(&mut Checker, &str, &super::lora::TargetModules, &S) -> super::lora::TargetModules {
    |c, key, v, _| {
        if let Err(problem) = v.check() {
            c.fail(key, problem);
        }
        v.clone()
    }
}

/// The value as it is (checked elsewhere, or nothing to check).
pub fn any<T: Clone, S>() -> impl Fn(&mut Checker, &str, &T, &S) -> T {
    |_, _, v, _| v.clone()
}

/// An integer of at least `min`.
pub fn at_least<S>(min: i64) -> impl Fn(&mut Checker, &str, &i64, &S) -> usize {
    move |c, key, &v, _| c.at_least(key, v, min)
}

/// 0 (off: `None`) or a positive count.
pub fn zero_is_off<S>() -> impl Fn(&mut Checker, &str, &i64, &S) -> Option<usize> {
    |c, key, &v, _| Some(c.at_least(key, v, 0)).filter(|&n| n > 0)
}

/// A finite number greater than 0.
pub fn positive<S>() -> impl Fn(&mut Checker, &str, &f64, &S) -> f64 {
    |c, key, &v, _| c.positive(key, v)
}

/// A finite number of 0 or more.
pub fn non_negative<S>() -> impl Fn(&mut Checker, &str, &f64, &S) -> f64 {
    |c, key, &v, _| c.non_negative(key, v, "")
}

/// 0 (off: `None`) or a positive number.
pub fn zero_is_off_f64<S>() -> impl Fn(&mut Checker, &str, &f64, &S) -> Option<f64> {
    |c, key, &v, _| Some(c.non_negative(key, v, " (off)")).filter(|&x| x > 0.0)
}

/// A number in `[lo, hi)`.
pub fn in_range<S>(lo: f64, hi: f64) -> impl Fn(&mut Checker, &str, &f64, &S) -> f64 {
    move |c, key, &v, _| c.in_range(key, v, lo, hi)
}

/// One of the named values; an unknown name is an error listing them (the first is the
/// stand-in returned with it).
pub fn choice<T: Copy, S>(
    choices: &'static [(&'static str, T)],
) -> impl Fn(&mut Checker, &str, &String, &S) -> T {
    move |c, key, v, _| {
        let names: Vec<&str> = choices.iter().map(|(n, _)| *n).collect();
        c.one_of(key, v, &names);
        choices
            .iter()
            .find(|(n, _)| n == v)
            .unwrap_or(&choices[0])
            .1
    }
}

/// An optional key: `check` when it is given.
pub fn optional<R, T, S>(
    check: impl Fn(&mut Checker, &str, &R, &S) -> T,
) -> impl Fn(&mut Checker, &str, &Option<R>, &S) -> Option<T> {
    move |c, key, v, section| v.as_ref().map(|v| check(c, key, v, section))
}
