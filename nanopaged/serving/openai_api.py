"""OpenAI's requests for the server: a request's fields become prompts and
SamplingParams, every field honoured or refused by name (the responses are in
`openai_responses.py`).

The completions and chat completions requests take OpenAI's fields and vLLM's extra
ones, with vLLM's meanings. A field nanopaged does not implement is a ValueError naming
it (a 400), never silently ignored; `user` (an end-user id for the caller's own records)
is the only field taken and unused.
"""

from dataclasses import dataclass

from nanopaged import chat
from nanopaged.checkpoint import is_multimodal
from nanopaged.inputs import check_priority, salted
from nanopaged.sampling_params import (
    BeamSearchParams,
    SamplingParams,
    StructuredOutputsParams,
)
from nanopaged.serving import tool_calls

SAMPLING_FIELDS = {  # request field -> SamplingParams field
    "n": "n",
    "temperature": "temperature",
    "top_p": "top_p",
    "seed": "seed",
    "stop": "stop",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "min_tokens": "min_tokens",
    "ignore_eos": "ignore_eos",
    "stop_token_ids": "stop_token_ids",
    "include_stop_str_in_output": "include_stop_str_in_output",
    "best_of": "best_of",
    "skip_special_tokens": "skip_special_tokens",
    "prompt_logprobs": "prompt_logprobs",
    "truncate_prompt_tokens": "truncate_prompt_tokens",
    "allowed_token_ids": "allowed_token_ids",
    "bad_words": "bad_words",
}
# vLLM's, before structured_outputs
GUIDED_FIELDS = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
COMMON_FIELDS = {
    "model",
    "stream",
    "stream_options",
    "max_tokens",
    "logprobs",
    "logit_bias",
    "echo",
    "add_special_tokens",
    "user",
    "response_format",
    "structured_outputs",
    "guided_decoding_backend",
    "guided_whitespace_pattern",
    "cache_salt",
    "priority",
    "use_beam_search",
    "length_penalty",
    *GUIDED_FIELDS,
    *SAMPLING_FIELDS,
}
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "suffix"}
CHAT_FIELDS = COMMON_FIELDS | {
    "messages",
    "top_logprobs",
    "max_completion_tokens",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "chat_template",
    "chat_template_kwargs",
    "add_generation_prompt",
    "continue_final_message",
    "mm_processor_kwargs",
}
# what vLLM's beam search (use_beam_search) takes of a request; it refuses the others
BEAM_FIELDS = {
    "model",
    "prompt",
    "messages",
    "n",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "ignore_eos",
    "length_penalty",
    "include_stop_str_in_output",
    "use_beam_search",
    "add_special_tokens",
    "chat_template",
    "chat_template_kwargs",
    "add_generation_prompt",
    "continue_final_message",
    "mm_processor_kwargs",
    "cache_salt",
    "priority",
    "user",
}
# fields taken only at the value that changes nothing, and why others are refused
ONLY_DEFAULT = {"suffix": ((None, ""), "suffix (fill-in-the-middle) is not supported")}


@dataclass
class ParsedRequest:
    """What a request asks for: one engine request per prompt, all with `params`."""

    prompts: list[dict]
    params: SamplingParams
    stream: bool
    include_usage: bool
    echo: bool = False
    echo_only: bool = (
        False  # max_tokens 0 with echo: the prompt back, nothing generated
    )
    tool_choice: tuple[str, str | None] = ("none", None)  # see tool_calls.choice
    beam: BeamSearchParams | None = None  # use_beam_search: serving/beam_api.py


def parse_request(body: dict, chat_request: bool, llm) -> ParsedRequest:
    """A request body as prompts (text and token ids) and SamplingParams; a ValueError
    names the first field that is wrong or not supported."""
    known = CHAT_FIELDS if chat_request else COMPLETION_FIELDS
    unknown = sorted(set(body) - known)
    if unknown:
        raise ValueError(
            f"{unknown[0]} is not supported by this server (nanopaged); the fields "
            f"it takes are {', '.join(sorted(known))}"
        )
    check_priority(body.get("priority"))
    for name, (allowed, reason) in ONLY_DEFAULT.items():
        if body.get(name) not in allowed:
            raise ValueError(f"{name}: {reason}, got {body[name]!r}")
    prompts = chat_prompt(body, llm) if chat_request else completion_prompts(body, llm)
    # vLLM's cache_salt: no cached block shared with another salt's prompts
    if body.get("cache_salt") is not None:
        prompts = [dict(prompt, cache_salt=body["cache_salt"]) for prompt in prompts]
        salted(prompts[0])  # checked now: a 400 if bad
    tools = tool_calls.choice(body) if chat_request else ("none", None)
    params, echo_only = sampling_params(body, chat_request, llm)
    params.structured_outputs = structured_output(body, tools)
    if params.structured_outputs is not None:
        llm.grammars().grammar(params.structured_outputs)  # checked now: a 400 if bad
    longest = max(len(p["prompt_token_ids"]) for p in prompts)
    check_context_length(longest, params, llm.config.max_model_len)
    if body.get("use_beam_search"):
        beam = beam_params(body, params, llm.config.max_model_len - longest)
        return ParsedRequest(prompts, params, False, False, beam=beam)
    if body.get("length_penalty") is not None:
        raise ValueError("length_penalty is beam search's: it needs use_beam_search")
    if body.get("stream") and (params.best_of or params.n) > params.n:
        raise ValueError("best_of cannot be streamed")
    return ParsedRequest(
        prompts,
        params,
        bool(body.get("stream")),
        stream_options(body),
        bool(body.get("echo")),
        echo_only,
        tools,
    )


def beam_params(body: dict, params: SamplingParams, room: int) -> BeamSearchParams:
    """vLLM's beam search for a request: `n` beams of `max_tokens` (else as many as
    the context has `room` for); a field it does not take is refused by name."""
    for name, value in body.items():
        if name not in BEAM_FIELDS and value not in (None, False):
            raise ValueError(
                f"use_beam_search does not take {name} (beam search keeps the beams "
                f"the model's logprobs rank highest)"
            )
    return BeamSearchParams(
        beam_width=params.n,
        max_tokens=params.max_tokens or room,
        ignore_eos=params.ignore_eos,
        temperature=body.get("temperature") or 0.0,
        length_penalty=body.get("length_penalty", 1.0),
        include_stop_str_in_output=params.include_stop_str_in_output,
    )


def structured_output(
    body: dict, tools: tuple[str, str | None]
) -> StructuredOutputsParams | None:
    """The one constraint of the request's text, from OpenAI's `response_format`, vLLM's
    `guided_*` or `structured_outputs` fields, or a tool choice that forces a call."""
    found = []
    response_format = body.get("response_format")
    if response_format is not None:
        found.append(_response_format(response_format))
    guided = {
        ours: body[theirs]
        for theirs, ours in GUIDED_FIELDS.items()
        if body.get(theirs) is not None
    }
    if guided:
        found.append(
            StructuredOutputsParams(
                **guided,
                backend=body.get("guided_decoding_backend"),
                whitespace_pattern=body.get("guided_whitespace_pattern"),
            )
        )
    if body.get("structured_outputs") is not None:
        options = body["structured_outputs"]
        if not isinstance(options, dict) or set(options) - set(
            StructuredOutputsParams.__dataclass_fields__
        ):
            raise ValueError(
                f"structured_outputs must be an object of vLLM's "
                f"StructuredOutputsParams fields, got {options!r}"
            )
        found.append(StructuredOutputsParams(**options))
    found.append(tool_calls.constraint(body, *tools))
    found = [one for one in found if one is not None]
    if len(found) > 1:
        raise ValueError(
            "response_format: give one of response_format, guided_*, "
            "structured_outputs and a forced tool choice"
        )
    return found[0] if found else None


def _response_format(response_format) -> StructuredOutputsParams | None:
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    json_schema = response_format.get("json_schema") if kind == "json_schema" else None
    schema = json_schema.get("schema") if isinstance(json_schema, dict) else None
    if not isinstance(schema, dict):
        raise ValueError(
            f"response_format must be {{'type': 'text'}}, {{'type': "
            f"'json_object'}} or {{'type': 'json_schema', 'json_schema': "
            f"{{'name': ..., 'schema': {{...}}}}}}, got {response_format!r}"
        )
    return StructuredOutputsParams(json=schema)


def completion_prompts(body: dict, llm) -> list[dict]:
    prompt = body.get("prompt")
    if isinstance(prompt, str) or (
        isinstance(prompt, list) and prompt and isinstance(prompt[0], int)
    ):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise ValueError(
            f"prompt must be a string, a list of token ids or a list of those, "
            f"got {prompt!r}"
        )
    special = _flag(body, "add_special_tokens", True)
    prompts = []
    for one in prompt:
        if isinstance(one, str):
            chat.check_text(one, "prompt")
            prompts.append(
                {
                    "prompt": one,
                    "prompt_token_ids": llm.tokenizer.encode(
                        one, add_special_tokens=special
                    ),
                }
            )
        elif isinstance(one, list) and all(isinstance(t, int) for t in one):
            prompts.append({"prompt_token_ids": one})
        else:
            raise ValueError(
                f"prompt must be a string, a list of token ids or a list of those, "
                f"got {one!r}"
            )
    return prompts


def chat_prompt(body: dict, llm) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ValueError(
            f"messages must be a non-empty list of messages, got {messages!r}"
        )
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise ValueError(f"chat_template_kwargs must be an object, got {kwargs!r}")
    tools = body.get("tools")
    if tools is not None and not (
        isinstance(tools, list)
        and all(
            isinstance(t, dict)
            and isinstance(t.get("function"), dict)
            and isinstance(t["function"].get("name"), str)
            for t in tools
        )
    ):
        raise ValueError(
            f"tools must be a list of {{'type': 'function', 'function': {{'name', "
            f"'parameters'}}}} objects, got {tools!r}"
        )
    images_of = getattr(llm, "images", None)  # a vision-language model's reader
    text, token_ids, images = chat.render(
        llm.tokenizer,
        messages,
        body.get("chat_template"),
        _flag(body, "add_generation_prompt", True),
        _flag(body, "continue_final_message", False),
        tools,
        kwargs,
        takes_images=is_multimodal(llm.inputs.config.hf_config),
    )
    if body.get("add_special_tokens"):
        token_ids = llm.tokenizer.encode(text, add_special_tokens=True)
    prompt = {"prompt": text, "prompt_token_ids": token_ids}
    if images:  # read here, off the engine's thread (by data-parallel replicas, there)
        if images_of is not None:
            images = images_of.images_of({"image": images})
        prompt["multi_modal_data"] = {"image": images}
        prompt["mm_processor_kwargs"] = body.get("mm_processor_kwargs")
    return [prompt]


def sampling_params(body: dict, chat_request: bool, llm) -> tuple[SamplingParams, bool]:
    """SamplingParams from the request's fields over the model's default sampling
    settings; and whether the request only echoes its prompt (max_tokens 0)."""
    settings = dict(llm.default_sampling)
    settings.update(
        {
            ours: body[theirs]
            for theirs, ours in SAMPLING_FIELDS.items()
            if body.get(theirs) is not None
        }
    )
    logprobs = body.get("logprobs")
    if chat_request:
        logprobs = (
            (body.get("top_logprobs") or 0) if _flag(body, "logprobs", False) else None
        )
    settings["logprobs"] = logprobs
    if body.get("echo") and logprobs is not None:
        settings["prompt_logprobs"] = (
            logprobs  # echoed prompt tokens come with their logprobs
        )
    settings["logit_bias"] = _logit_bias(body.get("logit_bias"))
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is None:
        max_tokens = None if chat_request else settings.get("max_tokens", 16)
    echo_only = max_tokens == 0 and bool(body.get("echo"))
    settings["max_tokens"] = 1 if echo_only else max_tokens
    return SamplingParams(**settings), echo_only


def check_context_length(
    prompt_tokens: int, params: SamplingParams, max_model_len: int
) -> None:
    """As vLLM: a prompt and max_tokens that cannot fit the context are a 400."""
    total = prompt_tokens + (params.max_tokens or 0)
    if prompt_tokens >= max_model_len or total > max_model_len:
        raise ValueError(
            f"This model's maximum context length is {max_model_len} tokens. "
            f"However, you requested {total} tokens ({prompt_tokens} in the "
            f"messages, {params.max_tokens or 0} in the completion). Please reduce "
            f"the length of the messages or completion."
        )


def stream_options(body: dict) -> bool:
    """Whether a streamed response ends with the usage."""
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict) or set(options) - {
        "include_usage",
        "continuous_usage_stats",
    }:
        raise ValueError(
            f"stream_options must be an object with include_usage, got {options!r}"
        )
    if options.get("continuous_usage_stats"):
        raise ValueError("stream_options: continuous_usage_stats is not supported")
    return bool(options.get("include_usage"))


def _flag(body: dict, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false, got {value!r}")
    return value


def _logit_bias(bias) -> dict[int, float] | None:
    """OpenAI's logit_bias, whose token ids are JSON object keys: strings."""
    if bias is None:
        return None
    if not isinstance(bias, dict):
        raise ValueError(f"logit_bias must map token ids to numbers, got {bias!r}")
    try:
        return {int(token_id): value for token_id, value in bias.items()}
    except ValueError:
        raise ValueError(
            f"logit_bias must have token ids as keys, got {sorted(bias)}"
        ) from None
