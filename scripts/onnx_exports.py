"""What the GPU scripts that export real models share (gpu_real_check.sh,
gpu_fp8_real.sh; both run in bundle/, where make_bundle.sh copies this file): the
exporter's options and a Hugging Face model's last hidden state as one output."""
import torch


class LastHidden(torch.nn.Module):
    """A Hugging Face model's last hidden state, its other outputs dropped."""

    def __init__(self, m):
        super().__init__()
        self.m = m

    def forward(self, x):
        return self.m(x).last_hidden_state


def export(model, x, path, batch_axis=False):
    """`model` in eval mode to `path` (opset 17, the TorchScript exporter), its input
    `x` named x, its output y; with `batch_axis` the batch is symbolic."""
    torch.onnx.export(model.eval(), (x,), path, opset_version=17, dynamo=False,
                      input_names=["x"], output_names=["y"],
                      dynamic_axes={"x": {0: "b"}} if batch_axis else None)
