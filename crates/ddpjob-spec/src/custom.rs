//! The `[model]` and `[data]` keys of the registered model and dataset (ddpjob's own or the
//! binary's author's): taken out of the document before the schema check (they are not the
//! schema's keys), checked against the fields of the registered options struct (unknown keys
//! get the file, line and a did-you-mean, or the model or dataset they belong to), and
//! deserialised once, the data's completed for the model, so their errors surface at
//! `validate`, not in a worker.

use super::builders::{Builders, DataContext, Known};
use super::error::{ConfigError, Hint, Origin};
use super::schema;
use super::source::{Source, value_at};

/// A registered model's or dataset's name and its resolved options (defaults written out).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CustomParts {
    pub model: Option<(String, toml::Table)>,
    pub data: Option<(String, toml::Table)>,
}

/// One section a registered builder owns part of.
struct Section {
    name: &'static str,
    /// The key that picks the builder, and its default.
    selector: &'static str,
    default: &'static str,
    /// ddpjob's own keys in the section, kept for the schema.
    own: &'static [&'static str],
    /// The registry's side of it: what a name is (with the keys it tolerates beside it, see
    /// [`Known::Registered`]), and the names.
    kind: fn(&dyn Builders, &str) -> Known,
    names: for<'a> fn(&'a dyn Builders) -> Vec<&'a str>,
}

const MODEL: Section = Section {
    name: "model",
    selector: "arch",
    default: "mlp",
    own: &["arch", "freeze", "lora", "quantize", "revision"],
    kind: |b, name| b.model_kind(name),
    names: |b| b.model_names(),
};

const DATA: Section = Section {
    name: "data",
    selector: "dataset",
    default: "mnist",
    own: &["dataset", "drop_last"],
    kind: |b, name| b.dataset_kind(name),
    names: |b| b.dataset_names(),
};

/// Takes the registered builders' options out of `source`; see the module docs.
/// Keys of another builder that a `--set` switch of the builder left behind are said in `notes`.
pub fn extract(
    source: &mut Source,
    registry: &dyn Builders,
    notes: &mut Vec<String>,
) -> Result<CustomParts, ConfigError> {
    let mut errors = Vec::new();
    let resolve_model = |arch: &str, t: &toml::Table| registry.resolve_model(arch, t);
    let model = take(source, &MODEL, registry, &resolve_model, &mut errors, notes);
    // The data is completed for the model it feeds; with no model to fit (its own errors are
    // reported), only its keys are read.
    let seed = source.table.get("seed").and_then(toml::Value::as_integer);
    let objective = value_at(&source.table, "train.objective").and_then(toml::Value::as_str);
    let pairs = objective == Some("dpo");
    let cx = model.as_ref().map(|(arch, options)| DataContext {
        seed: seed.unwrap_or(0) as u64,
        arch: arch.clone(),
        language: registry.language(arch, options).and_then(Result::ok),
        job: None,
        stored_job: source.is_stored_job(),
        staging: None,
        pairs,
    });
    let resolve_data = |dataset: &str, t: &toml::Table| match &cx {
        Some(cx) => registry.resolve_dataset(dataset, t, cx),
        None => registry.resolve_dataset_keys(dataset, t),
    };
    let data = take(source, &DATA, registry, &resolve_data, &mut errors, notes);
    ConfigError::collect(errors)?;
    Ok(CustomParts { model, data })
}

type Resolve<'a> = dyn Fn(&str, &toml::Table) -> Result<toml::Table, String> + 'a;

fn take(
    source: &mut Source,
    section: &Section,
    registry: &dyn Builders,
    resolve: &Resolve<'_>,
    errors: &mut Vec<ConfigError>,
    notes: &mut Vec<String>,
) -> Option<(String, toml::Table)> {
    let table = source
        .table
        .get(section.name)
        .and_then(toml::Value::as_table);
    let chosen = table
        .and_then(|t| t.get(section.selector))
        .and_then(toml::Value::as_str)
        .unwrap_or(section.default)
        .to_string();
    let (fields, tolerated, tolerated_in_stored_jobs) = match (section.kind)(registry, &chosen) {
        Known::Registered {
            fields,
            tolerated,
            tolerated_in_stored_jobs,
        } => (fields, tolerated, tolerated_in_stored_jobs),
        Known::Unknown => {
            // Said first: the section's other keys would otherwise read as unknown keys.
            let key = format!("{}.{}", section.name, section.selector);
            let names = (section.names)(registry);
            let quoted: Vec<String> = names.iter().map(|n| format!("\"{n}\"")).collect();
            let hint = schema::closest(&chosen, names.iter().copied())
                .map_or(String::new(), |n| format!("; did you mean \"{n}\"?"));
            errors.push(ConfigError::Invalid {
                at: source.value_origin(&key),
                key,
                problem: format!(
                    "unknown value \"{chosen}\"; expected one of {}{hint}",
                    quoted.join(", ")
                ),
            });
            return None;
        }
    };
    let mut options = toml::Table::new();
    let stored_job = source.is_stored_job();
    // `--set data.dataset=tokens` on a file written for text data (a CLI sweep): the file's
    // keys only the other builders read are left behind, as a switched optimizer's are.
    let selector = format!("{}.{}", section.name, section.selector);
    let switched_by = match source.value_origin(&selector) {
        by @ Origin::Override(_) => Some(by),
        _ => None,
    };
    let left_behind = |key: &&String| {
        let at = source.key_origin(&format!("{}.{key}", section.name));
        switched_by.is_some() && at.is_written() && !owners_of(registry, section, key).is_empty()
    };
    let left: Vec<String> = source
        .table
        .get(section.name)
        .and_then(toml::Value::as_table)
        .into_iter()
        .flat_map(|t| t.keys())
        .filter(|k| !section.own.contains(&k.as_str()))
        .filter(|k| fields.is_some_and(|f| !f.contains(&k.as_str())))
        .filter(left_behind)
        .cloned()
        .collect();
    if let Some(by) = switched_by.filter(|_| !left.is_empty()) {
        let keys: Vec<String> = left
            .iter()
            .map(|k| format!("{}.{k}", section.name))
            .collect();
        notes.push(format!(
            "{} ({}) left out: {by} chose \"{chosen}\", which does not read them",
            keys.join(", "),
            source.path.display()
        ));
    }
    if let Some(toml::Value::Table(table)) = source.table.get_mut(section.name) {
        for key in &left {
            table.remove(key);
        }
        let theirs: Vec<String> = table
            .keys()
            .filter(|k| !section.own.contains(&k.as_str()))
            .cloned()
            .collect();
        for key in theirs {
            let read = fields.is_none_or(|f| f.contains(&key.as_str()));
            let tolerated = tolerated.contains(&key.as_str())
                || (stored_job && tolerated_in_stored_jobs.contains(&key.as_str()));
            if let Some(value) = table.remove(&key)
                && (read || !tolerated)
            {
                options.insert(key, value);
            }
        }
    }
    let what = format!("[{}] ({} = \"{chosen}\")", section.name, section.selector);
    for key in options.keys() {
        if let Some(fields) = fields.filter(|f| !f.contains(&key.as_str())) {
            let owners = owners_of(registry, section, key);
            let candidates = fields.iter().chain(section.own).copied();
            let selector = format!("{}.{}", section.name, section.selector);
            let owner = format!("{selector} = {}", owners.join(" or "));
            let chosen_by_default = matches!(source.value_origin(&selector), Origin::Defaulted(_));
            let hint = match (owners.is_empty(), chosen_by_default) {
                (true, _) => Hint::closest(key, candidates),
                (false, false) => Some(Hint::BelongsTo(owner)),
                (false, true) => Some(Hint::Unchosen(format!(
                    "{owner}, and {selector} is not set (its default is \"{chosen}\")"
                ))),
            };
            errors.push(ConfigError::UnknownKey {
                key: key.clone(),
                table: what.clone(),
                at: source.key_origin(&format!("{}.{key}", section.name)),
                hint,
            });
        }
    }
    match resolve(&chosen, &options) {
        Ok(resolved) => Some((chosen, resolved)),
        Err(problem) => {
            // serde names the key it stopped at in backticks, and an options struct's checks
            // as `model.KEY` (or deeper, `data.synthetic.shape`): point at the key named first.
            let named_first = fields
                .unwrap_or_default()
                .iter()
                .filter_map(|f| {
                    let named = [format!("`{f}`"), format!("{}.{f}", section.name)];
                    named
                        .iter()
                        .filter_map(|n| problem.find(n.as_str()).map(|at| (at, n)))
                        .min()
                        .map(|(at, n)| (at, f, n.starts_with('`')))
                })
                .min();
            // serde may name only the value it stopped at (`unknown variant \`linear\``, inside
            // a table): the one key whose value holds it.
            let holding = || {
                let word = problem.split('`').nth(1).filter(|w| !w.is_empty())?;
                let mut holders = options
                    .iter()
                    .filter(|(_, v)| v.to_string().contains(word))
                    .map(|(k, _)| format!("{}.{k}", section.name));
                holders.next().filter(|_| holders.next().is_none())
            };
            let key = named_first.map(|(at, f, quoted)| {
                let top = format!("{}.{f}", section.name);
                let deeper = problem[at..]
                    .split(|c: char| !(c.is_ascii_alphanumeric() || "_-.".contains(c)))
                    .next()
                    .map(|p| p.trim_end_matches('.'));
                match deeper {
                    Some(path)
                        if !quoted
                            && path.len() > top.len()
                            && !matches!(source.key_origin(path), Origin::Defaulted(_)) =>
                    {
                        path.to_string()
                    }
                    _ => top,
                }
            });
            // toml's own errors end with the path they stopped in: "in `synthetic.shape`".
            let stopped_in = || {
                let last = problem.trim_end().lines().last()?;
                let path = last.strip_prefix("in `")?.strip_suffix('`')?;
                let top = path.split('.').next()?;
                options
                    .contains_key(top)
                    .then(|| format!("{}.{path}", section.name))
            };
            let stopped = stopped_in();
            // Said once: the key the error is reported under.
            let problem = match &stopped {
                Some(_) => problem
                    .trim_end()
                    .rsplit_once('\n')
                    .map_or(&*problem, |(p, _)| p),
                None => &problem,
            };
            let key = stopped.or(key).or_else(holding);
            let at = match &key {
                Some(k)
                    if options.contains_key(
                        k[section.name.len() + 1..]
                            .split('.')
                            .next()
                            .unwrap_or_default(),
                    ) =>
                {
                    // The key, or the table above it that was set whole (`--set k={...}`).
                    let mut path = k.as_str();
                    loop {
                        match (source.value_origin(path), path.rsplit_once('.')) {
                            (Origin::Defaulted(_), Some((up, _))) if up != section.name => {
                                path = up;
                            }
                            (origin, _) => break origin,
                        }
                    }
                }
                _ => source.key_origin(section.name),
            };
            // A size the job does not set, read from the checkpoint `init_from` names: its
            // config.json is what to fix, not the job file.
            let top = |k: &String| {
                k[section.name.len() + 1..]
                    .split('.')
                    .next()
                    .map(String::from)
            };
            let from_checkpoint = match (&key, options.get("init_from")) {
                (Some(k), Some(toml::Value::String(dir)))
                    if top(k).is_some_and(|t| !options.contains_key(&t)) =>
                {
                    Some(std::path::Path::new(dir).join("config.json"))
                        .filter(|p| p.is_file())
                        .map(|p| (p, source.value_origin("model.init_from")))
                }
                _ => None,
            };
            let (at, whose) = match (from_checkpoint, at) {
                (Some((file, init_from)), _) => (
                    init_from,
                    format!(
                        " (the value of `{}`, the checkpoint model.init_from names)",
                        file.display()
                    ),
                ),
                (None, Origin::Defaulted(_)) => (
                    source.key_origin(&format!("{}.{}", section.name, section.selector)),
                    String::new(),
                ),
                (None, other) => (other, String::new()),
            };
            errors.push(ConfigError::Invalid {
                key: key.unwrap_or_else(|| what.clone()),
                at,
                problem: format!("{what}: {}{whose}", problem.trim()),
            });
            None
        }
    }
}

/// The other registered names of `section` that read `key`, quoted.
fn owners_of(registry: &dyn Builders, section: &Section, key: &str) -> Vec<String> {
    let names = (section.names)(registry);
    let reads = |name: &str| match (section.kind)(registry, name) {
        Known::Registered {
            fields: Some(f), ..
        } => f.contains(&key),
        _ => false,
    };
    let owners = names.into_iter().filter(|n| reads(n));
    owners.map(|n| format!("\"{n}\"")).collect()
}
