//! What transformers adds to Jinja for chat templates, as Python computes it: `tojson` as
//! `json.dumps(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)` writes
//! (minijinja's own writes compact JSON and escapes HTML characters), and `strftime_now`,
//! Python's `datetime.now().strftime` for the formats templates use (Llama 3.1's
//! `"%d %b %Y"`). It must not depend on anything but minijinja and serde_json.

use minijinja::value::Kwargs;
use minijinja::{Error, ErrorKind, Value};
use serde_json::Value as Json;

/// `x | tojson(indent=None, ensure_ascii=False, sort_keys=False, separators=None)`.
pub fn tojson(value: &Value, kwargs: Kwargs) -> Result<String, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let separators: Option<Vec<String>> = kwargs.get("separators")?;
    kwargs.assert_all_used()?;
    let json = serde_json::to_value(value).map_err(|e| {
        Error::new(
            ErrorKind::InvalidOperation,
            "tojson: cannot write it as JSON",
        )
        .with_source(e)
    })?;
    let (item, key) = match separators.as_deref() {
        Some([item, key]) => (item.clone(), key.clone()),
        Some(_) => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                "tojson: separators is a pair (item, key)",
            ));
        }
        // Python's defaults: ", " without indent, "," with it.
        None if indent.is_some() => (",".into(), ": ".into()),
        None => (", ".into(), ": ".into()),
    };
    let style = Style {
        indent,
        item,
        key,
        ascii: ensure_ascii.unwrap_or(false),
        sort: sort_keys.unwrap_or(false),
    };
    let mut out = String::new();
    write(&json, &style, 0, &mut out);
    Ok(out)
}

struct Style {
    indent: Option<usize>,
    item: String,
    key: String,
    ascii: bool,
    sort: bool,
}

fn write(v: &Json, s: &Style, depth: usize, out: &mut String) {
    let newline = |out: &mut String, depth: usize| {
        if let Some(n) = s.indent {
            out.push('\n');
            out.push_str(&" ".repeat(n * depth));
        }
    };
    match v {
        Json::Null => out.push_str("null"),
        Json::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Json::Number(n) => out.push_str(&python_number(n)),
        Json::String(text) => quote(text, s.ascii, out),
        Json::Array(items) if items.is_empty() => out.push_str("[]"),
        Json::Object(map) if map.is_empty() => out.push_str("{}"),
        Json::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&s.item);
                }
                newline(out, depth + 1);
                write(item, s, depth + 1, out);
            }
            newline(out, depth);
            out.push(']');
        }
        Json::Object(map) => {
            let mut entries: Vec<(&String, &Json)> = map.iter().collect();
            if s.sort {
                entries.sort_by(|a, b| a.0.cmp(b.0));
            }
            out.push('{');
            for (i, (k, item)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push_str(&s.item);
                }
                newline(out, depth + 1);
                quote(k, s.ascii, out);
                out.push_str(&s.key);
                write(item, s, depth + 1, out);
            }
            newline(out, depth);
            out.push('}');
        }
    }
}

/// A number as Python's `repr` writes it: integers plain, floats with a `.0` or an exponent
/// of two digits at least (`1e-05`).
fn python_number(n: &serde_json::Number) -> String {
    if n.is_i64() || n.is_u64() {
        return n.to_string();
    }
    let f = n.as_f64().unwrap_or(f64::NAN);
    let text = format!("{f:?}");
    match text.split_once('e') {
        Some((mantissa, exp)) => {
            let (sign, digits) = match exp.strip_prefix('-') {
                Some(d) => ("-", d),
                None => ("+", exp),
            };
            format!("{mantissa}e{sign}{digits:0>2}")
        }
        None => text,
    }
}

/// `text` as a JSON string, as Python escapes it.
fn quote(text: &str, ascii: bool, out: &mut String) {
    out.push('"');
    for c in text.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 || (ascii && !c.is_ascii()) => {
                let mut units = [0u16; 2];
                for u in c.encode_utf16(&mut units) {
                    out.push_str(&format!("\\u{u:04x}"));
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// The time now (UTC) in `format`'s `strftime` directives: %d %m %Y %y %H %M %S %I %p %b %B
/// %a %A %j %%; another directive is an error naming it.
pub fn now_utc(format: &str) -> Result<String, Error> {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64);
    strftime(secs, format)
}

fn strftime(secs: i64, format: &str) -> Result<String, Error> {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = [
        "Monday",
        "Tuesday",
        "Wednesday",
        "Thursday",
        "Friday",
        "Saturday",
        "Sunday",
    ];
    let (days, rest) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    let (year, month, day) = civil(days);
    let (hour, minute, second) = (rest / 3600, rest / 60 % 60, rest % 60);
    // 1970-01-01 was a Thursday (index 3).
    let weekday = (days + 3).rem_euclid(7) as usize;
    let ordinal = days - days_from_civil(year, 1, 1) + 1;
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let month_name = MONTHS[month as usize - 1];
        match chars.next() {
            Some('d') => out.push_str(&format!("{day:02}")),
            Some('m') => out.push_str(&format!("{month:02}")),
            Some('Y') => out.push_str(&year.to_string()),
            Some('y') => out.push_str(&format!("{:02}", year.rem_euclid(100))),
            Some('H') => out.push_str(&format!("{hour:02}")),
            Some('I') => out.push_str(&format!("{:02}", (hour + 11) % 12 + 1)),
            Some('p') => out.push_str(if hour < 12 { "AM" } else { "PM" }),
            Some('M') => out.push_str(&format!("{minute:02}")),
            Some('S') => out.push_str(&format!("{second:02}")),
            Some('j') => out.push_str(&format!("{ordinal:03}")),
            Some('b') => out.push_str(&month_name[..3]),
            Some('B') => out.push_str(month_name),
            Some('a') => out.push_str(&DAYS[weekday][..3]),
            Some('A') => out.push_str(DAYS[weekday]),
            Some('%') => out.push('%'),
            other => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    format!(
                        "strftime_now: the directive %{} is not supported (%d %m %Y %y %H %M %S \
                         %I %p %b %B %a %A %j are)",
                        other.map(String::from).unwrap_or_default()
                    ),
                ));
            }
        }
    }
    Ok(out)
}

/// The proleptic Gregorian date of `days` since 1970-01-01 (Howard Hinnant's algorithm).
fn civil(days: i64) -> (i64, i64, i64) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

fn days_from_civil(year: i64, month: i64, day: i64) -> i64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let mp = if month > 2 { month - 3 } else { month + 9 };
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Python: `datetime.fromtimestamp(1785513600, timezone.utc).strftime(...)` (2026-07-31,
    /// a Friday, day 212) and a leap day, 2024-02-29 13:05:09 (a Thursday).
    #[test]
    fn strftime_writes_what_python_writes() {
        assert_eq!(
            strftime(1_785_456_000, "%d %b %Y, %A %j").unwrap(),
            "31 Jul 2026, Friday 212"
        );
        assert_eq!(
            strftime(1_709_211_909, "%Y-%m-%d %H:%M:%S %I%p %a %B %y %%").unwrap(),
            "2024-02-29 13:05:09 01PM Thu February 24 %"
        );
        assert!(strftime(0, "%Z").unwrap_err().to_string().contains("%Z"));
    }

    /// `json.dumps({"b": [1, 2.5, 1e-05], "a": "é\n\"x\"", "c": {}}, ensure_ascii=False)` and
    /// with `indent=2`: what Python 3.11 prints.
    #[test]
    fn tojson_writes_what_json_dumps_writes() {
        let v = Value::from(minijinja::value::Serde(serde_json::json!({
            "b": [1, 2.5, 1e-05], "a": "é\n\"x\"", "c": {}
        })));
        let env = minijinja::Environment::new();
        let render = |template: &str| {
            let mut env = env.clone();
            env.add_filter("tojson", tojson);
            env.render_str(template, minijinja::context! { v => v.clone() })
                .unwrap()
        };
        // serde_json's map is sorted: a, b, c.
        assert_eq!(
            render("{{ v | tojson }}"),
            r#"{"a": "é\n\"x\"", "b": [1, 2.5, 1e-05], "c": {}}"#
        );
        assert_eq!(
            render("{{ v | tojson(indent=2) }}"),
            "{\n  \"a\": \"é\\n\\\"x\\\"\",\n  \"b\": [\n    1,\n    2.5,\n    1e-05\n  ],\n  \"c\": {}\n}"
        );
        assert_eq!(
            render("{{ 'é' | tojson(ensure_ascii=true) }}"),
            r#""\u00e9""#
        );
    }
}
