//! The passes `ampgraph rewrite --passes` can name that need no configuration, by
//! name; one row per pass (docs/passes.md describes them). AMP takes its precision
//! settings and is built apart.

use crate::attention::FuseAttention;
use crate::cross_entropy::FuseCrossEntropy;
use crate::epilogue::GemmEpilogue;
use crate::fuse::Fuse;
use crate::group_updates::GroupUpdates;
use crate::norm_grad_epilogue::NormGradEpilogueFusion;
use crate::simplify::{
    Algebraic, CastIntoNorm, CastIntoReduce, CastIntoUpdate, ConstFold, Cse, Dce, FoldBatchNorm,
    PadGemm, ScaleIntoMatmul, UnscaleIntoUpdate,
};
use crate::softmax_prologue::SoftmaxPrologue;
use crate::sum_into_elementwise::SumIntoElementwise;
use crate::{Pass, PassManager};

/// One row of the registry.
pub struct PassEntry {
    pub name: &'static str,
    pub make: fn() -> Box<dyn Pass>,
}

/// Every configuration-free pass.
pub const PASSES: &[PassEntry] = &[
    PassEntry {
        name: "const-fold",
        make: || Box::new(ConstFold),
    },
    PassEntry {
        name: "algebraic",
        make: || Box::new(Algebraic),
    },
    PassEntry {
        name: "cse",
        make: || Box::new(Cse),
    },
    PassEntry {
        name: "dce",
        make: || Box::new(Dce),
    },
    PassEntry {
        name: "cast-into-reduce",
        make: || Box::new(CastIntoReduce),
    },
    PassEntry {
        name: "cast-into-norm",
        make: || Box::new(CastIntoNorm),
    },
    PassEntry {
        name: "fuse-cross-entropy",
        make: || Box::new(FuseCrossEntropy),
    },
    PassEntry {
        name: "scale-into-matmul",
        make: || Box::new(ScaleIntoMatmul),
    },
    PassEntry {
        name: "fuse-attention",
        make: || Box::new(FuseAttention),
    },
    PassEntry {
        name: "unscale-into-update",
        make: || Box::new(UnscaleIntoUpdate),
    },
    PassEntry {
        name: "cast-into-update",
        make: || Box::new(CastIntoUpdate),
    },
    PassEntry {
        name: "fold-batchnorm",
        make: || Box::new(FoldBatchNorm),
    },
    PassEntry {
        name: "pad-gemm",
        make: || Box::new(PadGemm),
    },
    PassEntry {
        name: "gemm-epilogue",
        make: || Box::new(GemmEpilogue),
    },
    PassEntry {
        name: "fuse",
        make: || Box::new(Fuse),
    },
    PassEntry {
        name: "softmax-prologue",
        make: || Box::new(SoftmaxPrologue),
    },
    PassEntry {
        name: "sum-into-elementwise",
        make: || Box::new(SumIntoElementwise),
    },
    PassEntry {
        name: "norm-grad-epilogue",
        make: || Box::new(NormGradEpilogueFusion),
    },
    PassEntry {
        name: "group-updates",
        make: || Box::new(GroupUpdates),
    },
];

/// The simplification pipeline, in order: folding exposes identities, removing
/// identities exposes common subexpressions, and all three leave dead nodes.
pub const SIMPLIFY_PIPELINE: &[&str] = &["const-fold", "algebraic", "cse", "dce"];

/// The fusion pipeline for a CUDA graph after AMP (the default of `bench --passes`):
/// dead nodes go first (gradients built for constants would otherwise count as
/// readers and block folds), reductions take the widening casts AMP put before them,
/// layer norms the casts AMP put around them, cross-entropy its gradient (one read of
/// the logits for both, the casts around them folded),
/// batched products their scalar scalings, explicit attentions become fused ones
/// (scores never stored), the finiteness check and the optimizer
/// updates the loss-scale unscaling, the updates the casts of their variables,
/// products their bias and activation into the GEMM, then the remaining elementwise
/// chains fuse into generated kernels (a softmax takes the one computing its operand),
/// those kernels take the bias gradients summed
/// from what they compute, layer-norm gradients the Adds of the residual gradient
/// after them (with those bias gradients), and the small variables' updates share
/// launches.
pub const CUDA_PIPELINE: &[&str] = &[
    "dce",
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
}
