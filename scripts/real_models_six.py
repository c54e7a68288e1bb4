#!/usr/bin/env python3
"""../shared/bench/real_models.py with issue 42's sixth model, torchvision's
EfficientNet-B0 at batch 64 (a convnet: channels_last for PyTorch's AMP), added to
its table of models; the same arguments and output.

    python3 real_models_six.py OUTDIR [--only a,b] [--no-compile]
"""
import torch

import real_models

shared_models = real_models.models


def models():
    import torchvision.models as tvm

    out = shared_models()
    out["efficientnet_b0"] = (
        lambda: tvm.efficientnet_b0(),
        lambda: (torch.randn(64, 3, 224, 224),),
        "conv",
    )
    return out


real_models.models = models

if __name__ == "__main__":
    real_models.main()
