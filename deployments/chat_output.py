"""A chat choice's text as the API hands it out: `reasoning` (reasoning.py), `content`
and `tool_calls` (tools.py), whole or as it streams, and the marker hold-back both
splits share, and the joining of a tool call's streamed pieces."""


def partial_marker(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def joined_pieces(pieces: list[dict]) -> list[dict]:
    """Streamed call pieces (a header, then argument pieces, each with its `index`) as
    one entry a call, in index order, its arguments joined: what a chunk carries, as
    OpenAI's do (clients that merge chunks by index may not merge within one), and what
    a whole message is made of."""
    calls: dict[int, dict] = {}
    for piece in pieces:
        i = piece["index"]
        if i in calls:
            calls[i]["function"]["arguments"] += piece["function"]["arguments"]
        else:
            calls[i] = {**piece, "function": dict(piece["function"])}
    return [calls[i] for i in sorted(calls)]


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
        parts, finish_reason = self.parts(delta, finish_reason)
        out: dict = {}
        for kind, value in parts:
            out[kind] = out.get(kind, [] if kind == "tool_calls" else "") + value
        if "tool_calls" in out:
            out["tool_calls"] = joined_pieces(out["tool_calls"])
        return out, finish_reason

    def parts(self, delta: str, finish_reason: str | None) -> tuple[list[tuple[str, object]], str | None]:
        """`feed`, as the pieces in the order written: ("reasoning", text), ("content",
        text) and ("tool_calls", [call]), so that a client of items (the Responses API)
        gets them in one order however the text was cut."""
        split = []
        if self.split is not None:
            split = self.split.parts(delta) + (self.split.close_parts() if finish_reason is not None else [])
        elif delta:
            split = [("content", delta)]
        if self.tools is None:
            return split, finish_reason
        out: list[tuple[str, object]] = []
        for kind, text in split:
            if kind == "content":
                out += self._tool_parts(*self.tools.feed(text))
            else:
                out.append((kind, text))
        if finish_reason is not None:
            out += self._tool_parts(*self.tools.close())
            finish_reason = self.tools.finish_reason(finish_reason)
        return out, finish_reason

    @staticmethod
    def _tool_parts(content: str, calls: list[dict]) -> list[tuple[str, object]]:
        return ([("content", content)] if content else []) + ([("tool_calls", calls)] if calls else [])
