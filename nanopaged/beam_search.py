"""vLLM's beam search, `LLM.beam_search(prompts, BeamSearchParams(...))`, above the
engine: it speaks to `LLM.generate` alone (the server's, `serving/beam_api.py`, to its
engine loop).

Each prompt keeps `beam_width` beams, sequences of tokens scored by their cumulative
log-probability. One round is one `generate` call that asks every live beam of every
prompt for a single token with the `2 * beam_width` most likely next tokens and their
logprobs; each such token extends its beam into a candidate, and a prompt keeps its
`beam_width` best candidates. A candidate that ends with EOS (an id that ends
`generate`'s completions: the generation config's, else the model config's, else the
tokenizer's; vLLM takes the tokenizer's), unless `ignore_eos`, is
complete and extends no further; so is a beam that fills `max_model_len`. After
`max_tokens` rounds, or once no beam is live, the complete and the live are ranked
together and the best `beam_width` returned, best first.

A beam's score is its cumulative logprob divided by its length to the power
`length_penalty`, its length counting the prompt and not a final EOS, as in vLLM (and in
transformers, whose beam search keeps the same beams: `tests/test_beam_search.py`).
Each round sends every beam whole, and the prefix cache serves all but its last block:
the cost is a prefill of at most a block per beam per token. The logprobs are the
model's own, before temperature: `temperature` changes which token each round's request
samples (a candidate too, if outside the top `2 * beam_width`), never a score.

As vLLM's offline beam search: a sequence's `tokens` hold the prompt's and the
generated, and its `text` decodes them all.
"""

import dataclasses
from dataclasses import dataclass, field

from nanopaged.outputs import Logprob
from nanopaged.sampling_params import BeamSearchParams, SamplingParams


@dataclass
class BeamSearchSequence:
    """One beam: the prompt's tokens and the generated ones, each generated token's
    logprobs (the candidates it was chosen among), their sum, and once returned its
    text and why it ended ("stop" at EOS, "length" otherwise); what its prompt brought
    besides its tokens goes with it to every round."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    lora_request: object = None
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    multi_modal_data: dict | None = None
    mm_processor_kwargs: dict | None = None
    cache_salt: str | None = None


# what a beam's prompt brings to every round besides its tokens
PROMPT_OPTIONS = ("multi_modal_data", "mm_processor_kwargs", "cache_salt")


@dataclass
class BeamSearchOutput:
    """A prompt's best sequences, best first (at most `beam_width` of them)."""

    sequences: list[BeamSearchSequence]


def score(
    beam: BeamSearchSequence, eos_token_ids: frozenset, length_penalty: float
) -> float:
    """The beam's cumulative logprob over its length (a final EOS not counted) to the
    power `length_penalty`."""
    length = len(beam.tokens) - (beam.tokens[-1] in eos_token_ids)
    return beam.cum_logprob / length**length_penalty


class BeamSearch:
    """The search of a batch of prompts on `llm` (an `LLM` or its replicas: their EOS
    ids and `max_model_len`), round by round, apart from what runs the rounds:
    `next_round()` gives the prompts (and their adapters) to run for one token each
    with `sampling`, `take(outputs)` takes their outputs in that order, and
    `results(decode)` gives each prompt's best once `next_round()` is None. `LLM`'s
    driver is `beam_search` below; the server's runs the rounds on its engine loop."""

    def __init__(self, llm, prompts: list, params: BeamSearchParams, adapters: list):
        if not isinstance(params, BeamSearchParams):
            raise ValueError(
                f"params must be a BeamSearchParams, got {type(params).__name__}"
            )
        self.prompts, self.adapters = prompts, adapters
        self.limit = llm.inputs.config.max_model_len
        self.rounds_left, self.started = params.max_tokens, False
        eos = frozenset() if params.ignore_eos else llm.inputs.eos_token_ids
        self.searches = [Search(params, eos) for _ in prompts]
        self.sampling = SamplingParams(
            max_tokens=1,
            temperature=params.temperature,
            logprobs=2 * params.beam_width,
            ignore_eos=True,
            detokenize=False,
        )

    def next_round(self) -> tuple[list, list] | None:
        """The prompts of the next round and their adapters (the first round: the
        prompts as given; then every live beam), or None: the search is over."""
        if not self.started:
            return self.prompts, self.adapters
        beams = [beam for search in self.searches for beam in search.beams]
        if not self.rounds_left or not beams:
            return None
        return [token_prompt(beam) for beam in beams], [b.lora_request for b in beams]

    def take(self, outputs: list) -> None:
        """The outputs of the round `next_round` gave, in its order."""
        self.rounds_left -= 1
        if not self.started:
            self.started = True
            for prompt, adapter, output, search in zip(
                self.prompts, self.adapters, outputs, self.searches
            ):
                options = prompt if isinstance(prompt, dict) else {}
                start = BeamSearchSequence(
                    list(output.prompt_token_ids),
                    lora_request=adapter,
                    **{key: options.get(key) for key in PROMPT_OPTIONS},
                )
                search.extend([start], [output], self.limit)
            return
        for search in self.searches:
            count = len(search.beams)
            search.extend(search.beams, outputs[:count], self.limit)
            outputs = outputs[count:]

    def results(self, decode) -> list[BeamSearchOutput]:
        """Each prompt's best sequences, their text by `decode` (a tokenizer's)."""
        results = []
        for search in self.searches:
            best = search.best()
            for beam in best:
                beam.text = decode(beam.tokens)
            results.append(BeamSearchOutput(best))
        return results


def beam_search(
    llm,
    prompts: list,
    params: BeamSearchParams,
    adapters: list,
    use_tqdm: bool = False,
) -> list[BeamSearchOutput]:
    """The `params.beam_width` best sequences of each prompt of `prompts` (texts, token
    ids or vLLM's prompt dicts, images among them), each under its LoRA adapter of
    `adapters` (or None), found by `llm` (an `LLM` or its data-parallel replicas)."""
    search = BeamSearch(llm, prompts, params, adapters)
    while (batch := search.next_round()) is not None:
        round_prompts, round_adapters = batch
        shown = use_tqdm and round_prompts is prompts  # the first round's bar alone
        search.take(
            llm.generate(
                round_prompts,
                search.sampling,
                use_tqdm=shown,
                lora_request=round_adapters,
            )
        )
    return search.results(llm.get_tokenizer().decode)


def token_prompt(beam: BeamSearchSequence) -> dict:
    """A beam as the prompt of its next round: its tokens, and what its prompt brought
    (images, their processing, a cache salt)."""
    prompt = {"prompt_token_ids": beam.tokens}
    for key in PROMPT_OPTIONS:
        if getattr(beam, key) is not None:
            prompt[key] = getattr(beam, key)
    return prompt


class Search:
    """One prompt's search: its live `beams` and its `complete` ones."""

    def __init__(self, params: BeamSearchParams, eos: frozenset):
        self.beams: list[BeamSearchSequence] = []
        self.complete: list[BeamSearchSequence] = []
        self.width, self.eos = params.beam_width, eos
        self.key = lambda beam: score(beam, eos, params.length_penalty)

    def extend(self, beams: list, outputs: list, limit: int) -> None:
        """The candidates of one round (each beam of `beams` extended by each token of
        its output's logprobs); the best `width` stay live."""
        candidates = []
        for beam, output in zip(beams, outputs):
            if output.error is not None:  # failed alone (generate warned): it ends
                continue
            logprobs = output.outputs[0].logprobs[0]
            for token, logprob in logprobs.items():
                new = dataclasses.replace(
                    beam,
                    tokens=beam.tokens + [token],
                    logprobs=beam.logprobs + [logprobs],
                    cum_logprob=beam.cum_logprob + logprob.logprob,
                )
                if token in self.eos:
                    new.finish_reason, new.stop_reason = "stop", token
                    self.complete.append(new)
                else:
                    candidates.append(new)
        candidates.sort(key=self.key, reverse=True)
        self.beams = []
        for beam in candidates[: self.width]:
            if len(beam.tokens) >= limit:  # it fills the context: complete
                beam.finish_reason = "length"
                self.complete.append(beam)
            else:
                self.beams.append(beam)

    def best(self) -> list[BeamSearchSequence]:
        """The best `width` of the complete and the live beams, best first."""
        for beam in self.beams:
            beam.finish_reason = "length"
        ranked = sorted(self.complete + self.beams, key=self.key, reverse=True)
        return ranked[: self.width]
