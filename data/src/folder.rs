//! An image folder, as torchvision's `ImageFolder`: one sub-folder per class (classes
//! numbered in the sorted order of their names), PNG or JPEG images in each, decoded
//! (by the `image` crate) when an example is asked for. Every image must have the
//! channels and size of the first; an error names the file.

use std::path::{Path, PathBuf};

use image::DynamicImage;

use crate::idx::display;
use crate::{DataError, Dataset, Example, Result};

/// The image files of a folder of class folders.
#[derive(Clone, Debug)]
pub struct ImageFolder {
    root: PathBuf,
    /// Class names, sorted; a class is its position.
    classes: Vec<String>,
    /// Each image's file and class.
    files: Vec<(PathBuf, i64)>,
    /// `[channels, height, width]` of the first image: every image's.
    shape: [usize; 3],
}

/// Whether `path` names an image this set reads.
fn is_image(path: &Path) -> bool {
    let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("");
    ["png", "jpg", "jpeg"].contains(&ext.to_ascii_lowercase().as_str())
}

fn io_error(path: &Path) -> impl Fn(std::io::Error) -> DataError + '_ {
    move |source| DataError::Io {
        path: display(path),
        source,
    }
}

/// The entries of `dir`, sorted by name.
fn sorted_entries(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut entries = std::fs::read_dir(dir)
        .map_err(io_error(dir))?
        .map(|e| e.map(|e| e.path()).map_err(io_error(dir)))
        .collect::<Result<Vec<_>>>()?;
    entries.sort();
    Ok(entries)
}

impl ImageFolder {
    /// The classes and images under `root` (decoding only the first image, for the
    /// shape). Refuses a root with no class folder and a class folder with no image.
    pub fn open(root: impl AsRef<Path>) -> Result<ImageFolder> {
        let root = root.as_ref().to_path_buf();
        let mut classes = Vec::new();
        let mut files = Vec::new();
        for dir in sorted_entries(&root)?.into_iter().filter(|p| p.is_dir()) {
            let class = classes.len() as i64;
            let images: Vec<PathBuf> = sorted_entries(&dir)?
                .into_iter()
                .filter(|p| p.is_file() && is_image(p))
                .collect();
            if images.is_empty() {
                return Err(DataError::EmptyClass { dir: display(&dir) });
            }
            files.extend(images.into_iter().map(|p| (p, class)));
            let name = dir.file_name().map(|n| n.to_string_lossy().into_owned());
            classes.push(name.unwrap_or_default());
        }
        let Some((first, _)) = files.first() else {
            return Err(DataError::NotFound {
                dir: display(&root),
                what: "image folder",
                looked: "class folders holding PNG or JPEG images".into(),
            });
        };
        let first = decode(first)?;
        let shape = shape_of(&first);
        Ok(ImageFolder {
            root,
            classes,
            files,
            shape,
        })
    }

    /// The class names, in the order of their numbers.
    pub fn class_names(&self) -> &[String] {
        &self.classes
    }

    /// Each image's file and class.
    pub fn files(&self) -> &[(PathBuf, i64)] {
        &self.files
    }
}

/// The image at `path`, decoded within the image crate's default allocation limit,
/// lowered to the memory the process can still allocate: the decoder checks the
/// header's dimensions against it before it allocates (a small file can declare any
/// size).
fn decode(path: &Path) -> Result<DynamicImage> {
    let bytes = std::fs::read(path).map_err(io_error(path))?;
    let err = |e: image::ImageError| DataError::Decode {
        path: display(path),
        msg: e.to_string(),
    };
    let mut reader = image::ImageReader::new(std::io::Cursor::new(&bytes))
        .with_guessed_format()
        .map_err(io_error(path))?;
    let mut limits = image::Limits::default();
    if let Some(available) = ampgraph_graph::host_memory::available_bytes() {
        limits.max_alloc = limits.max_alloc.map(|most| most.min(available as u64));
    }
    reader.limits(limits);
    reader.decode().map_err(err)
}

fn shape_of(image: &DynamicImage) -> [usize; 3] {
    let channels = usize::from(image.color().channel_count());
    [channels, image.height() as usize, image.width() as usize]
}

impl Dataset for ImageFolder {
    fn len(&self) -> usize {
        self.files.len()
    }

    fn shape(&self) -> &[usize] {
        &self.shape
    }

    fn classes(&self) -> usize {
        self.classes.len()
    }

    /// The image's channels planar (`[channels, height, width]`) scaled to `[0, 1]`
    /// (16-bit images by 65535), as torchvision's `ToTensor`.
    fn get(&self, index: usize) -> Result<Example> {
        let (path, label) = self.files.get(index).ok_or(DataError::Index {
            index,
            len: self.len(),
        })?;
        let image = decode(path)?;
        let found = shape_of(&image);
        if found != self.shape {
            return Err(DataError::ImageShape {
                path: display(path),
                found,
                expected: self.shape,
            });
        }
        let [c, h, w] = found;
        // The decoded pixels as stored, `c` channels interleaved, 8 or 16 bits each.
        let sixteen_bit = usize::from(image.color().bytes_per_pixel()) == 2 * c;
        let bytes = image.into_bytes();
        let interleaved: Vec<f32> = match sixteen_bit {
            true => (bytes.chunks_exact(2))
                .map(|b| f32::from(u16::from_ne_bytes([b[0], b[1]])) / 65535.0)
                .collect(),
            false => bytes.iter().map(|&v| f32::from(v) / 255.0).collect(),
        };
        let mut values = Vec::with_capacity(c * h * w);
        for k in 0..c {
            values.extend(interleaved.iter().skip(k).step_by(c));
        }
        Ok(Example {
            values,
            label: *label,
        })
    }

    fn describe(&self) -> String {
        display(&self.root)
    }
}
