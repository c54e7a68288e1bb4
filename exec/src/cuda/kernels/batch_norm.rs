//! Batch normalisation through cuDNN (`crate::cuda::dnn`): BatchNorm in training
//! (batch statistics; the batch mean and Bessel-corrected variance as outputs, which
//! the graph's running averages read) and inference, and BatchNormGrad in training.
//! Rank-4 images in NHWC or NCHW, or `[N, C]` matrices.

use ampgraph_graph::ops::{BatchNorm, BatchNormGrad, DataFormat};
use ampgraph_graph::{Op, TensorType};

use super::{float_input, input, kernel, KernelResult, Lowering};
use crate::cuda::dnn;

/// cuDNN's smallest epsilon (`CUDNN_BN_MIN_EPSILON`).
const MIN_EPSILON: f64 = 1e-5;

pub(super) fn lower(op: &dyn Op, ins: &[TensorType], outs: &[TensorType]) -> Lowering {
    if let Some(bn) = op.downcast_ref::<BatchNorm>() {
        return Some(lower_batch_norm(bn, ins, outs));
    }
    if let Some(g) = op.downcast_ref::<BatchNormGrad>() {
        return Some(lower_batch_norm_grad(g, ins, outs));
    }
    None
}

/// `[n, c, h, w]` and the layout cuDNN reads `x` of `shape` in (a matrix is NCHW with
/// 1x1 images), after checking what cuDNN takes.
fn geometry(
    layout: DataFormat,
    epsilon: f64,
    training: bool,
    ins: &[TensorType],
) -> Result<(DataFormat, [usize; 4]), String> {
    dnn::available()?;
    float_input(ins)?;
    if epsilon < MIN_EPSILON {
        return Err(format!(
            "cuDNN's batch norm takes epsilon >= {MIN_EPSILON:e}, got {epsilon:e}"
        ));
    }
    let (layout, nchw) = match (&ins[0].shape[..], layout) {
        (&[n, c], _) => (DataFormat::Nchw, [n, c, 1, 1]),
        (&[n, h, w, c], DataFormat::Nhwc) => (layout, [n, c, h, w]),
        (&[n, c, h, w], DataFormat::Nchw) => (layout, [n, c, h, w]),
        (s, _) => return Err(format!("batch norm takes rank 2 or 4, got {s:?}")),
    };
    let count = nchw[0] * nchw[2] * nchw[3];
    if training && count < 2 {
        return Err(format!(
            "a training batch norm over {count} value per channel has no variance"
        ));
    }
    Ok((layout, nchw))
}

fn lower_batch_norm(bn: &BatchNorm, ins: &[TensorType], outs: &[TensorType]) -> KernelResult {
    let (layout, nchw) = geometry(bn.data_format, bn.epsilon, bn.training, ins)?;
    let (epsilon, training) = (bn.epsilon, bn.training);
    let [y_ty, mean_ty, var_ty] = outs else {
        return Err("BatchNorm has three outputs".into());
    };
    let (y_ty, mean_ty, var_ty) = (y_ty.clone(), mean_ty.clone(), var_ty.clone());
    Ok(kernel(move |c, inputs| {
        let x = input(inputs, 0)?;
        let params = [input(inputs, 1)?, input(inputs, 2)?];
        let y = c.alloc(&y_ty)?;
        if training {
            let (mean, var) = (c.alloc(&mean_ty)?, c.alloc(&var_ty)?);
            let stats = [&mean, &var];
            c.dnn
                .batch_norm(c.dev, layout, nchw, epsilon, true, x, params, stats, &y)?;
            Ok(vec![y, mean, var])
        } else {
            // The given statistics pass through as outputs 1 and 2.
            let (mean, var) = (input(inputs, 3)?, input(inputs, 4)?);
            c.dnn.batch_norm(
                c.dev,
                layout,
                nchw,
                epsilon,
                false,
                x,
                params,
                [mean, var],
                &y,
            )?;
            Ok(vec![y, mean.clone(), var.clone()])
        }
    }))
}

fn lower_batch_norm_grad(
    g: &BatchNormGrad,
    ins: &[TensorType],
    outs: &[TensorType],
) -> KernelResult {
    if !g.training {
        return Err("BatchNormGrad of an inference batch norm has no CUDA kernel".into());
    }
    let (layout, nchw) = geometry(g.data_format, g.epsilon, true, ins)?;
    let epsilon = g.epsilon;
    let outs = outs.to_vec();
    Ok(kernel(move |c, inputs| {
        let (x, scale, dy) = (input(inputs, 0)?, input(inputs, 1)?, input(inputs, 4)?);
        let [dx, dscale, doffset]: [_; 3] = c
            .alloc_all(&outs)?
            .try_into()
            .map_err(|_| "BatchNormGrad has three outputs")?;
        c.dnn.batch_norm_grad(
            c.dev,
            layout,
            nchw,
            epsilon,
            [x, scale, dy],
            [&dx, &dscale, &doffset],
        )?;
        Ok(vec![dx, dscale, doffset])
    }))
}
