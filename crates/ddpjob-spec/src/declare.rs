//! `section!`: one declaration per config key. A key is written once, in `keys.rs`, with its
//! documentation, its serde type and default, and the check that turns its value into the
//! typed one the program uses; the macro makes the serde struct, its `Default`, the checked
//! struct, and the key table that unknown-key errors, `--set`, `ddpjob keys` and the book's
//! config table are made from (rustc declares its `-C` options the same way).

use std::collections::BTreeMap;

use super::schema::{KeySpec, Kind};

/// What a serde value type looks like in a job file, and the keys under it when it is a table.
pub trait ValueKind {
    const KIND: Kind;

    /// The keys of a `[section]` type, under `path`; nothing for a value.
    fn keys_under(_path: &str) -> Vec<KeySpec> {
        Vec::new()
    }
}

macro_rules! value_kind {
    ($($ty:ty => $kind:ident),+ $(,)?) => {
        $(impl ValueKind for $ty {
            const KIND: Kind = Kind::$kind;
        })+
    };
}

value_kind! {
    i64 => Int,
    f64 => Float,
    bool => Bool,
    String => Str,
    Vec<i64> => IntList,
    Vec<f64> => FloatList,
    Vec<String> => StrList,
    // `model.lora.target_modules`: names, or one regular expression (PEFT's two forms).
    super::lora::TargetModules => StrListOrStr,
    BTreeMap<String, String> => StrMap,
    // The one key that takes either: `nproc_per_node = "auto"` or a number.
    toml::Value => AutoOrInt,
}

impl<T: ValueKind> ValueKind for Option<T> {
    const KIND: Kind = T::KIND;
}

/// A declared section: its keys' checks, run together.
pub trait Section {
    type Checked;

    /// Checks every key (all problems go to `c`) and returns the typed values; they are only
    /// used when `c` has no errors.
    fn check(&self, c: &mut super::checks::Checker) -> Self::Checked;
}

/// `prefix.key`, or `key` at the root.
pub fn join(prefix: &str, key: &str) -> String {
    // A key named as a Rust keyword is declared as a raw identifier (`r#type`).
    let key = key.trim_start_matches("r#");
    if prefix.is_empty() {
        key.to_string()
    } else {
        format!("{prefix}.{key}")
    }
}

/// A doc comment's lines as one line of Markdown.
pub fn one_line(lines: &[&str]) -> String {
    lines
        .iter()
        .map(|l| l.trim())
        .filter(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join(" ")
}

/// How the config reference shows a default: `shown` when the declaration words it, else the
/// TOML value in backticks (`none` for an absent optional key).
pub fn shown_default<T: serde::Serialize>(value: &T, shown: Option<&str>) -> String {
    if let Some(words) = shown {
        return words.to_string();
    }
    match toml::Value::try_from(value) {
        Ok(v) => format!("`{v}`"),
        Err(_) => "none".to_string(),
    }
}

/// The entries of one key: the key itself, and for a `[section]` every key under it.
pub fn entries<T: ValueKind>(path: String, default: String, doc: String) -> Vec<KeySpec> {
    let mut out = Vec::new();
    if T::KIND == Kind::Table {
        out.push(KeySpec {
            path: path.clone(),
            kind: Kind::Table,
            default: String::new(),
            doc,
        });
        out.extend(T::keys_under(&path));
    } else {
        out.push(KeySpec {
            path,
            kind: T::KIND,
            default,
            doc,
        });
    }
    out
}

/// Declares a config section: its serde struct (`$raw`, every key optional in the file, unknown
/// keys refused), the struct of its checked values (`$checked`, with `+ Copy` and such for
/// more derives), and, per key, what it means (the doc comment), its serde type and default,
/// optionally how the config reference words the default (`shown`), and `=> field: Type = check`: the checked struct's field and the check that
/// makes it, called as `check(checker, "section.key", &value, &section)`.
macro_rules! section {
    (
        $(#[doc = $sdoc:literal])+
        $raw:ident at $path:literal, checked into $checked:ident $(+ $derive:ident)* {
            $(
                $(#[doc = $doc:literal])+
                $(#[serde($($serde:tt)*)])*
                $key:ident: $raw_ty:ty = $default:expr $(, shown $shown:literal)?
                    => $field:ident: $ty:ty = $check:expr;
            )+
        }
    ) => {
        $(#[doc = $sdoc])+
        #[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
        #[serde(deny_unknown_fields, default)]
        pub struct $raw {
            $(
                $(#[doc = $doc])+
                $(#[serde($($serde)*)])*
                pub $key: $raw_ty,
            )+
        }

        impl Default for $raw {
            fn default() -> Self {
                Self {
                    $($key: $default,)+
                }
            }
        }

        $(#[doc = $sdoc])+
        #[derive(Debug, Clone, PartialEq $(, $derive)*)]
        pub struct $checked {
            $(
                $(#[doc = $doc])+
                pub $field: $ty,
            )+
        }

        impl $crate::declare::ValueKind for $raw {
            const KIND: $crate::schema::Kind = $crate::schema::Kind::Table;

            fn keys_under(path: &str) -> Vec<$crate::schema::KeySpec> {
                let defaults = $raw::default();
                let mut out = Vec::new();
                $(
                    out.extend($crate::declare::entries::<$raw_ty>(
                        $crate::declare::join(path, stringify!($key)),
                        $crate::declare::shown_default(
                            &defaults.$key,
                            None$(.or(Some($shown)))?,
                        ),
                        $crate::declare::one_line(&[$($doc),+]),
                    ));
                )+
                out
            }
        }

        impl $crate::declare::Section for $raw {
            type Checked = $checked;

            fn check(&self, c: &mut $crate::checks::Checker) -> $checked {
                $checked {
                    $(
                        $field: ($check)(
                            c,
                            &$crate::declare::join($path, stringify!($key)),
                            &self.$key,
                            self,
                        ),
                    )+
                }
            }
        }
    };
}

pub(crate) use section;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checks::{Checker, at_least, zero_is_off};
    use crate::source::Source;

    section! {
        /// A section made for this test.
        RawDemo at "demo", checked into DemoKeys {
            /// how many, at least
            /// two
            count: i64 = 3 => count: usize = at_least(2);
            /// every N steps
            every: i64 = 0, shown "`0` (off)" => every: Option<usize> = zero_is_off();
        }
    }

    #[test]
    fn one_declaration_gives_the_struct_its_defaults_the_key_table_and_the_checks() {
        let raw = RawDemo::default();
        assert_eq!((raw.count, raw.every), (3, 0));
        let keys = RawDemo::keys_under("demo");
        let rows: Vec<(String, Kind, String, String)> = keys
            .into_iter()
            .map(|k| (k.path, k.kind, k.default, k.doc))
            .collect();
        assert_eq!(
            rows,
            [
                (
                    "demo.count".into(),
                    Kind::Int,
                    "`3`".into(),
                    "how many, at least two".into()
                ),
                (
                    "demo.every".into(),
                    Kind::Int,
                    "`0` (off)".into(),
                    "every N steps".into()
                ),
            ]
        );
        let source = Source::parse(std::path::Path::new("demo.toml"), String::new(), &[]).unwrap();
        let mut c = Checker {
            source: &source,
            errors: Vec::new(),
        };
        let checked = RawDemo { count: 5, every: 4 }.check(&mut c);
        assert_eq!((checked.count, checked.every), (5, Some(4)));
        assert!(c.errors.is_empty());
        RawDemo { count: 1, every: 0 }.check(&mut c);
        let errors: Vec<String> = c.errors.iter().map(|e| e.to_string()).collect();
        assert_eq!(errors.len(), 1, "{errors:?}");
        assert!(
            errors[0].contains("demo.count") && errors[0].contains("must be at least 2, got 1"),
            "{errors:?}"
        );
        // Unknown keys in the file are refused by serde as well.
        let bad: Result<RawDemo, _> = toml::from_str("cont = 2");
        assert!(bad.is_err());
    }
}
