"""Is mlx-lm's forward pass of a mixture-of-experts model the same run after run, and
the same as on the CPU? A check of the MLX backend underneath, not of this engine.

It runs mlx-lm's own forward of the gpt-oss-shaped test model (`tests/conftest.py`'s
spec: sliding and full layers, sinks, 4 experts, 2 a token) on the default device
several times against the CPU stream, three ways: as one graph (as mlx-lm and this
engine run it), evaluated after each layer, and with the experts' token sort taken out
(mlx-lm's `SwitchGLU` sorts the tokens by expert from 64 indices on, 32 tokens here).
On MLX's CUDA backend (0.32.4, an H100) the one graph at 40 tokens read up to 1.8 off
the CPU, and differently run to run, while the other two ways and 57 tokens read 3e-6.

    python bench/moe_determinism.py --lengths 40 57 --runs 4
"""

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402

from bench.bench_continuous_vs_static import RESULTS  # noqa: E402


def _unsorted(self, x, indices):
    """`SwitchGLU.__call__` without its token sort (its path below 64 indices)."""
    x = mx.expand_dims(x, (-2, -3))
    x = self.down_proj(self.activation(self.up_proj(x, indices), self.gate_proj(x, indices)), indices)
    return x.squeeze(-2)


def _per_layer(model, ids):
    from mlx_lm.models.base import create_attention_mask

    inner = model.model
    x = inner.embed_tokens(ids)
    full, swa = create_attention_mask(x, None), create_attention_mask(x, None, window_size=inner.window_size)
    for layer, kind in zip(inner.layers, inner.layer_types):
        x = layer(x, full if kind == "full_attention" else swa, None)
        mx.eval(x)
    return model.lm_head(inner.norm(x))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[40, 57])
    ap.add_argument("--runs", type=int, default=4)
    ap.add_argument("--out", default=str(RESULTS / "moe_determinism.json"))
    args = ap.parse_args(argv)
    from mlx_lm import load
    from mlx_lm.models import switch_layers

    from runtime.models.tiny import make_model
    from tests.conftest import MODEL_SPECS

    with tempfile.TemporaryDirectory() as tmp:
        model, _ = load(str(make_model(Path(tmp) / "gpt-oss", **MODEL_SPECS["gpt-oss"])))
    rng, rows = random.Random(5), []
    sorted_call = switch_layers.SwitchGLU.__call__
    ways = (("one graph", model, sorted_call),
            ("eval after each layer", lambda ids: _per_layer(model, ids), sorted_call),
            ("experts unsorted", model, _unsorted))
    for n in args.lengths:
        ids = mx.array([[rng.randrange(3, 380) for _ in range(n)]])
        with mx.stream(mx.cpu):
            ref = model(ids)
            mx.eval(ref)
        for way, fn, call in ways:
            switch_layers.SwitchGLU.__call__ = call
            outs = [fn(ids) for _ in range(args.runs)]
            mx.eval(outs)
            switch_layers.SwitchGLU.__call__ = sorted_call
            off = [mx.abs(o - ref).max().item() for o in outs]
            rows.append({"tokens": n, "way": way, "max_abs_logit_off_cpu": off})
            print(f"{n:>6} tokens | {way:<22} | off the CPU, each run: " + " ".join(f"{d:.1e}" for d in off))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"device": str(mx.default_device()), "mlx": mx.__version__, "rows": rows},
                                         indent=2))


if __name__ == "__main__":
    main()
