//! ONNX `TensorProto` <-> [`Tensor`]: the element types both sides have, data inline
//! (typed fields or `raw_data`) or in an external file beside the model.

use std::io::{Read, Seek, SeekFrom};
use std::path::{Component, Path};

use ampgraph_graph::tensor::checked_numel;
use ampgraph_graph::{DType, Data, Tensor};
use half::{bf16, f16};

use crate::error::{OnnxError, Result};
use crate::proto::{data_type, StringStringEntryProto, TensorProto, DATA_LOCATION_EXTERNAL};

/// Our dtype for an ONNX element type, or why there is none.
pub fn dtype_of(elem_type: i32) -> Result<DType, String> {
    Ok(match elem_type {
        data_type::FLOAT => DType::F32,
        data_type::FLOAT16 => DType::F16,
        data_type::BFLOAT16 => DType::BF16,
        data_type::FLOAT8E4M3FN => DType::F8E4M3,
        data_type::FLOAT8E5M2 => DType::F8E5M2,
        data_type::DOUBLE => DType::F64,
        data_type::INT32 => DType::I32,
        data_type::INT64 => DType::I64,
        data_type::BOOL => DType::Bool,
        other => {
            return Err(format!(
                "element type {} is not supported",
                type_name(other)
            ))
        }
    })
}

/// The ONNX element type of our dtype.
pub fn elem_type_of(dtype: DType) -> i32 {
    match dtype {
        DType::F32 => data_type::FLOAT,
        DType::F16 => data_type::FLOAT16,
        DType::BF16 => data_type::BFLOAT16,
        DType::F64 => data_type::DOUBLE,
        DType::I32 => data_type::INT32,
        DType::I64 => data_type::INT64,
        DType::Bool => data_type::BOOL,
        DType::F8E4M3 => data_type::FLOAT8E4M3FN,
        DType::F8E5M2 => data_type::FLOAT8E5M2,
    }
}

/// ONNX's name of an element type, for messages.
fn type_name(elem_type: i32) -> String {
    const NAMES: [&str; 24] = [
        "UNDEFINED",
        "FLOAT",
        "UINT8",
        "INT8",
        "UINT16",
        "INT16",
        "INT32",
        "INT64",
        "STRING",
        "BOOL",
        "FLOAT16",
        "DOUBLE",
        "UINT32",
        "UINT64",
        "COMPLEX64",
        "COMPLEX128",
        "BFLOAT16",
        "FLOAT8E4M3FN",
        "FLOAT8E4M3FNUZ",
        "FLOAT8E5M2",
        "FLOAT8E5M2FNUZ",
        "UINT4",
        "INT4",
        "FLOAT4E2M1",
    ];
    usize::try_from(elem_type)
        .ok()
        .and_then(|i| NAMES.get(i))
        .map_or_else(|| format!("#{elem_type}"), |n| (*n).to_string())
}

/// A shape from ONNX dims: every dim non-negative, the element count addressable.
pub fn shape_of(dims: &[i64]) -> Result<Vec<usize>, String> {
    let shape = dims
        .iter()
        .map(|&d| usize::try_from(d).map_err(|_| format!("dims {dims:?} has a negative dimension")))
        .collect::<Result<Vec<_>, _>>()?;
    checked_numel(&shape)
        .ok_or_else(|| format!("dims {dims:?} hold more elements than can be addressed"))?;
    Ok(shape)
}

/// Reads a tensor, resolving external data against `base` (the model's folder).
pub fn decode(t: &TensorProto, base: Option<&Path>) -> Result<Tensor> {
    let err = |msg: String| OnnxError::tensor(&t.name, msg);
    let dtype = dtype_of(t.data_type).map_err(err)?;
    let shape = shape_of(&t.dims).map_err(err)?;
    let n = checked_numel(&shape).unwrap_or(0);
    let want_bytes = n.checked_mul(dtype.size_bytes()).ok_or_else(|| {
        err(format!(
            "dims {:?} hold more bytes than can be addressed",
            t.dims
        ))
    })?;
    let data = if t.data_location == DATA_LOCATION_EXTERNAL {
        let bytes = read_external(t, base, want_bytes)?;
        Data::from_le_bytes(dtype, &bytes).map_err(err)?
    } else if !t.raw_data.is_empty() || n == 0 {
        if t.raw_data.len() != want_bytes {
            return Err(err(format!(
                "raw_data holds {} bytes but dims {:?} of {dtype} need {want_bytes}",
                t.raw_data.len(),
                t.dims
            )));
        }
        Data::from_le_bytes(dtype, &t.raw_data).map_err(err)?
    } else {
        typed_fields(t, dtype, n).map_err(err)?
    };
    Tensor::new(shape, data).map_err(err)
}

/// The data of a tensor stored in the typed repeated fields.
fn typed_fields(t: &TensorProto, dtype: DType, n: usize) -> Result<Data, String> {
    let (len, field) = match dtype {
        DType::F32 => (t.float_data.len(), "float_data"),
        DType::F64 => (t.double_data.len(), "double_data"),
        DType::I64 => (t.int64_data.len(), "int64_data"),
        _ => (t.int32_data.len(), "int32_data"),
    };
    if len != n {
        return Err(format!(
            "{field} holds {len} values but dims {:?} need {n}",
            t.dims
        ));
    }
    let bits = |v: &i32| (*v as u32 & 0xffff) as u16;
    Ok(match dtype {
        DType::F32 => Data::F32(t.float_data.clone()),
        DType::F64 => Data::F64(t.double_data.clone()),
        DType::I64 => Data::I64(t.int64_data.clone()),
        DType::I32 => Data::I32(t.int32_data.clone()),
        DType::F16 => Data::F16(
            t.int32_data
                .iter()
                .map(|v| f16::from_bits(bits(v)))
                .collect(),
        ),
        DType::BF16 => Data::BF16(
            t.int32_data
                .iter()
                .map(|v| bf16::from_bits(bits(v)))
                .collect(),
        ),
        DType::Bool => Data::Bool(t.int32_data.iter().map(|&v| v != 0).collect()),
        // One value a word, in its low byte.
        DType::F8E4M3 | DType::F8E5M2 => {
            let codes: Vec<u8> = t.int32_data.iter().map(|&v| v as u8).collect();
            Data::from_le_bytes(dtype, &codes)?
        }
    })
}

fn entry<'a>(t: &'a TensorProto, key: &str) -> Option<&'a str> {
    t.external_data
        .iter()
        .find(|e| e.key == key)
        .map(|e| e.value.as_str())
}

/// Reads `want` bytes of an external tensor, after checking the file is a regular
/// file inside the model's folder once links are resolved, and long enough (nothing is
/// allocated for a length the file cannot back).
fn read_external(t: &TensorProto, base: Option<&Path>, want: usize) -> Result<Vec<u8>> {
    let err = |msg: String| OnnxError::tensor(&t.name, msg);
    let location =
        entry(t, "location").ok_or_else(|| err("external data without a 'location'".into()))?;
    let rel = Path::new(location);
    if rel.is_absolute()
        || rel
            .components()
            .any(|c| !matches!(c, Component::Normal(_) | Component::CurDir))
    {
        return Err(err(format!(
            "external data location '{location}' must be a path inside the model's folder"
        )));
    }
    let base = base.ok_or_else(|| {
        err("external data needs the model's folder (read the model from a file)".into())
    })?;
    let path = base.join(rel);
    let number = |key: &str| -> Result<Option<u64>> {
        entry(t, key)
            .map(|v| {
                v.parse::<u64>()
                    .map_err(|_| err(format!("external data '{key}' {v:?} is not a byte count")))
            })
            .transpose()
    };
    let offset = number("offset")?.unwrap_or(0);
    let io = |e: std::io::Error| err(format!("external data {}: {e}", path.display()));
    // Links resolved, the file must still be inside the folder, and a regular file
    // (a FIFO or a device would block or never end).
    let inside = base.canonicalize().map_err(io)?;
    let resolved = path.canonicalize().map_err(io)?;
    if !resolved.starts_with(&inside) {
        return Err(err(format!(
            "external data {} leads outside the model's folder (to {})",
            path.display(),
            resolved.display()
        )));
    }
    if !std::fs::metadata(&resolved).map_err(io)?.is_file() {
        return Err(err(format!(
            "external data {} is not a regular file",
            path.display()
        )));
    }
    let mut file = std::fs::File::open(&resolved).map_err(io)?;
    let file_len = file.metadata().map_err(io)?.len();
    let length = number("length")?.unwrap_or_else(|| file_len.saturating_sub(offset));
    if length != want as u64 {
        return Err(err(format!(
            "external data holds {length} bytes but its dims {:?} need {want}",
            t.dims
        )));
    }
    if offset.checked_add(length).is_none_or(|end| end > file_len) {
        return Err(err(format!(
            "external data bytes {offset}..{} lie past the end of {} ({file_len} bytes)",
            offset.saturating_add(length),
            path.display()
        )));
    }
    file.seek(SeekFrom::Start(offset)).map_err(io)?;
    let mut bytes = vec![0u8; want];
    file.read_exact(&mut bytes).map_err(io)?;
    Ok(bytes)
}

/// A tensor as ONNX stores it: little-endian `raw_data`.
pub fn encode(name: &str, t: &Tensor) -> TensorProto {
    TensorProto {
        name: name.to_string(),
        dims: t.shape().iter().map(|&d| d as i64).collect(),
        data_type: elem_type_of(t.dtype()),
        raw_data: t.data().to_le_bytes(),
        ..TensorProto::default()
    }
}

/// Moves a tensor's bytes to `file` at `offset` (the caller writes them), leaving
/// the proto pointing at them.
pub fn externalize(t: &mut TensorProto, location: &str, offset: u64) -> Vec<u8> {
    let bytes = std::mem::take(&mut t.raw_data);
    t.data_location = DATA_LOCATION_EXTERNAL;
    let kv = |k: &str, v: String| StringStringEntryProto {
        key: k.into(),
        value: v,
    };
    t.external_data = vec![
        kv("location", location.into()),
        kv("offset", offset.to_string()),
        kv("length", bytes.len().to_string()),
    ];
    bytes
}

/// Reads a serialized `TensorProto` file (the `input_0.pb` of ONNX's test data), with
/// its name.
pub fn load(path: &Path) -> Result<(String, Tensor)> {
    use prost::Message;
    let shown = path.display().to_string();
    let bytes = std::fs::read(path).map_err(|source| OnnxError::Io {
        path: shown.clone(),
        source,
    })?;
    let proto = TensorProto::decode(bytes.as_slice()).map_err(|e| OnnxError::Decode {
        path: shown,
        msg: e.to_string(),
    })?;
    Ok((proto.name.clone(), decode(&proto, path.parent())?))
}
