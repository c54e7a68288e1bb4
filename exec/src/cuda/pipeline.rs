//! The passes a session runs after AMP on the CUDA executor, by registry name
//! (`ampgraph_passes::registry`; the session resolves them there).

/// The fusion pipeline for a CUDA graph after AMP ([`Executor::default_passes`] of the
/// CUDA executor, and the default of `bench --passes`): dead nodes go first (gradients
/// built for constants would otherwise count as readers and block folds), NCHW
/// convolution networks compute in NHWC inside (the pass cancels its Transposes against
/// the graph's own, leaving them at the NCHW inputs and outputs) before anything fuses
/// the elementwise ops between the convolutions, 16-bit convolutions pad their channels
/// to multiples of 8 (on the NHWC channel axis by then), reductions take the widening
/// casts AMP put before them, layer norms the casts AMP put around them, cross-entropy
/// its gradient (one read of the logits for both, the casts around them folded),
/// batched products their scalar scalings, explicit attentions become fused ones
/// (scores never stored), the finiteness check and the optimizer updates the loss-scale
/// unscaling, the updates the casts of their variables, products their bias and
/// activation into the GEMM, then the remaining elementwise chains fuse into generated
/// kernels (a softmax takes the one computing its operand), those kernels take the bias
/// gradients summed from what they compute, layer-norm gradients the Adds of the
/// residual gradient after them (with those bias gradients), and the small variables'
/// updates share launches.
///
/// [`Executor::default_passes`]: crate::Executor::default_passes
pub const PIPELINE: &[&str] = &[
    "dce",
    "layout-nhwc",
    "pad-conv-channels",
    "fuse-batchnorm-activation",
    "cast-into-reduce",
    "cast-into-norm",
    "fuse-cross-entropy",
    "scale-into-matmul",
    "fuse-attention",
    "unscale-into-update",
    "cast-into-update",
    "gemm-epilogue",
    "fuse",
    "softmax-prologue",
    "sum-into-elementwise",
    "norm-grad-epilogue",
    "group-updates",
];

/// The pipeline for an executor with `options`: [`PIPELINE`], except that with TF32
/// allowed every NCHW graph runs NHWC (`layout-nhwc-all`), f32 convolutions included, as
/// PyTorch runs channels_last with TF32: cuDNN's TF32 convolutions on the H100 are NHWC
/// kernels (its f32 NHWC gradients without TF32 are far slower than NCHW ones).
pub fn pipeline(options: &crate::ExecOptions) -> Vec<&'static str> {
    PIPELINE
        .iter()
        .map(|&name| match name {
            "layout-nhwc" if options.allow_tf32 => "layout-nhwc-all",
            _ => name,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tf32_swaps_the_layout_pass_for_its_every_graph_form() {
        let plain = pipeline(&crate::ExecOptions::default());
        assert_eq!(plain, PIPELINE);
        let tf32 = pipeline(&crate::ExecOptions {
            allow_tf32: true,
            ..Default::default()
        });
        assert_eq!(tf32.len(), PIPELINE.len());
        let differ: Vec<(&str, &str)> = PIPELINE
            .iter()
            .zip(&tf32)
            .filter(|(a, b)| a != b)
            .map(|(a, b)| (*a, *b))
            .collect();
        assert_eq!(differ, [("layout-nhwc", "layout-nhwc-all")]);
    }
}
