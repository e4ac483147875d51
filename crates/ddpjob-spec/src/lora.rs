//! `[model.lora]` as the job describes it: the adapters' rank, scale, dropout, the layers they
//! target by PEFT's rules and the PEFT directory they may start from. The adapters themselves
//! (their weights and their product) are the model kit's; this is only what a job asks for.

/// `[model.lora]` once it is on (`r` > 0).
#[derive(Debug, Clone, PartialEq)]
pub struct LoraSpec {
    /// The adapters' rank.
    pub r: usize,
    /// The scale's numerator: adapters add `alpha / r` times their product.
    pub alpha: f64,
    /// Dropout on the adapters' input in training, in [0, 1): masks keyed by each sample's
    /// seed and the layer, never by rank or batch.
    pub dropout: f64,
    /// The linear layers that get adapters, by PEFT's rules (see [`TargetModules`]).
    pub target_modules: TargetModules,
    /// A PEFT adapter directory the adapters start from (`model.lora.adapter`, or
    /// `model.init_from` naming one) instead of `A` drawn and `B` zeros.
    pub adapter: Option<std::path::PathBuf>,
}

impl LoraSpec {
    /// `alpha / r`.
    pub fn scale(&self) -> f64 {
        self.alpha / self.r as f64
    }

    /// Whether the linear layer `name` gets an adapter, given the arch's default targets.
    pub fn targets(&self, name: &str, defaults: &[&str]) -> bool {
        let names: Vec<&str> = match &self.target_modules {
            TargetModules::Regex(pattern) if pattern == "all-linear" => return true,
            TargetModules::Regex(pattern) => return full_match(pattern, name),
            TargetModules::Names(names) if names.is_empty() => defaults.to_vec(),
            TargetModules::Names(names) => names.iter().map(String::as_str).collect(),
        };
        names
            .iter()
            .any(|t| *t == "all-linear" || name == *t || name.ends_with(&format!(".{t}")))
    }
}

/// `model.lora.target_modules`, as PEFT's `LoraConfig` takes it: a list of layer names, each
/// a layer's full name or its last dotted components (`q_proj` names
/// `model.layers.0.self_attn.q_proj`), or `"all-linear"`; empty, the arch's default
/// (`q_proj`, `v_proj` for llama, `c_attn` for gpt, as PEFT's). Or one string: a regular
/// expression the whole layer name must match (`re.fullmatch`), e.g.
/// `'.*\.(1|3)\.self_attn\.(q|v)_proj'`.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(untagged)]
pub enum TargetModules {
    Names(Vec<String>),
    Regex(String),
}

impl Default for TargetModules {
    fn default() -> Self {
        TargetModules::Names(Vec::new())
    }
}

impl TargetModules {
    /// Whether it is left to the arch's default.
    pub fn is_default(&self) -> bool {
        *self == TargetModules::default()
    }

    /// Why a regular expression is not one, if it is not.
    pub fn check(&self) -> std::result::Result<(), String> {
        match self {
            TargetModules::Regex(p) => regex::Regex::new(&anchored(p))
                .map(|_| ())
                .map_err(|e| format!("\"{p}\" is not a regular expression: {e}")),
            TargetModules::Names(_) => Ok(()),
        }
    }
}

impl std::fmt::Display for TargetModules {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TargetModules::Names(names) => write!(f, "{names:?}"),
            TargetModules::Regex(p) => write!(f, "\"{p}\""),
        }
    }
}

fn anchored(pattern: &str) -> String {
    format!("^(?:{pattern})$")
}

/// Whether all of `name` matches `pattern` (a pattern that is not one matches nothing; the
/// config refuses it first).
fn full_match(pattern: &str, name: &str) -> bool {
    regex::Regex::new(&anchored(pattern)).is_ok_and(|re| re.is_match(name))
}

/// Whether the parameter `name` is an adapter's: absent from base checkpoints, never frozen.
pub fn is_adapter(name: &str) -> bool {
    name.contains(".lora_A.") || name.contains(".lora_B.")
}
