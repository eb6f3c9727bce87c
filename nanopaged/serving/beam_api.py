"""vLLM's beam search on the server (`"use_beam_search": true` in a completions or chat
request): the rounds of `beam_search.BeamSearch` run as engine requests beside everyone
else's, each round one `Response` of the whole batch of live beams; the answer is
OpenAI's JSON with the `n` best sequences of each prompt, best first, their text the
generated tokens' (a final EOS apart), as vLLM's server gives them. Not streamed."""

from fastapi.responses import JSONResponse

from nanopaged.beam_search import BeamSearch, BeamSearchSequence
from nanopaged.serving.openai_api import ParsedRequest
from nanopaged.serving.openai_responses import Response


async def respond(response: Response) -> dict | JSONResponse:
    """The answer to `response`'s request, whose `parsed.beam` holds its beam search."""
    llm, parsed = response.engine.llm, response.parsed
    adapters = [response.lora_request] * len(parsed.prompts)
    search = BeamSearch(llm, parsed.prompts, parsed.beam, adapters)
    while (batch := search.next_round()) is not None:
        round_ = Response(
            response.request,
            response.engine,
            ParsedRequest(batch[0], search.sampling, False, False),
            response.chat,
            response.model_name,
            response.lora_request,
        )
        outputs = await round_.run()
        if isinstance(outputs, JSONResponse):
            return outputs
        search.take(outputs)
    prompt_lengths = [len(p["prompt_token_ids"]) for p in parsed.prompts]
    choices, completion_tokens = [], 0
    for results, length in zip(search.results(llm.tokenizer.decode), prompt_lengths):
        for beam in results.sequences:
            generated = beam.tokens[length:]
            completion_tokens += len(generated)
            text = text_of(beam, generated, llm.tokenizer.decode, parsed)
            choices.append(choice(len(choices), beam, text, response.chat))
    prompt_tokens = sum(prompt_lengths)
    return response.envelope(
        choices,
        usage={
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    )


def text_of(beam: BeamSearchSequence, generated: list[int], decode, parsed) -> str:
    """A beam's generated text: its final EOS left out unless the request keeps stop
    strings."""
    if beam.finish_reason == "stop" and not parsed.beam.include_stop_str_in_output:
        generated = generated[:-1]
    return decode(generated, skip_special_tokens=True)


def choice(index: int, beam: BeamSearchSequence, text: str, chat: bool) -> dict:
    answer = (
        {"message": {"role": "assistant", "content": text}} if chat else {"text": text}
    )
    return {
        "index": index,
        **answer,
        "logprobs": None,
        "finish_reason": beam.finish_reason,
        "stop_reason": beam.stop_reason,
    }
