//! DPO's reference: the model as the job started, frozen, whose log-probabilities of each
//! completion the policy's are measured against. Three ways to have it:
//!
//! - **Adapters off**: the policy is LoRA adapters over a frozen base, so the reference is
//!   the same model with its adapters switched off for the pass (`ddpjob_seam::adapters`):
//!   no second copy of the weights (TRL's `disable_adapter()`).
//! - **Frozen**: a second model, built as the job first built the policy (its `init_from`, or
//!   the weights its seed draws), never trained.
//! - **Table**: the log-probabilities computed once before training
//!   (`train.dpo.precompute_reference`), kept in the job directory (`dpo-reference.bin`).
//!
//! Every completion is scored alone, its row cut to its own length, whatever batch it came
//! in: the same bits live or precomputed, on any number of workers or row shards, and a
//! table is keyed by the completion's tokens (a SHA-256 of them), not by where it sits in
//! an epoch.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Result, Tensor};
use ddpjob_seam::{Mode, Model};
use sha2::{Digest, Sha256};

use super::logps::{row_extents, row_logps};

/// The reference's log-probabilities.
pub enum Reference {
    /// The policy with its LoRA adapters switched off.
    AdaptersOff,
    /// A frozen copy of the model as the job started.
    Frozen(Box<dyn Model>),
    /// Computed before training, by completion.
    Table(ReferenceTable),
}

/// A completion's key in a [`ReferenceTable`]: the first 16 bytes of the SHA-256 of its
/// inputs and targets (u32, little-endian) up to its last scored target.
pub type RowKey = [u8; 16];

/// The key of a row cut to its length.
pub fn row_key(xs: &[u32], ys: &[u32]) -> RowKey {
    let mut hash = Sha256::new();
    for v in xs.iter().chain(ys) {
        hash.update(v.to_le_bytes());
    }
    hash.update((xs.len() as u64).to_le_bytes());
    let digest = hash.finalize();
    let mut key = [0u8; 16];
    key.copy_from_slice(&digest[..16]);
    key
}

impl Reference {
    /// The reference's summed log-probability of each row of `xs`, `ys` `[m, t]` (0 for a row
    /// that scores nothing), each row alone; `policy` is the model adapters-off runs.
    pub fn row_logps(&self, policy: &dyn Model, xs: &Tensor, ys: &Tensor) -> Result<Vec<f32>> {
        let extents = row_extents(ys)?;
        let mut out = Vec::with_capacity(extents.len());
        for (i, &(scored, len)) in extents.iter().enumerate() {
            if scored == 0 {
                out.push(0.0);
                continue;
            }
            let x = xs.narrow(0, i, 1)?.narrow(1, 0, len)?.contiguous()?;
            let y = ys.narrow(0, i, 1)?.narrow(1, 0, len)?.contiguous()?;
            let one = |model: &dyn Model| -> Result<f32> {
                row_logps(model, &x, &y, &Mode::Eval)?
                    .detach()
                    .to_vec1::<f32>()
                    .map(|v| v[0])
            };
            out.push(match self {
                Reference::AdaptersOff => ddpjob_seam::adapters::without(|| one(policy))?,
                Reference::Frozen(model) => one(model.as_ref())?,
                Reference::Table(table) => {
                    let key = key_of(&x, &y)?;
                    table.get(&key).ok_or_else(|| {
                        candle_core::Error::Msg(format!(
                            "the precomputed reference (`{}`) has no completion of {len} \
                             tokens met in this batch: it holds the job's own pairs, as they \
                             were when it was made (other data, as `eval --data` gives, needs \
                             train.dpo.precompute_reference = false; a table from before the \
                             data changed is deleted to compute it again)",
                            table.path.display()
                        ))
                    })?
                }
            });
        }
        Ok(out)
    }
}

/// The key of each row of `xs`, `ys` `[m, t]` cut to its length (`None` for a row that scores
/// nothing).
pub fn row_keys(xs: &Tensor, ys: &Tensor) -> Result<Vec<Option<RowKey>>> {
    let extents = row_extents(ys)?;
    let xs = xs.to_dtype(DType::U32)?.to_vec2::<u32>()?;
    let ys = ys.to_dtype(DType::U32)?.to_vec2::<u32>()?;
    Ok((extents.iter().enumerate())
        .map(|(i, &(scored, len))| (scored > 0).then(|| row_key(&xs[i][..len], &ys[i][..len])))
        .collect())
}

fn key_of(x: &Tensor, y: &Tensor) -> Result<RowKey> {
    let x = x.to_dtype(DType::U32)?.flatten_all()?.to_vec1::<u32>()?;
    let y = y.to_dtype(DType::U32)?.flatten_all()?.to_vec1::<u32>()?;
    Ok(row_key(&x, &y))
}

/// The reference's log-probability of every completion of the data, by [`RowKey`].
pub struct ReferenceTable {
    values: HashMap<RowKey, f32>,
    path: PathBuf,
}

/// The stored table's first bytes; then the number of entries (u64), then each entry's key
/// (16 bytes) and value (f32), little-endian.
const MAGIC: &[u8; 8] = b"DDPJREF1";

impl ReferenceTable {
    /// The file's name in the job directory.
    pub const FILE: &'static str = "dpo-reference.bin";

    pub fn new(values: HashMap<RowKey, f32>, path: PathBuf) -> Self {
        ReferenceTable { values, path }
    }

    pub fn get(&self, key: &RowKey) -> Option<f32> {
        self.values.get(key).copied()
    }

    pub fn len(&self) -> usize {
        self.values.len()
    }

    pub fn is_empty(&self) -> bool {
        self.values.is_empty()
    }

    /// Writes the table to its path (a temporary beside it, then renamed: never half a file).
    pub fn save(&self) -> std::io::Result<()> {
        let mut entries: Vec<(&RowKey, &f32)> = self.values.iter().collect();
        entries.sort_by_key(|(key, _)| **key);
        let mut bytes = Vec::with_capacity(16 + entries.len() * 20);
        bytes.extend_from_slice(MAGIC);
        bytes.extend_from_slice(&(entries.len() as u64).to_le_bytes());
        for (key, value) in entries {
            bytes.extend_from_slice(key);
            bytes.extend_from_slice(&value.to_le_bytes());
        }
        let partial = self.path.with_extension("bin.partial");
        std::fs::write(&partial, bytes)?;
        std::fs::rename(&partial, &self.path)
    }

    /// The table stored at `path`, or why it cannot be read (named, with the fix).
    pub fn load(path: &Path) -> std::result::Result<Self, String> {
        let bytes =
            std::fs::read(path).map_err(|e| format!("cannot read `{}`: {e}", path.display()))?;
        let bad = |why: &str| {
            format!(
                "`{}` is damaged ({why}); delete it to compute the reference again",
                path.display()
            )
        };
        let rest = bytes
            .strip_prefix(MAGIC)
            .ok_or_else(|| bad("not a reference table"))?;
        let (count, entries) = rest.split_at_checked(8).ok_or_else(|| bad("cut short"))?;
        let count = u64::from_le_bytes(count.try_into().expect("8 bytes")) as usize;
        if count.checked_mul(20) != Some(entries.len()) {
            return Err(bad("its length does not match its header"));
        }
        let values = entries
            .chunks_exact(20)
            .map(|e| {
                let key: RowKey = e[..16].try_into().expect("16 bytes");
                (
                    key,
                    f32::from_le_bytes(e[16..].try_into().expect("4 bytes")),
                )
            })
            .collect();
        Ok(ReferenceTable::new(values, path.to_path_buf()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_table_reads_back_as_written() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(ReferenceTable::FILE);
        let values: HashMap<RowKey, f32> = [
            (row_key(&[1, 2], &[u32::MAX, 3]), -1.5f32),
            (row_key(&[1, 2, 3], &[u32::MAX, 3, 4]), -0.25),
        ]
        .into();
        ReferenceTable::new(values.clone(), path.clone())
            .save()
            .unwrap();
        let back = ReferenceTable::load(&path).unwrap();
        assert_eq!(back.values, values);
        assert_ne!(row_key(&[1, 2], &[3, 4]), row_key(&[1, 2], &[3, 5]));
        std::fs::write(&path, b"DDPJREF1\x05\0\0\0\0\0\0\0").unwrap();
        let e = ReferenceTable::load(&path).err().unwrap();
        assert!(e.contains("damaged") && e.contains("delete it"), "{e}");
    }
}
