//! The passes `ampgraph rewrite --passes` can name that need no configuration, by
//! name; one row per pass (docs/passes.md describes them). AMP takes its precision
//! settings and is built apart.

use crate::activation_into_fp8::ActivationIntoFp8;
use crate::amax_into_elementwise::AmaxIntoElementwise;
use crate::attention::FuseAttention;
use crate::attention_grad_into_fp8::AttentionGradIntoFp8;
use crate::attention_into_fp8::AttentionIntoFp8;
use crate::bias_before_reshape::BiasBeforeReshape;
use crate::compose_views::ComposeViews;
use crate::cross_entropy::FuseCrossEntropy;
use crate::elementwise_into_fp8::ElementwiseIntoFp8;
use crate::epilogue::GemmEpilogue;
use crate::fuse::Fuse;
use crate::fuse_batchnorm_activation::FuseBatchNormActivation;
use crate::group_fp8_casts::GroupFp8Casts;
use crate::group_updates::GroupUpdates;
use crate::layout_nhwc::LayoutNhwc;
use crate::merge_projections::MergeProjections;
use crate::norm_grad_epilogue::NormGradEpilogueFusion;
use crate::norm_grad_into_fp8::NormGradIntoFp8;
use crate::norm_into_fp8::NormIntoFp8;
use crate::pack_qkv::PackQkv;
use crate::recognize_gelu::RecognizeGelu;
use crate::recognize_layer_norm::RecognizeLayerNorm;
use crate::recompute::{RecomputeActivations, RecomputeInputViews};
use crate::simplify::{
    Algebraic, CastIntoNorm, CastIntoReduce, CastIntoUpdate, ConstFold, ConvAsMatmul, Cse, Dce,
    FoldBatchNorm, GradCastIntoUpdate, GradRoundIntoUpdate, PadConvChannels, PadGemm,
    ScaleIntoMatmul, TransposeIntoMatmul, UnscaleIntoUpdate,
};
use crate::softmax_prologue::SoftmaxPrologue;
use crate::sum_into_elementwise::SumIntoElementwise;
use crate::{Pass, PassManager};

/// One row of the registry.
pub struct PassEntry {
    pub name: &'static str,
    /// One sentence on what the pass does (`ampgraph rewrite --list-passes` prints it;
    /// docs/passes.md has the details).
    pub summary: &'static str,
    pub make: fn() -> Box<dyn Pass>,
}

/// Every configuration-free pass.
pub const PASSES: &[PassEntry] = &[
    PassEntry {
        name: "const-fold",
        summary: "Replaces a node whose inputs are all Consts by a Const of its value.",
        make: || Box::new(ConstFold),
    },
    PassEntry {
        name: "algebraic",
        summary: "Bypasses nodes that return their input (x*1, x+0, same-type Casts, identity Reshapes and Transposes) and merges chained Transposes and Reshapes.",
        make: || Box::new(Algebraic),
    },
    PassEntry {
        name: "cse",
        summary: "Merges nodes with equal ops and attributes that read the same tensors.",
        make: || Box::new(Cse),
    },
    PassEntry {
        name: "dce",
        summary: "Removes nodes that no graph output or variable write depends on.",
        make: || Box::new(Dce),
    },
    PassEntry {
        name: "recognize-gelu",
        summary: "A GELU written out as exporters decompose it (erf or tanh form, Pow included) becomes one Gelu.",
        make: || Box::new(RecognizeGelu),
    },
    PassEntry {
        name: "recognize-layer-norm",
        summary: "A layer norm written out as exporters decompose it before opset 17 (Mean, Sub, Pow or Mul, Mean, Add, Sqrt, Div or Reciprocal-Mul, affine) becomes one LayerNorm.",
        make: || Box::new(RecognizeLayerNorm),
    },
    PassEntry {
        name: "bias-before-reshape",
        summary: "A bias added after a Reshape that keeps the last axis (a Linear layer on a 3-D input) is added before it, next to its product.",
        make: || Box::new(BiasBeforeReshape),
    },
    PassEntry {
        name: "compose-views",
        summary: "A chain of Reshapes and Transposes with two Transposes or more becomes one Transpose between Reshapes, and a Transpose read only by Slices moves after them (nn.MultiheadAttention's exported q, k, v: one copy each instead of four).",
        make: || Box::new(ComposeViews),
    },
    PassEntry {
        name: "cast-into-reduce",
        summary: "A Sum, Mean or Max reads the input of the widening Cast before it and stores the wide type itself.",
        make: || Box::new(CastIntoReduce),
    },
    PassEntry {
        name: "cast-into-norm",
        summary: "A LayerNorm or LayerNormGrad takes in the Casts around it: it reads the narrow input and stores the narrow output.",
        make: || Box::new(CastIntoNorm),
    },
    PassEntry {
        name: "fuse-cross-entropy",
        summary: "The softmax cross-entropy loss, its gradient and the output bias gradient become one SoftmaxCrossEntropyWithGrad.",
        make: || Box::new(FuseCrossEntropy),
    },
    PassEntry {
        name: "transpose-into-matmul",
        summary: "A Transpose moving a product operand's last axis next-to-last (a scalar Mul between allowed) becomes the product's adjoint flag.",
        make: || Box::new(TransposeIntoMatmul),
    },
    PassEntry {
        name: "scale-into-matmul",
        summary: "A multiplication by a scalar constant folds into BatchMatMul's alpha.",
        make: || Box::new(ScaleIntoMatmul),
    },
    PassEntry {
        name: "recompute-activations",
        summary: "A GELU or LayerNorm whose output the backward pass reads is computed again for it, so the forward's output dies early (memory for time; opt-in).",
        make: || Box::new(RecomputeActivations),
    },
    PassEntry {
        name: "recompute-input-views",
        summary: "A Transpose (over Casts) of a value the step holds anyway, read by the backward pass too, is computed again for it: AMP's NHWC f16 copy of the input images dies after the first convolution.",
        make: || Box::new(RecomputeInputViews),
    },
    PassEntry {
        name: "fuse-attention",
        summary: "Explicit attention (with a causal mask or key bias) and its gradient become FusedAttention and FusedAttentionGrad.",
        make: || Box::new(FuseAttention),
    },
    PassEntry {
        name: "merge-projections",
        summary: "A self-attention's q, k and v projections of one input with constant weights become one product, sliced back (inference; then pack-qkv takes it).",
        make: || Box::new(MergeProjections),
    },
    PassEntry {
        name: "pack-qkv",
        summary: "A self-attention reads q, k and v from their packed projection, and its gradient writes them packed (no slices, no Concat).",
        make: || Box::new(PackQkv),
    },
    PassEntry {
        name: "unscale-into-update",
        summary: "The loss-scale unscaling of the gradients folds into the finiteness check and the optimizer updates.",
        make: || Box::new(UnscaleIntoUpdate),
    },
    PassEntry {
        name: "grad-cast-into-update",
        summary: "An optimizer update whose gradient is an exact widening Cast (AMP's bf16 gradient cast to f32) reads the 16-bit gradient itself.",
        make: || Box::new(GradCastIntoUpdate),
    },
    PassEntry {
        name: "grad-round-into-update",
        summary: "An optimizer update whose gradient is a narrowing Cast (a bias gradient summed in f32 by a fused kernel, rounded to bf16) reads the wide gradient and rounds it as it loads it.",
        make: || Box::new(GradRoundIntoUpdate),
    },
    PassEntry {
        name: "cast-into-update",
        summary: "An optimizer update also writes the 16-bit copy of the f32 variable it updates.",
        make: || Box::new(CastIntoUpdate),
    },
    PassEntry {
        name: "fold-batchnorm",
        summary: "An inference BatchNorm folds into the filter and bias of the Conv2D or MatMul before it.",
        make: || Box::new(FoldBatchNorm),
    },
    PassEntry {
        name: "pad-gemm",
        summary: "A large 16-bit MatMul whose stored row lengths are not multiples of 8 multiplies zero-padded operands and is sliced back.",
        make: || Box::new(PadGemm::default()),
    },
    PassEntry {
        name: "conv-as-matmul",
        summary: "An inference NHWC convolution reading each patch once (1x1 with unit strides, or strides equal to the filter's size tiling the image, as ViT's patch embedding; no padding) is the product of its patches by the filter, its bias and ReLU on the product's rows.",
        make: || Box::new(ConvAsMatmul),
    },
    PassEntry {
        name: "pad-conv-channels",
        summary: "A 16-bit convolution (or its gradient) whose channel counts are not multiples of 8 runs on zero-padded channels and is sliced back.",
        make: || Box::new(PadConvChannels),
    },
    PassEntry {
        name: "layout-nhwc",
        summary: "In a graph with a 16-bit convolution, NCHW convolutions, pools, batch norms and bias adds (and their gradients) compute on NHWC tensors, with Transposes only at the graph's NCHW inputs and outputs.",
        make: || Box::new(LayoutNhwc::SIXTEEN_BIT),
    },
    PassEntry {
        name: "layout-nhwc-all",
        summary: "layout-nhwc on every graph, f32 convolutions included (the CUDA pipeline's form when TF32 is allowed).",
        make: || Box::new(LayoutNhwc::EVERY_GRAPH),
    },
    PassEntry {
        name: "fuse-batchnorm-activation",
        summary: "A BatchNorm takes the Relu after it (and a residual Add before that Relu, as a side input), and a BatchNormGrad the Relu's gradient mask (TensorFlow's _FusedBatchNormEx).",
        make: || Box::new(FuseBatchNormActivation),
    },
    PassEntry {
        name: "activation-into-fp8",
        summary: "A Unary read only by an FP8 cast becomes its activation (its 16-bit output no longer stored).",
        make: || Box::new(ActivationIntoFp8),
    },
    PassEntry {
        name: "norm-into-fp8",
        summary: "A LayerNorm over rows of at most 1024 values read only by a delayed-scaling FP8 cast (sides multiples of 8) is computed by the cast (its 16-bit output no longer stored).",
        make: || Box::new(NormIntoFp8),
    },
    PassEntry {
        name: "gemm-epilogue",
        summary: "MatMul, BiasAdd, Relu or tanh-GELU, a residual Add and a Cast to f32 become one FusedMatMul (cuBLASLt epilogue); an Fp8MatMul stored in 16 bits takes its BiasAdd and residual Add.",
        make: || Box::new(GemmEpilogue),
    },
    PassEntry {
        name: "fuse",
        summary: "Connected elementwise ops become one FusedElementwise node with a generated kernel.",
        make: || Box::new(Fuse),
    },
    PassEntry {
        name: "softmax-prologue",
        summary: "A Softmax or LogSoftmax takes the elementwise program computing its operand as its prologue (FusedSoftmax).",
        make: || Box::new(SoftmaxPrologue),
    },
    PassEntry {
        name: "sum-into-elementwise",
        summary: "A bias gradient's column Sum becomes an extra output of the elementwise kernel that produces its operand (which no longer stores a value only summed).",
        make: || Box::new(SumIntoElementwise),
    },
    PassEntry {
        name: "norm-grad-epilogue",
        summary: "A LayerNormGrad takes the Add of the residual gradient (and its column sums) as its epilogue.",
        make: || Box::new(NormGradEpilogueFusion),
    },
    PassEntry {
        name: "norm-grad-into-fp8",
        summary: "A LayerNormGrad (rows of at most 1024 values, sides multiples of 8) whose dx a delayed-scaling FP8 cast reads casts it as it stores it (dx no longer read back to be cast).",
        make: || Box::new(NormGradIntoFp8),
    },
    PassEntry {
        name: "amax-into-elementwise",
        summary: "Current FP8 scaling's Fp8Scale of a tensor a fused elementwise kernel (or lone elementwise node) computes reads the amax that kernel measures as it stores the tensor.",
        make: || Box::new(AmaxIntoElementwise),
    },
    PassEntry {
        name: "elementwise-into-fp8",
        summary: "A fused elementwise program whose one stored value only a delayed-scaling FP8 cast (transposed, sides multiples of 8) reads becomes the cast's prologue, its column sums output by the cast (a GELU gradient and its bias sum: TransformerEngine's dgelu_cast_transpose_dbias); a tensor read only by such a cast and column Sums has its sums taken by the cast.",
        make: || Box::new(ElementwiseIntoFp8),
    },
    PassEntry {
        name: "attention-into-fp8",
        summary: "A non-causal attention whose output a delayed-scaling FP8 cast (transposed) reads casts it as its forward kernel stores it (sequences multiples of 64; the output no longer read back to be cast).",
        make: || Box::new(AttentionIntoFp8),
    },
    PassEntry {
        name: "attention-grad-into-fp8",
        summary: "A packed attention gradient whose dqkv only a delayed-scaling FP8 cast of it (transposed, with its column sums) reads is cast by the attention's gradient kernels (sequences multiples of 64, not causal; dqkv no longer written in 16 bits and read back).",
        make: || Box::new(AttentionGradIntoFp8),
    },
    PassEntry {
        name: "group-fp8-casts",
        summary: "The transposed delayed-scaling FP8 casts of a step's weights sharing a format and a dtype become one GroupedQuantizeFp8 (one launch per 32 weights).",
        make: || Box::new(GroupFp8Casts),
    },
    PassEntry {
        name: "group-updates",
        summary: "The optimizer updates of small variables sharing one configuration become one GroupedOptimizerUpdate.",
        make: || Box::new(GroupUpdates),
    },
];

/// The simplification pipeline, in order: folding exposes identities, removing
/// identities exposes common subexpressions, and all three leave dead nodes.
pub const SIMPLIFY_PIPELINE: &[&str] = &["const-fold", "algebraic", "cse", "dce"];

/// The names of the registered passes, in registry order.
pub fn names() -> impl Iterator<Item = &'static str> {
    PASSES.iter().map(|e| e.name)
}

/// A new instance of the pass of that name.
pub fn by_name(name: &str) -> Option<Box<dyn Pass>> {
    PASSES.iter().find(|e| e.name == name).map(|e| (e.make)())
}

/// A pass manager running [`SIMPLIFY_PIPELINE`].
pub fn default_pipeline() -> PassManager {
    let mut pm = PassManager::new();
    for name in SIMPLIFY_PIPELINE {
        if let Some(pass) = by_name(name) {
            pm.push(pass);
        }
    }
    pm
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_row_builds_the_pass_of_its_name() {
        for entry in PASSES {
            assert_eq!((entry.make)().name(), entry.name);
        }
        assert!(by_name("no-such-pass").is_none());
        assert_eq!(default_pipeline().names(), SIMPLIFY_PIPELINE);
    }

    #[test]
    fn every_pass_has_a_summary_and_a_row_in_docs_passes_md() {
        let doc = include_str!("../../docs/passes.md");
        for entry in PASSES {
            assert!(
                !entry.summary.trim().is_empty() && !entry.summary.contains('\n'),
                "{}: the summary must be one non-empty line",
                entry.name
            );
            assert!(
                doc.contains(&format!("| `{}` |", entry.name)),
                "docs/passes.md has no table row for `{}`",
                entry.name
            );
        }
    }
}
