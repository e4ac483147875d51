//! ddpjob's data sets and how batches are made from them: IDX images (MNIST, Fashion-MNIST,
//! found, downloaded and checked), a synthetic set, text and pre-tokenised token files cut
//! into windows, instruction data from JSON Lines (prompt masking, conversations through the
//! model's chat template, packing), tensors a user
//! hands over, and the `DistributedSampler` every rank draws its share with.
//!
//! It depends on the seams (`Task`, `DatasetOptions`), the spec and the storage (vocabularies,
//! tokenizers, the job directory's helpers) only: never on a model, the trainer or the
//! registry, which registers these sets in `ddpjob` as a user's binary registers its own.

mod arrow_rows;
mod batches;
mod builtin;
mod catalog;
pub mod chat;
mod conversation;
mod corpus;
pub mod download;
mod examples;
mod examples_task;
pub mod fingerprint;
pub mod host;
mod hub_source;
pub use ddpjob_storage::hf_tokenizer;
pub mod idx;
mod jinja_python;
mod jsonl;
mod jsonl_hooks;
mod jsonl_index;
mod jsonl_keys;
mod kept;
mod pairs;
mod pairs_task;
mod parquet;
mod parquet_rows;
mod pixels;
mod record_batches;
pub mod sampler;
mod synthetic;
mod tensors;
pub mod text;
mod text_options;
pub use ddpjob_storage::vocab;

use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};

use pixels::PixelMap;

pub use batches::Batches;
pub use builtin::{
    FashionMnist, IDX_KEYS, IdxOptions, Mnist, SYNTHETIC_KEYS, SyntheticOptions, SyntheticSpec,
};
pub use jsonl::{Format, JSONL_KEYS, JsonlOptions};
pub use parquet::{ARROW_KEYS, ArrowOptions, PARQUET_KEYS, ParquetOptions};
pub use sampler::DistributedSampler;
pub use tensors::TensorDataset;
pub use text_options::{TEXT_KEYS, TOKENS_KEYS, TextOptions, TokensOptions};

pub use ddpjob_seam::DataError;

/// One split: `len` images of `shape` = [channels, height, width], pixels row-major as u8.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Split {
    pub images: Vec<u8>,
    pub labels: Vec<u8>,
    pub shape: [usize; 3],
}

impl Split {
    /// Whether it holds no samples.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn len(&self) -> usize {
        self.labels.len()
    }

    fn sample_len(&self) -> usize {
        self.shape.iter().product()
    }
}

/// Both splits, the number of classes, and the pixel → f32 mapping.
#[derive(Debug, Clone)]
pub struct Dataset {
    pub train: Split,
    pub test: Split,
    pub classes: usize,
    pixels: PixelMap,
}

impl Dataset {
    pub fn new(
        train: Split,
        test: Split,
        classes: usize,
        normalize: Option<&(Vec<f32>, Vec<f32>)>,
    ) -> Self {
        let pixels = PixelMap::new(train.shape[0], normalize);
        Dataset {
            train,
            test,
            classes,
            pixels,
        }
    }

    /// Reads train images, train labels, test images, test labels (the `FILES` order), of a
    /// set whose labels are `0..classes`.
    pub fn from_idx_files(
        paths: &[PathBuf; 4],
        classes: usize,
        normalize: Option<&(Vec<f32>, Vec<f32>)>,
    ) -> Result<Self, DataError> {
        let train = split_from(&paths[0], &paths[1])?;
        let test = split_from(&paths[2], &paths[3])?;
        if train.shape != test.shape {
            return Err(DataError::Mismatch(format!(
                "train images are {:?} but test images are {:?} ({} vs {})",
                train.shape,
                test.shape,
                paths[0].display(),
                paths[2].display()
            )));
        }
        // A label past the set's classes is a damaged file, not a wider model.
        for (split, labels) in [(&train, &paths[1]), (&test, &paths[3])] {
            if let Some((i, &label)) = split
                .labels
                .iter()
                .enumerate()
                .find(|(_, l)| usize::from(**l) >= classes)
            {
                return Err(DataError::Corrupt {
                    path: labels.clone(),
                    problem: format!(
                        "label {label} of item {i} is not one of the set's {classes} classes (0 to \
                         {}); the file is damaged: delete it to download it again, or put \
                         the original there",
                        classes - 1
                    ),
                });
            }
        }
        Ok(Dataset::new(train, test, classes, normalize))
    }

    /// Images [n, c, h, w] (f32) and labels `[n]` (u32) for `indices` of `split`, built in one
    /// pass from the u8 buffer straight into the tensor's storage.
    pub fn batch(
        &self,
        split: &Split,
        indices: &[usize],
        device: &Device,
    ) -> Result<(Tensor, Tensor), DataError> {
        let sample_len = split.sample_len();
        let plane = split.shape[1] * split.shape[2];
        let mut xs = Vec::with_capacity(indices.len() * sample_len);
        let mut ys = Vec::with_capacity(indices.len());
        for &i in indices {
            let pixels = &split.images[i * sample_len..(i + 1) * sample_len];
            self.pixels.extend(&mut xs, pixels, plane);
            ys.push(u32::from(split.labels[i]));
        }
        let [c, h, w] = split.shape;
        let xs = Tensor::from_vec(xs, (indices.len(), c, h, w), device)?;
        let ys = Tensor::from_vec(ys, indices.len(), device)?;
        Ok((xs, ys))
    }
}

fn split_from(images: &Path, labels: &Path) -> Result<Split, DataError> {
    let img = idx::read_idx(images)?;
    let lab = idx::read_idx(labels)?;
    let shape = match img.dims.as_slice() {
        &[_, h, w] => [1, h, w],
        &[_, c, h, w] => [c, h, w],
        other => {
            return Err(DataError::Corrupt {
                path: images.into(),
                problem: format!("expected image dimensions [n, height, width], found {other:?}"),
            });
        }
    };
    if lab.dims.len() != 1 {
        return Err(DataError::Corrupt {
            path: labels.into(),
            problem: format!("expected label dimensions [n], found {:?}", lab.dims),
        });
    }
    if img.dims[0] != lab.dims[0] {
        return Err(DataError::Mismatch(format!(
            "`{}` has {} images but `{}` has {} labels; the files do not belong together",
            images.display(),
            img.dims[0],
            labels.display(),
            lab.dims[0]
        )));
    }
    Ok(Split {
        images: img.data,
        labels: lab.data,
        shape,
    })
}

impl ddpjob_seam::task::Task for Dataset {
    fn train_len(&self) -> usize {
        self.train.len()
    }

    fn eval_len(&self) -> usize {
        self.test.len()
    }

    fn targets_per_sample(&self) -> usize {
        1
    }

    fn input(&self) -> ddpjob_seam::task::ModelInput {
        ddpjob_seam::task::ModelInput::Image {
            shape: self.train.shape,
            classes: self.classes,
        }
    }

    fn batches<'a>(
        &'a self,
        device: &Device,
    ) -> Result<Box<dyn ddpjob_seam::task::BatchSource + 'a>, DataError> {
        Ok(Box::new(Batches::new(self, device)?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batches_scale_like_to_tensor_and_normalise() {
        let split = Split {
            images: vec![0, 255, 51, 102],
            labels: vec![3, 1],
            shape: [1, 1, 2],
        };
        let plain = Dataset::new(split.clone(), split.clone(), 4, None);
        let (x, y) = plain.batch(&split, &[1, 0], &Device::Cpu).unwrap();
        assert_eq!(x.dims(), &[2, 1, 1, 2]);
        assert_eq!(
            x.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            vec![0.2, 0.4, 0.0, 1.0]
        );
        assert_eq!(y.to_vec1::<u32>().unwrap(), vec![1, 3]);
        let norm = (vec![0.5], vec![0.5]);
        let normed = Dataset::new(split.clone(), split.clone(), 4, Some(&norm));
        let (x, _) = normed.batch(&split, &[0], &Device::Cpu).unwrap();
        assert_eq!(
            x.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            vec![-1.0, 1.0]
        );
    }

    #[test]
    fn mismatched_counts_name_both_files() {
        let dir = std::env::temp_dir().join(format!("ddpjob-mismatch-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let images = dir.join("train-images-idx3-ubyte");
        let labels = dir.join("train-labels-idx1-ubyte");
        std::fs::write(&images, idx::encode_idx(&[3, 2, 2], &[0; 12])).unwrap();
        std::fs::write(&labels, idx::encode_idx(&[2], &[0, 1])).unwrap();
        let err = split_from(&images, &labels).unwrap_err().to_string();
        assert!(
            err.contains("3 images") && err.contains("2 labels"),
            "{err}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_label_past_the_sets_classes_is_a_damaged_file_named() {
        let tmp = tempfile::tempdir().unwrap();
        let path = |name: &str| tmp.path().join(name);
        let paths = [
            path("train-images"),
            path("train-labels"),
            path("test-images"),
            path("test-labels"),
        ];
        for (images, labels, ys) in [(0, 1, [1, 9]), (2, 3, [0, 200])] {
            std::fs::write(&paths[images], idx::encode_idx(&[2, 2, 2], &[0; 8])).unwrap();
            std::fs::write(&paths[labels], idx::encode_idx(&[2], &ys)).unwrap();
        }
        let err = Dataset::from_idx_files(&paths, 10, None)
            .err()
            .unwrap()
            .to_string();
        assert!(
            err.contains("test-labels") && err.contains("label 200 of item 1 is not one of"),
            "{err}"
        );
        std::fs::write(&paths[3], idx::encode_idx(&[2], &[0, 9])).unwrap();
        let data = Dataset::from_idx_files(&paths, 10, None).unwrap();
        assert_eq!(data.classes, 10);
    }
}
