//! u8 pixels to the f32 values a model reads: ToTensor's /255, then (x - mean) / std per
//! channel, computed per element so the loop vectorises (a 256-entry table lookup per pixel
//! was ~1 ns each, a fifth of a small model's CPU step; the arithmetic gives the table's
//! values bit for bit, the same operations in the same order).

/// Each channel's (mean, std); (0, 1) without normalisation.
#[derive(Debug, Clone)]
pub struct PixelMap {
    per_channel: Vec<(f32, f32)>,
}

impl PixelMap {
    pub fn new(channels: usize, normalize: Option<&(Vec<f32>, Vec<f32>)>) -> Self {
        let per_channel = (0..channels)
            .map(|c| normalize.map_or((0.0, 1.0), |(m, s)| (m[c], s[c])))
            .collect();
        PixelMap { per_channel }
    }

    /// Appends the values of one sample's `pixels` (its channels' planes one after another,
    /// `plane` pixels each) to `out`.
    pub fn extend(&self, out: &mut Vec<f32>, pixels: &[u8], plane: usize) {
        for (channel, &(mean, std)) in pixels.chunks_exact(plane).zip(&self.per_channel) {
            out.reserve(channel.len());
            let start = out.len();
            let spare = &mut out.spare_capacity_mut()[..channel.len()];
            convert(spare, channel, mean, std);
            // SAFETY: `convert` wrote every one of the `channel.len()` values after `start`.
            unsafe { out.set_len(start + channel.len()) };
        }
    }
}

/// The value of pixel `v`: the one expression both the loop and the tests use.
#[inline(always)]
fn value(v: u8, mean: f32, std: f32) -> f32 {
    (v as f32 / 255.0 - mean) / std
}

fn convert(out: &mut [std::mem::MaybeUninit<f32>], pixels: &[u8], mean: f32, std: f32) {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU supports AVX2, checked just above.
        return unsafe { convert_avx2(out, pixels, mean, std) };
    }
    convert_plain(out, pixels, mean, std)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn convert_avx2(out: &mut [std::mem::MaybeUninit<f32>], pixels: &[u8], mean: f32, std: f32) {
    convert_plain(out, pixels, mean, std)
}

#[inline(always)]
fn convert_plain(out: &mut [std::mem::MaybeUninit<f32>], pixels: &[u8], mean: f32, std: f32) {
    for (o, &v) in out.iter_mut().zip(pixels) {
        o.write(value(v, mean, std));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every pixel value of every channel, normalised or not, as the expression gives it (the
    /// table the loop replaced held exactly these), whatever the vector width the loop takes.
    #[test]
    fn every_pixel_value_maps_as_the_expression_gives_it() {
        let normalize = (vec![0.2860, 0.5, 0.0], vec![0.3530, 0.25, 1.0]);
        for stats in [None, Some(&normalize)] {
            let map = PixelMap::new(3, stats);
            // Three planes of all 256 values, at odd lengths to reach the loop's tails.
            for plane in [256, 7, 33] {
                let pixels: Vec<u8> = (0..3 * plane).map(|i| (i * 37 % 256) as u8).collect();
                let mut out = vec![-1.0];
                map.extend(&mut out, &pixels, plane);
                assert_eq!(out.len(), 1 + 3 * plane);
                assert_eq!(out[0], -1.0, "values before are kept");
                for (i, (&v, got)) in pixels.iter().zip(&out[1..]).enumerate() {
                    let (mean, std) = map.per_channel[i / plane];
                    let want = value(v, mean, std);
                    assert_eq!(
                        got.to_bits(),
                        want.to_bits(),
                        "pixel {v} of channel {}",
                        i / plane
                    );
                    let exact = (v as f64 / 255.0 - mean as f64) / std as f64;
                    assert!(
                        (*got as f64 - exact).abs() < 1e-6,
                        "pixel {v}: {got} vs {exact}"
                    );
                }
            }
        }
        // ToTensor's range without normalisation: 0 → 0, 255 → 1.
        let mut out = Vec::new();
        PixelMap::new(1, None).extend(&mut out, &[0, 255], 2);
        assert_eq!(out, [0.0, 1.0]);
    }
}
