"""Fused q/k/v and gate/up projections compute what the separate ones did."""

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm import load

from runtime.models.fuse import FusedProjection, ProjectionSlice, fuse_projections


def _size(model) -> int:
    return sum(v.size for _, v in tree_flatten(model.parameters()))


@pytest.mark.parametrize("name", ["llama", "qwen3", "llama-4bit"])
def test_fused_model_matches(model_dirs, name):
    plain, _ = load(model_dirs[name])
    fused, _ = load(model_dirs[name])
    size = _size(fused)
    assert fuse_projections(fused) == 2 * len(fused.layers)
    assert _size(fused) == size   # the weights moved, none were copied or lost
    attn = fused.layers[0].self_attn
    assert isinstance(attn.qkv_proj, FusedProjection) and isinstance(attn.k_proj, ProjectionSlice)
    x = mx.array([[5, 9, 33, 100, 7, 250]])
    want = plain(x)
    assert mx.allclose(fused(x), want, atol=1e-5).item()
    assert mx.allclose(mx.compile(fused)(x), want, atol=1e-5).item()
    # no activations are held once every slice was read
    assert all(layer.self_attn.qkv_proj._last is None and layer.mlp.gate_up_proj._last is None
               for layer in fused.layers)


def test_slice_of_another_input_computes_its_own(model_dirs):
    plain, _ = load(model_dirs["llama"])
    fused, _ = load(model_dirs["llama"])
    fuse_projections(fused)
    a = mx.random.normal((1, 3, plain.args.hidden_size))
    b = mx.random.normal((1, 3, plain.args.hidden_size))
    p, f = plain.layers[1].self_attn, fused.layers[1].self_attn
    q, k, v = f.q_proj(a), f.k_proj(b), f.v_proj(a)
    assert mx.allclose(q, p.q_proj(a), atol=1e-5).item()
    assert mx.allclose(k, p.k_proj(b), atol=1e-5).item()
    assert mx.allclose(v, p.v_proj(a), atol=1e-5).item()


def test_unfusible_layers_are_left_alone(model_dirs):
    """Projections of another kind (here: q/k/v with mixed bias) are not touched."""
    import mlx.nn as nn

    model, _ = load(model_dirs["llama"])
    attn = model.layers[0].self_attn
    attn.k_proj = nn.Linear(attn.k_proj.weight.shape[1], attn.k_proj.weight.shape[0], bias=True)
    assert fuse_projections(model) == 2 * len(model.layers) - 1
    assert "qkv_proj" not in attn and isinstance(attn.q_proj, nn.Linear)


def _with_bias(model):
    """q/k/v with biases, as Qwen2's attention has them (same values in every copy)."""
    import mlx.nn as nn

    for i, layer in enumerate(model.layers):
        attn = layer.self_attn
        for j, name in enumerate(("q_proj", "k_proj", "v_proj")):
            old = attn[name]
            new = nn.Linear(old.weight.shape[1], old.weight.shape[0], bias=True)
            new.weight = old.weight
            new.bias = mx.random.normal((old.weight.shape[0],), key=mx.random.key(10 * i + j))
            attn[name] = new
    return model


@pytest.mark.parametrize("name", ["llama", "llama-bias", "llama-4bit"])
def test_long_inputs_run_one_matmul_per_slice(model_dirs, name):
    """Above `max_rows` tokens (prefill chunks) each slice multiplies by its own rows
    of the fused weight; the result is the same."""
    path = model_dirs[name.removesuffix("-bias")]
    prep = _with_bias if name.endswith("-bias") else (lambda m: m)
    plain, fused = prep(load(path)[0]), prep(load(path)[0])
    fuse_projections(fused)
    x = mx.array([[5, 9, 33, 100, 7, 250, 11, 3]])
    want = plain(x)
    assert mx.allclose(fused(x), want, atol=1e-5).item()
    for layer in fused.layers:
        layer.self_attn.qkv_proj.max_rows = layer.mlp.gate_up_proj.max_rows = 4
    assert mx.allclose(fused(x), want, atol=1e-5).item()
    assert all(layer.self_attn.qkv_proj._last is None for layer in fused.layers)
