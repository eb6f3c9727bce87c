"""Conversations in: OpenAI-style messages rendered by the checkpoint's chat template,
as vLLM renders them for `LLM.chat` and the chat completions endpoint.

A message's content is a string, None (an assistant message that only calls tools), or a
list of parts, whose text parts are joined with newlines (vLLM's "string" content
format). A model that takes images also takes image parts (OpenAI's `image_url`, with a
data URL or a file:// URL, and vLLM's `image_pil`): such a message keeps its parts, each
image one `{"type": "image"}` for the template (which writes the model's placeholder
there), and the images are returned in order. An assistant message's `tool_calls`
reach the template with their JSON `arguments` parsed, as the templates of Qwen, Llama
and Mistral expect; `tools` are handed to the template, which describes them to the
model.
"""

import json

from transformers import PreTrainedTokenizerBase

IMAGE_PARTS = ("image_url", "image_pil")  # a part's type, and the key of its image


def check_text(text: str, what: str) -> None:
    """A ValueError naming `what` when `text` cannot be encoded (a lone UTF-16
    surrogate)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(
            f"{what} is not valid Unicode: it holds the lone surrogate "
            f"{text[error.start]!r} at position {error.start}"
        ) from None


def render(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict],
    chat_template: str | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    tools: list[dict] | None = None,
    chat_template_kwargs: dict | None = None,
    takes_images: bool = False,
) -> tuple[str, list[int], list]:
    """The text and token ids of a conversation through the chat template, and its
    images (their URLs or PIL images, in order; image parts only where
    `takes_images`)."""
    if chat_template is None and not tokenizer.chat_template:
        raise ValueError(
            "the checkpoint's tokenizer has no chat template; pass chat_template "
            "or format the prompt yourself"
        )
    if add_generation_prompt and continue_final_message:
        raise ValueError(
            "continue_final_message=True continues the last message: it cannot go "
            "with add_generation_prompt=True"
        )
    if not isinstance(messages, list) or not messages:
        raise ValueError(
            f"messages must be a non-empty list of messages, got {messages!r}"
        )
    images: list = []
    conversation = [
        _message(i, message, images if takes_images else None)
        for i, message in enumerate(messages)
    ]
    if continue_final_message and conversation[-1]["role"] != "assistant":
        raise ValueError("continue_final_message=True needs an assistant message last")
    options = dict(chat_template_kwargs or {})
    try:
        text = tokenizer.apply_chat_template(
            conversation,
            chat_template=chat_template,
            tools=tools,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            **options,
        )
    except Exception as error:
        raise ValueError(
            f"cannot render the conversation with the chat template: "
            f"{type(error).__name__}: {error}"
        ) from None
    # the template wrote the special tokens already
    return text, tokenizer.encode(text, add_special_tokens=False), images


def _message(i: int, message, images: list | None) -> dict:
    """Message `i` as chat templates take it; its images appended to `images` (None:
    the model takes none)."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise ValueError(
            f"message {i} must be an object with a string role, got {message!r}"
        )
    message = dict(message)
    content = message.get("content")
    pictured = isinstance(content, list) and any(
        isinstance(part, dict) and part.get("type") in IMAGE_PARTS for part in content
    )
    if pictured and images is not None:
        message["content"] = [_part(i, part, images) for part in content]
    elif isinstance(content, list):
        message["content"] = "\n".join(_text_part(i, part) for part in content)
    elif content is None and not message.get("tool_calls"):
        raise ValueError(f"message {i} has no content")
    elif content is not None and not isinstance(content, str):
        raise ValueError(
            f"message {i}'s content must be a string or a list of parts, "
            f"got {content!r}"
        )
    if message.get("tool_calls") is not None:
        message["tool_calls"] = [_tool_call(i, call) for call in message["tool_calls"]]
    for key, value in message.items():
        if isinstance(value, str):
            check_text(value, f"message {i}'s {key}")
    return message


def _part(i: int, part, images: list) -> dict:
    """A part of a message with images, as templates take them; an image part's image
    (a URL, a {"url": ...}, a PIL image) appended to `images`."""
    kind = part.get("type") if isinstance(part, dict) else None
    if kind in IMAGE_PARTS:
        if part.get(kind) is None:
            raise ValueError(f"message {i} has an {kind} part without its {kind!r}")
        images.append(part[kind])
        return {"type": "image"}
    return {"type": "text", "text": _text_part(i, part, images=True)}


def _text_part(i: int, part, images: bool = False) -> str:
    if (
        not isinstance(part, dict)
        or part.get("type") != "text"
        or not isinstance(part.get("text"), str)
    ):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        takes = "image_url, image_pil and text" if images else "text"
        raise ValueError(
            f"message {i} has a content part of type {kind!r}; this model takes "
            f"only {takes} parts"
            + (
                ""
                if images or kind not in ("image_url", "image_pil")
                else " (images need a vision-language model)"
            )
        )
    return part["text"]


def _tool_call(i: int, call) -> dict:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ValueError(
            f"message {i} has a tool call without a function name: {call!r}"
        )
    arguments = function.get("arguments") or {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            raise ValueError(
                f"message {i}'s tool call {function['name']!r} has arguments "
                f"that are not JSON: {arguments!r}"
            ) from None
    return dict(call, function=dict(function, arguments=arguments))
