//! Per-example transforms, as torchvision's: normalise per channel, random crop of a
//! padded image, random horizontal flip. A random one draws from the generator the
//! loader seeds for the example (seed, epoch, index).

use ampgraph_graph::rng::SplitMix64;

use crate::{DataError, Result};

#[derive(Clone, Debug, PartialEq)]
pub enum Transform {
    /// `(x - mean[c]) / std[c]` for channel `c` of a `[channels, height, width]` image
    /// (one mean and std for any shape when one is given).
    Normalize { mean: Vec<f32>, std: Vec<f32> },
    /// Pads the image with `padding` zeros on each side, then crops a window of its
    /// own size at a random place (`RandomCrop(size, padding)`).
    RandomCrop { padding: usize },
    /// Mirrors the image left to right with probability one half.
    RandomFlip,
}

impl Transform {
    /// [`Transform::Normalize`] by `mean` and `std` per channel.
    pub fn normalize(mean: &[f32], std: &[f32]) -> Transform {
        Transform::Normalize {
            mean: mean.to_vec(),
            std: std.to_vec(),
        }
    }

    /// Transforms `values`, an example of `shape`.
    pub fn apply(&self, values: &mut [f32], shape: &[usize], rng: &mut SplitMix64) -> Result<()> {
        match self {
            Transform::Normalize { mean, std } => {
                if mean.len() != std.len() || mean.is_empty() {
                    return Err(DataError::Invalid(format!(
                        "Normalize takes as many means as stds, at least one ({} and {})",
                        mean.len(),
                        std.len()
                    )));
                }
                if let Some(s) = std.iter().find(|s| **s <= 0.0 || !s.is_finite()) {
                    return Err(DataError::Invalid(format!(
                        "Normalize's std {s} is not a positive number"
                    )));
                }
                let per_channel = match (mean.len(), shape) {
                    (1, _) => values.len(),
                    (n, [c, h, w]) if n == *c => h * w,
                    (n, _) => {
                        return Err(DataError::Invalid(format!(
                            "Normalize has {n} channels' means, the examples are {shape:?}"
                        )))
                    }
                };
                for (k, chunk) in values.chunks_mut(per_channel.max(1)).enumerate() {
                    let (m, s) = (mean[k % mean.len()], std[k % std.len()]);
                    chunk.iter_mut().for_each(|v| *v = (*v - m) / s);
                }
            }
            Transform::RandomCrop { padding } => {
                let [c, h, w] = image_shape(shape, "RandomCrop")?;
                let p = *padding;
                // The window's corner in the padded image.
                let top = rng.below(2 * p as u64 + 1) as usize;
                let left = rng.below(2 * p as u64 + 1) as usize;
                let source = values.to_vec();
                for ch in 0..c {
                    for y in 0..h {
                        for x in 0..w {
                            // Padded coordinates (top + y, left + x) in the original.
                            let (sy, sx) = ((top + y).wrapping_sub(p), (left + x).wrapping_sub(p));
                            values[(ch * h + y) * w + x] = match sy < h && sx < w {
                                true => source[(ch * h + sy) * w + sx],
                                false => 0.0,
                            };
                        }
                    }
                }
            }
            Transform::RandomFlip => {
                let [_, _, w] = image_shape(shape, "RandomFlip")?;
                if rng.below(2) == 1 {
                    values.chunks_mut(w).for_each(|row| row.reverse());
                }
            }
        }
        Ok(())
    }
}

fn image_shape(shape: &[usize], what: &str) -> Result<[usize; 3]> {
    match *shape {
        [c, h, w] => Ok([c, h, w]),
        _ => Err(DataError::Invalid(format!(
            "{what} takes [channels, height, width] images, not {shape:?}"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normalize_is_per_channel() {
        let mut v = vec![1.0, 1.0, 2.0, 2.0];
        Transform::normalize(&[1.0, 0.0], &[0.5, 2.0])
            .apply(&mut v, &[2, 1, 2], &mut SplitMix64::new(0))
            .unwrap();
        assert_eq!(v, [0.0, 0.0, 1.0, 1.0]);
        let bad = Transform::normalize(&[0.0, 0.0, 0.0], &[1.0; 3]);
        let err = bad.apply(&mut v, &[2, 1, 2], &mut SplitMix64::new(0));
        assert!(err.unwrap_err().to_string().contains("3 channels' means"));
    }

    #[test]
    fn a_crop_is_a_shifted_window_with_zeros_past_the_edge() {
        // 1x3x3 image 1..9; with padding 1 the window shifts by -1..=1 each way.
        let image: Vec<f32> = (1..=9).map(|v| v as f32).collect();
        let mut seen = std::collections::HashSet::new();
        for seed in 0..200 {
            let mut v = image.clone();
            let mut rng = SplitMix64::new(seed);
            Transform::RandomCrop { padding: 1 }
                .apply(&mut v, &[1, 3, 3], &mut rng)
                .unwrap();
            let mut again = SplitMix64::new(seed);
            let (dy, dx) = (again.below(3) as i64 - 1, again.below(3) as i64 - 1);
            for y in 0..3i64 {
                for x in 0..3i64 {
                    let (sy, sx) = (y + dy, x + dx);
                    let want = match (0..3).contains(&sy) && (0..3).contains(&sx) {
                        true => image[(sy * 3 + sx) as usize],
                        false => 0.0,
                    };
                    assert_eq!(v[(y * 3 + x) as usize], want, "seed {seed}");
                }
            }
            seen.insert((dy, dx));
        }
        assert_eq!(seen.len(), 9, "every shift happens");
    }

    #[test]
    fn a_flip_mirrors_each_row() {
        let (mut flipped, mut kept) = (0, 0);
        for seed in 0..100 {
            let mut v = vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
            Transform::RandomFlip
                .apply(&mut v, &[1, 2, 3], &mut SplitMix64::new(seed))
                .unwrap();
            match v[0] {
                3.0 => {
                    assert_eq!(v, [3.0, 2.0, 1.0, 6.0, 5.0, 4.0]);
                    flipped += 1
                }
                _ => {
                    assert_eq!(v, [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
                    kept += 1
                }
            }
        }
        assert!(flipped > 30 && kept > 30, "{flipped} flipped, {kept} kept");
    }
}
