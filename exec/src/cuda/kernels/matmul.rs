//! Matrix products through cuBLASLt (`crate::cuda::gemm`: plans autotuned once per
//! shape): MatMul, FusedMatMul (a bias, activation and residual in the epilogue, the
//! `gemm-epilogue` pass's) and BatchMatMul with broadcast batches.

use ampgraph_graph::ops::{BatchMatMul, FusedMatMul, MatMul};
use ampgraph_graph::shape::broadcast_index_map;
use ampgraph_graph::{Op, TensorType};

use super::elementwise::cast_into;
use super::{first, float_input, input, numel, one_output, KernelResult, Lowering};
use crate::cuda::gemm::Product;

pub(super) fn lower(op: &dyn Op, ins: &[TensorType], outs: &[TensorType]) -> Lowering {
    let fused = op.downcast_ref::<FusedMatMul>();
    if let Some(m) = op.downcast_ref::<MatMul>().or(fused.map(|f| &f.product)) {
        return Some(lower_matmul(m, fused, ins, outs));
    }
    if let Some(bm) = op.downcast_ref::<BatchMatMul>() {
        return Some(lower_batch_matmul(bm, ins, outs));
    }
    None
}

fn lower_matmul(
    m: &MatMul,
    fused: Option<&FusedMatMul>,
    ins: &[TensorType],
    outs: &[TensorType],
) -> KernelResult {
    float_input(ins)?;
    let out = first(outs)?;
    let [mm, nn] = out.shape[..] else {
        return Err("MatMul takes matrices".into());
    };
    let k = if m.transpose_a {
        ins[0].shape[0]
    } else {
        ins[0].shape[1]
    };
    let (transpose_a, transpose_b) = (m.transpose_a, m.transpose_b);
    let epilogue = fused.map(|f| f.epilogue);
    let has_residual = fused.is_some_and(|f| f.residual);
    Ok(one_output(out, move |c, inputs, y| {
        let (a, b) = (input(inputs, 0)?, input(inputs, 1)?);
        let bias = match epilogue {
            Some(e) => Some((input(inputs, 2)?, e)),
            None => None,
        };
        let residual = if has_residual {
            Some(input(inputs, 3)?)
        } else {
            None
        };
        let product = |out, bias| Product {
            bias,
            residual,
            ..Product::single([a, b, out], (mm, k, nn), (transpose_a, transpose_b))
        };
        // cuBLASLt adds a bias of the output's type: a 16-bit bias of a product
        // stored in f32 is widened first (exactly; a kernel over the bias alone).
        let wide_bias = match bias {
            Some((b, e)) if b.dtype != y.dtype => {
                let wide = c.temp(y.dtype, b.len())?;
                cast_into(c, b, &wide)?;
                Some((wide, e))
            }
            _ => None,
        };
        let stored_bias = wide_bias.as_ref().map(|(b, e)| (b, *e)).or(bias);
        let run = c.gemm.run(c.dev, &product(y, stored_bias), c.gemm_options);
        if let (Err(why), true) = (&run, y.dtype != a.dtype) {
            // No cuBLASLt kernel stores this product wide: in its own type, then a cast.
            log::debug!("{}: {why}; storing the product, then casting", c.name);
            let narrow = c.temp(a.dtype, y.len())?;
            c.gemm.run(c.dev, &product(&narrow, bias), c.gemm_options)?;
            cast_into(c, &narrow, y)?;
            return Ok(());
        }
        run?;
        Ok(())
    }))
}

fn lower_batch_matmul(bm: &BatchMatMul, ins: &[TensorType], outs: &[TensorType]) -> KernelResult {
    float_input(ins)?;
    let out = first(outs)?;
    let [a, b, ..] = ins else {
        return Err("BatchMatMul takes two inputs".into());
    };
    let (ra, rb, ro) = (a.shape.len(), b.shape.len(), out.shape.len());
    if ra < 2 || rb < 2 || ro < 2 {
        return Err("BatchMatMul takes matrices".into());
    }
    let (mm, nn) = (out.shape[ro - 2], out.shape[ro - 1]);
    let k = if bm.adj_x {
        a.shape[ra - 2]
    } else {
        a.shape[ra - 1]
    };
    let batch_shape = &out.shape[..ro - 2];
    let total = numel(batch_shape);
    let (ba, bb) = (numel(&a.shape[..ra - 2]), numel(&b.shape[..rb - 2]));
    let (sa, sb) = (mm * k, k * nn);
    let stride = |n: usize, s: usize| -> Option<usize> {
        if n == total {
            Some(s)
        } else if n == 1 {
            Some(0)
        } else {
            None
        }
    };
    // (batch, stride a, stride b, offset a, offset b, offset c) of each product: one
    // strided batch, or, for batches that broadcast both ways, one per output matrix.
    let products: Vec<[usize; 6]> = match (stride(ba, sa), stride(bb, sb)) {
        (Some(s1), Some(s2)) => vec![[total, s1, s2, 0, 0, 0]],
        _ => {
            let ia = broadcast_index_map(&a.shape[..ra - 2], batch_shape);
            let ib = broadcast_index_map(&b.shape[..rb - 2], batch_shape);
            (ia.iter().zip(&ib).enumerate())
                .map(|(o, (&i, &j))| [1, 0, 0, i * sa, j * sb, o * mm * nn])
                .collect()
        }
    };
    let (adj_x, adj_y, alpha) = (bm.adj_x, bm.adj_y, bm.alpha);
    Ok(one_output(out, move |c, inputs, y| {
        let (a, b) = (input(inputs, 0)?, input(inputs, 1)?);
        for &[batch, stride_a, stride_b, offset_a, offset_b, offset_c] in &products {
            let p = Product {
                batch,
                stride_a,
                stride_b,
                offset_a,
                offset_b,
                offset_c,
                alpha,
                ..Product::single([a, b, y], (mm, k, nn), (adj_x, adj_y))
            };
            c.gemm.run(c.dev, &p, c.gemm_options)?;
        }
        Ok(())
    }))
}
