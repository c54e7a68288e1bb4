//! Data for the examples: the MNIST idx files (plain or gzip) and a synthetic
//! MNIST-shaped data set for running with no files at all.
//!
//! Reading never trusts the file: magic numbers, dimensions and lengths are checked,
//! every problem is a [`DataError`] naming the file, and no buffer is ever larger than
//! the data the file really holds (a header claiming more than the file can contain
//! is refused before anything is allocated).
//!
//! ```no_run
//! use ampgraph_exec::data::Mnist;
//! # fn main() -> Result<(), ampgraph_exec::data::DataError> {
//! let data = Mnist::load("../shared/data/mnist")?;
//! for indices in data.batches(128, 0) {
//!     let (images, labels) = data.batch(&indices)?; // f32 [128, 784], i64 [128]
//! #   let _ = (images, labels);
//! }
//! # Ok(()) }
//! ```

use std::fs::File;
use std::io::{self, BufReader, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use ampgraph_graph::{Data, Tensor};
use flate2::bufread::MultiGzDecoder;
use thiserror::Error;

use crate::rng::SplitMix64;

/// Magic number of an idx file of unsigned bytes with 3 dimensions (images).
pub const IMAGES_MAGIC: u32 = 0x0000_0803;
/// Magic number of an idx file of unsigned bytes with 1 dimension (labels).
pub const LABELS_MAGIC: u32 = 0x0000_0801;
/// Classes of MNIST (and of [`Mnist::synthetic`]).
pub const NUM_CLASSES: usize = 10;

/// The largest expansion of DEFLATE (about 1032:1), with room for the gzip framing:
/// a gzip file of `n` bytes cannot decompress to more than this many times `n`.
const MAX_GZIP_RATIO: u64 = 1032;

#[derive(Debug, Error)]
pub enum DataError {
    #[error("{path}: {source}")]
    Io {
        path: String,
        #[source]
        source: io::Error,
    },
    #[error("{path}: not a valid gzip stream: {source}")]
    Gzip {
        path: String,
        #[source]
        source: io::Error,
    },
    #[error("{path}: truncated: {what}")]
    Truncated { path: String, what: String },
    #[error("{path}: bad magic number {found:#010x}, expected {expected:#010x} (idx {kind})")]
    BadMagic {
        path: String,
        found: u32,
        expected: u32,
        kind: &'static str,
    },
    #[error("{path}: bad dimensions: {what}")]
    BadDims { path: String, what: String },
    #[error("{path}: count mismatch: {what}")]
    CountMismatch { path: String, what: String },
    #[error("{path}: label {label} at index {index} is not a class in 0..{NUM_CLASSES}")]
    BadLabel {
        path: String,
        index: usize,
        label: u8,
    },
    #[error("{dir}: no MNIST files found (looked for {looked})")]
    NotFound { dir: String, looked: String },
    #[error("example {index} is out of range for a data set of {len}")]
    Index { index: usize, len: usize },
    #[error("{0}")]
    Invalid(String),
}

pub type Result<T, E = DataError> = std::result::Result<T, E>;

/// Reads an idx3 image file (`.gz` or plain, told apart by the gzip magic `1f 8b`):
/// returns `(rows, cols, pixels)` with `pixels.len() = count * rows * cols`.
pub fn load_idx_images(path: impl AsRef<Path>) -> Result<(usize, usize, Vec<u8>)> {
    let (dims, pixels) = read_idx(path.as_ref(), IMAGES_MAGIC, "images")?;
    match dims[..] {
        [_, rows, cols] => Ok((rows, cols, pixels)),
        _ => Err(DataError::BadDims {
            path: display(path.as_ref()),
            what: format!("{} dimensions, expected 3", dims.len()),
        }),
    }
}

/// Reads an idx1 label file (`.gz` or plain): one byte per example.
pub fn load_idx_labels(path: impl AsRef<Path>) -> Result<Vec<u8>> {
    Ok(read_idx(path.as_ref(), LABELS_MAGIC, "labels")?.1)
}

fn display(path: &Path) -> String {
    path.display().to_string()
}

/// Reads an idx file whose magic must be `magic` (which also fixes the number of
/// dimensions): returns the dimensions and the data.
fn read_idx(path: &Path, magic: u32, kind: &'static str) -> Result<(Vec<usize>, Vec<u8>)> {
    let name = display(path);
    let io_err = |source: io::Error| DataError::Io {
        path: name.clone(),
        source,
    };
    let mut file = File::open(path).map_err(io_err)?;
    let file_len = file.metadata().map_err(io_err)?.len();
    let gzip = is_gzip(&mut file).map_err(io_err)?;
    // The most data the file can hold once decompressed.
    let capacity = if gzip {
        file_len.saturating_mul(MAX_GZIP_RATIO)
    } else {
        file_len
    };
    let buffered = BufReader::new(file);
    let mut reader: Box<dyn Read> = if gzip {
        Box::new(MultiGzDecoder::new(buffered))
    } else {
        Box::new(buffered)
    };
    let read_err = |e: io::Error, what: &str| match e.kind() {
        io::ErrorKind::UnexpectedEof => DataError::Truncated {
            path: name.clone(),
            what: what.to_string(),
        },
        _ if gzip => DataError::Gzip {
            path: name.clone(),
            source: e,
        },
        _ => DataError::Io {
            path: name.clone(),
            source: e,
        },
    };

    let ndims = (magic & 0xff) as usize;
    let header_len = 4 + 4 * ndims as u64;
    let mut header = vec![0u8; header_len as usize];
    reader
        .read_exact(&mut header[..4])
        .map_err(|e| read_err(e, "the file ends inside the header"))?;
    let found = be_u32(&header[..4]);
    if found != magic {
        return Err(DataError::BadMagic {
            path: name,
            found,
            expected: magic,
            kind,
        });
    }
    reader
        .read_exact(&mut header[4..])
        .map_err(|e| read_err(e, "the file ends inside the header"))?;
    let dims: Vec<usize> = header[4..]
        .chunks_exact(4)
        .map(|c| be_u32(c) as usize)
        .collect();
    if dims.iter().skip(1).any(|&d| d == 0) {
        return Err(DataError::BadDims {
            path: name,
            what: format!("an item has a zero dimension ({dims:?})"),
        });
    }
    let bytes = dims
        .iter()
        .try_fold(1u64, |acc, &d| acc.checked_mul(d as u64));
    let Some(bytes) = bytes.filter(|&b| b <= capacity.saturating_sub(header_len)) else {
        return Err(DataError::Truncated {
            path: name,
            what: format!(
                "the header declares {kind} of dimensions {dims:?}, more than the {file_len}-byte \
                 file {}",
                if gzip { "can decompress to" } else { "holds" }
            ),
        });
    };
    // Reserve no more than the file's size: a gzip file's buffer grows only with the
    // data it really decompresses to (and never past the declared size).
    let reserve = usize::try_from(bytes.min(file_len)).unwrap_or(0);
    let mut data = Vec::with_capacity(reserve);
    (&mut reader)
        .take(bytes)
        .read_to_end(&mut data)
        .map_err(|e| read_err(e, "the data stream ends early"))?;
    if (data.len() as u64) < bytes {
        return Err(DataError::Truncated {
            path: name,
            what: format!(
                "the header declares {kind} of dimensions {dims:?} ({bytes} bytes) but the file \
                 holds {} bytes of data",
                data.len()
            ),
        });
    }
    // Reading to the end also checks the gzip CRC.
    let mut extra = [0u8; 4096];
    let mut trailing = 0u64;
    loop {
        match reader.read(&mut extra) {
            Ok(0) => break,
            Ok(k) => trailing += k as u64,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(read_err(e, "the gzip stream ends early")),
        }
        if trailing > 0 {
            break;
        }
    }
    if trailing > 0 {
        return Err(DataError::CountMismatch {
            path: name,
            what: format!(
                "the header declares {kind} of dimensions {dims:?} ({bytes} bytes) but more data \
                 follows"
            ),
        });
    }
    Ok((dims, data))
}

fn be_u32(b: &[u8]) -> u32 {
    u32::from_be_bytes([b[0], b[1], b[2], b[3]])
}

/// Whether the file starts with the gzip magic; leaves the file at its start.
fn is_gzip(file: &mut File) -> io::Result<bool> {
    let mut magic = [0u8; 2];
    let mut got = 0;
    while got < 2 {
        match file.read(&mut magic[got..]) {
            Ok(0) => break,
            Ok(k) => got += k,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    file.seek(SeekFrom::Start(0))?;
    Ok(got == 2 && magic == [0x1f, 0x8b])
}

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
#[derive(Clone, Debug, PartialEq)]
pub struct Mnist {
    rows: usize,
    cols: usize,
    images: Vec<u8>,
    labels: Vec<u8>,
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
            rows,
            cols,
            images,
            labels,
        })
    }

    /// The MNIST set in `dir`: the training files when present, else the test (t10k)
    /// files, each plain or `.gz`.
    pub fn load(dir: impl AsRef<Path>) -> Result<Mnist> {
        let dir = dir.as_ref();
        match Mnist::load_split(dir, Split::Train) {
            Err(DataError::NotFound { .. }) => {
                Mnist::load_split(dir, Split::Test).map_err(|e| match e {
                    DataError::NotFound { dir, .. } => DataError::NotFound {
                        dir,
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
        let (Some(images), Some(labels)) = (images, labels) else {
            return Err(DataError::NotFound {
                dir: display(dir),
                looked: format!("{p}-images-idx3-ubyte[.gz] and {p}-labels-idx1-ubyte[.gz]"),
            });
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
        Mnist::new(rows, cols, pixels, labels_vec)
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
            rows: SIDE,
            cols: SIDE,
            images,
            labels,
        }
    }

    pub fn len(&self) -> usize {
        self.labels.len()
    }

    pub fn is_empty(&self) -> bool {
        self.labels.is_empty()
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Pixels per image (784 for MNIST).
    pub fn image_size(&self) -> usize {
        self.rows * self.cols
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

    /// The examples at `indices`: images as f32 `[B, rows*cols]` scaled to `[0, 1]`
    /// and labels as i64 `[B]`.
    pub fn batch(&self, indices: &[usize]) -> Result<(Tensor, Tensor)> {
        let size = self.image_size();
        let mut pixels = Vec::with_capacity(indices.len().saturating_mul(size));
        let mut labels = Vec::with_capacity(indices.len());
        for &i in indices {
            let (Some(image), Some(label)) = (self.image(i), self.label(i)) else {
                return Err(DataError::Index {
                    index: i,
                    len: self.len(),
                });
            };
            pixels.extend(image.iter().map(|&p| f32::from(p) / 255.0));
            labels.push(i64::from(label));
        }
        let b = indices.len();
        let images = Tensor::new([b, size], Data::F32(pixels)).map_err(DataError::Invalid)?;
        let labels = Tensor::new([b], Data::I64(labels)).map_err(DataError::Invalid)?;
        Ok((images, labels))
    }

    /// `0..len` in an order fixed by `seed` (Fisher-Yates on SplitMix64).
    pub fn shuffled_indices(&self, seed: u64) -> Vec<usize> {
        shuffled(self.len(), seed)
    }

    /// One epoch's batches of `batch_size` indices in the order of
    /// [`Mnist::shuffled_indices`]; a last partial batch is dropped, since graph
    /// placeholders have a fixed batch size. Empty when `batch_size` is 0.
    pub fn batches(&self, batch_size: usize, seed: u64) -> Vec<Vec<usize>> {
        if batch_size == 0 {
            return Vec::new();
        }
        self.shuffled_indices(seed)
            .chunks_exact(batch_size)
            .map(<[usize]>::to_vec)
            .collect()
    }

    /// The examples `start..end` (clamped to the set) as a new set, e.g. to hold out
    /// a validation split.
    pub fn slice(&self, start: usize, end: usize) -> Mnist {
        let end = end.min(self.len());
        let start = start.min(end);
        let size = self.image_size();
        Mnist {
            rows: self.rows,
            cols: self.cols,
            images: self.images[start * size..end * size].to_vec(),
            labels: self.labels[start..end].to_vec(),
        }
    }
}

/// `dir/name`, `dir/name.gz`, `dir/alt`, `dir/alt.gz`: the first that exists.
fn find_file(dir: &Path, name: &str, alt: &str) -> Option<PathBuf> {
    [name, alt]
        .iter()
        .flat_map(|n| [dir.join(n), dir.join(format!("{n}.gz"))])
        .find(|p| p.is_file())
}

/// `0..n` shuffled deterministically by `seed`.
pub fn shuffled(n: usize, seed: u64) -> Vec<usize> {
    let mut v: Vec<usize> = (0..n).collect();
    let mut rng = SplitMix64::new(seed);
    for i in (1..n).rev() {
        let j = rng.below(i as u64 + 1) as usize;
        v.swap(i, j);
    }
    v
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

    #[test]
    fn shuffle_is_a_permutation() {
        let mut v = shuffled(1000, 3);
        assert_ne!(v, (0..1000).collect::<Vec<_>>());
        v.sort_unstable();
        assert_eq!(v, (0..1000).collect::<Vec<_>>());
    }
}
