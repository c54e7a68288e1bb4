//! The checkpoint file: every variable with a CRC-32 of its name, type and bytes, and a
//! CRC-32 of the whole, written atomically beside the previous file
//! ([`Session::save`](crate::Session::save) and
//! [`Session::restore`](crate::Session::restore) decide which variables).
//!
//! Layout (version 2): `AMPGCKPT`, the version (u32), the body's length (u64), the
//! body (bincode: per variable its name, dtype, shape, little-endian bytes and
//! checksum), the CRC-32 of everything before it (u32); all little-endian.

use std::path::Path;

use half::{bf16, f16};
use serde::{Deserialize, Serialize};

use ampgraph_graph::format::{describe_decode_error, previous_path, write_atomic_keeping_previous};
use ampgraph_graph::fp8::{F8E4M3, F8E5M2};
use ampgraph_graph::{DType, Data, Tensor};

use crate::optim::LOSS_SCALE_VARIABLE;
use crate::session::{checkpoint_err, SessionError};

/// Variables the library keeps in a checkpoint beside the model's (a trainer's
/// position) are named under this prefix: a session whose graph lacks them skips them
/// ([`RestoreOptions::skip_unknown`](crate::RestoreOptions::skip_unknown)).
pub const LIBRARY_PREFIX: &str = "ampgraph/";

const CHECKPOINT_MAGIC: &[u8; 8] = b"AMPGCKPT";
/// Version 2 added the checksums (the layout above); version 1 had none.
const CHECKPOINT_VERSION: u32 = 2;
/// Magic, version (u32) and body length (u64), all little-endian.
const CHECKPOINT_HEADER: usize = 8 + 4 + 8;
/// The whole-file CRC-32 after the body.
const CHECKPOINT_TRAILER: usize = 4;

#[derive(Serialize, Deserialize)]
struct CheckpointEntry {
    name: String,
    dtype: DType,
    shape: Vec<usize>,
    /// The values, little-endian (bools one byte each, 0 or 1).
    bytes: Vec<u8>,
    /// CRC-32 of the name, dtype, shape and bytes ([`entry_checksum`]).
    checksum: u32,
}

fn entry_checksum(name: &str, dtype: DType, shape: &[usize], bytes: &[u8]) -> u32 {
    let mut h = crc32fast::Hasher::new();
    h.update(&(name.len() as u64).to_le_bytes());
    h.update(name.as_bytes());
    h.update(dtype.as_str().as_bytes());
    h.update(&(shape.len() as u64).to_le_bytes());
    for &d in shape {
        h.update(&(d as u64).to_le_bytes());
    }
    h.update(bytes);
    h.finalize()
}

/// How many of `data`'s values are NaN or infinite, and the index of the first.
fn non_finite(data: &Data) -> Option<(usize, usize)> {
    fn count<T: Copy>(v: &[T], finite: impl Fn(T) -> bool) -> Option<(usize, usize)> {
        let first = v.iter().position(|&x| !finite(x))?;
        Some((v[first..].iter().filter(|&&x| !finite(x)).count(), first))
    }
    match data {
        Data::F32(v) => count(v, f32::is_finite),
        Data::F16(v) => count(v, f16::is_finite),
        Data::BF16(v) => count(v, bf16::is_finite),
        Data::F64(v) => count(v, f64::is_finite),
        Data::F8E4M3(v) => count(v, F8E4M3::is_finite),
        Data::F8E5M2(v) => count(v, F8E5M2::is_finite),
        Data::I32(_) | Data::I64(_) | Data::Bool(_) => None,
    }
}

/// Writes `variables` (name and value, in the order given) to `path` atomically,
/// keeping the previous file as `PATH.prev`.
pub fn write(path: &Path, variables: &[(String, Tensor)]) -> Result<(), SessionError> {
    let entries: Vec<CheckpointEntry> = (variables.iter())
        .map(|(name, t)| {
            let dtype = t.data().dtype();
            let bytes = t.data().to_le_bytes();
            let checksum = entry_checksum(name, dtype, t.shape(), &bytes);
            CheckpointEntry {
                name: name.clone(),
                dtype,
                shape: t.shape().to_vec(),
                bytes,
                checksum,
            }
        })
        .collect();
    let body = bincode::serde::encode_to_vec(&entries, bincode::config::standard())
        .map_err(|e| checkpoint_err(path, e.to_string()))?;
    let mut bytes = Vec::with_capacity(CHECKPOINT_HEADER + body.len() + CHECKPOINT_TRAILER);
    bytes.extend_from_slice(CHECKPOINT_MAGIC);
    bytes.extend_from_slice(&CHECKPOINT_VERSION.to_le_bytes());
    bytes.extend_from_slice(&(body.len() as u64).to_le_bytes());
    bytes.extend_from_slice(&body);
    let file_checksum = crc32fast::hash(&bytes);
    bytes.extend_from_slice(&file_checksum.to_le_bytes());
    Ok(write_atomic_keeping_previous(path, &bytes)?)
}

/// The variables of the checkpoint at `path`, checksums verified; a float variable
/// holding NaN or infinity is refused unless `allow_non_finite`.
pub fn read(path: &Path, allow_non_finite: bool) -> Result<Vec<(String, Tensor)>, SessionError> {
    let prev = previous_path(path);
    read_checked(path, allow_non_finite).map_err(|e| match e {
        SessionError::Checkpoint { path: shown, msg } if prev.is_file() => {
            SessionError::Checkpoint {
                msg: format!(
                    "{msg}; {} holds the checkpoint saved before it: restore that file instead",
                    prev.display()
                ),
                path: shown,
            }
        }
        other => other,
    })
}

/// [`read`], without the hint at the previous checkpoint.
fn read_checked(
    path: &Path,
    allow_non_finite: bool,
) -> Result<Vec<(String, Tensor)>, SessionError> {
    let bytes = std::fs::read(path).map_err(|e| checkpoint_err(path, e.to_string()))?;
    let mut variables: Vec<(String, Tensor)> = Vec::new();
    for e in decode_checkpoint(path, &bytes)? {
        if variables.iter().any(|(name, _)| *name == e.name) {
            return Err(checkpoint_err(
                path,
                format!("variable '{}' is stored twice", e.name),
            ));
        }
        let data = Data::from_le_bytes(e.dtype, &e.bytes)
            .map_err(|m| checkpoint_err(path, format!("variable '{}': {m}", e.name)))?;
        if !allow_non_finite {
            if let Some((count, first)) = non_finite(&data) {
                return Err(checkpoint_err(
                    path,
                    format!(
                        "variable '{}' has {count} non-finite value(s) (NaN or inf, first at index {first}); \
                         restore_with allow_non_finite to accept them",
                        e.name
                    ),
                ));
            }
        }
        let t = Tensor::new(e.shape, data)
            .map_err(|m| checkpoint_err(path, format!("variable '{}': {m}", e.name)))?;
        if e.name == LOSS_SCALE_VARIABLE {
            let scale = t.to_f64_vec();
            if scale.len() != 1 || !(scale[0].is_finite() && scale[0] > 0.0) {
                return Err(checkpoint_err(
                    path,
                    match scale[..] {
                        [v] => format!(
                            "variable '{}' is {v}: a loss scale is positive and finite",
                            e.name
                        ),
                        _ => format!(
                            "variable '{}' holds {} values: a loss scale is one",
                            e.name,
                            scale.len()
                        ),
                    },
                ));
            }
        }
        variables.push((e.name, t));
    }
    Ok(variables)
}

/// Checks a checkpoint's header, length and checksums and decodes its variables.
/// A variable whose checksum does not match is named; damage elsewhere is the file's.
fn decode_checkpoint(path: &Path, bytes: &[u8]) -> Result<Vec<CheckpointEntry>, SessionError> {
    let err = |msg: String| checkpoint_err(path, msg);
    let rest = bytes
        .strip_prefix(CHECKPOINT_MAGIC.as_slice())
        .ok_or_else(|| err("not an ampgraph checkpoint (bad magic)".into()))?;
    let version = rest
        .first_chunk::<4>()
        .map(|v| u32::from_le_bytes(*v))
        .ok_or_else(|| err("truncated or corrupt: the header is cut short".into()))?;
    if version != CHECKPOINT_VERSION {
        let why = if version < CHECKPOINT_VERSION {
            "written by an older ampgraph, before checksums"
        } else {
            "written by a newer ampgraph"
        };
        return Err(err(format!(
            "checkpoint format version {version} is not supported ({why}); this ampgraph reads version {CHECKPOINT_VERSION}"
        )));
    }
    let len = bytes[12..]
        .first_chunk::<8>()
        .map(|v| u64::from_le_bytes(*v))
        .ok_or_else(|| err("truncated or corrupt: the header is cut short".into()))?;
    let expected = usize::try_from(len)
        .ok()
        .and_then(|l| l.checked_add(CHECKPOINT_HEADER + CHECKPOINT_TRAILER));
    if expected != Some(bytes.len()) {
        return Err(err(format!(
            "truncated or corrupt: the header says {len} bytes of variables, the file has {} bytes in all",
            bytes.len()
        )));
    }
    let (covered, trailer) = bytes.split_at(bytes.len() - CHECKPOINT_TRAILER);
    let stored = u32::from_le_bytes(trailer.try_into().expect("4 bytes"));
    let file_ok = crc32fast::hash(covered) == stored;
    let file_corrupt = || err("the file is corrupt (checksum mismatch)".into());
    let body = &covered[CHECKPOINT_HEADER..];
    let config = bincode::config::standard().with_limit::<{ 1 << 34 }>();
    let entries: Vec<CheckpointEntry> = match bincode::serde::decode_from_slice(body, config) {
        Ok((entries, used)) if used == body.len() => entries,
        Ok(_) if !file_ok => return Err(file_corrupt()),
        Ok(_) => return Err(err("corrupt: trailing bytes".into())),
        Err(_) if !file_ok => return Err(file_corrupt()),
        Err(e) => return Err(err(format!("corrupt: {}", describe_decode_error(&e)))),
    };
    for e in &entries {
        if entry_checksum(&e.name, e.dtype, &e.shape, &e.bytes) != e.checksum {
            return Err(err(format!(
                "variable '{}' is corrupt (checksum mismatch)",
                e.name
            )));
        }
    }
    if !file_ok {
        return Err(file_corrupt());
    }
    Ok(entries)
}
