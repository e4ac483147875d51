//! A classification data set held in memory as f32 features and integer labels, as torch's
//! `TensorDataset`: what a user's dataset opener returns after reading its own files (CSV,
//! `.npy`, ...), so it gets the sampler, sharding and resume of the built-in sets for free.

use candle_core::{DType, Device, Tensor};

use super::DataError;
use ddpjob_seam::task::{BatchSource, ModelInput, Task};

/// Labelled samples of one shape, a training and an evaluation split.
///
/// ```
/// use ddpjob_data::TensorDataset;
/// use ddpjob_seam::Task;
///
/// // Four samples of 2 features (shape [1, 1, 2]), two classes; one evaluation sample.
/// let data = TensorDataset::classification(
///     [1, 1, 2], 2,
///     vec![0.0, 1.0, 1.0, 0.0, 0.5, 0.5, 0.2, 0.9], vec![0, 1, 1, 0],
///     vec![0.1, 0.8], vec![0],
/// )?;
/// assert_eq!((data.train_len(), data.eval_len()), (4, 1));
/// # Ok::<(), ddpjob_seam::DataError>(())
/// ```
#[derive(Debug, Clone)]
pub struct TensorDataset {
    shape: [usize; 3],
    classes: usize,
    train: Split,
    test: Split,
}

#[derive(Debug, Clone)]
struct Split {
    features: Vec<f32>,
    labels: Vec<u32>,
}

impl TensorDataset {
    /// Samples of `shape` ([channels, height, width]; a table row of F values is
    /// `[1, 1, F]`), row-major, with labels in `0..classes`.
    pub fn classification(
        shape: [usize; 3],
        classes: usize,
        train_features: Vec<f32>,
        train_labels: Vec<u32>,
        test_features: Vec<f32>,
        test_labels: Vec<u32>,
    ) -> Result<Self, DataError> {
        let per_sample: usize = shape.iter().product();
        let check = |what: &str, features: &[f32], labels: &[u32]| {
            if per_sample == 0 || features.len() != labels.len() * per_sample {
                return Err(DataError::Mismatch(format!(
                    "{what}: {} values for {} labels, but each sample of shape {shape:?} has \
                     {per_sample}",
                    features.len(),
                    labels.len()
                )));
            }
            if labels.is_empty() {
                return Err(DataError::Mismatch(format!("{what} has no samples")));
            }
            if let Some((i, l)) = labels
                .iter()
                .enumerate()
                .find(|(_, l)| **l as usize >= classes)
            {
                return Err(DataError::Mismatch(format!(
                    "{what}: sample {i} has label {l}, but there are {classes} classes (0..{})",
                    classes.saturating_sub(1)
                )));
            }
            Ok(())
        };
        check("the training split", &train_features, &train_labels)?;
        check("the evaluation split", &test_features, &test_labels)?;
        Ok(TensorDataset {
            shape,
            classes,
            train: Split {
                features: train_features,
                labels: train_labels,
            },
            test: Split {
                features: test_features,
                labels: test_labels,
            },
        })
    }
}

impl Task for TensorDataset {
    fn train_len(&self) -> usize {
        self.train.labels.len()
    }

    fn eval_len(&self) -> usize {
        self.test.labels.len()
    }

    fn targets_per_sample(&self) -> usize {
        1
    }

    fn input(&self) -> ModelInput {
        ModelInput::Image {
            shape: self.shape,
            classes: self.classes,
        }
    }

    fn batches<'a>(&'a self, device: &Device) -> Result<Box<dyn BatchSource + 'a>, DataError> {
        Ok(Box::new(TensorBatches {
            data: self,
            device: device.clone(),
        }))
    }
}

struct TensorBatches<'a> {
    data: &'a TensorDataset,
    device: Device,
}

impl TensorBatches<'_> {
    fn gather(&self, split: &Split, indices: &[usize]) -> Result<(Tensor, Tensor), DataError> {
        let [c, h, w] = self.data.shape;
        let per_sample = c * h * w;
        let mut features = Vec::with_capacity(indices.len() * per_sample);
        let mut labels = Vec::with_capacity(indices.len());
        for &i in indices {
            let row = split
                .features
                .get(i * per_sample..(i + 1) * per_sample)
                .ok_or_else(|| {
                    DataError::Mismatch(format!(
                        "sample {i} is past the split's {} samples",
                        split.labels.len()
                    ))
                })?;
            features.extend_from_slice(row);
            labels.push(split.labels[i]);
        }
        let n = indices.len();
        let xs = Tensor::from_vec(features, (n, c, h, w), &self.device)?;
        let ys = Tensor::from_vec(labels, n, &self.device)?.to_dtype(DType::U32)?;
        Ok((xs, ys))
    }
}

impl BatchSource for TensorBatches<'_> {
    fn train(&self, _epoch: usize, indices: &[usize]) -> Result<(Tensor, Tensor), DataError> {
        self.gather(&self.data.train, indices)
    }

    fn eval(&self, indices: &[usize]) -> Result<(Tensor, Tensor), DataError> {
        self.gather(&self.data.test, indices)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batches_gather_the_asked_samples_and_bad_shapes_are_refused() {
        let data = TensorDataset::classification(
            [1, 1, 2],
            3,
            vec![0.0, 0.1, 1.0, 1.1, 2.0, 2.1],
            vec![0, 1, 2],
            vec![9.0, 9.1],
            vec![2],
        )
        .unwrap();
        let batches = data.batches(&Device::Cpu).unwrap();
        let (xs, ys) = batches.train(0, &[2, 0]).unwrap();
        assert_eq!(xs.dims(), [2, 1, 1, 2]);
        assert_eq!(
            xs.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            [2.0, 2.1, 0.0, 0.1]
        );
        assert_eq!(ys.to_vec1::<u32>().unwrap(), [2, 0]);
        let (_, ys) = batches.eval(&[0]).unwrap();
        assert_eq!(ys.to_vec1::<u32>().unwrap(), [2]);

        let short = TensorDataset::classification(
            [1, 1, 2],
            3,
            vec![0.0],
            vec![0],
            vec![0.0, 0.0],
            vec![0],
        );
        assert!(
            short
                .unwrap_err()
                .to_string()
                .contains("1 values for 1 labels")
        );
        let label =
            TensorDataset::classification([1, 1, 1], 2, vec![0.0], vec![5], vec![0.0], vec![0]);
        assert!(label.unwrap_err().to_string().contains("label 5"));
    }
}
