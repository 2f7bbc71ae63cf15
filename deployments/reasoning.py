"""Reasoning in /v1/chat/completions: what a thinking model writes between its think
markers (Qwen3's and DeepSeek-R1's `<think>` and `</think>`, and the others mlx-lm's
tokenizer knows: `think_start`, `think_end`) goes to the message's `reasoning` field,
the name vLLM and mlx-lm's server use, and the rest to `content`.

A prompt can open the reasoning itself (templates that end in "<think>\\n"): the split
then starts inside it, by the same reading of the prompt's tail that starts a
constraint after the reasoning (`runtime.structured_output.reasoning_state`).
"""

from .chat_output import partial_marker


class ReasoningSplit:
    """Splits one completion's text, whole or as it streams, into reasoning and content.
    Text that may be the start of the marker awaited next is held back."""

    def __init__(self, start: str, end: str, in_reasoning: bool):
        self.start, self.end = start, end
        self.state = "reasoning" if in_reasoning else "before"
        self.pending = ""

    def parts(self, delta: str) -> list[tuple[str, str]]:
        """New text in; the pieces that can go out now, in the order written, each
        ("reasoning" | "content", text): content may come before the reasoning too."""
        text, self.pending = self.pending + delta, ""
        out = []
        while text:
            if self.state == "after":
                out.append(("content", text))
                break
            kind, marker = ("content", self.start) if self.state == "before" else ("reasoning", self.end)
            at = text.find(marker)
            if at < 0:
                keep = partial_marker(text, marker)
                out.append((kind, text[:len(text) - keep]))
                self.pending = text[len(text) - keep:]
                break
            out.append((kind, text[:at]))
            self.state = "reasoning" if self.state == "before" else "after"
            text = text[at + len(marker):]
        return [(kind, t) for kind, t in out if t]

    def close_parts(self) -> list[tuple[str, str]]:
        """At the end: the text held back, as what the split stands in."""
        held, self.pending = self.pending, ""
        return [("reasoning" if self.state == "reasoning" else "content", held)] if held else []

    def feed(self, delta: str) -> tuple[str, str]:
        """New text in; the (reasoning, content) that can go out now."""
        return _joined(self.parts(delta))

    def close(self) -> tuple[str, str]:
        """At the end: the text held back, to where it stands."""
        return _joined(self.close_parts())

    def split(self, text: str) -> tuple[str, str]:
        r, c = self.feed(text)
        r2, c2 = self.close()
        return r + r2, c + c2


def _joined(parts: list[tuple[str, str]]) -> tuple[str, str]:
    return ("".join(t for kind, t in parts if kind == "reasoning"),
            "".join(t for kind, t in parts if kind == "content"))
