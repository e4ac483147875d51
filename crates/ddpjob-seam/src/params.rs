//! Named parameters in a fixed order ([`Params`]): what checkpoints, the optimizers, the
//! collectives and the Hugging Face exchange read and write by name, and how a new
//! parameter's values are given memory without aborting the process.

use candle_core::{Result, Tensor, Var};

use crate::freeze::FrozenSet;
use crate::packed::PackedWeight;

/// Named trainable parameters in a fixed order (the order gradients are bucketed in).
#[derive(Debug, Clone, Default)]
pub struct Params {
    pub(crate) entries: Vec<(String, Var)>,
    /// Parameters exempt from weight decay, by position (biases and LayerNorm gains of a GPT).
    pub(crate) no_decay: Vec<bool>,
    /// Extra names of a tied parameter (e.g. `lm_head.weight` for `transformer.wte.weight`):
    /// written into `model.safetensors` as a PyTorch `state_dict()` holds them, never trained
    /// twice.
    pub(crate) aliases: Vec<(String, usize)>,
    /// State that is not trained but checkpointed, restored and broadcast from rank 0 with the
    /// parameters (BatchNorm's running statistics), as a PyTorch module's buffers.
    pub(crate) buffers: Vec<(String, Var)>,
    /// Parameters that do not train (`model.freeze`; see `freeze.rs`), shared with the
    /// layers that hold them.
    pub(crate) frozen: FrozenSet,
    /// Frozen weights kept in 4 bits (`[model.quantize]`), by name: not parameters, part of
    /// the base (see `packed/`).
    pub(crate) packed: Vec<(String, PackedWeight)>,
}

impl Params {
    /// The trainable parameters by name, in order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &Var)> {
        self.entries.iter().map(|(n, v)| (n.as_str(), v))
    }

    /// The buffers (non-trained state) by name.
    pub fn buffers(&self) -> impl Iterator<Item = (&str, &Var)> {
        self.buffers.iter().map(|(n, v)| (n.as_str(), v))
    }

    /// The trainable parameters, in order.
    pub fn vars(&self) -> impl Iterator<Item = &Var> {
        self.entries.iter().map(|(_, v)| v)
    }

    /// The position of `var` among the trainable parameters, if it is one of them.
    pub fn position(&self, var: &Var) -> Option<usize> {
        let id = var.as_tensor().id();
        self.vars().position(|v| v.as_tensor().id() == id)
    }

    /// Whether weight decay applies to the parameter at `index`.
    pub fn decays(&self, index: usize) -> bool {
        !self.no_decay.get(index).copied().unwrap_or(false)
    }

    /// Marks the parameter at `index` as exempt from weight decay.
    pub fn exempt_from_decay(&mut self, index: usize) {
        if self.no_decay.len() < self.entries.len() {
            self.no_decay.resize(self.entries.len(), false);
        }
        self.no_decay[index] = true;
    }

    /// Records `alias` as a second name of the parameter called `name`.
    pub fn tie(&mut self, alias: &str, name: &str) {
        if let Some(i) = self.entries.iter().position(|(n, _)| n == name) {
            self.aliases.push((alias.to_string(), i));
        }
    }

    /// Names that are aliases of a trained parameter, with that parameter's name.
    pub fn aliases(&self) -> impl Iterator<Item = (&str, &str)> {
        self.aliases
            .iter()
            .map(|(a, i)| (a.as_str(), self.entries[*i].0.as_str()))
    }

    /// The number of trainable parameters (tensors).
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether there are no trainable parameters.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The current values by name, aliases of tied parameters and buffers included, and the
    /// 4-bit weights as bitsandbytes saves them (see `packed::PackedWeight::saved`; a weight
    /// never loaded is left out): what `model.safetensors` holds.
    pub fn named_tensors(&self) -> std::collections::HashMap<String, Tensor> {
        // 4-bit weights are made on the CPU only (their layers run there).
        let packed = (self.packed.iter())
            .filter_map(|(n, w)| w.saved(n, &candle_core::Device::Cpu).ok())
            .flatten();
        let mut tensors = self.parameter_tensors();
        tensors.extend(packed);
        tensors
    }

    /// [`Params::named_tensors`] but the 4-bit weights: the parameters, buffers and aliases
    /// (what a checkpoint starts from, which never holds the 4-bit base).
    pub fn parameter_tensors(&self) -> std::collections::HashMap<String, Tensor> {
        let aliased = self
            .aliases
            .iter()
            .map(|(a, i)| (a.clone(), self.entries[*i].1.as_tensor().clone()));
        self.iter()
            .chain(self.buffers())
            .map(|(n, v)| (n.to_string(), v.as_tensor().clone()))
            .chain(aliased)
            .collect()
    }

    /// A name given to more than one parameter, buffer or alias, if any.
    pub fn repeated_name(&self) -> Option<&str> {
        let mut seen = std::collections::HashSet::new();
        let aliases = self.aliases.iter().map(|(a, _)| a.as_str());
        let mut names = self
            .iter()
            .chain(self.buffers())
            .map(|(n, _)| n)
            .chain(aliases);
        names.find(|n| !seen.insert(*n))
    }

    /// Entries of `named_tensors`: parameters, buffers and aliases.
    pub fn named_len(&self) -> usize {
        self.entries.len() + self.buffers.len() + self.aliases.len()
    }

    /// The number of trainable values (elements of every parameter).
    pub fn element_count(&self) -> usize {
        self.entries.iter().map(|(_, v)| v.elem_count()).sum()
    }

    /// The set of its frozen tensors, shared with the layers that hold them.
    #[doc(hidden)]
    pub fn frozen(&self) -> &FrozenSet {
        &self.frozen
    }

    /// Parameters from explicit (name, var) pairs, in that order.
    pub fn from_vars(entries: Vec<(String, Var)>) -> Self {
        Params {
            entries,
            ..Params::default()
        }
    }

    /// Appends the parameter `name` (for the builders of a model kit).
    #[doc(hidden)]
    pub fn push(&mut self, name: String, var: Var) -> Var {
        self.entries.push((name, var.clone()));
        var
    }

    /// Appends the 4-bit weight `name` (for the builders of a model kit).
    #[doc(hidden)]
    pub fn push_packed(&mut self, name: String, weight: PackedWeight) {
        self.packed.push((name, weight));
    }

    /// The frozen weights kept in 4 bits, by name, in the order the model made them.
    pub fn packed(&self) -> impl Iterator<Item = (&str, &PackedWeight)> {
        self.packed.iter().map(|(n, w)| (n.as_str(), w))
    }

    /// Values the 4-bit weights stand for (what their f32 copies would hold).
    pub fn packed_element_count(&self) -> usize {
        self.packed.iter().map(|(_, w)| w.len()).sum()
    }

    /// Bytes the 4-bit weights take (their codes and scales).
    pub fn packed_bytes(&self) -> usize {
        self.packed.iter().map(|(_, w)| w.bytes()).sum()
    }

    /// Appends the buffer `name`.
    #[doc(hidden)]
    pub fn push_buffer(&mut self, name: String, var: Var) {
        self.buffers.push((name, var));
    }
}

/// Sets `var` (the parameter `name`) to `tensor`, converted to its dtype and device; `Err` when
/// the shapes differ.
pub fn set_parameter(name: &str, var: &Var, tensor: &Tensor) -> std::result::Result<(), String> {
    if tensor.dims() != var.dims() {
        return Err(format!(
            "`{name}` has shape {:?} there but {:?} in this model",
            tensor.dims(),
            var.dims()
        ));
    }
    tensor
        .to_dtype(var.dtype())
        .and_then(|t| t.to_device(var.device()))
        .and_then(|t| var.set(&t))
        .map_err(|e| format!("`{name}`: {e}"))
}

/// A new parameter's values, `shape`'s count of them drawn by `draw`; where this machine
/// cannot give them memory (a mistyped width, say) an error naming the parameter and its size,
/// so that the model is refused instead of the process aborted.
pub fn parameter_values(
    name: &str,
    shape: &[usize],
    mut draw: impl FnMut() -> f32,
) -> Result<Vec<f32>> {
    let mut values = Vec::new();
    match shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d)) {
        Some(n) if values.try_reserve_exact(n).is_ok() => {
            values.extend((0..n).map(|_| draw()));
            Ok(values)
        }
        _ => Err(too_large(name, shape)),
    }
}

/// [`parameter_values`] all zero, from zeroed pages (as `vec![0.0; n]`, which the kernel
/// maps on first touch: a blank model's weights are replaced by loaded ones).
pub fn zeroed_parameter_values(name: &str, shape: &[usize]) -> Result<Vec<f32>> {
    let count = shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d));
    let Some((n, layout)) =
        count.and_then(|n| Some((n, std::alloc::Layout::array::<f32>(n).ok()?)))
    else {
        return Err(too_large(name, shape));
    };
    if layout.size() == 0 {
        return Ok(Vec::new());
    }
    // SAFETY: a non-zero-sized layout; a non-null result is `n` zeroed f32s from the global
    // allocator with the layout a `Vec<f32>` of capacity `n` frees with.
    let ptr = unsafe { std::alloc::alloc_zeroed(layout) }.cast::<f32>();
    if ptr.is_null() {
        return Err(too_large(name, shape));
    }
    // SAFETY: as above; all `n` values are initialised (zero).
    Ok(unsafe { Vec::from_raw_parts(ptr, n, n) })
}

fn too_large(name: &str, shape: &[usize]) -> candle_core::Error {
    let bytes = shape.iter().fold(4.0, |b, &d| b * d as f64);
    candle_core::Error::Msg(format!(
        "parameter `{name}` of shape {shape:?} needs {:.1} GB, more memory than this machine \
         can give; check the model's sizes",
        bytes / 1e9
    ))
}
