"""OpenAI's request and response formats for the server: a request's fields become prompts and
SamplingParams, every field honoured or refused by name; outputs become OpenAI's JSON.

The completions and chat completions requests take OpenAI's fields and vLLM's extra ones, with
vLLM's meanings. A field nanopaged does not implement is a ValueError naming it (a 400), never
silently ignored; `user` (an end-user id for the caller's own records) is the only field taken
and unused.
"""
from dataclasses import dataclass, field

from nanopaged import chat
from nanopaged.outputs import CompletionOutput, Logprob
from nanopaged.sampling_params import SamplingParams

SAMPLING_FIELDS = {  # request field -> SamplingParams field
    "n": "n", "temperature": "temperature", "top_p": "top_p", "seed": "seed", "stop": "stop",
    "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
    "top_k": "top_k", "min_p": "min_p", "repetition_penalty": "repetition_penalty",
    "min_tokens": "min_tokens", "ignore_eos": "ignore_eos", "stop_token_ids": "stop_token_ids",
    "include_stop_str_in_output": "include_stop_str_in_output", "best_of": "best_of",
    "skip_special_tokens": "skip_special_tokens", "prompt_logprobs": "prompt_logprobs",
    "truncate_prompt_tokens": "truncate_prompt_tokens", "allowed_token_ids": "allowed_token_ids",
    "bad_words": "bad_words"}
COMMON_FIELDS = {"model", "stream", "stream_options", "max_tokens", "logprobs", "logit_bias",
                 "echo", "add_special_tokens", "user", *SAMPLING_FIELDS}
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "suffix"}
CHAT_FIELDS = COMMON_FIELDS | {"messages", "top_logprobs", "max_completion_tokens", "tools",
                               "tool_choice", "chat_template", "chat_template_kwargs",
                               "add_generation_prompt", "continue_final_message"}
# fields taken only at the value that changes nothing, and why others are refused
ONLY_DEFAULT = {"suffix": ((None, ""), "suffix (fill-in-the-middle) is not supported"),
                "tool_choice": ((None, "none", "auto"), "tool_choice must be 'none' or 'auto'")}
LOGPROB_FLOOR = -9999.0  # what vLLM reports for -inf: JSON has no infinities


@dataclass
class ParsedRequest:
    """What a request asks for: one engine request per prompt, all with `params`."""
    prompts: list[dict]
    params: SamplingParams
    stream: bool
    include_usage: bool
    echo: bool = False
    echo_only: bool = False  # max_tokens 0 with echo: the prompt back, nothing generated
    prompt_texts: list[str] = field(default_factory=list)


def parse_request(body: dict, chat_request: bool, llm) -> ParsedRequest:
    """A request body as prompts (text and token ids) and SamplingParams; a ValueError names
    the first field that is wrong or not supported."""
    known = CHAT_FIELDS if chat_request else COMPLETION_FIELDS
    unknown = sorted(set(body) - known)
    if unknown:
        raise ValueError(f"{unknown[0]} is not supported by this server (nanopaged); the fields "
                         f"it takes are {', '.join(sorted(known))}")
    for name, (allowed, reason) in ONLY_DEFAULT.items():
        if body.get(name) not in allowed:
            raise ValueError(f"{name}: {reason}, got {body[name]!r}")
    prompts = chat_prompt(body, llm) if chat_request else completion_prompts(body, llm)
    params, echo_only = sampling_params(body, chat_request, llm)
    longest = max(len(p["prompt_token_ids"]) for p in prompts)
    check_context_length(longest, params, llm.config.max_model_len)
    if body.get("stream") and (params.best_of or params.n) > params.n:
        raise ValueError("best_of cannot be streamed")
    return ParsedRequest(prompts, params, bool(body.get("stream")), stream_options(body),
                         bool(body.get("echo")), echo_only)


def completion_prompts(body: dict, llm) -> list[dict]:
    prompt = body.get("prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt
                                   and isinstance(prompt[0], int)):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise ValueError(f"prompt must be a string, a list of token ids or a list of those, "
                         f"got {prompt!r}")
    special = _flag(body, "add_special_tokens", True)
    prompts = []
    for one in prompt:
        if isinstance(one, str):
            chat.check_text(one, "prompt")
            prompts.append({"prompt": one,
                            "prompt_token_ids": llm.tokenizer.encode(one, add_special_tokens=special)})
        elif isinstance(one, list) and all(isinstance(t, int) for t in one):
            prompts.append({"prompt_token_ids": one})
        else:
            raise ValueError(f"prompt must be a string, a list of token ids or a list of those, "
                             f"got {one!r}")
    return prompts


def chat_prompt(body: dict, llm) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"messages must be a non-empty list of messages, got {messages!r}")
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise ValueError(f"chat_template_kwargs must be an object, got {kwargs!r}")
    tools = body.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict)
                                                                   for t in tools)):
        raise ValueError(f"tools must be a list of tool objects, got {tools!r}")
    text, token_ids = chat.render(
        llm.tokenizer, messages, body.get("chat_template"),
        _flag(body, "add_generation_prompt", True), _flag(body, "continue_final_message", False),
        tools if body.get("tool_choice") != "none" else None, kwargs)
    if body.get("add_special_tokens"):
        token_ids = llm.tokenizer.encode(text, add_special_tokens=True)
    return [{"prompt": text, "prompt_token_ids": token_ids}]


def sampling_params(body: dict, chat_request: bool, llm) -> tuple[SamplingParams, bool]:
    """SamplingParams from the request's fields over the model's default sampling settings;
    and whether the request only echoes its prompt (max_tokens 0)."""
    settings = dict(llm.default_sampling)
    settings.update({ours: body[theirs] for theirs, ours in SAMPLING_FIELDS.items()
                     if body.get(theirs) is not None})
    logprobs = body.get("logprobs")
    if chat_request:
        logprobs = (body.get("top_logprobs") or 0) if _flag(body, "logprobs", False) else None
    settings["logprobs"] = logprobs
    if body.get("echo") and logprobs is not None:
        settings["prompt_logprobs"] = logprobs  # echoed prompt tokens come with their logprobs
    settings["logit_bias"] = _logit_bias(body.get("logit_bias"))
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is None:
        max_tokens = None if chat_request else settings.get("max_tokens", 16)
    echo_only = max_tokens == 0 and bool(body.get("echo"))
    settings["max_tokens"] = 1 if echo_only else max_tokens
    return SamplingParams(**settings), echo_only


def check_context_length(prompt_tokens: int, params: SamplingParams, max_model_len: int) -> None:
    """As vLLM: a prompt and max_tokens that cannot fit the context are a 400."""
    total = prompt_tokens + (params.max_tokens or 0)
    if prompt_tokens >= max_model_len or total > max_model_len:
        raise ValueError(f"This model's maximum context length is {max_model_len} tokens. "
                         f"However, you requested {total} tokens ({prompt_tokens} in the "
                         f"messages, {params.max_tokens or 0} in the completion). Please reduce "
                         f"the length of the messages or completion.")


def stream_options(body: dict) -> bool:
    """Whether a streamed response ends with the usage."""
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict) or set(options) - {"include_usage",
                                                         "continuous_usage_stats"}:
        raise ValueError(f"stream_options must be an object with include_usage, got {options!r}")
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
        raise ValueError(f"logit_bias must have token ids as keys, got {sorted(bias)}") from None


# ---- responses ----

def completion_logprobs(entries: list[dict[int, Logprob] | None], token_ids: list[int],
                        top: int, text_offset: int, decode) -> dict:
    """The completions format: each token's text, logprob, the `top` most likely tokens (and
    the token itself) by text, and where its text starts (None logprobs for the prompt's first
    token)."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for token_id, entry in zip(token_ids, entries):
        text = entry[token_id].decoded_token if entry else decode([token_id])
        tokens.append(text)
        token_logprobs.append(entry and max(entry[token_id].logprob, LOGPROB_FLOOR))
        top_logprobs.append(entry and {lp.decoded_token: max(lp.logprob, LOGPROB_FLOOR)
                                       for t, lp in entry.items() if t == token_id or lp.rank <= top})
        offsets.append(text_offset)
        text_offset += len(text or "")
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": offsets}


def chat_logprobs(completion: CompletionOutput, start: int, top: int) -> dict:
    """The chat format of the logprobs of a completion's tokens from `start` on."""
    def item(lp: Logprob) -> dict:
        return {"token": lp.decoded_token, "logprob": max(lp.logprob, LOGPROB_FLOOR),
                "bytes": list(lp.decoded_token.encode())}
    pairs = zip(completion.token_ids[start:], completion.logprobs[start:])
    return {"content": [dict(item(entry[t]), top_logprobs=[
        item(lp) for lp in entry.values() if lp.rank <= top][:top]) for t, entry in pairs]}


def envelope(request_id: str, created: int, model: str, chat_request: bool, choices: list,
             chunk: bool = False, **extra) -> dict:
    kind = ("chat.completion.chunk" if chunk else "chat.completion") if chat_request \
        else "text_completion"
    return {"id": request_id, "object": kind, "created": created, "model": model,
            "choices": choices, **extra}


def usage(outputs: list) -> dict:
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    completion_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_choice(index: int, output, completion: CompletionOutput,
                      parsed: ParsedRequest, decode) -> dict:
    """One choice of a whole completions response; with echo, the prompt (and its logprobs)
    first."""
    text, token_ids = completion.text, completion.token_ids
    logprobs, prefix = completion.logprobs, ""
    if parsed.echo_only:
        text, token_ids, logprobs = "", [], [] if logprobs is not None else None
    if parsed.echo:
        prefix = output.prompt if output.prompt is not None else ""
        token_ids = output.prompt_token_ids + token_ids
        if logprobs is not None:
            logprobs = output.prompt_logprobs + logprobs
    top = parsed.params.logprobs
    return {"index": index, "text": prefix + text, "finish_reason": _finish(completion, parsed),
            "stop_reason": completion.stop_reason,
            "logprobs": None if logprobs is None else completion_logprobs(logprobs, token_ids,
                                                                          top, 0, decode)}


def chat_choice(index: int, completion: CompletionOutput, parsed: ParsedRequest) -> dict:
    return {"index": index, "message": {"role": "assistant", "content": completion.text},
            "finish_reason": completion.finish_reason, "stop_reason": completion.stop_reason,
            "logprobs": completion.logprobs and chat_logprobs(completion, 0,
                                                              parsed.params.logprobs)}


def chunk_choice(index: int, completion: CompletionOutput, parsed: ParsedRequest,
                 chars: int, tokens: int, chat_request: bool, decode, prefix: str = "") -> dict:
    """The choice of a streamed chunk: what `completion` added since `chars` characters and
    `tokens` tokens (a delta may be empty: a character still incomplete)."""
    delta = prefix + completion.text[chars:]
    if chat_request:
        body = {"delta": {"role": "assistant", "content": delta} if chars == tokens == 0
                else {"content": delta} if delta else {}}
        logprobs = completion.logprobs and chat_logprobs(completion, tokens,
                                                         parsed.params.logprobs)
    else:
        body = {"text": delta}
        logprobs = completion.logprobs and completion_logprobs(
            completion.logprobs[tokens:], completion.token_ids[tokens:], parsed.params.logprobs,
            chars, decode)
    return {"index": index, **body, "finish_reason": _finish(completion, parsed),
            "logprobs": logprobs}


def _finish(completion: CompletionOutput, parsed: ParsedRequest) -> str | None:
    return "length" if parsed.echo_only and completion.finish_reason else completion.finish_reason
