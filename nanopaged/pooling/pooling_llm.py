"""`PoolingLLM`: vLLM's `LLM` over a pooling model (`runner="pooling"`): `embed`,
`classify`, `score` and `encode` instead of `generate`.

A pooling request is one sequence that asks for no token (`max_tokens=0`) and for its
hidden states (`Sequence.hidden_states`): the core prefills it, in chunks when it is
long, beside any other sequence, and ends it once its last token has run. After each
step, `take` folds each chunk's hidden states into its request's `Pooling`; the last
chunk's makes the request's output. Pooling that reads every token (mean, CLS, ...)
cannot be served from the prefix cache, whose blocks hold K/V and no hidden states:
such a sequence gets a `cache_salt` of its own, so that it hits no block; last-token
pooling shares prefixes as generation does.
"""

import itertools
import time

import torch
import torch.nn.functional as F

from nanopaged.checkpoint import checkpoint_architecture
from nanopaged.core.config import Config
from nanopaged.core.sequence import SamplingOptions, Sequence, cdiv
from nanopaged.core.step import SamplerOutput, ScheduledStep
from nanopaged.engine.llm import LLM
from nanopaged.inputs import Prompt, as_batch, salted
from nanopaged.models.pooling import FAMILIES
from nanopaged.outputs import RequestMetrics
from nanopaged.pooling.params import (
    ClassificationOutput,
    ClassificationRequestOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    PoolingOutput,
    PoolingParams,
    PoolingRequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from nanopaged.pooling.pooler import Pooling, lowercase_texts, read_pooler_config
from nanopaged.sampling_params import SamplingParams

# a causal LM run for pooling is built as its family's bare decoder
BODIES = {f"{family}ForCausalLM": f"{family}Model" for family in FAMILIES}


def paired(first: list, second: list, name: str) -> list:
    """The first of each pair of `first` and `second`: one of `first` against each of
    `second`, or pairwise for lists of one length (else a ValueError that `name`
    pairs them so)."""
    if len(first) not in (1, len(second)) or not second:
        raise ValueError(
            f"{name} pairs one input with many, or lists of one length; got "
            f"{len(first)} and {len(second)}"
        )
    return first * len(second) if len(first) == 1 else first


class PoolingRequest:
    """One input to pool, from its arrival to its output: its sequence, its `Pooling`,
    and (once its last token ran) its `result`."""

    def __init__(self, request_id, token_ids, params: PoolingParams, pooling: Pooling):
        self.request_id, self.params, self.pooling = request_id, params, pooling
        self.prompt_token_ids = token_ids
        seq = Sequence(token_ids, SamplingOptions(max_tokens=0))
        seq.hidden_states = True
        self.seqs = [seq]
        self.metrics = RequestMetrics(arrival_time=time.perf_counter())
        self.result: torch.Tensor | None = None
        self.error: str | None = None

    @property
    def finished(self) -> bool:
        return self.seqs[0].finish_reason is not None

    def output(self, with_text: bool = True) -> PoolingRequestOutput:
        """The output its task makes of its result (None while it runs, or after a
        failure)."""
        task, result = self.params.task, self.result
        kind, outputs = PoolingRequestOutput, None
        if result is not None and self.error is None:
            if task == "embed":
                kind, outputs = EmbeddingRequestOutput, EmbeddingOutput(result.tolist())
            elif task == "classify":
                kind = ClassificationRequestOutput
                outputs = ClassificationOutput(result.tolist())
            elif task == "score":
                kind, outputs = ScoringRequestOutput, ScoringOutput(result.item())
            else:
                outputs = PoolingOutput(result)
        return kind(
            self.request_id,
            outputs,
            self.prompt_token_ids,
            self.finished,
            self.seqs[0].num_cached_tokens,
            self.metrics,
            self.error,
        )


class PoolingLLM(LLM):
    """The engine of a pooling model: `embed` (any pooling checkpoint), `classify` and
    cross-encoder `score` (a `*ForSequenceClassification`), `score` of two embeddings'
    cosine (an embedding model), `encode` (vLLM's raw outputs). Requests can also be
    run a step at a time: `add_request(prompt, PoolingParams(task=...))`, then
    `step()`. Bad input is a ValueError before anything is queued, as for generation."""

    runner_type = "pooling"
    progress = "Pooling"
    params_types = (PoolingParams, SamplingParams)

    def __init__(self, model: str = "Qwen/Qwen3-0.6B", **options):
        super().__init__(model, **options)
        # a classifier's head, applied here to each pooled vector: the model's own
        # layer (`SequenceClassifier.score`), on the runner that owns the weights
        self.score_head = self.engine.runner.model.score if self.classifier else None
        if self.pooler.lowercase:
            lowercase_texts(self.tokenizer)

    def prepare(self, config: Config, surface: dict) -> None:
        """Reads how the checkpoint pools; a causal LM is built as its bare decoder."""
        for option in ("speculative_config", "enable_lora"):
            if surface[option]:
                raise ValueError(f"runner='pooling' does not support {option}")
        architecture = checkpoint_architecture(config.hf_config)
        self.classifier = architecture.endswith("ForSequenceClassification")
        if architecture.endswith("ForCausalLM"):
            if architecture not in BODIES:
                raise ValueError(
                    f"runner='pooling' pools the families {', '.join(FAMILIES)}; "
                    f"{architecture} is not one of them"
                )
            config.hf_config.architectures = [BODIES[architecture]]
        self.pooler = read_pooler_config(
            config.model, config.hf_config, surface["pooler_config"]
        )
        if self.pooler.max_seq_length:  # Sentence Transformers' longest input
            config.max_model_len = min(config.max_model_len, self.pooler.max_seq_length)
        task = surface["task"]
        if task == "classify" and not self.classifier:
            raise ValueError(
                f"task='classify' needs a *ForSequenceClassification checkpoint; "
                f"{architecture} has no classifier head"
            )
        self.default_task = "classify" if self.classifier else "embed"
        if task in ("embed", "classify"):
            self.default_task = task
        self.salts = itertools.count(1 << 62)  # a cache_salt no adapter hash takes

    # ---- requests in ----

    def make_request(
        self,
        prompt: Prompt,
        params: PoolingParams | None,
        request_id: str | None = None,
        lora_request=None,
    ) -> PoolingRequest:
        """A checked request to pool `prompt` (a ValueError names what is wrong)."""
        if lora_request is not None:
            raise ValueError("runner='pooling' does not run LoRA adapters")
        params = self._checked(params)
        salt = salted(prompt)
        token_ids = self._tokenize(prompt, params.task != "classify")
        token_ids = token_ids[-(params.truncate_prompt_tokens or len(token_ids)) :]
        request = self._request(token_ids, params, request_id)
        if request.seqs[0].cache_salt is None:  # else it shares no block anyway
            request.seqs[0].cache_salt = salt
        return request

    def _tokenize(self, prompt: Prompt, with_prompt: bool) -> list[int]:
        """The token ids of an input; a text as Sentence Transformers renders it:
        after the checkpoint's default prompt (`with_prompt`), or as a chat."""
        is_text = isinstance(prompt, dict) and set(prompt) == {"prompt"}
        text = prompt["prompt"] if is_text else prompt
        if not isinstance(text, str):
            return self.inputs.tokenize(prompt)[1]
        self.inputs.tokenize(text)  # its checks
        before = self.pooler.prompt if with_prompt else ""
        if not self.pooler.chat:
            return self.inputs.tokenize(before + text)[1]
        return self._render_chat(before, [("user", text)])

    def _render_chat(self, system: str, turns: list[tuple[str, str]]) -> list[int]:
        """The token ids of a chat of (role, text) turns, after `system` as the system
        message (if any), as Sentence Transformers renders its "message" inputs."""
        messages = [{"role": "system", "content": system}] if system else []
        messages += [{"role": role, "content": text} for role, text in turns]
        return self.tokenizer.apply_chat_template(
            messages, tokenize=True, add_generation_prompt=False, return_dict=True
        )["input_ids"]

    def _request(self, token_ids, params, request_id) -> PoolingRequest:
        config = self.config
        if len(token_ids) > config.max_model_len:
            raise ValueError(
                f"input has {len(token_ids)} tokens, more than "
                f"max_model_len={config.max_model_len}"
            )
        blocks = cdiv(len(token_ids), config.kvcache_block_size)
        if blocks > self.inputs.num_blocks:
            raise ValueError(
                f"input needs {blocks} KV-cache blocks ({len(token_ids)} tokens) but "
                f"the pool has only {self.inputs.num_blocks}"
            )
        mode = "all" if params.task == "token_embed" else self.pooler.mode
        if self.classifier and params.task in ("classify", "score"):
            mode = "lasttoken"  # as transformers' *ForSequenceClassification
        request = PoolingRequest(
            self.inputs.request_id(request_id, self.requests),
            token_ids,
            params,
            Pooling(mode, len(token_ids)),
        )
        if request.pooling.needs_every_token:
            request.seqs[0].cache_salt = next(self.salts)
        return request

    def _checked(self, params, task: str | None = None) -> PoolingParams:
        """A copy of `params` (None: the defaults) with `task` (else theirs, else the
        model's), checked against the model."""
        if isinstance(params, SamplingParams):
            raise ValueError(
                "this engine pools (runner='pooling'): it takes PoolingParams, and "
                "cannot generate"
            )
        params = PoolingParams() if params is None else params
        if not isinstance(params, PoolingParams):
            raise ValueError(
                f"pooling_params must be PoolingParams, got {type(params).__name__}"
            )
        params = params.clone()
        params.task = task or params.task or self.default_task
        params.validate()
        task = params.task
        if task == "classify" and not self.classifier:
            raise ValueError(
                "classify() needs a *ForSequenceClassification checkpoint; this one "
                "embeds"
            )
        if task == "score" and not self.classifier:
            raise ValueError(
                "task='score' needs a *ForSequenceClassification checkpoint (a "
                "cross-encoder); this one embeds: score() compares two embeddings"
            )
        if task == "score" and self.num_labels != 1:
            raise ValueError(
                f"score() needs a classifier of one label; this one has "
                f"{self.num_labels}"
            )
        if params.dimensions is not None:
            self._check_dimensions(params.dimensions, task)
        return params

    def _check_dimensions(self, dimensions: int, task: str) -> None:
        allowed, size = self.pooler.dimensions, self.config.hf_config.hidden_size
        if task != "embed":
            raise ValueError(f"dimensions cuts embeddings; {task}() has none to cut")
        if allowed is None:
            raise ValueError(
                "this model does not support Matryoshka representation: its "
                "embeddings cannot be cut to dimensions"
            )
        if dimensions > size or (allowed and dimensions not in allowed):
            raise ValueError(
                f"dimensions={dimensions} is not one the model gives: "
                f"{allowed or f'1 to {size}'}"
            )

    @property
    def num_labels(self) -> int:
        return self.config.hf_config.num_labels

    # ---- steps ----

    def take(self, step: ScheduledStep, sampled: SamplerOutput) -> list:
        """Folds each pooling sequence's rows of the step's hidden states into its
        request; finishes those whose last token ran. Returns the requests that got
        rows, in the step's order; a request whose pooling fails ends alone."""
        advanced, first = {}, 0
        for i, seq in enumerate(step.seqs):
            count = step.num_tokens[i] + len(step.proposals.get(i, ()))
            rows, first = sampled.hidden_states[first : first + count], first + count
            if seq not in self.owners:
                continue
            request = self.owners[seq][0]
            advanced[request] = None
            try:
                request.pooling.add(rows[: step.num_tokens[i]], step.starts[i])
                if seq.finish_reason is not None and request.error is None:
                    request.result = self._finish(request)
                    request.metrics.finish_time = time.perf_counter()
            except Exception as error:
                self._fail(request, error)
        return list(advanced)

    def _finish(self, request: PoolingRequest) -> torch.Tensor:
        """The request's result, from its pooled vector, as its task asks (on the
        CPU)."""
        params, pooled = request.params, request.pooling.result()
        activation = params.use_activation is not False
        if params.task in ("classify", "score") and self.classifier:
            head = self.score_head
            logits = head(pooled.to(head.weight.dtype)).float()
            if not activation:
                result = logits
            elif params.task == "score" or self.num_labels == 1:
                result = logits.sigmoid()
            else:
                result = logits.softmax(-1)
            return (result[0] if params.task == "score" else result).cpu()
        if params.dimensions is not None:
            pooled = pooled[..., : params.dimensions]
        normalize = params.normalize
        if normalize is None:
            normalize = self.pooler.normalize and params.use_activation is not False
        return (F.normalize(pooled, dim=-1) if normalize else pooled).cpu()

    def generate(self, *args, **kwargs):
        raise ValueError(
            "this engine pools (runner='pooling'): it cannot generate; use embed(), "
            "classify(), score() or encode(), or LLM(model, runner='generate') with "
            "a checkpoint that has an LM head"
        )

    # ---- whole batches ----

    def encode(
        self,
        prompts: Prompt | list[Prompt],
        pooling_params: PoolingParams | list[PoolingParams] | None = None,
        use_tqdm: bool = True,
        pooling_task: str | None = None,
    ) -> list[PoolingRequestOutput]:
        """Pools every prompt with its params (`pooling_task` sets each one's task: by
        default the model's, "embed" or "classify"; "token_embed" gives every token's
        hidden state); returns one output per prompt, in order."""
        self._check_idle("encode")
        prompts, params = as_batch(prompts, pooling_params)
        params = [self._checked(p, pooling_task) for p in params]
        requests = [self.make_request(p, sp) for p, sp in zip(prompts, params)]
        return self.run_requests(requests, use_tqdm)

    def embed(self, prompts, pooling_params=None, use_tqdm: bool = True) -> list:
        """The embedding of every prompt (`outputs.embedding`), in order."""
        return self.encode(prompts, pooling_params, use_tqdm, "embed")

    def classify(self, prompts, pooling_params=None, use_tqdm: bool = True) -> list:
        """The class probabilities of every prompt (`outputs.probs`), in order."""
        return self.encode(prompts, pooling_params, use_tqdm, "classify")

    def score(
        self,
        data_1: Prompt | list[Prompt],
        data_2: Prompt | list[Prompt],
        pooling_params: PoolingParams | None = None,
        use_tqdm: bool = True,
    ) -> list[ScoringRequestOutput]:
        """The score of each pair: `data_1` against each of `data_2` (one against many,
        or pairwise for lists of one length). A classifier scores the pair as one input
        (the sigmoid of its one logit, a cross-encoder); an embedding model, the cosine
        of their embeddings."""
        self._check_idle("score")
        first, second = as_batch(data_1, None)[0], as_batch(data_2, None)[0]
        if self.classifier:
            params = self._checked(pooling_params, "score")
            pairs = zip(paired(first, second, "score()"), second)
            requests = [self.make_request(self.pair_prompt(*p), params) for p in pairs]
            return self.run_requests(requests, use_tqdm)
        paired(first, second, "score()")  # its check
        params = self._checked(pooling_params, "embed")
        # each input embedded once, also one against many
        requests = [self.make_request(p, params) for p in first + second]
        outputs = self.run_requests(requests, use_tqdm)
        queries = paired(outputs[: len(first)], second, "score()")
        return [self._cosine(a, b) for a, b in zip(queries, outputs[len(first) :])]

    def pair_prompt(self, a: Prompt, b: Prompt) -> dict:
        """A pair as one input of a classifier (a cross-encoder), as Sentence
        Transformers' `CrossEncoder` renders it: two texts after the default prompt, as
        a chat of a "query" and a "document" where the checkpoint declares chats, else
        as the tokenizer joins a pair; token ids, the first's then the second's."""
        ids = [self.inputs.tokenize(p) for p in (a, b)]  # their checks
        texts = [text for text, _ in ids]
        if any(text is None for text in texts):
            return {"prompt_token_ids": ids[0][1] + ids[1][1]}
        prompt = self.pooler.prompt
        if self.pooler.chat:
            turns = [("query", texts[0]), ("document", texts[1])]
            return {"prompt_token_ids": self._render_chat(prompt, turns)}
        return {
            "prompt_token_ids": self.tokenizer(prompt + texts[0], texts[1])["input_ids"]
        }

    @staticmethod
    def _cosine(a: PoolingRequestOutput, b: PoolingRequestOutput):
        error = a.error or b.error
        score = None
        if error is None:
            x, y = (torch.tensor(o.outputs.embedding) for o in (a, b))
            score = ScoringOutput(F.cosine_similarity(x, y, dim=0).item())
        return ScoringRequestOutput(
            f"{a.request_id}-{b.request_id}",
            score,
            a.prompt_token_ids + b.prompt_token_ids,
            True,
            a.num_cached_tokens + b.num_cached_tokens,
            a.metrics,
            error,
        )
