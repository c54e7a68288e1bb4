//! The passes a session runs after AMP on the CUDA executor: the backend's recipe,
//! as pass values (each also in `ampgraph_passes::registry` by its name, for
//! `--passes`).

use ampgraph_passes::activation_into_fp8::ActivationIntoFp8;
use ampgraph_passes::amax_into_elementwise::AmaxIntoElementwise;
use ampgraph_passes::attention::FuseAttention;
use ampgraph_passes::attention_grad_into_fp8::AttentionGradIntoFp8;
use ampgraph_passes::attention_into_fp8::AttentionIntoFp8;
use ampgraph_passes::compose_views::ComposeViews;
use ampgraph_passes::cross_entropy::FuseCrossEntropy;
use ampgraph_passes::elementwise_into_fp8::ElementwiseIntoFp8;
use ampgraph_passes::epilogue::GemmEpilogue;
use ampgraph_passes::fuse::Fuse;
use ampgraph_passes::fuse_batchnorm_activation::FuseBatchNormActivation;
use ampgraph_passes::group_fp8_casts::GroupFp8Casts;
use ampgraph_passes::group_updates::GroupUpdates;
use ampgraph_passes::layout_nhwc::LayoutNhwc;
use ampgraph_passes::merge_projections::MergeProjections;
use ampgraph_passes::norm_grad_epilogue::NormGradEpilogueFusion;
use ampgraph_passes::norm_grad_into_fp8::NormGradIntoFp8;
use ampgraph_passes::norm_into_fp8::NormIntoFp8;
use ampgraph_passes::pack_qkv::PackQkv;
use ampgraph_passes::recompute::RecomputeInputViews;
use ampgraph_passes::simplify::{
    CastIntoNorm, CastIntoReduce, CastIntoUpdate, ConvAsMatmul, Cse, Dce, GradCastIntoUpdate,
    GradRoundIntoUpdate, PadConvChannels, PadGemm, ScaleIntoMatmul, TransposeIntoMatmul,
    UnscaleIntoUpdate,
};
use ampgraph_passes::softmax_prologue::SoftmaxPrologue;
use ampgraph_passes::sum_into_elementwise::SumIntoElementwise;
use ampgraph_passes::Pass;

use crate::ExecOptions;

/// The fusion pipeline for a CUDA graph after AMP ([`Executor::passes`] of the CUDA
/// executor, and the default of `bench --passes`): dead nodes go first (gradients
/// built for constants would otherwise count as readers and block folds), NCHW
/// convolution networks compute in NHWC inside (the pass cancels its Transposes against
/// the graph's own, leaving them at the NCHW inputs and outputs) before anything fuses
/// the elementwise ops between the convolutions, an inference step's convolutions that
/// read each patch once (pointwise ones, patch embeddings) become products (their bias
/// and ReLU in the GEMM's epilogue, as cuBLASLt runs them), 16-bit convolutions pad
/// their channels to multiples of 8 (on the NHWC channel axis by then), reductions take the widening
/// casts AMP put before them, layer norms the casts AMP put around them, cross-entropy
/// its gradient (one read of the logits for both, the casts around them folded),
/// products their operands' transposes (as adjoints) and batched products their
/// scalar scalings (products that differed only by them become one: `x x^T` read
/// through a Transpose and as an adjoint), explicit attentions become fused ones (scores never stored; q, k
/// and v projected by one product where they were three), the chains of Reshapes and
/// Transposes around them one Transpose at most (an exported `nn.MultiheadAttention` copies each operand four
/// times otherwise), the finiteness check and the optimizer updates the loss-scale
/// unscaling, the updates their gradients' widening casts (reading bf16 gradients)
/// and the casts of their variables, products their bias and
/// activation into the GEMM, FP8 casts the activation or the layer norm they read (its
/// output no longer stored), large products left whose rows are misaligned for Tensor
/// Cores pad them (GPT-2's vocabulary), then the remaining elementwise chains fuse into generated
/// kernels (a softmax takes the one computing its operand), those kernels take the bias
/// gradients summed from what they compute, layer-norm gradients the Adds of the
/// residual gradient after them (with those bias gradients) and then the delayed FP8
/// casts of their dx, current FP8 scales the
/// amax of the kernel computing their tensor, delayed FP8 casts the program computing
/// theirs (a GELU gradient with its bias sum), the updates the rounding of the bias
/// sums those fusions leave, and the weights' FP8 casts and the small variables'
/// updates share launches.
///
/// With TF32 allowed every NCHW graph runs NHWC, f32 convolutions included, as PyTorch
/// runs channels_last with TF32: cuDNN's TF32 convolutions on the H100 are NHWC
/// kernels (its f32 NHWC gradients without TF32 are far slower than NCHW ones).
///
/// [`Executor::passes`]: crate::Executor::passes
pub fn pipeline(options: &ExecOptions) -> Vec<Box<dyn Pass>> {
    let layout = LayoutNhwc {
        sixteen_bit_only: !options.gemm.allow_tf32,
    };
    vec![
        Box::new(Dce),
        Box::new(layout),
        Box::new(ConvAsMatmul),
        Box::new(PadConvChannels),
        Box::new(FuseBatchNormActivation),
        Box::new(CastIntoReduce),
        Box::new(CastIntoNorm),
        Box::new(FuseCrossEntropy),
        Box::new(TransposeIntoMatmul),
        Box::new(ScaleIntoMatmul),
        Box::new(Cse),
        Box::new(FuseAttention),
        Box::new(MergeProjections),
        Box::new(ComposeViews),
        Box::new(PackQkv),
        Box::new(UnscaleIntoUpdate),
        Box::new(GradCastIntoUpdate),
        Box::new(CastIntoUpdate),
        Box::new(GemmEpilogue),
        Box::new(ActivationIntoFp8),
        Box::new(NormIntoFp8),
        Box::new(PadGemm::default()),
        Box::new(RecomputeInputViews),
        Box::new(Fuse),
        Box::new(SoftmaxPrologue),
        Box::new(SumIntoElementwise),
        Box::new(NormGradEpilogueFusion),
        Box::new(NormGradIntoFp8),
        Box::new(AmaxIntoElementwise),
        Box::new(ElementwiseIntoFp8),
        Box::new(AttentionGradIntoFp8),
        Box::new(AttentionIntoFp8),
        Box::new(GradRoundIntoUpdate),
        Box::new(GroupFp8Casts),
        Box::new(GroupUpdates),
    ]
}

/// The names of [`pipeline`]'s passes under `options`, as `--passes` takes them.
pub fn pipeline_names(options: &ExecOptions) -> Vec<&'static str> {
    pipeline(options).iter().map(|p| p.name()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every pass of the recipe is in the registry under its name, and TF32 swaps
    /// the layout pass for its every-graph form and nothing else.
    #[test]
    fn tf32_swaps_the_layout_pass_for_its_every_graph_form() {
        let plain = pipeline_names(&ExecOptions::default());
        for name in &plain {
            assert!(ampgraph_passes::registry::by_name(name).is_some(), "{name}");
        }
        let mut tf32 = ExecOptions::default();
        tf32.gemm.allow_tf32 = true;
        let tf32 = pipeline_names(&tf32);
        assert_eq!(tf32.len(), plain.len());
        let differ: Vec<(&str, &str)> = (plain.iter().zip(&tf32))
            .filter(|(a, b)| a != b)
            .map(|(a, b)| (*a, *b))
            .collect();
        assert_eq!(differ, [("layout-nhwc", "layout-nhwc-all")]);
    }
}
