"""vLLM's prompt types, at vLLM's module path (`vllm.inputs`): a prompt is a text, token ids,
or one of these dicts."""
from typing import TypedDict


class TextPrompt(TypedDict):
    prompt: str


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]
