//! MNIST-format image sets: the idx files of MNIST or Fashion-MNIST (images of any
//! size the file declares, one byte a pixel, labels in 0..10), and a synthetic set
//! of the same shape for running with no files at all.

use std::path::{Path, PathBuf};

use ampgraph_graph::rng::SplitMix64;

use crate::idx::{display, load_idx_images, load_idx_labels};
use crate::{DataError, Dataset, Example, Result};

/// Classes of MNIST (and of [`Mnist::synthetic`]).
pub const NUM_CLASSES: usize = 10;

/// Which MNIST files [`Mnist::load_split`] reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Split {
    /// `train-images-idx3-ubyte`, `train-labels-idx1-ubyte` (60000 examples).
    Train,
    /// `t10k-images-idx3-ubyte`, `t10k-labels-idx1-ubyte` (10000 examples).
    Test,
}

impl Split {
    fn prefix(self) -> &'static str {
        match self {
            Split::Train => "train",
            Split::Test => "t10k",
        }
    }
}

/// Images (`rows x cols` bytes each) with a class label in `0..10` each.
#[derive(Clone, Debug)]
pub struct Mnist {
    /// `[1, rows, cols]`.
    shape: [usize; 3],
    images: Vec<u8>,
    labels: Vec<u8>,
    /// The images' file, or what made them.
    source: String,
}

impl Mnist {
    /// A data set from its parts, checking that they agree.
    pub fn new(rows: usize, cols: usize, images: Vec<u8>, labels: Vec<u8>) -> Result<Mnist> {
        let size = rows.checked_mul(cols).filter(|&s| s > 0).ok_or_else(|| {
            DataError::Invalid(format!("images of {rows}x{cols} pixels are not allowed"))
        })?;
        if images.len() % size != 0 || images.len() / size != labels.len() {
            return Err(DataError::Invalid(format!(
                "{} pixel bytes of {rows}x{cols} images do not match {} labels",
                images.len(),
                labels.len()
            )));
        }
        if let Some(index) = labels.iter().position(|&l| l as usize >= NUM_CLASSES) {
            return Err(DataError::Invalid(format!(
                "label {} at index {index} is not a class in 0..{NUM_CLASSES}",
                labels[index]
            )));
        }
        Ok(Mnist {
            shape: [1, rows, cols],
            images,
            labels,
            source: format!("{rows}x{cols} images in memory"),
        })
    }

    /// The MNIST set in `dir`: the training files when present, else the test (t10k)
    /// files, each plain or `.gz`.
    pub fn load(dir: impl AsRef<Path>) -> Result<Mnist> {
        let dir = dir.as_ref();
        match Mnist::load_split(dir, Split::Train) {
            Err(DataError::NotFound { .. }) => {
                Mnist::load_split(dir, Split::Test).map_err(|e| match e {
                    DataError::NotFound { dir, what, .. } => DataError::NotFound {
                        dir,
                        what,
                        looked: "train-* and t10k-*-idx?-ubyte[.gz]".into(),
                    },
                    other => other,
                })
            }
            other => other,
        }
    }

    /// One split of the MNIST files in `dir`.
    pub fn load_split(dir: impl AsRef<Path>, split: Split) -> Result<Mnist> {
        let dir = dir.as_ref();
        let p = split.prefix();
        let images = find_file(
            dir,
            &format!("{p}-images-idx3-ubyte"),
            &format!("{p}-images.idx3-ubyte"),
        );
        let labels = find_file(
            dir,
            &format!("{p}-labels-idx1-ubyte"),
            &format!("{p}-labels.idx1-ubyte"),
        );
        let (images_name, labels_name) = (
            format!("{p}-images-idx3-ubyte[.gz]"),
            format!("{p}-labels-idx1-ubyte[.gz]"),
        );
        let (images, labels) = match (images, labels) {
            (Some(images), Some(labels)) => (images, labels),
            (None, None) => {
                return Err(DataError::NotFound {
                    dir: display(dir),
                    what: "MNIST files",
                    looked: format!("{images_name} and {labels_name}"),
                })
            }
            // Half a split is an error, not a reason to take another split.
            (Some(found), None) => return Err(incomplete(dir, &found, labels_name)),
            (None, Some(found)) => return Err(incomplete(dir, &found, images_name)),
        };
        let (rows, cols, pixels) = load_idx_images(&images)?;
        let labels_vec = load_idx_labels(&labels)?;
        let count = pixels.len() / (rows * cols);
        if count != labels_vec.len() {
            return Err(DataError::CountMismatch {
                path: display(&labels),
                what: format!(
                    "{} labels but {} holds {count} images",
                    labels_vec.len(),
                    images.display()
                ),
            });
        }
        if let Some(index) = labels_vec.iter().position(|&l| l as usize >= NUM_CLASSES) {
            return Err(DataError::BadLabel {
                path: display(&labels),
                index,
                label: labels_vec[index],
            });
        }
        let mut set = Mnist::new(rows, cols, pixels, labels_vec)?;
        set.source = display(&images);
        Ok(set)
    }

    /// `n` deterministic 28x28 examples of 10 classes (`i % 10` for example `i`, so
    /// balanced): each class is a seven-segment digit drawn with blurred strokes,
    /// randomly shifted, scaled, slanted and thickened, with noise. Learnable by an
    /// MLP, yet not trivially.
    pub fn synthetic(n: usize, seed: u64) -> Mnist {
        const SIDE: usize = 28;
        let mut images = Vec::with_capacity(n.saturating_mul(SIDE * SIDE));
        let mut labels = Vec::with_capacity(n);
        for i in 0..n {
            let class = i % NUM_CLASSES;
            let mut rng = SplitMix64::new(seed ^ (i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15));
            render_digit(class, SIDE, &mut rng, &mut images);
            labels.push(class as u8);
        }
        Mnist {
            shape: [1, SIDE, SIDE],
            images,
            labels,
            source: format!("{n} synthetic digits (seed {seed})"),
        }
    }

    pub fn rows(&self) -> usize {
        self.shape[1]
    }

    pub fn cols(&self) -> usize {
        self.shape[2]
    }

    /// Pixels per image (784 for MNIST).
    pub fn image_size(&self) -> usize {
        self.rows() * self.cols()
    }

    /// All pixels, image after image, row-major.
    pub fn images(&self) -> &[u8] {
        &self.images
    }

    pub fn labels(&self) -> &[u8] {
        &self.labels
    }

    /// The pixels of example `i`.
    pub fn image(&self, i: usize) -> Option<&[u8]> {
        let size = self.image_size();
        self.images
            .get(i.checked_mul(size)?..i.checked_add(1)?.checked_mul(size)?)
    }

    pub fn label(&self, i: usize) -> Option<u8> {
        self.labels.get(i).copied()
    }

    /// The examples `start..end` (clamped to the set) as a new set, e.g. to hold out
    /// a validation split.
    pub fn slice(&self, start: usize, end: usize) -> Mnist {
        let end = end.min(self.len());
        let start = start.min(end);
        let size = self.image_size();
        Mnist {
            shape: self.shape,
            images: self.images[start * size..end * size].to_vec(),
            labels: self.labels[start..end].to_vec(),
            source: format!("{} [{start}..{end}]", self.source),
        }
    }
}

/// The same images and labels, wherever they came from.
impl PartialEq for Mnist {
    fn eq(&self, other: &Mnist) -> bool {
        (self.shape, &self.images, &self.labels) == (other.shape, &other.images, &other.labels)
    }
}

impl Dataset for Mnist {
    fn len(&self) -> usize {
        self.labels.len()
    }

    fn shape(&self) -> &[usize] {
        &self.shape
    }

    fn classes(&self) -> usize {
        NUM_CLASSES
    }

    /// The pixels scaled to `[0, 1]` (as torchvision's `ToTensor`) and the label.
    fn get(&self, index: usize) -> Result<Example> {
        let (Some(image), Some(label)) = (self.image(index), self.label(index)) else {
            return Err(DataError::Index {
                index,
                len: self.len(),
            });
        };
        Ok(Example {
            values: image.iter().map(|&p| f32::from(p) / 255.0).collect(),
            label: i64::from(label),
        })
    }

    fn describe(&self) -> String {
        self.source.clone()
    }
}

/// The error of a split whose file `found` is in `dir` without its partner `missing`.
fn incomplete(dir: &Path, found: &Path, missing: String) -> DataError {
    DataError::Incomplete {
        dir: display(dir),
        found: found
            .file_name()
            .unwrap_or_default()
            .to_string_lossy()
            .into_owned(),
        missing,
    }
}

/// `dir/name`, `dir/name.gz`, `dir/alt`, `dir/alt.gz`: the first that exists.
fn find_file(dir: &Path, name: &str, alt: &str) -> Option<PathBuf> {
    [name, alt]
        .iter()
        .flat_map(|n| [dir.join(n), dir.join(format!("{n}.gz"))])
        .find(|p| p.is_file())
}

/// Seven-segment strokes on a 28x28 canvas: corners of a 12x18 box centred at (14, 14).
const SEGMENTS: [[f32; 4]; 7] = {
    const L: f32 = 8.0;
    const R: f32 = 20.0;
    const T: f32 = 5.0;
    const M: f32 = 14.0;
    const B: f32 = 23.0;
    [
        [L, T, R, T], // a: top
        [R, T, R, M], // b: upper right
        [R, M, R, B], // c: lower right
        [L, B, R, B], // d: bottom
        [L, M, L, B], // e: lower left
        [L, T, L, M], // f: upper left
        [L, M, R, M], // g: middle
    ]
};

/// Segments lit for each digit, as bits a (1) .. g (64).
const DIGITS: [u8; NUM_CLASSES] = [
    0b011_1111, // 0: abcdef
    0b000_0110, // 1: bc
    0b101_1011, // 2: abdeg
    0b100_1111, // 3: abcdg
    0b110_0110, // 4: bcfg
    0b110_1101, // 5: acdfg
    0b111_1101, // 6: acdefg
    0b000_0111, // 7: abc
    0b111_1111, // 8: all
    0b110_1111, // 9: abcdfg
];

/// Appends one `side x side` image of `class` to `out`.
fn render_digit(class: usize, side: usize, rng: &mut SplitMix64, out: &mut Vec<u8>) {
    let lit: Vec<[f32; 4]> = SEGMENTS
        .iter()
        .enumerate()
        .filter(|(k, _)| DIGITS[class] & (1 << k) != 0)
        .map(|(_, s)| *s)
        .collect();
    let centre = side as f32 / 2.0;
    let (dx, dy) = (rng.range(-2.5, 2.5), rng.range(-2.5, 2.5));
    let scale = rng.range(0.8, 1.1);
    let shear = rng.range(-0.25, 0.25);
    let sigma = rng.range(0.8, 1.5) / scale;
    let strength = rng.range(0.75, 1.0);
    let inv_two_var = 1.0 / (2.0 * sigma * sigma);
    for y in 0..side {
        for x in 0..side {
            // Undo the transform: pixel -> glyph coordinates.
            let qy = y as f32 - centre - dy;
            let qx = x as f32 - centre - dx - shear * qy;
            let (u, v) = (qx / scale + centre, qy / scale + centre);
            let d2 = lit
                .iter()
                .map(|s| segment_dist2(u, v, s))
                .fold(f32::INFINITY, f32::min);
            let ink = strength * (-d2 * inv_two_var).exp();
            let noise = 0.2 * rng.unit_f32() - 0.05;
            let value = (ink + noise).clamp(0.0, 1.0);
            out.push((value * 255.0).round() as u8);
        }
    }
}

/// Squared distance from `(px, py)` to the segment `[x0, y0, x1, y1]`.
fn segment_dist2(px: f32, py: f32, s: &[f32; 4]) -> f32 {
    let [x0, y0, x1, y1] = *s;
    let (vx, vy) = (x1 - x0, y1 - y0);
    let (wx, wy) = (px - x0, py - y0);
    let len2 = vx * vx + vy * vy;
    let t = if len2 > 0.0 {
        ((wx * vx + wy * vy) / len2).clamp(0.0, 1.0)
    } else {
        0.0
    };
    let (ex, ey) = (wx - t * vx, wy - t * vy);
    ex * ex + ey * ey
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn digits_are_distinct() {
        let set: std::collections::HashSet<u8> = DIGITS.iter().copied().collect();
        assert_eq!(set.len(), NUM_CLASSES);
    }
}
