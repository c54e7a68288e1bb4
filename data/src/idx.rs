//! The idx file format of MNIST and Fashion-MNIST (plain or gzip): magic numbers,
//! dimensions and lengths are checked, every problem is a [`DataError`] naming the
//! file, and no buffer is ever larger than the data the file really holds (a header
//! claiming more than the file can contain is refused before anything is allocated).

use std::fs::File;
use std::io::{self, BufReader, Read, Seek, SeekFrom};
use std::path::Path;

use flate2::bufread::MultiGzDecoder;

use crate::{DataError, Result};

/// Magic number of an idx file of unsigned bytes with 3 dimensions (images).
pub const IMAGES_MAGIC: u32 = 0x0000_0803;
/// Magic number of an idx file of unsigned bytes with 1 dimension (labels).
pub const LABELS_MAGIC: u32 = 0x0000_0801;
/// The largest expansion of DEFLATE (about 1032:1), with room for the gzip framing:
/// a gzip file of `n` bytes cannot decompress to more than this many times `n`.
const MAX_GZIP_RATIO: u64 = 1032;

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

pub(crate) fn display(path: &Path) -> String {
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
