"""What a request gives back, in vLLM's shape (at vLLM's module path): its completions
as they grow, their text decoded a whole character at a time and cut at stop strings,
and their log-probabilities; and the engine's counters."""

import time
from dataclasses import dataclass

import torch
from transformers import PreTrainedTokenizerBase

from nanopaged.core.sequence import Sequence
from nanopaged.sampling_params import SamplingParams


@dataclass
class Logprob:
    """One token's log-probability, its rank in the distribution (1: the most likely)
    and text (None with `detokenize=False`)."""

    logprob: float
    rank: int
    decoded_token: str | None


@dataclass
class CompletionOutput:
    """One completion of a request. `token_ids` keeps a stop token; `text` drops it and
    a stop string unless `include_stop_str_in_output`. `finish_reason` is "stop" (EOS, a
    stop token or string, named by `stop_reason`; None for EOS), "length" or "abort",
    and None while it runs."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Wall-clock times (time.perf_counter) of one request's life; None until they
    happen."""

    arrival_time: float
    first_token_time: float | None = None
    finish_time: float | None = None


@dataclass
class RequestOutput:
    """A request's completions so far (all of them once `finished`). `prompt` is None
    for a prompt given as token ids; `num_cached_tokens` counts prompt tokens the prefix
    cache served. `prompt_logprobs`, when asked for, has an entry per prompt token, None
    for the first. `error` says why a request that failed on its own ended (its
    completions then end with finish_reason "abort"). `weight_version` counts the
    changes of weights before the request came (`rl/control.py`): the weights that made
    it."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int
    metrics: RequestMetrics
    error: str | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    weight_version: int = 0


@dataclass
class EngineStats:
    """A snapshot of the engine's load: what `/metrics` serves."""

    num_unfinished_requests: int
    num_waiting_seqs: int  # not yet prefilled, or preempted
    num_running_seqs: int
    num_free_blocks: int
    num_blocks: int
    num_preemptions: int
    num_generated_tokens: int
    num_drafts: (
        int  # speculative decoding: rows that verified proposals, how many, accepted
    )
    num_proposed_tokens: int
    num_accepted_tokens: int


@dataclass
class TokenLogprobs:
    """The log-probability and 1-based rank of a token, and the most likely tokens'."""

    logprob: float
    rank: int
    top_token_ids: list[int]
    top_logprobs: list[float]


def token_logprobs(
    logits: torch.Tensor, token_ids: list[int], ks: list[int]
) -> list[TokenLogprobs]:
    """logits (R, V), a token per row -> for each row, the log-softmax of its token in
    the model's own distribution, its rank, and the ks[row] most likely tokens'."""
    logprobs = logits.float().log_softmax(dim=-1)  # (R, V)
    # (R, 1)
    chosen = logprobs.gather(1, torch.tensor(token_ids, device=logits.device)[:, None])
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    top = logprobs.topk(max(ks), dim=-1)
    columns = zip(
        chosen[:, 0].tolist(),
        ranks.tolist(),
        top.indices.tolist(),
        top.values.tolist(),
        ks,
    )
    return [
        TokenLogprobs(logprob, rank, top_ids[:k], top_logprobs[:k])
        for logprob, rank, top_ids, top_logprobs, k in columns
    ]


class Detokenizer:
    """The text of one completion, decoded as its tokens come and cut at the first stop
    string.

    Each update decodes a short window only: the tokens since the last whole character,
    after the tokens read before them, starting with the prompt's last few (a tokenizer
    may decode a token differently at the start of a text: SentencePiece drops a leading
    space). The window moves on only when the text grew, so a special token that prints
    nothing never starts it. A character split across tokens waits for its last byte, so
    the text grows by whole characters, and the growth concatenates to the final text.
    While stop strings may still match, the text shown holds back their length less one
    character.
    """

    PROMPT_CONTEXT = (
        5  # prompt tokens decoded before the first completion token, as vLLM
    )

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        params: SamplingParams,
        prompt_token_ids: list[int],
    ):
        self.tokenizer = tokenizer
        self.params = params
        # the window's tokens: the prompt's last few, then the completion's, less a stop
        # token
        self.token_ids = list(prompt_token_ids[-self.PROMPT_CONTEXT :])
        self.prefix_offset, self.read_offset = 0, len(self.token_ids)
        self.num_read = 0  # completion tokens read
        self.text = ""
        self.stop_strings = params.stop_strings
        longest = max((len(s) for s in self.stop_strings), default=0)
        self.held_back = 0 if params.include_stop_str_in_output else max(0, longest - 1)

    def update(
        self, seq: Sequence, end: int | None = None, stop_token: bool = False
    ) -> str | None:
        """Reads the completion tokens of `seq` from where the last call stopped up to
        `end` (None: all); `stop_token`: the last of them is a stop token, which has no
        text. Returns the stop string found, if any (none before `min_tokens`)."""
        new = seq.completion_token_ids[self.num_read : end]
        self.num_read += len(new)
        if new and stop_token and not self.params.include_stop_str_in_output:
            new = new[:-1]
        self.token_ids += new
        if self.read_offset == len(self.token_ids):
            return None  # nothing left to decode
        before = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        after = self._decode(self.token_ids[self.prefix_offset :])
        final = (
            seq.finish_reason is not None and self.num_read == seq.num_completion_tokens
        )
        split = after.endswith("\ufffd") and not final
        if len(after) <= len(before) or split:
            # no whole new character yet (or a special token that prints nothing)
            return None
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        old_length = len(self.text)
        self.text += after[len(before) :]
        if self.num_read < self.params.min_tokens:
            return None
        found = [
            (index, stop)
            for stop in self.stop_strings
            if (index := self.text.find(stop, max(0, old_length - len(stop) + 1))) >= 0
        ]
        if not found:
            return None
        index, stop = min(found)
        self.text = self.text[
            : index + (len(stop) if self.params.include_stop_str_in_output else 0)
        ]
        return stop

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(
            token_ids, skip_special_tokens=self.params.skip_special_tokens
        )

    def visible_text(self, finished: bool) -> str:
        return (
            self.text
            if finished
            else self.text[: max(0, len(self.text) - self.held_back)]
        )


class Request:
    """One request from its arrival to its last output: its n sequences (its samples,
    each with its detokenizer and, when it has a grammar, its matcher) and what they
    produced."""

    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        seqs: list[Sequence],
        tokenizer: PreTrainedTokenizerBase,
        matchers: list | None = None,
    ):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.seqs = seqs
        self.matchers = matchers
        self.tokenizer = tokenizer
        self.metrics = RequestMetrics(arrival_time=time.perf_counter())
        self.detokenizers = [
            Detokenizer(tokenizer, params, prompt_token_ids) for _ in seqs
        ]
        self.num_seen = [0] * len(seqs)  # completion tokens taken note of, per sample
        self.stop_reasons: list[int | str | None] = [None] * len(seqs)
        self.logprobs: list[list[dict[int, Logprob]]] = [[] for _ in seqs]
        self.cumulative_logprobs = [0.0] * len(seqs)
        self.prompt_logprobs: list[dict[int, Logprob] | None] = [None]
        self.error: str | None = None
        self.lora_request = None  # the adapter its samples run with (lora/), if any
        self.weight_version = 0  # the weights' version when it was queued
        # whether each token needs a look (a grammar, logprobs, stop strings), or only
        # the last
        self.each_token = bool(matchers or params.logprobs is not None or params.stop)

    @property
    def finished(self) -> bool:
        return all(seq.finish_reason is not None for seq in self.seqs)

    def take_tokens(
        self, index: int, logprobs: list[TokenLogprobs] | None
    ) -> int | None:
        """Takes note of the tokens sample `index` got in a step: advances its grammar,
        records their logprobs, and looks for a stop string after each. When one ends at
        a token, returns how many completion tokens it keeps (those after it are to be
        dropped, and the sample must end as "stop"); else None."""
        seq = self.seqs[index]
        if self.each_token:
            first = self.num_seen[index]
            self.num_seen[index] = seq.num_completion_tokens
            for j, token_id in enumerate(
                seq.token_ids[seq.num_prompt_tokens + first :]
            ):
                if self._take_token(
                    index, first + j, token_id, logprobs and logprobs[j]
                ):
                    return first + j + 1
        # at a stop token: it is the reason, unless it is EOS
        if seq.finish_reason == "stop":
            last = seq.token_ids[-1]
            self.stop_reasons[index] = (
                last if last in (self.params.stop_token_ids or ()) else None
            )
        return None

    def _take_token(
        self, index: int, position: int, token_id: int, logprobs: TokenLogprobs | None
    ) -> bool:
        """Takes note of token `position` of the completion of sample `index`; True when
        it completes a stop string."""
        seq, detokenizer = self.seqs[index], self.detokenizers[index]
        if self.matchers:
            self.matchers[index].accept(token_id)
        if logprobs is not None:
            self.logprobs[index].append(self._entries(token_id, logprobs))
            self.cumulative_logprobs[index] += logprobs.logprob
        if not detokenizer.stop_strings:
            return False
        stop_token = (
            seq.finish_reason == "stop" and position + 1 == seq.num_completion_tokens
        )
        stop = detokenizer.update(seq, position + 1, stop_token)
        if stop is None:
            return False
        self.stop_reasons[index] = stop
        return True

    def record_prompt_logprobs(self, start: int, logprobs: list[TokenLogprobs]):
        """Takes note of the logprobs of the prompt tokens from `start` on (a prompt
        computed again after a preemption reports each token once)."""
        for position, entry in enumerate(logprobs, start=start):
            if position == len(self.prompt_logprobs):
                self.prompt_logprobs.append(
                    self._entries(self.prompt_token_ids[position], entry)
                )

    def _entries(self, token_id: int, logprobs: TokenLogprobs) -> dict[int, Logprob]:
        """The token's own Logprob, then the most likely tokens', by token id."""
        entries = [(token_id, logprobs.logprob, logprobs.rank)]
        entries += [
            (t, lp, rank)
            for rank, (t, lp) in enumerate(
                zip(logprobs.top_token_ids, logprobs.top_logprobs), start=1
            )
        ]
        decode = self.tokenizer.decode if self.params.detokenize else lambda ids: None
        return {t: Logprob(lp, rank, decode([t])) for t, lp, rank in entries}

    def output(self, with_text: bool = True) -> RequestOutput:
        """The request's completions so far, their text brought up to date."""
        outputs, with_logprobs = [], self.params.logprobs is not None
        for i, (seq, detokenizer) in enumerate(zip(self.seqs, self.detokenizers)):
            if with_text and self.params.detokenize:
                stop_token = seq.finish_reason == "stop" and not isinstance(
                    self.stop_reasons[i], str
                )
                detokenizer.update(seq, None, stop_token)
            outputs.append(
                CompletionOutput(
                    index=i,
                    text=detokenizer.visible_text(seq.finish_reason is not None),
                    token_ids=seq.completion_token_ids,
                    cumulative_logprob=self.cumulative_logprobs[i]
                    if with_logprobs
                    else None,
                    logprobs=list(self.logprobs[i]) if with_logprobs else None,
                    finish_reason=seq.finish_reason,
                    stop_reason=self.stop_reasons[i],
                )
            )
        prompt_logprobs = (
            self.prompt_logprobs if self.params.prompt_logprobs is not None else None
        )
        return RequestOutput(
            self.request_id,
            self.prompt,
            self.prompt_token_ids,
            outputs,
            self.finished,
            self.seqs[0].num_cached_tokens,
            self.metrics,
            self.error,
            prompt_logprobs and list(prompt_logprobs),
            self.weight_version,
        )
