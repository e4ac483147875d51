//! Frozen parameters (`model.freeze`): a model's parameters that do not train. They keep the
//! values the model was built with (a pretrained checkpoint's, or the seed's), get no optimizer
//! state and never cross the wire: only the trainable parameters' gradients are averaged,
//! clipped and applied, so a job that trains a small part of a model all-reduces only that part.
//! Any model, built-in or registered, is frozen the same way: by name, after it is built.
//!
//! Which tensors are frozen is a set shared by the model's [`Params`] and the layers built with
//! them (a [`FrozenSet`]): a built-in layer hands a frozen weight to its op detached, so the op
//! forms no gradient for it (the weight-gradient product of a frozen linear layer is skipped),
//! and the hand-written backward passes ask the same set.

use std::collections::HashSet;
use std::sync::{Arc, OnceLock};

use candle_core::{Tensor, TensorId, Var};

use crate::Params;

/// The tensors of a model that do not train, set once when the model is frozen.
#[derive(Debug, Clone, Default)]
pub struct FrozenSet(Arc<OnceLock<HashSet<TensorId>>>);

impl FrozenSet {
    /// Whether `var` is frozen.
    pub fn contains(&self, var: &Var) -> bool {
        self.0
            .get()
            .is_some_and(|set| set.contains(&var.as_tensor().id()))
    }

    /// `var` as a layer's op should take it: detached when frozen, so no gradient is formed.
    pub fn as_input(&self, var: &Var) -> Tensor {
        match self.contains(var) {
            true => var.as_detached_tensor(),
            false => var.as_tensor().clone(),
        }
    }
}

impl Params {
    /// Freezes every parameter whose name, or the name of one of its aliases, matches one of
    /// `patterns`: the name itself, a dotted prefix of it (a module), or a glob of either with
    /// `*` and `?`; returns how many are frozen. A pattern that matches
    /// nothing, or patterns that leave nothing to train, are errors naming the fix; a model is
    /// frozen once.
    pub fn freeze(&self, patterns: &[String]) -> std::result::Result<usize, String> {
        self.freeze_also(patterns, |_| false)
    }

    /// [`Params::freeze`], freezing too every parameter whose name `also` holds for (LoRA's
    /// base: everything but the adapters).
    pub fn freeze_also(
        &self,
        patterns: &[String],
        also: impl Fn(&str) -> bool,
    ) -> std::result::Result<usize, String> {
        let mut frozen: Vec<bool> = self.entries.iter().map(|(n, _)| also(n)).collect();
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
        let ids = self.entries.iter().zip(&frozen);
        let ids = ids
            .filter(|(_, f)| **f)
            .map(|((_, v), _)| v.as_tensor().id());
        self.frozen
            .0
            .set(ids.collect())
            .map_err(|_| "model.freeze: the model's parameters are frozen already".to_string())?;
        Ok(count)
    }

    /// How many parameter tensors are frozen.
    pub fn frozen_count(&self) -> usize {
        (0..self.entries.len())
            .filter(|&i| self.is_frozen(i))
            .count()
    }

    /// Whether the parameter at `index` is frozen.
    pub fn is_frozen(&self, index: usize) -> bool {
        self.entries
            .get(index)
            .is_some_and(|(_, v)| self.frozen.contains(v))
    }

    /// Shares `frozen` with these parameters (the set their layers were built with).
    pub fn share_frozen(&mut self, frozen: FrozenSet) {
        self.frozen = frozen;
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

        let p = params(&[
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
        let p = params(&["a.weight", "b.weight"]);
        let err = p.freeze(&["c.*".into()]).unwrap_err();
        assert!(
            err.contains("\"c.*\" matches no parameter") && err.contains("a.weight, b.weight"),
            "{err}"
        );
        let err = p.freeze(&["*".into()]).unwrap_err();
        assert!(err.contains("nothing would train"), "{err}");
        assert!(!p.is_frozen(0), "a refused freeze changes nothing");
        assert_eq!(p.freeze(&["a".into()]), Ok(1));
        let err = p.freeze(&["b".into()]).unwrap_err();
        assert!(err.contains("frozen already"), "{err}");
    }
}
