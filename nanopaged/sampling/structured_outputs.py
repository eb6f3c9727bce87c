"""Structured outputs: completions that follow a JSON schema, any JSON object, a regular
expression, a choice among strings, or a grammar (GBNF or Lark), as vLLM's
`StructuredOutputsParams` (formerly `GuidedDecodingParams`) asks. JSON may hold any of
JSON's whitespace, as in vLLM, unless `disable_any_whitespace` (per request, or the
engine's `structured_outputs_config`) or a `whitespace_pattern` bounds it: a model that
loops on whitespace then still ends its JSON. An object that lists its properties takes
no others unless its schema says so, as vLLM's default backend (xgrammar, in strict
mode) has it.

Each sequence that asks carries its own llguidance matcher as a logits processor (a seam
of the core's sampler): before a step samples, the rows with a matcher get the bitmask
of the tokens their grammar allows next, and every token a sequence gets advances its
matcher. llguidance rather than xgrammar (the two libraries vLLM and SGLang use):
measured on this engine, with a 32k-token vocabulary, it built a 60-field schema's
matcher in 5 ms where xgrammar compiled it in 335 ms, and filled the masks of 64
sequences in 2.4 ms a step where xgrammar took 5.0 ms. Grammars are cached by their
text; the llguidance tokenizer is built on the first request that asks for a grammar, so
that the others never pay for any of this.
"""

import functools
import json
import threading
from collections import OrderedDict

import llguidance
import llguidance.hf
import llguidance.numpy
import torch
from transformers import PreTrainedTokenizerBase

from nanopaged.core.sequence import Sequence
from nanopaged.sampling_params import StructuredOutputsParams

# vLLM's backend names: each is taken as a hint; llguidance enforces every kind of
# constraint
BACKENDS = (
    None,
    "auto",
    "guidance",
    "llguidance",
    "xgrammar",
    "outlines",
    "lm-format-enforcer",
)
CACHE_SIZE = 256  # grammars kept, by their text
MAX_SCHEMA_DEPTH = (
    100  # a JSON schema nesting deeper is refused (llguidance recurses over it)
)
SIMULATED_TOKENS = (
    3  # tokens a grammar is walked at intake, to refuse one no text can follow
)


def constraint(spec: StructuredOutputsParams, defaults: dict) -> tuple[str, str]:
    """The one constraint of `spec`, as (llguidance's format, its text), with the
    engine's `structured_outputs_config` as `defaults`; a ValueError names what is wrong
    with it."""
    given = [
        name
        for name in ("json", "regex", "choice", "grammar", "json_object")
        if getattr(spec, name) not in (None, False)
    ]
    if len(given) != 1:
        raise ValueError(
            f"structured outputs take exactly one of json, regex, choice, grammar "
            f"and json_object; got {given or 'none'}"
        )
    if spec.backend not in BACKENDS:
        raise ValueError(
            f"structured outputs backend must be one of {BACKENDS[1:]}, got "
            f"{spec.backend!r}"
        )
    kind = given[0]
    if kind in ("json", "json_object"):
        schema = {"type": "object"} if kind == "json_object" else spec.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except (json.JSONDecodeError, RecursionError) as error:
                raise ValueError(
                    f"structured outputs: the JSON schema is not JSON (or nests "
                    f"too deep): {error}"
                ) from None
        if not isinstance(schema, dict):
            raise ValueError(
                f"structured outputs: a JSON schema must be an object, got {schema!r}"
            )
        if _depth(schema) > MAX_SCHEMA_DEPTH:
            raise ValueError(
                f"structured outputs: the JSON schema nests more than "
                f"{MAX_SCHEMA_DEPTH} levels deep"
            )
        schema = _closed(schema)
        if spec.whitespace_pattern is not None:
            whitespace = {"whitespace_pattern": spec.whitespace_pattern}
        else:  # JSON's whitespace, or none at all
            whitespace = {
                "whitespace_flexible": not (
                    spec.disable_any_whitespace
                    or defaults.get("disable_any_whitespace")
                )
            }
        return "json", json.dumps(dict(schema, **{"x-guidance": whitespace}))
    if kind == "choice":
        if (
            not isinstance(spec.choice, list)
            or not spec.choice
            or not all(isinstance(c, str) for c in spec.choice)
        ):
            raise ValueError(
                f"structured outputs: choice must be a list of strings, got "
                f"{spec.choice!r}"
            )
        return "choice", json.dumps(spec.choice)
    text = getattr(spec, kind)
    if not isinstance(text, str):
        raise ValueError(f"structured outputs: {kind} must be a string, got {text!r}")
    return kind, text


def _depth(value) -> int:
    """How deep a JSON value nests, found without recursion (a deep one would exhaust
    the stack), and not beyond MAX_SCHEMA_DEPTH + 1."""
    deepest, stack = 0, [(value, 1)]
    while stack and deepest <= MAX_SCHEMA_DEPTH:
        value, depth = stack.pop()
        deepest = max(deepest, depth)
        children = (
            value.values()
            if isinstance(value, dict)
            else value
            if isinstance(value, list)
            else ()
        )
        stack.extend((child, depth + 1) for child in children)
    return deepest


def _closed(schema):
    """The schema with every object that lists its properties and says nothing of others
    taking no others, as vLLM's default backend (xgrammar, strict) reads schemas."""
    if isinstance(schema, list):
        return [_closed(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    closed = {key: _closed(value) for key, value in schema.items()}
    if "properties" in closed and "additionalProperties" not in closed:
        closed["additionalProperties"] = False
    return closed


class Grammars:
    """The grammars of one engine's requests: llguidance's view of the tokenizer, built
    on the first use, and each grammar, checked once and cached by its text.
    Thread-safe, so that the server can prepare a request's grammar outside the engine
    loop."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        vocab_size: int,
        eos_token_ids: frozenset[int],
        defaults: dict,
    ):
        self.hf_tokenizer, self.vocab_size, self.defaults = (
            tokenizer,
            vocab_size,
            defaults,
        )
        self.eos_token_ids = sorted(eos_token_ids)
        self.tokenizer = None
        self.cache: OrderedDict[tuple[str, str], str] = OrderedDict()
        self.lock = threading.Lock()

    def grammar(self, spec: StructuredOutputsParams) -> str:
        """The checked llguidance grammar of `spec` (a ValueError names what is
        wrong)."""
        key = constraint(spec, self.defaults)
        with self.lock:
            if self.tokenizer is None:
                try:
                    self.tokenizer = llguidance.hf.from_tokenizer(
                        self.hf_tokenizer,
                        n_vocab=self.vocab_size,
                        eos_token=self.eos_token_ids,
                    )
                except Exception as error:
                    raise ValueError(
                        f"structured outputs need a tokenizer that llguidance can "
                        f"read, a fast tokenizer whose tokenizer.json has a "
                        f"byte-level or SentencePiece decoder; this one is not "
                        f"({type(error).__name__}: {error})"
                    ) from None
            if key in self.cache:
                self.cache.move_to_end(key)
                return self.cache[key]
        try:
            grammar = llguidance.grammar_from(*key)
        except (ValueError, RuntimeError) as error:
            raise ValueError(f"structured outputs: invalid {key[0]}: {error}") from None
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            grammar, self.tokenizer
        )
        if failed:
            raise ValueError(
                f"structured outputs: invalid {key[0]}: {'; '.join(messages)}"
            )
        self._check_followable(key[0], grammar)
        with self.lock:
            self.cache[key] = grammar
            if len(self.cache) > CACHE_SIZE:
                self.cache.popitem(last=False)
        return grammar

    def _check_followable(self, kind: str, grammar: str) -> None:
        """Walks the grammar a few tokens (the lowest one allowed at each) and refuses
        it, a ValueError, when no text can follow it at all (a schema that only refers
        to itself, an empty character class, a rule `x: x`) or llguidance cannot build
        its lexer (a regex of a million states): such a request would end at once with
        empty text, or fail midway."""
        matcher = llguidance.LLMatcher(self.tokenizer, grammar)
        for _ in range(SIMULATED_TOKENS):
            bitmask = llguidance.numpy.allocate_token_bitmask(1, self.vocab_size)
            llguidance.numpy.fill_next_token_bitmask(matcher, bitmask)
            if matcher.is_error():
                break
            allowed = torch.nonzero(
                _unpack(torch.from_numpy(bitmask), self.vocab_size)[0]
            )
            token = next(
                (t for t in allowed.flatten().tolist() if t not in self.eos_token_ids),
                None,
            )
            if token is None:
                return  # the text may end here
            matcher.consume_token(token)
            if matcher.is_error():
                break
        else:
            return
        reason = matcher.get_error().split("\n")[0]
        if reason == "NoExtensionBias":
            raise ValueError(
                f"structured outputs: no text can follow this {kind}: nothing "
                f"satisfies it"
            )
        raise ValueError(
            f"structured outputs: llguidance cannot follow this {kind}: {reason}"
        )

    def matchers(self, spec: StructuredOutputsParams, count: int) -> list["Matcher"]:
        """A matcher for each of the `count` samples of a request."""
        grammar = self.grammar(spec)
        return [
            Matcher(llguidance.LLMatcher(self.tokenizer, grammar)) for _ in range(count)
        ]


class Matcher:
    """Where one sequence is in its grammar; as a logits processor (see `Sampler`), it
    masks the tokens the grammar does not allow next."""

    def __init__(self, matcher: "llguidance.LLMatcher"):
        self.matcher = matcher

    def accept(self, token_id: int) -> None:
        """Advances over the token the sequence got (which the mask allowed)."""
        if not self.matcher.consume_token(token_id):
            raise ValueError(
                f"the grammar refused token {token_id}: {self.matcher.get_error()}"
            )

    @classmethod
    def apply(
        cls, logits: torch.Tensor, matchers: list["Matcher"], seqs: list[Sequence]
    ) -> torch.Tensor:
        """logits (R, V) float32, a row per matcher -> each row keeps only the tokens
        its grammar allows next."""
        bitmask = llguidance.numpy.allocate_token_bitmask(
            len(matchers), logits.shape[1]
        )
        # on all cores; on a GPU this runs while the forward that made `logits` still
        # does
        llguidance.numpy.fill_next_token_bitmask_par(
            _executor(), [(m.matcher, r) for r, m in enumerate(matchers)], bitmask
        )
        allowed = _unpack(torch.from_numpy(bitmask).to(logits.device), logits.shape[1])
        return logits.masked_fill_(~allowed, float("-inf"))


def _unpack(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(R, W) int32 words, bit i of word w for token 32w + i -> (R, vocab_size) bool,
    the tokens allowed. Plain torch, not llguidance.torch's kernel: that one imports and
    runs torch.compile, seconds on a server's first structured request."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    return bits.flatten(1)[:, :vocab_size].bool()


@functools.cache
def _executor() -> "llguidance.LLExecutor":
    return llguidance.LLExecutor()
