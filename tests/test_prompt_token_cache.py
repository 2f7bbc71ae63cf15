"""`PromptTokenCache` gives a prompt the tokens its tokenizer gives it whole, for the
tokenizer layouts of the models people serve (trained here on the bundled corpus, with
those models' pre-tokenizers, normalizers and special tokens: GPT-2's, Llama 3's, Qwen 2's,
gpt-oss's o200k regex, a Metaspace one, and the embedded model's), and reuses a shared start's
tokens where the layout allows it."""

import random

import pytest
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from runtime.models import default_model_path
from runtime.models.loader import load_tokenizer
from runtime.prompt_token_cache import MIN_CHARS, PromptTokenCache, cuts_text

# Llama 3's and Qwen 2's pre-tokenizer regexes (their tokenizer.json files).
LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
         r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# o200k's (gpt-oss): words cut at case changes, contractions kept on.
O200K = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
         r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
         r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
SPECIAL = ["<|begin|>", "<|im_start|>", "<|im_end|>", "<|eot|>"]
CORPUS = (default_model_path().parent / "corpus.txt").read_text().split()
EXTRA = ["'s", "'t", "don't", "McDonald's", "HTTPServer", "iPhone", "12345", "3.14", "caf\u00e9", "\u4f60\u597d", "\U0001f642", "--", "...", "$x",
         "\u03b1\u03b2\u03b3", "<|im_start|>", "<|im_end|>", "<|eot|>", "e\u0301"]
SEPS = [" ", " ", " ", " ", "  ", "\n", "\n\n", "\t", " \n", "   ", ""]


def text(rng: random.Random, n: int) -> str:
    """Words of the corpus with numbers, accents, scripts, emoji, special tokens and
    runs of spaces, tabs and newlines between them: the places pre-tokenizers cut."""
    out: list[str] = []
    size = 0
    while size < n:
        for w in (rng.choice(CORPUS if rng.random() < 0.8 else EXTRA), rng.choice(SEPS)):
            out.append(w)
            size += len(w)
    return "".join(out)[:n]


def trained(pre, normalizer=None, post=None, specials=SPECIAL, model=None) -> PreTrainedTokenizerFast:
    tok = Tokenizer(model or models.BPE())
    tok.normalizer = normalizer
    tok.pre_tokenizer = pre
    tok.decoder = decoders.ByteLevel()
    rng = random.Random(1)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok.train_from_iterator((text(rng, 400) for _ in range(300)),
                            trainers.BpeTrainer(vocab_size=700, special_tokens=specials, initial_alphabet=alphabet,
                                                show_progress=False))
    if post is not None:
        tok.post_processor = post(tok)
    tok.add_special_tokens([AddedToken("<|eot|>", lstrip=True, rstrip=True, special=True)])
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def bos(tok: Tokenizer):
    return processors.Sequence([processors.ByteLevel(trim_offsets=True), processors.TemplateProcessing(
        single="<|begin|> $A", special_tokens=[("<|begin|>", tok.token_to_id("<|begin|>"))])])


LAYOUTS = {
    "gpt2": lambda: trained(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
                            post=lambda t: processors.ByteLevel(trim_offsets=True)),
    "llama3": lambda: trained(pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]), post=bos),
    "qwen2": lambda: trained(pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]), normalizer=normalizers.NFC()),
    "o200k": lambda: trained(pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(O200K), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])),
    "metaspace": lambda: trained(pre_tokenizers.Metaspace(prepend_scheme="always", split=True)),
}


@pytest.fixture(scope="module", params=[*LAYOUTS, "embedded"])
def layout(request):
    if request.param == "embedded":
        return request.param, load_tokenizer(str(default_model_path()))
    return request.param, LAYOUTS[request.param]()


def test_prompts_sharing_starts_get_their_whole_tokenization(layout):
    """Prompts that share starts of 2k–12k characters and part anywhere (mid-word, in a
    run of spaces, at a special token), with and without the special tokens the
    tokenizer adds: each gets exactly its whole tokenization. Every byte-level layout
    reuses most of its tokens."""
    name, tok = layout
    cache = PromptTokenCache(tok, verify_every=0)
    assert cache.enabled, cache.reason_off
    rng = random.Random(0)
    wrong = 0
    for _ in range(60):
        start = text(rng, rng.randrange(MIN_CHARS, 12000))
        for _ in range(3):
            prompt = start + rng.choice(["", " ", "  ", "\n", "x", "<|eot|>"]) + text(rng, rng.randrange(0, 300))
            special = rng.random() < 0.5
            wrong += cache.encode(prompt, special) != list(tok.encode(prompt, add_special_tokens=special))
    assert wrong == 0
    assert cache.enabled
    if name != "metaspace":
        assert cache.stats["reused"] >= 110 and cache.stats["refused"] <= 6, cache.stats


def test_a_prompt_repeated_is_served_from_the_cache(layout):
    _, tok = layout
    cache = PromptTokenCache(tok, verify_every=1)
    prompt = text(random.Random(2), 5000)
    first = cache.encode(prompt)
    assert cache.encode(prompt) == first == list(tok.encode(prompt))
    assert cache.stats["reused"] == 1 and cache.stats["reused_tokens"] >= len(first) - 1


def test_short_prompts_and_unsuited_tokenizers_are_tokenized_whole():
    """Below `MIN_CHARS` nothing is cached. SentencePiece-style BPE over the whole text
    (Llama 2's layout: a normalizer that prepends, no pre-tokenizer) and byte-level BPE
    without its regex cannot be cut, so their cache stays off and only passes through."""
    tok = load_tokenizer(str(default_model_path()))
    cache = PromptTokenCache(tok)
    short = text(random.Random(3), MIN_CHARS - 1)
    assert cache.encode(short) == list(tok.encode(short)) and cache.cached_tokens() == 0
    llama2 = trained(None, normalizer=normalizers.Sequence([normalizers.Prepend("\u2581"),
                                                            normalizers.Replace(" ", "\u2581")]))
    whole = trained(pre_tokenizers.ByteLevel(use_regex=False))
    for tok in (llama2, whole):
        cache = PromptTokenCache(tok)
        assert not cache.enabled and "pre-tokenizer" in cache.reason_off
        prompt = text(random.Random(4), 4000)
        assert cache.encode(prompt) == list(tok.encode(prompt))
        assert cache.encode(prompt + " more") == list(tok.encode(prompt + " more"))
        assert cache.cached_tokens() == 0 and cache.stats["reused"] == 0
    assert not cuts_text({"type": "Sequence", "pretokenizers": [{"type": "Metaspace", "split": False}]})
    assert cuts_text({"type": "Sequence", "pretokenizers": [{"type": "Split"}, {"type": "ByteLevel",
                                                                                "use_regex": False}]})


def test_a_wrong_reuse_turns_the_cache_off():
    """A normalizer that reaches across the whole text (x becomes y wherever a '!' comes
    later) passes the check at the cut, since the cut sees no x; the standing check
    finds the difference, the prompt still gets its own tokens, and the cache stays off."""
    tok = trained(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
                  normalizer=normalizers.Replace(Regex("x(?=[^!]*!)"), "y"))
    cache = PromptTokenCache(tok, verify_every=1)
    assert cache.enabled
    rng = random.Random(5)
    words = " ".join(rng.choice(CORPUS) for _ in range(600)).replace("x", "z").replace("!", ".")
    start = "x marks x " * 100 + words   # no special tokens: the normalizer sees the text whole
    assert cache.encode(start + " plain") == list(tok.encode(start + " plain"))
    prompt = start + " loud!"
    assert cache.encode(prompt) == list(tok.encode(prompt))
    assert not cache.enabled and "differed" in cache.reason_off and cache.cached_tokens() == 0
    assert cache.encode(prompt + " again") == list(tok.encode(prompt + " again"))


def test_the_cache_keeps_within_its_capacity():
    tok = load_tokenizer(str(default_model_path()))
    cache = PromptTokenCache(tok, capacity_tokens=5000)
    rng = random.Random(6)
    prompts = [text(rng, 4000) for _ in range(8)]
    for p in prompts:
        cache.encode(p)
    assert 0 < cache.cached_tokens() <= 5000
    assert cache.encode(prompts[-1] + " q") == list(tok.encode(prompts[-1] + " q"))
    assert cache.stats["reused"] == 1
    assert cache.encode(prompts[0] + " q") == list(tok.encode(prompts[0] + " q"))
    assert cache.stats["reused"] == 1   # the first prompt was evicted
