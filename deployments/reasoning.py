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

    def feed(self, delta: str) -> tuple[str, str]:
        """New text in; the (reasoning, content) that can go out now."""
        text, self.pending = self.pending + delta, ""
        reasoning = content = ""
        while text:
            if self.state == "after":
                return reasoning, content + text
            marker = self.start if self.state == "before" else self.end
            at = text.find(marker)
            if at < 0:
                keep = partial_marker(text, marker)
                out, self.pending = text[:len(text) - keep], text[len(text) - keep:]
                if self.state == "before":
                    content += out
                else:
                    reasoning += out
                return reasoning, content
            if self.state == "before":
                content += text[:at]
                self.state = "reasoning"
            else:
                reasoning += text[:at]
                self.state = "after"
            text = text[at + len(marker):]
        return reasoning, content

    def close(self) -> tuple[str, str]:
        """At the end: the text held back, to where it stands."""
        held, self.pending = self.pending, ""
        return (held, "") if self.state == "reasoning" else ("", held)

    def split(self, text: str) -> tuple[str, str]:
        r, c = self.feed(text)
        r2, c2 = self.close()
        return r + r2, c + c2
