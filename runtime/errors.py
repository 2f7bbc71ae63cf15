"""Typed errors of the engine; the HTTP layer maps each to a status code."""


class EngineError(Exception):
    """Base class of every error the engine raises on purpose.

    Errors cross from the engine process to its server (engine_process.py) by pickle,
    which rebuilds an exception from its `args`; subclasses whose constructors take
    other arguments than their message are rebuilt from their state instead."""

    def __reduce__(self):
        return _rebuild, (type(self), self.args, self.__dict__)


def _rebuild(cls, args, state):
    e = cls.__new__(cls)
    e.args = args
    e.__dict__.update(state)
    return e


class InvalidRequestError(EngineError, ValueError):
    """The request itself is wrong; `param` names the offending field when known."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class EmptyPromptError(InvalidRequestError):
    def __init__(self):
        super().__init__("the prompt is empty: give at least one token", "prompt")


class PromptTooLongError(InvalidRequestError):
    def __init__(self, num_prompt_tokens: int, max_tokens: int, max_model_len: int):
        super().__init__(
            f"this model's maximum context length is {max_model_len} tokens; the request "
            f"asked for {num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the "
            f"prompt, {max_tokens} for the completion). Shorten the prompt or lower max_tokens.",
            "prompt",
        )
        self.num_prompt_tokens = num_prompt_tokens
        self.max_tokens = max_tokens
        self.max_model_len = max_model_len


class InvalidSamplingParamsError(InvalidRequestError):
    """A sampling parameter is out of range."""


class TokenOutOfVocabularyError(InvalidRequestError):
    def __init__(self, token_id: int, vocab_size: int, param: str = "prompt"):
        super().__init__(f"token id {token_id} is outside the vocabulary [0, {vocab_size})", param)


class DuplicateRequestError(InvalidRequestError):
    def __init__(self, request_id: str):
        super().__init__(f"request id {request_id!r} is already in use", "request_id")


class UnsupportedModelError(EngineError):
    """The model's architecture cannot run on the paged KV cache (yet)."""


class EngineStepError(EngineError):
    """A step failed (out of device memory, say). The requests it was running were
    aborted with this error and their KV blocks freed; the engine carries on with the
    rest, so a retry can succeed."""


class EngineDeadError(EngineError):
    """The engine loop stopped on an unexpected error; the replica must restart."""


class RequestAbortedError(EngineError):
    """Raised to a waiter whose request was aborted by someone else (shutdown)."""
