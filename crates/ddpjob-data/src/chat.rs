//! Chat templates: a model's own Jinja template rendered as transformers'
//! `apply_chat_template` renders it (`trim_blocks`, `lstrip_blocks`, loop controls, Python's
//! string methods through minijinja-contrib's pycompat, `raise_exception`, `strftime_now`,
//! a `tojson` that writes what Python's `json.dumps` writes), with the characters of the
//! assistant's turns: those inside `{% generation %}` markers when the template has them (what
//! `return_assistant_tokens_mask` reports and TRL's `assistant_only_loss` trains), otherwise
//! each assistant turn found by rendering the conversation's prefixes. It knows nothing of
//! tokenizers or files of examples (see `conversation`).

use std::collections::BTreeMap;
use std::ops::Range;
use std::path::Path;

use minijinja::{Environment, Error, ErrorKind, Value};
use serde_json::Value as Json;

/// Written where a `{% generation %}` block starts and ends, then taken out: Unicode
/// noncharacters, which no text is meant to hold.
const START: char = '\u{FDD0}';
const END: char = '\u{FDD1}';

/// A loaded template.
pub struct ChatTemplate {
    env: Environment<'static>,
    /// Where it came from, for errors.
    pub origin: String,
    /// Whether it marks the assistant's tokens with `{% generation %}`.
    pub marked: bool,
    /// `bos_token`, `eos_token`, ... as the template sees them (transformers' special
    /// tokens map).
    specials: BTreeMap<String, String>,
}

/// A conversation rendered, and the byte ranges of the text it trains on.
#[derive(Debug, Clone, PartialEq)]
pub struct Rendered {
    pub text: String,
    pub trained: Vec<Range<usize>>,
}

impl ChatTemplate {
    /// The template in `source` (named `origin` in errors), with the special tokens of
    /// `tokenizer_config.json` (`bos_token`, `eos_token`, `pad_token`, `unk_token`).
    pub fn new(
        source: &str,
        origin: &str,
        specials: BTreeMap<String, String>,
    ) -> Result<ChatTemplate, String> {
        let (source, marked) = with_markers(source);
        let mut env = Environment::new();
        env.set_syntax(
            minijinja::syntax::SyntaxConfig::builder()
                .trim_blocks(true)
                .lstrip_blocks(true)
                .build()
                .map_err(|e| e.to_string())?,
        );
        // Jinja2's filters minijinja's core lacks (`truncate`, `striptags`, ...), and Python's
        // string and dict methods.
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |message: String| -> Result<Value, Error> {
                Err(Error::new(ErrorKind::InvalidOperation, message))
            },
        );
        env.add_function("strftime_now", |format: String| {
            super::jinja_python::now_utc(&format)
        });
        env.add_filter("tojson", super::jinja_python::tojson);
        env.add_template_owned("chat_template", source)
            .map_err(|e| format!("chat template {origin}: {}", describe(&e)))?;
        Ok(ChatTemplate {
            env,
            origin: origin.into(),
            marked,
            specials,
        })
    }

    /// The model's template for `tokenizer` (a `tokenizer.json`): `chat_template.jinja` beside
    /// it (what transformers 5 saves), else `tokenizer_config.json`'s `chat_template` (a
    /// string, or a list of `{name, template}` whose `default` is taken); `None` when it has
    /// none. `path` overrides it (`data.chat_template`).
    pub fn for_tokenizer(
        tokenizer: &Path,
        path: Option<&Path>,
    ) -> Result<Option<ChatTemplate>, String> {
        let dir = tokenizer.parent().unwrap_or(Path::new("."));
        let config: Option<Json> = std::fs::read_to_string(dir.join("tokenizer_config.json"))
            .ok()
            .and_then(|t| serde_json::from_str(&t).ok());
        let specials = specials_of(config.as_ref());
        let read =
            |p: &Path| std::fs::read_to_string(p).map_err(|e| format!("`{}`: {e}", p.display()));
        if let Some(path) = path {
            let origin = format!("`{}` (data.chat_template)", path.display());
            return ChatTemplate::new(&read(path)?, &origin, specials).map(Some);
        }
        let beside = dir.join("chat_template.jinja");
        if beside.is_file() {
            let origin = format!("`{}`", beside.display());
            return ChatTemplate::new(&read(&beside)?, &origin, specials).map(Some);
        }
        let origin = format!(
            "`{}`'s chat_template",
            dir.join("tokenizer_config.json").display()
        );
        let source = match config.as_ref().and_then(|c| c.get("chat_template")) {
            None | Some(Json::Null) => return Ok(None),
            Some(Json::String(s)) => s.clone(),
            Some(Json::Array(named)) => {
                let default = named.iter().find(|t| t["name"] == "default");
                match default.and_then(|t| t["template"].as_str()) {
                    Some(s) => s.to_string(),
                    None => {
                        return Err(format!(
                            "{origin} is a list of named templates without a \"default\"; set \
                             data.chat_template to the one to use (saved as a .jinja file)"
                        ));
                    }
                }
            }
            Some(other) => return Err(format!("{origin} is not a string but {other}")),
        };
        ChatTemplate::new(&source, &origin, specials).map(Some)
    }

    /// `messages` rendered (with the generation prompt when `add_generation_prompt`), and
    /// where its `{% generation %}` blocks are.
    pub fn render(
        &self,
        messages: &[Json],
        add_generation_prompt: bool,
    ) -> Result<Rendered, String> {
        // The messages are read where they are (no copy into a context object).
        let context = minijinja::context! {
            messages => Value::from(minijinja::value::Serde(messages)),
            add_generation_prompt => add_generation_prompt,
            ..Value::from(minijinja::value::Serde(&self.specials))
        };
        let template = (self.env.get_template("chat_template")).map_err(|e| describe(&e))?;
        let out = template
            .render(context)
            .map_err(|e| format!("chat template {}: {}", self.origin, describe(&e)))?;
        take_markers(&out)
    }

    /// `messages` rendered whole, and the text of its assistant turns: the marked blocks,
    /// or without markers each assistant message's, found as what `messages[..=i]` renders
    /// beyond `messages[..i]` with the generation prompt (the turn's header is the prompt's;
    /// its end-of-turn tokens are trained).
    pub fn assistant_turns(&self, messages: &[Json]) -> Result<Rendered, String> {
        let whole = self.render(messages, false)?;
        if self.marked {
            return Ok(whole);
        }
        let mut trained = Vec::new();
        for (i, m) in messages.iter().enumerate() {
            if m["role"] != "assistant" {
                continue;
            }
            let before = match i {
                0 => String::new(),
                _ => self.render(&messages[..i], true)?.text,
            };
            let through = self.render(&messages[..=i], false)?.text;
            if !through.starts_with(&before) || !whole.text.starts_with(&through) {
                return Err(format!(
                    "chat template {} renders message {i} (an assistant's) differently once \
                     later messages follow, so its turn cannot be found in the whole \
                     conversation: give the template {{% generation %}} markers around the \
                     assistant's text, or set data.train_on_prompt = true",
                    self.origin
                ));
            }
            trained.push(before.len()..through.len());
        }
        Ok(Rendered {
            text: whole.text,
            trained,
        })
    }
}

/// The special tokens `tokenizer_config.json` names, as strings (an added token's object
/// gives its `content`).
fn specials_of(config: Option<&Json>) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    for key in ["bos_token", "eos_token", "pad_token", "unk_token"] {
        let value = config.and_then(|c| c.get(key));
        let text = match value {
            Some(Json::String(s)) => Some(s.clone()),
            Some(Json::Object(o)) => o.get("content").and_then(|c| c.as_str()).map(String::from),
            _ => None,
        };
        if let Some(text) = text {
            out.insert(key.to_string(), text);
        }
    }
    out
}

/// `source` with each `{% generation %}` / `{% endgeneration %}` tag (whitespace control
/// kept) replaced by a block that writes a marker: `{%- if true %}START{% endif %}` keeps the
/// tag's `lstrip_blocks` and `trim_blocks` effects on either side. Whether it had any.
fn with_markers(source: &str) -> (String, bool) {
    let tag =
        regex::Regex::new(r"\{%([-+]?)\s*(end)?generation\s*([-+]?)%\}").expect("a valid pattern");
    let mut marked = false;
    let out = tag.replace_all(source, |c: &regex::Captures| {
        marked = true;
        let marker = if c.get(2).is_some() { END } else { START };
        format!("{{%{} if true %}}{marker}{{% endif {}%}}", &c[1], &c[3])
    });
    (out.into_owned(), marked)
}

/// The rendered text without its markers, and the byte ranges between them.
fn take_markers(out: &str) -> Result<Rendered, String> {
    let mut text = String::with_capacity(out.len());
    let (mut trained, mut open) = (Vec::new(), None);
    for c in out.chars() {
        match c {
            START if open.is_none() => open = Some(text.len()),
            END if open.is_some() => trained.push(open.take().unwrap_or(0)..text.len()),
            START | END => {
                return Err(
                    "a message holds U+FDD0 or U+FDD1 (or the template nests {% generation %} \
                     blocks): take those characters out of the messages"
                        .into(),
                );
            }
            c => text.push(c),
        }
    }
    if open.is_some() {
        return Err("a {% generation %} block is not closed".into());
    }
    Ok(Rendered { text, trained })
}

/// A template error with its line.
fn describe(e: &Error) -> String {
    let mut text = match e.detail() {
        Some(detail) => format!("{}: {detail}", e.kind()),
        None => e.kind().to_string(),
    };
    if let Some(line) = e.line() {
        text.push_str(&format!(" (line {line})"));
    }
    text
}

#[cfg(test)]
#[path = "chat_tests.rs"]
mod tests;
