"""Shared fixtures: small models made offline, and an mlx-lm reference to compare with."""

import functools
import os
import resource
from pathlib import Path

import pytest

# This process's file-descriptor limit before anything imports mlx-lm (which lowers it).
FD_LIMIT_AT_START = resource.getrlimit(resource.RLIMIT_NOFILE)

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Full float32 matmuls where MLX would use TF32 (CUDA, M5-class Apple GPUs): the
# tolerances below compare float32 paths, which TF32 rounding exceeds by ~10x.
os.environ.setdefault("MLX_ENABLE_TF32", "0")

import mlx.core as mx  # noqa: E402

from runtime.models import default_model_path  # noqa: E402
from runtime.models.tiny import make_model  # noqa: E402

MODEL_SPECS = {
    "llama": dict(arch="llama", hidden=64, layers=2, heads=4, kv_heads=2, vocab_size=384, seed=1),
    "qwen3": dict(arch="qwen3", hidden=64, layers=2, heads=4, kv_heads=1, vocab_size=384, seed=2,
                  tie=False),
    "llama-4bit": dict(arch="llama", hidden=64, layers=2, heads=4, kv_heads=2, vocab_size=384,
                       seed=3, quantize=4),
    # Sliding-window layers (window 8) around a full-attention one, as Gemma 3 alternates them.
    "gemma3": dict(arch="gemma3_text", hidden=64, layers=3, heads=4, kv_heads=2, vocab_size=384, seed=4,
                   sliding_window=8),
    # gpt-oss's: sliding and full layers alternating, attention sinks, a mixture of experts.
    "gpt-oss": dict(arch="gpt_oss", hidden=64, layers=4, heads=4, kv_heads=2, vocab_size=384, seed=5,
                    sliding_window=8, tie=False),
}


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory):
    """Random-weight models with GQA, llama, qwen3, gemma3 and gpt-oss (sliding-window
    layers; gpt-oss's with sinks), and a 4-bit quantized one."""
    root = tmp_path_factory.mktemp("models")
    return {name: str(make_model(root / name, **spec)) for name, spec in MODEL_SPECS.items()}


@pytest.fixture(scope="session")
def default_model():
    return str(default_model_path())


# A ChatML template that shows tools and writes calls as Qwen's do, between <tool_call>
# markers (mlx-lm infers its `json_tools` parser from it), and thinks as Qwen3 does: off
# with `enable_thinking: false`; `think_open` ends the prompt inside "<think>", as
# DeepSeek-R1's template does; an assistant message's `reasoning_content` is shown again.
FORMAT_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nYou may call:{% for t in tools %} {{ t.function.name }}{% endfor %}"
    "<|im_end|>\n{% endif %}"
    "{%- for message in messages %}<|im_start|>{{ message.role }}\n"
    "{% if message.reasoning_content %}<think>{{ message.reasoning_content }}</think>{% endif %}"
    "{% if message.tool_calls %}{% for tool_call in message.tool_calls %}"
    "{%- set tool_call = tool_call.function %}"
    '<tool_call>\n{"name": "{{ tool_call.name }}", "arguments": {{ tool_call.arguments | tojson }}}\n</tool_call>'
    "{%- endfor %}{% else %}{{ message.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{%- elif think_open is defined and think_open %}<think>\n{% endif %}{% endif %}"
)


# Mistral's call format as its newer templates write it (each call `[TOOL_CALLS]name[ARGS]{...}`);
# without "[ARGS]", as older ones do: `[TOOL_CALLS] [{"name": ..., "arguments": ...}]`.
MISTRAL_TEMPLATE = (
    "{%- if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' %}{{ message.content or '' }}"
    "{%- for tc in message.tool_calls or [] %}[TOOL_CALLS]{{ tc.function.name }}[ARGS]"
    "{{ tc.function.arguments | tojson }}{% endfor %}</s>"
    "{%- elif message.role == 'tool' %}[TOOL_RESULTS]{{ message.content }}[/TOOL_RESULTS]"
    "{%- else %}[INST]{{ message.content }}[/INST]{% endif %}{% endfor %}"
)
MISTRAL_LIST_TEMPLATE = MISTRAL_TEMPLATE.replace(
    "[TOOL_CALLS]{{ tc.function.name }}[ARGS]{{ tc.function.arguments | tojson }}",
    '[TOOL_CALLS] [{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}]')


def make_format_model(out, added_tokens: tuple[str, ...], template: str = FORMAT_TEMPLATE,
                      special: bool = False) -> str:
    """A small random-weight model with `added_tokens` in its vocabulary and `template`
    as its chat template; `special`: the added tokens flagged special, so that decoding
    that skips special tokens drops them (Mistral's markers are)."""
    import json

    out = make_model(out, hidden=64, layers=2, heads=4, kv_heads=2, vocab_size=384, seed=4,
                     added_tokens=added_tokens)
    config = json.loads((out / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    if special:
        tok = json.loads((out / "tokenizer.json").read_text())
        for t in tok["added_tokens"]:
            t["special"] = t["special"] or t["content"] in added_tokens
        (out / "tokenizer.json").write_text(json.dumps(tok))
    return str(out)


@pytest.fixture(scope="session")
def format_model(tmp_path_factory):
    """A random-weight model whose vocabulary has "<think>" and "</think>" and whose chat
    template is `FORMAT_TEMPLATE`: mlx-lm gives its tokenizer a thinking format and a
    tool parser."""
    return make_format_model(tmp_path_factory.mktemp("format-model") / "model", ("<think>", "</think>"))


@pytest.fixture(scope="session")
def mistral_model(tmp_path_factory):
    """A random-weight model of Mistral's call format (`MISTRAL_TEMPLATE`), its
    "[TOOL_CALLS]" and "[ARGS]" special tokens as in Mistral's tokenizers."""
    return make_format_model(tmp_path_factory.mktemp("mistral-model") / "model", ("[TOOL_CALLS]", "[ARGS]"),
                             MISTRAL_TEMPLATE, special=True)


# gpt-oss's harmony framing, cut down: messages `<|start|>ROLE<|message|>...<|end|>`, the
# tools in a developer message, an earlier turn's reasoning, calls and their results as
# gpt-oss's own template writes them (a call's reasoning is its message's content or
# `thinking`, never both); the prompt ends in `<|start|>assistant`.
HARMONY_MARKERS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|call|>", "<|return|>", "<|constrain|>")
HARMONY_TEMPLATE = (
    "{%- if tools %}<|start|>developer<|message|>Functions:{% for t in tools %} {{ t.function.name }}"
    "{% endfor %}<|end|>{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}"
    "{%- if m.content and m.thinking %}{{ raise_exception('Cannot pass both content and thinking') }}{% endif %}"
    "{%- if m.content or m.thinking %}<|start|>assistant<|channel|>analysis<|message|>{{ m.content or m.thinking }}"
    "<|end|>{% endif %}"
    "{%- for tc in m.tool_calls %}<|start|>assistant to=functions.{{ tc.function.name }}<|channel|>commentary"
    " json<|message|>{{ tc.function.arguments | tojson }}<|call|>{% endfor %}"
    "{%- elif m.role == 'assistant' %}<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>"
    "{%- elif m.role == 'tool' %}<|start|>functions.{{ m.name or 'tool' }} to=assistant<|channel|>commentary"
    "<|message|>{{ m.content }}<|end|>"
    "{%- else %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endif %}{% endfor %}"
    "{%- if add_generation_prompt %}<|start|>assistant{% endif %}"
)


@pytest.fixture(scope="session")
def harmony_model(tmp_path_factory):
    """A random-weight model of gpt-oss's harmony format (`HARMONY_TEMPLATE`): its markers
    special tokens, `<|return|>` and `<|call|>` among its EOS tokens as gpt-oss's
    generation config has them."""
    import json

    out = make_format_model(tmp_path_factory.mktemp("harmony-model") / "model", HARMONY_MARKERS,
                            HARMONY_TEMPLATE, special=True)
    ids = {t["content"]: t["id"] for t in json.loads((Path(out) / "tokenizer.json").read_text())["added_tokens"]}
    (Path(out) / "generation_config.json").write_text(json.dumps({"eos_token_id": [ids["<|return|>"], 0,
                                                                                 ids["<|call|>"]]}))
    return out


@functools.lru_cache(maxsize=8)
def _mlx_lm_model(path: str, adapter_path: str | None = None):
    from mlx_lm import load

    return load(path, adapter_path=adapter_path)[0]


def reference_greedy(path, prompt_ids, max_tokens, adapter_path=None):
    """mlx-lm's own greedy decode of the model at `path` (with the LoRA adapters at
    `adapter_path`), loaded by mlx-lm as it is (the engine's copy has fused
    projections): [(token, logprobs over the vocab)] per step."""
    from mlx_lm.generate import generate_step

    out = []
    model = _mlx_lm_model(path, adapter_path)
    for tok, logprobs in generate_step(mx.array(prompt_ids), model, max_tokens=max_tokens,
                                       sampler=lambda lp: mx.argmax(lp, axis=-1)):
        out.append((int(tok), logprobs.astype(mx.float32)))
        if len(out) == max_tokens:
            break
    return out


@functools.lru_cache(maxsize=None)
def rope_cannot_launch(head_dim: int, rows: int = 256) -> bool:
    """MLX 0.32's CUDA `mx.fast.rope` fails to launch (`cudaGraphAddKernelNode ...
    invalid argument`) for head_dim 16 from 128 rows on (64 and 96 run), whatever the
    offsets or layout; head_dim 32 and 64 run. The test models have head_dim 16, so the
    tests that pack that many rows into one step skip where this happens (real models
    are not affected). False on the CPU and on Metal."""
    x = mx.zeros((rows, 4, 1, head_dim))
    try:
        mx.eval(mx.fast.rope(x, head_dim, traditional=False, base=10000.0, scale=1.0, offset=0))
    except RuntimeError:
        return True
    return False


# For tests that pack 128 or more rows of a head_dim-16 test model into one step.
needs_rope16_launch = pytest.mark.skipif(
    rope_cannot_launch(16), reason="MLX's CUDA rope cannot launch head_dim 16 on 128 rows or more "
                                   "(conftest.rope_cannot_launch)")


def make_lora_adapter(model_path: str, out, rank: int = 4, scale: float = 8.0, seed: int = 7) -> str:
    """A LoRA adapter directory as mlx-lm's fine-tuning writes it, for the last two
    layers of the model at `model_path`, with random (nonzero) weights so it changes
    the outputs."""
    import json
    from pathlib import Path

    from mlx.utils import tree_flatten
    from mlx_lm import load
    from mlx_lm.tuner.utils import linear_to_lora_layers

    model = load(model_path)[0]
    model.freeze()
    lora = {"rank": rank, "scale": scale, "dropout": 0.0}
    linear_to_lora_layers(model, 2, lora)
    mx.random.seed(seed)
    weights = {k: mx.random.normal(v.shape, scale=0.05).astype(v.dtype)
               for k, v in tree_flatten(model.trainable_parameters())}
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "adapters.safetensors"), weights)
    (out / "adapter_config.json").write_text(json.dumps(
        {"fine_tune_type": "lora", "num_layers": 2, "lora_parameters": lora}))
    return str(out)
