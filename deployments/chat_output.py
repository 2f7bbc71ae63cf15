"""A chat choice's text as the API hands it out: `reasoning` (reasoning.py), `content`
and `tool_calls` (tools.py), whole or as it streams, and the marker hold-back both
splits share."""


def partial_marker(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ChoiceParser:
    """One chat choice's text, whole or as it streams, split into `reasoning` (when the
    model thinks), `content` and `tool_calls` (when tools are parsed): the reasoning
    split first, then the tool calls out of what is content."""

    def __init__(self, split=None, tools=None):
        """`split`: a `ReasoningSplit`; `tools`: a `ToolOutput`; either may be None."""
        self.split, self.tools = split, tools

    def message(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """The whole message of a finished choice, and the finish reason to report."""
        message, content = {"role": "assistant"}, text
        if self.split is not None:
            reasoning, content = self.split.split(text)
            if reasoning:
                message["reasoning"] = reasoning
        if self.tools is None:
            return {**message, "content": content}, finish_reason
        whole, finish_reason = self.tools.message(content, finish_reason)
        return {**whole, **message}, finish_reason

    def feed(self, delta: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """New text in (with the finish reason once it ends); the chunk's delta fields
        and the finish reason to report."""
        out, content = {}, delta
        if self.split is not None:
            reasoning, content = self.split.feed(delta)
            if finish_reason is not None:
                more, more_content = self.split.close()
                reasoning, content = reasoning + more, content + more_content
            if reasoning:
                out["reasoning"] = reasoning
        if self.tools is not None:
            content, calls = self.tools.feed(content)
            if finish_reason is not None:
                more, more_calls = self.tools.close()
                content, calls = content + more, calls + more_calls
                finish_reason = self.tools.finish_reason(finish_reason)
            if calls:
                out["tool_calls"] = calls
        if content:
            out["content"] = content
        return out, finish_reason
