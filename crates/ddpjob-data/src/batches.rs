//! Where a step's batches come from. On the CPU they are assembled from the u8 pixels per step.
//! On a GPU both splits are uploaded once (as the f32 tensors the host path would build), and
//! each batch is an `index_select` on the device: the only per-step transfer is the indices.

use candle_core::{Device, Tensor};

use super::{DataError, Dataset, Split};
use ddpjob_seam::task::BatchSource;

/// Splits larger than this together stay on the host (a GPU has other uses for its memory).
pub const MAX_RESIDENT_BYTES: usize = 4 << 30;

/// A split uploaded to a device: images [n, c, h, w] f32, labels [n] u32.
pub struct DeviceSplit {
    images: Tensor,
    labels: Tensor,
}

impl DeviceSplit {
    /// Uploads all of `split`, normalised exactly as [`Dataset::batch`] does.
    pub fn upload(data: &Dataset, split: &Split, device: &Device) -> Result<Self, DataError> {
        let all: Vec<usize> = (0..split.len()).collect();
        let (images, labels) = data.batch(split, &all, device)?;
        Ok(DeviceSplit { images, labels })
    }

    /// The samples `indices`, gathered on the device.
    pub fn gather(&self, indices: &[usize]) -> Result<(Tensor, Tensor), DataError> {
        let idx: Vec<u32> = indices.iter().map(|&i| i as u32).collect();
        let idx = Tensor::from_vec(idx, indices.len(), self.images.device())?;
        Ok((
            self.images.index_select(&idx, 0)?,
            self.labels.index_select(&idx, 0)?,
        ))
    }
}

pub enum Batches<'a> {
    Host {
        data: &'a Dataset,
        device: Device,
    },
    Resident {
        train: DeviceSplit,
        test: DeviceSplit,
    },
}

impl<'a> Batches<'a> {
    /// Resident on a GPU when both splits fit in `MAX_RESIDENT_BYTES`, else built per step.
    pub fn new(data: &'a Dataset, device: &Device) -> Result<Self, DataError> {
        let bytes = (data.train.images.len() + data.test.images.len()) * 4;
        if device.is_cpu() || bytes > MAX_RESIDENT_BYTES {
            return Ok(Batches::Host {
                data,
                device: device.clone(),
            });
        }
        Self::resident(data, device)
    }

    /// Uploads both splits to `device`, whatever it is.
    pub fn resident(data: &Dataset, device: &Device) -> Result<Self, DataError> {
        Ok(Batches::Resident {
            train: DeviceSplit::upload(data, &data.train, device)?,
            test: DeviceSplit::upload(data, &data.test, device)?,
        })
    }

    #[cfg(test)]
    pub fn is_resident(&self) -> bool {
        matches!(self, Batches::Resident { .. })
    }

    /// Training samples `indices`: images and labels.
    pub fn train(&self, indices: &[usize]) -> Result<(Tensor, Tensor), DataError> {
        match self {
            Batches::Host { data, device } => data.batch(&data.train, indices, device),
            Batches::Resident { train, .. } => train.gather(indices),
        }
    }

    /// Test samples `indices`.
    pub fn test(&self, indices: &[usize]) -> Result<(Tensor, Tensor), DataError> {
        match self {
            Batches::Host { data, device } => data.batch(&data.test, indices, device),
            Batches::Resident { test, .. } => test.gather(indices),
        }
    }
}

impl BatchSource for Batches<'_> {
    fn train(&self, _epoch: usize, indices: &[usize]) -> Result<(Tensor, Tensor), DataError> {
        Batches::train(self, indices)
    }

    fn eval(&self, indices: &[usize]) -> Result<(Tensor, Tensor), DataError> {
        self.test(indices)
    }

    fn note(&self) -> Option<String> {
        match self {
            Batches::Resident { train, .. } => Some(format!(
                "data: both splits uploaded to {:?} once; batches are gathered there",
                train.images.device().location()
            )),
            Batches::Host { .. } => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::SyntheticSpec;

    #[test]
    fn resident_batches_equal_the_host_built_ones() {
        let spec = SyntheticSpec {
            train_samples: 40,
            test_samples: 10,
            shape: [2, 5, 4],
            classes: 3,
            noise: 0.5,
        };
        let (train, test) = super::super::synthetic::generate(&spec, 7);
        let normalize = (vec![0.5, 0.25], vec![0.2, 0.4]);
        let data = Dataset::new(train, test, 3, Some(&normalize));
        let host = Batches::new(&data, &Device::Cpu).unwrap();
        assert!(!host.is_resident());
        let resident = Batches::resident(&data, &Device::Cpu).unwrap();
        let same = |a: (Tensor, Tensor), b: (Tensor, Tensor)| {
            let flat = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            assert_eq!(a.0.dims(), b.0.dims());
            assert_eq!(flat(&a.0), flat(&b.0));
            assert_eq!(a.1.to_vec1::<u32>().unwrap(), b.1.to_vec1::<u32>().unwrap());
        };
        let picks = [39, 0, 17, 17, 5];
        same(host.train(&picks).unwrap(), resident.train(&picks).unwrap());
        same(host.test(&[9, 3]).unwrap(), resident.test(&[9, 3]).unwrap());
    }
}
