"""Make small models, offline, in the Hugging Face layout that `mlx_lm.load` reads.

The project cannot download weights, so tests, `serve run` and benchmarks run on
models made here: deterministic random weights from mlx-lm's own model classes,
a byte-level BPE tokenizer trained on the bundled `corpus.txt`, and a ChatML
chat template. Optionally the weights are trained on that corpus for a few
hundred steps, so greedy outputs are words rather than one repeated token.

    python -m runtime.models.tiny OUT --arch llama --hidden 128 --layers 4
    python -m runtime.models.tiny OUT --arch qwen3 --quantize 4
    python -m runtime.models.tiny OUT --arch gemma3_text --sliding-window 8
    python -m runtime.models.tiny OUT --arch gpt_oss --layers 4
    python -m runtime.models.tiny OUT --train-steps 300
"""

import argparse
import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_flatten, tree_map

CORPUS = Path(__file__).with_name("corpus.txt")
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def build_tokenizer(out: Path, vocab_size: int, added_tokens: tuple[str, ...] = ()) -> int:
    """Train a byte-level BPE on the bundled corpus and write the tokenizer files.
    `added_tokens`: whole tokens after the trained ones, decoded as text (markers such
    as a reasoning model's "<think>")."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train([str(CORPUS)], trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in added_tokens])
    tok.save(str(out / "tokenizer.json"))
    eos = SPECIAL_TOKENS[0]
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": None,
                "eos_token": eos,
                "pad_token": eos,
                "unk_token": None,
                "model_max_length": 1 << 20,
                "add_bos_token": False,
                "chat_template": CHAT_TEMPLATE,
            },
            indent=2,
        )
    )
    (out / "special_tokens_map.json").write_text(
        json.dumps({"eos_token": eos, "pad_token": eos}, indent=2)
    )
    return tok.get_vocab_size()


ARCHS = ("llama", "qwen3", "gemma3_text", "gpt_oss")


def model_config(arch: str, vocab: int, hidden: int, layers: int, heads: int,
                 kv_heads: int, context: int, tie: bool, intermediate: int | None = None,
                 sliding_window: int = 8, window_pattern: int = 2) -> dict:
    """`sliding_window`: the window of gemma3_text's and gpt_oss's sliding layers; every
    `window_pattern`-th layer attends in full, the others are sliding (Gemma 3's 6,
    gpt-oss's 2; gpt_oss's layers attend with sinks too, and its MLP is 4 experts, 2 a
    token)."""
    head_dim = hidden // heads
    config = {
        "model_type": arch,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": intermediate or hidden * 2,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": 1e-5,
        "vocab_size": vocab,
        "max_position_embeddings": context,
        "rope_theta": 10000.0,
        "tie_word_embeddings": tie,
        "eos_token_id": 0,
        "bos_token_id": 0,
    }
    if arch == "llama":
        config["architectures"] = ["LlamaForCausalLM"]
    elif arch == "qwen3":
        config["architectures"] = ["Qwen3ForCausalLM"]
    elif arch == "gemma3_text":
        config.update(architectures=["Gemma3ForCausalLM"], sliding_window=sliding_window,
                      sliding_window_pattern=window_pattern,
                      query_pre_attn_scalar=head_dim, rope_local_base_freq=10000.0)
    elif arch == "gpt_oss":
        config.update(architectures=["GptOssForCausalLM"], sliding_window=sliding_window, num_local_experts=4,
                      num_experts_per_tok=2,
                      layer_types=[("sliding_attention", "full_attention")[(i + 1) % window_pattern == 0]
                                   for i in range(layers)])
    else:
        raise ValueError(f"unknown arch {arch!r}: choose {', '.join(ARCHS)}")
    return config


def _train(model: nn.Module, tokenizer_path: Path, steps: int, seq_len: int = 64) -> float:
    """Next-token training on the corpus; returns the final loss."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_path))
    ids = mx.array(tok.encode(CORPUS.read_text()).ids)
    n = ids.shape[0] - seq_len - 1

    def loss_fn(m, x, y):
        return nn.losses.cross_entropy(m(x), y).mean()

    opt = optim.AdamW(learning_rate=3e-3, weight_decay=0.0)
    step = nn.value_and_grad(model, loss_fn)
    loss = mx.array(0.0)
    for i in range(steps):
        starts = mx.random.randint(0, n, (16,))
        window = starts[:, None] + mx.arange(seq_len + 1)[None]
        batch = ids[window]
        loss, grads = step(model, batch[:, :-1], batch[:, 1:])
        opt.update(model, grads)
        mx.eval(model.parameters(), opt.state, loss)
    return loss.item()


def make_model(out, arch: str = "llama", hidden: int = 128, layers: int = 4,
               heads: int = 4, kv_heads: int = 2, vocab_size: int = 512,
               context: int = 4096, tie: bool = True, seed: int = 0,
               dtype: str = "float32", quantize: int | None = None,
               train_steps: int = 0, intermediate: int | None = None,
               added_tokens: tuple[str, ...] = (), sliding_window: int = 8, window_pattern: int = 2) -> Path:
    """Write a model directory and return its path."""
    from mlx_lm.utils import _get_classes, quantize_model, save_config, save_model

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    vocab = build_tokenizer(out, vocab_size, tuple(added_tokens))
    config = model_config(arch, vocab, hidden, layers, heads, kv_heads, context, tie, intermediate, sliding_window,
                          window_pattern)
    model_cls, args_cls = _get_classes(config)
    mx.random.seed(seed)
    model = model_cls(args_cls.from_dict(config))
    # Small init keeps random logits spread out, so greedy ties are rare.
    model.update(tree_map(lambda p: p * 2.0 if p.ndim == 2 else p, model.parameters()))
    if train_steps:
        _train(model, out / "tokenizer.json", train_steps)
    model.set_dtype(getattr(mx, dtype))
    mx.eval(model.parameters())
    if quantize:
        model, config = quantize_model(model, config, group_size=32, bits=quantize)
    save_model(out, model)
    save_config(config, out / "config.json")
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out")
    p.add_argument("--arch", default="llama", choices=ARCHS)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--intermediate", type=int, help="MLP width (default 2 x hidden)")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--vocab-size", type=int, default=512)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--untied", action="store_true", help="separate lm_head")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--quantize", type=int, choices=[4, 8])
    p.add_argument("--train-steps", type=int, default=0)
    p.add_argument("--sliding-window", type=int, default=8, help="gemma3_text, gpt_oss: the sliding layers' window")
    a = p.parse_args(argv)
    path = make_model(a.out, a.arch, a.hidden, a.layers, a.heads, a.kv_heads, a.vocab_size,
                      a.context, not a.untied, a.seed, a.dtype, a.quantize, a.train_steps,
                      a.intermediate, sliding_window=a.sliding_window)
    n = sum(v.size for _, v in tree_flatten(mx.load(str(path / "model.safetensors"))))
    print(f"wrote {path} ({n:,} stored values)")


if __name__ == "__main__":
    main()
