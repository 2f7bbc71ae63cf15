"""Projections that read the same input, fused into one matmul.

On a GPU a decode step is host-bound: its time goes to encoding a few kernels per
layer, not to running them. Llama-style attention projects one input three times
(q, k, v) and the MLP twice (gate, up). With their weights concatenated, each set is
one matmul: three fewer kernels per layer, and one wider matmul, which uses the device
better at small batches than three narrow ones. The model's code is unchanged: each
projection becomes a slice of the fused one, and the first slice called on an input
computes the fused matmul for the others. A slice called on another input computes
its own, so a model that feeds its projections different inputs stays correct.

Prefill chunks are compute-bound and gain nothing from fewer launches. One H200
measurement found them slower fused (a 16k-token step 126 vs 99 ms); the bench's own
run later did not (`fuse_projections_gpu.json`: 98.7 vs 98.0 ms). Until that is
settled, each slice runs its own layer over its rows of the fused weights above
`FUSED_MAX_ROWS` (views, no copies): the same matmul as before fusing.
"""

from functools import partial

import mlx.core as mx
import mlx.nn as nn

FUSED_MAX_ROWS = 512   # inputs of more rows (tokens) than this run one matmul per slice

# (parent module attribute, projections that read the same input, fused name)
FUSIBLE = (
    ("self_attn", ("q_proj", "k_proj", "v_proj"), "qkv_proj"),
    ("mlp", ("gate_proj", "up_proj"), "gate_up_proj"),
)


class _Last:
    """The last input a fused projection saw, its slices, and how many are unread."""

    __slots__ = ("x", "parts", "unread")

    def __init__(self, x, parts):
        self.x, self.parts, self.unread = x, parts, len(parts)


class FusedProjection(nn.Module):
    """One linear layer (plain or quantized) standing for several with the same input."""

    def __init__(self, layer: nn.Module, sizes: list[int]):
        super().__init__()
        self.fused = layer
        self._split_at = [sum(sizes[:i + 1]) for i in range(len(sizes) - 1)]
        bounds = zip([0, *self._split_at], [*self._split_at, sum(sizes)])
        slices = [_layer_like(layer, {k: v[a:b] for k, v in layer.items()}) for a, b in bounds]
        mx.eval([x.parameters() for x in slices])
        # Set past Module.__setattr__: a list would register them as children, and
        # their views of the fused weights would count as parameters twice.
        object.__setattr__(self, "_slices", slices)
        self._last = None
        self.max_rows = FUSED_MAX_ROWS

    def part(self, x: mx.array, index: int) -> mx.array:
        if x.size > self.max_rows * x.shape[-1]:
            return self._slices[index](x)
        last = self._last
        if last is None or last.x is not x:
            last = self._last = _Last(x, mx.split(self.fused(x), self._split_at, axis=-1))
        last.unread -= 1
        if last.unread <= 0:
            self._last = None   # do not hold activations past the layer
        return last.parts[index]


class ProjectionSlice(nn.Module):
    """Stands where one of the fused projections was; holds no weights of its own."""

    def __init__(self, fused: FusedProjection, index: int):
        super().__init__()
        self._part = partial(fused.part, index=index)   # a plain attribute, not a child module

    def __call__(self, x: mx.array) -> mx.array:
        return self._part(x)


def _layer_like(like: nn.Module, arrays: dict) -> nn.Module:
    """A layer of `like`'s type and quantization settings holding `arrays`, built
    without the constructor's random initialization."""
    layer = type(like).__new__(type(like))
    nn.Module.__init__(layer)
    quantized = isinstance(like, nn.QuantizedLinear)
    if quantized:
        layer.group_size, layer.bits, layer.mode = like.group_size, like.bits, like.mode
    for k, v in arrays.items():
        layer[k] = v
    if quantized:
        layer.freeze()   # as QuantizedLinear's own constructor does
    return layer


def _concat(layers: list[nn.Module]) -> nn.Module | None:
    """The layers as one, or None when they cannot be concatenated (other layer types,
    different inputs or quantization settings, bias on some only)."""
    first = layers[0]
    kind = type(first)
    if kind not in (nn.Linear, nn.QuantizedLinear) or any(type(x) is not kind for x in layers):
        return None
    keys = set(first.keys())
    if any(set(x.keys()) != keys for x in layers):
        return None
    if any(x.weight.shape[1] != first.weight.shape[1] or x.weight.dtype != first.weight.dtype
           for x in layers):
        return None
    if kind is nn.QuantizedLinear:
        settings = (first.group_size, first.bits, first.mode)
        if any((x.group_size, x.bits, x.mode) != settings for x in layers):
            return None
    return _layer_like(first, {k: mx.concatenate([x[k] for x in layers], axis=0) for k in keys})


def fuse_projections(model) -> int:
    """Fuse each layer's q/k/v and gate/up projections in place. Returns how many sets
    were fused (0 for a model whose layers do not have them)."""
    n = 0
    for layer in getattr(model, "layers", []):
        for parent_name, names, fused_name in FUSIBLE:
            parent = getattr(layer, parent_name, None)
            if parent is None or fused_name in parent or not all(name in parent for name in names):
                continue
            layers = [parent[name] for name in names]
            fused = _concat(layers)
            if fused is None:
                continue
            mx.eval(fused.parameters())
            proj = FusedProjection(fused, [x.weight.shape[0] for x in layers])
            parent[fused_name] = proj
            for i, name in enumerate(names):
                parent[name] = ProjectionSlice(proj, i)
            n += 1
    return n
