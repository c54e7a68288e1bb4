//! Shape rules shared by many ops: broadcasting and axis normalisation.

use crate::tensor::ShapeDisplay;

/// NumPy broadcasting of two shapes.
pub fn broadcast_shapes(a: &[usize], b: &[usize]) -> Result<Vec<usize>, String> {
    let rank = a.len().max(b.len());
    let mut out = vec![0; rank];
    for i in 0..rank {
        let da = if i < rank - a.len() {
            1
        } else {
            a[i - (rank - a.len())]
        };
        let db = if i < rank - b.len() {
            1
        } else {
            b[i - (rank - b.len())]
        };
        out[i] = match (da, db) {
            (x, y) if x == y => x,
            (1, y) => y,
            (x, 1) => x,
            _ => {
                return Err(format!(
                    "shapes {} and {} do not broadcast",
                    ShapeDisplay(a),
                    ShapeDisplay(b)
                ))
            }
        };
    }
    Ok(out)
}

/// Maps `axis` (negative counts from the end) into `0..rank`.
pub fn normalize_axis(axis: i64, rank: usize) -> Result<usize, String> {
    let r = rank as i64;
    let a = if axis < 0 { axis + r } else { axis };
    if (0..r).contains(&a) {
        Ok(a as usize)
    } else {
        Err(format!("axis {axis} is out of range for rank {rank}"))
    }
}

/// Normalises a list of distinct axes, sorted.
pub fn normalize_axes(axes: &[i64], rank: usize) -> Result<Vec<usize>, String> {
    let mut out = axes
        .iter()
        .map(|&a| normalize_axis(a, rank))
        .collect::<Result<Vec<_>, _>>()?;
    out.sort_unstable();
    if out.windows(2).any(|w| w[0] == w[1]) {
        return Err(format!("axes {axes:?} name the same axis twice"));
    }
    Ok(out)
}

/// For each element of `out_shape`, the index of the element of `in_shape` that
/// broadcasting reads. Precomputed once per op call.
pub fn broadcast_index_map(in_shape: &[usize], out_shape: &[usize]) -> Vec<usize> {
    broadcast_indices(in_shape, out_shape).collect()
}

/// [`broadcast_index_map`]'s indices one at a time, without a table of the output's size.
pub fn broadcast_indices(in_shape: &[usize], out_shape: &[usize]) -> impl Iterator<Item = usize> {
    let rank = out_shape.len();
    let offset = rank - in_shape.len();
    // Stride of each output axis inside the input; 0 where the input broadcasts.
    let in_strides = crate::tensor::strides(in_shape);
    let stride: Vec<usize> = (0..rank)
        .map(|i| {
            if i < offset || in_shape[i - offset] == 1 {
                0
            } else {
                in_strides[i - offset]
            }
        })
        .collect();
    let out_shape = out_shape.to_vec();
    let n: usize = out_shape.iter().product();
    let mut idx = vec![0usize; rank];
    let mut pos = 0usize;
    (0..n).map(move |_| {
        let here = pos;
        // Odometer increment over the output index.
        for ax in (0..rank).rev() {
            idx[ax] += 1;
            pos += stride[ax];
            if idx[ax] < out_shape[ax] {
                break;
            }
            pos -= stride[ax] * idx[ax];
            idx[ax] = 0;
        }
        here
    })
}
