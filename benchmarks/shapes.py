"""Models with the exact tensor shapes of ResNet-50 and BERT-base (no torchvision needed)."""

from __future__ import annotations

import torch


class ShapeModel(torch.nn.Module):
    """Parameters (and BatchNorm-like buffers) with given shapes; forward is not needed."""

    def __init__(
        self, params: list[tuple[str, tuple[int, ...]]], buffers: list[tuple[str, tuple[int, ...], torch.dtype]] = ()
    ):
        super().__init__()
        for name, shape in params:
            self.register_parameter(name, torch.nn.Parameter(torch.randn(shape) * 0.01))
        for name, shape, dtype in buffers:
            self.register_buffer(name, torch.zeros(shape, dtype=dtype))


def resnet50_like() -> ShapeModel:
    """161 parameter tensors, 25,557,032 parameters; 159 BatchNorm buffers."""
    params: list[tuple[str, tuple[int, ...]]] = []
    buffers: list[tuple[str, tuple[int, ...], torch.dtype]] = []

    def conv_bn(name: str, cin: int, cout: int, k: int) -> None:
        params.append((f"{name}_conv", (cout, cin, k, k)))
        params.extend([(f"{name}_bn_w", (cout,)), (f"{name}_bn_b", (cout,))])
        buffers.extend(
            [
                (f"{name}_bn_mean", (cout,), torch.float32),
                (f"{name}_bn_var", (cout,), torch.float32),
                (f"{name}_bn_count", (), torch.int64),
            ]
        )

    conv_bn("stem", 3, 64, 7)
    cin = 64
    for layer, (planes, blocks) in enumerate(zip((64, 128, 256, 512), (3, 4, 6, 3))):
        for block in range(blocks):
            prefix = f"l{layer}b{block}"
            conv_bn(f"{prefix}a", cin, planes, 1)
            conv_bn(f"{prefix}b", planes, planes, 3)
            conv_bn(f"{prefix}c", planes, planes * 4, 1)
            if block == 0:
                conv_bn(f"{prefix}down", cin, planes * 4, 1)
            cin = planes * 4
    params += [("fc_w", (1000, 2048)), ("fc_b", (1000,))]
    return ShapeModel(params, buffers)


def bert_base_like() -> ShapeModel:
    """199 parameter tensors, about 110M parameters."""
    h, ff = 768, 3072
    params = [
        ("word", (30522, h)),
        ("position", (512, h)),
        ("token_type", (2, h)),
        ("emb_ln_w", (h,)),
        ("emb_ln_b", (h,)),
    ]
    for i in range(12):
        for part in ("q", "k", "v", "o"):
            params += [(f"l{i}_{part}_w", (h, h)), (f"l{i}_{part}_b", (h,))]
        params += [
            (f"l{i}_ln1_w", (h,)),
            (f"l{i}_ln1_b", (h,)),
            (f"l{i}_ff1_w", (ff, h)),
            (f"l{i}_ff1_b", (ff,)),
            (f"l{i}_ff2_w", (h, ff)),
            (f"l{i}_ff2_b", (h,)),
            (f"l{i}_ln2_w", (h,)),
            (f"l{i}_ln2_b", (h,)),
        ]
    params += [("pooler_w", (h, h)), ("pooler_b", (h,))]
    return ShapeModel(params)
