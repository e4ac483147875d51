//! Frozen parameters (`model.freeze`): a model's parameters that do not train. They keep the
//! values the model was built with (a pretrained checkpoint's, or the seed's), get no optimizer
//! state and never cross the wire: only the trainable parameters' gradients are averaged,
//! clipped and applied, so a job that trains a small part of a model all-reduces only that part.
//! Any model, built-in or registered, is frozen the same way: by name, after it is built.

use candle_core::{Result, Tensor, Var};

use super::{KvDecoder, Mode, Model, Params, TrainPass};

impl Params {
    /// Freezes every parameter whose name, or the name of one of its aliases, matches one of
    /// `patterns` (see [`name_matches`]); returns how many are frozen. A pattern that matches
    /// nothing, or patterns that leave nothing to train, are errors naming the fix.
    pub fn freeze(&mut self, patterns: &[String]) -> std::result::Result<usize, String> {
        let mut frozen = vec![false; self.entries.len()];
        for pattern in patterns {
            let mut matched = false;
            for (i, (name, _)) in self.entries.iter().enumerate() {
                if name_matches(pattern, name) {
                    frozen[i] = true;
                    matched = true;
                }
            }
            for (alias, i) in &self.aliases {
                if name_matches(pattern, alias) {
                    frozen[*i] = true;
                    matched = true;
                }
            }
            if !matched {
                let names: Vec<&str> = self.entries.iter().map(|(n, _)| n.as_str()).collect();
                let shown = names.len().min(8);
                let more = match names.len() - shown {
                    0 => String::new(),
                    n => format!(" and {n} more"),
                };
                return Err(format!(
                    "model.freeze: \"{pattern}\" matches no parameter; the model's are {}{more} \
                     (a pattern is a name, a module's dotted prefix, or a glob with `*` and `?`)",
                    names[..shown].join(", ")
                ));
            }
        }
        if !frozen.is_empty() && frozen.iter().all(|&f| f) {
            return Err(format!(
                "model.freeze = {patterns:?} freezes every parameter: nothing would train; \
                 name fewer"
            ));
        }
        let count = frozen.iter().filter(|&&f| f).count();
        self.frozen = frozen;
        Ok(count)
    }

    /// Whether the parameter at `index` is frozen.
    pub fn is_frozen(&self, index: usize) -> bool {
        self.frozen.get(index).copied().unwrap_or(false)
    }

    /// The parameters that train, with their positions in [`Params::iter`]'s order: what
    /// gradients are averaged, clipped and applied for, in this order.
    pub fn trainable(&self) -> impl Iterator<Item = (usize, &Var)> {
        let vars = self.entries.iter().map(|(_, v)| v).enumerate();
        vars.filter(|(i, _)| !self.is_frozen(*i))
    }

    /// The number of values (elements) that train.
    pub fn trainable_element_count(&self) -> usize {
        self.trainable().map(|(_, v)| v.elem_count()).sum()
    }
}

/// Whether `pattern` names `name`: the name itself, a dotted prefix of it (a module:
/// `model.layers.0` names `model.layers.0.mlp.up_proj.weight`), or a glob of either where `*`
/// stands for any characters (dots included) and `?` for one.
pub fn name_matches(pattern: &str, name: &str) -> bool {
    let (p, n): (Vec<char>, Vec<char>) = (pattern.chars().collect(), name.chars().collect());
    glob(&p, &n)
        || (0..n.len())
            .filter(|&i| n[i] == '.')
            .any(|i| glob(&p, &n[..i]))
}

/// Glob matching with `*` and `?` over the whole of `name` (iterative, with one backtrack
/// point: linear in practice).
fn glob(pattern: &[char], name: &[char]) -> bool {
    let (mut p, mut n) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    while n < name.len() {
        match pattern.get(p) {
            Some('*') => {
                star = Some((p, n));
                p += 1;
            }
            Some(&c) if c == '?' || c == name[n] => {
                p += 1;
                n += 1;
            }
            _ => match star {
                Some((sp, sn)) => {
                    p = sp + 1;
                    n = sn + 1;
                    star = Some((sp, sn + 1));
                }
                None => return false,
            },
        }
    }
    pattern[p..].iter().all(|&c| c == '*')
}

/// A model with some parameters frozen: the same network, its [`Params`] saying which train.
struct Frozen {
    inner: Box<dyn Model>,
    params: Params,
}

/// `model` with the parameters `patterns` name frozen, and how many; `model` itself when there
/// are no patterns.
pub(super) fn with_frozen(
    model: Box<dyn Model>,
    patterns: &[String],
) -> std::result::Result<(Box<dyn Model>, usize), String> {
    if patterns.is_empty() {
        return Ok((model, 0));
    }
    let mut params = model.params().clone();
    let count = params.freeze(patterns)?;
    Ok((
        Box::new(Frozen {
            inner: model,
            params,
        }),
        count,
    ))
}

impl Model for Frozen {
    fn forward(&self, xs: &Tensor, mode: &Mode) -> Result<Tensor> {
        self.inner.forward(xs, mode)
    }

    fn params(&self) -> &Params {
        &self.params
    }

    fn loss(&self, xs: &Tensor, targets: &Tensor, mode: &Mode) -> Result<Tensor> {
        self.inner.loss(xs, targets, mode)
    }

    fn score(&self, xs: &Tensor, targets: &Tensor) -> Result<(f64, usize)> {
        self.inner.score(xs, targets)
    }

    fn train_flops_per_sample(&self) -> Option<f64> {
        self.inner.train_flops_per_sample()
    }

    fn train_pass(
        &self,
        xs: &Tensor,
        targets: &Tensor,
        mode: &Mode,
    ) -> Result<Option<Box<dyn TrainPass + '_>>> {
        self.inner.train_pass(xs, targets, mode)
    }

    fn rows_independent(&self) -> bool {
        self.inner.rows_independent()
    }

    fn kv_decoder(&self) -> Option<&dyn KvDecoder> {
        self.inner.kv_decoder()
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device};

    use super::*;

    fn params(names: &[&str]) -> Params {
        let var = || Var::zeros(2, DType::F32, &Device::Cpu).unwrap();
        let mut p = Params::from_vars(names.iter().map(|n| (n.to_string(), var())).collect());
        p.tie("lm_head.weight", "model.embed_tokens.weight");
        p
    }

    #[test]
    fn patterns_name_parameters_modules_globs_and_aliases() {
        assert!(name_matches("fc1.weight", "fc1.weight"));
        assert!(name_matches(
            "model.layers.0",
            "model.layers.0.mlp.up_proj.weight"
        ));
        assert!(!name_matches(
            "model.layers.1",
            "model.layers.10.mlp.up_proj.weight"
        ));
        assert!(name_matches(
            "model.layers.*.self_attn.*",
            "model.layers.3.self_attn.q_proj.weight"
        ));
        assert!(name_matches("*.bias", "h.0.attn.c_attn.bias"));
        assert!(name_matches("h.?.ln_1", "h.7.ln_1.weight"));
        assert!(!name_matches("h.?.ln_1", "h.17.ln_1.weight"));
        assert!(!name_matches("fc1", "fc10.weight"));

        let mut p = params(&[
            "model.embed_tokens.weight",
            "model.norm.weight",
            "fc.weight",
        ]);
        // The tied head's name freezes the embedding it shares.
        assert_eq!(p.freeze(&["lm_head.weight".into()]), Ok(1));
        assert!(p.is_frozen(0) && !p.is_frozen(1));
        let trainable: Vec<usize> = p.trainable().map(|(i, _)| i).collect();
        assert_eq!(trainable, [1, 2]);
        assert_eq!(p.trainable_element_count(), 4);
    }

    #[test]
    fn a_pattern_that_matches_nothing_or_everything_is_refused() {
        let mut p = params(&["a.weight", "b.weight"]);
        let err = p.freeze(&["c.*".into()]).unwrap_err();
        assert!(
            err.contains("\"c.*\" matches no parameter") && err.contains("a.weight, b.weight"),
            "{err}"
        );
        let err = p.freeze(&["*".into()]).unwrap_err();
        assert!(err.contains("nothing would train"), "{err}");
        assert!(!p.is_frozen(0), "a refused freeze changes nothing");
    }
}
