"""Structured outputs from a random-weight model are still valid: JSON that parses and
follows its schema, text that matches its regex or grammar, one of the choices; over
many seeds, with n > 1, under preemption and streamed; bad constraints are ValueErrors
naming the problem."""

import json
import re

import jsonschema
import pytest
from conftest import random_prompts

from nanopaged import LLM, SamplingParams
from nanopaged.sampling_params import GuidedDecodingParams, StructuredOutputsParams

pytest.importorskip("llguidance")
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "colour": {"enum": ["red", "green", "blue"]},
        "tags": {
            "type": "array",
            "items": {"type": "string", "maxLength": 5},
            "maxItems": 3,
        },
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 10}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "colour", "tags", "address"],
    "additionalProperties": False,
}
PROMPTS = ["Give me a person as JSON:", "Paged attention", "{"]


@pytest.fixture(scope="module")
def llm(qwen3_path):
    # a random-weight model loops on whitespace wherever JSON allows it: compact JSON
    # ends
    return LLM(
        qwen3_path,
        max_model_len=512,
        kvcache_block_size=16,
        structured_outputs_config={"disable_any_whitespace": True},
    )


def sampled(seed: int, n: int = 1, **constraint) -> SamplingParams:
    return SamplingParams(
        temperature=1.0,
        seed=seed,
        n=n,
        max_tokens=200,
        structured_outputs=StructuredOutputsParams(**constraint),
    )


def texts(outputs) -> list[str]:
    assert all(c.finish_reason == "stop" for o in outputs for c in o.outputs)
    return [c.text for o in outputs for c in o.outputs]


def test_json_follows_its_schema_over_many_seeds_and_samples(llm):
    prompts = PROMPTS * 6
    outputs = llm.generate(
        prompts, [sampled(seed, n=2, json=SCHEMA) for seed in range(18)], use_tqdm=False
    )
    for text in texts(outputs):
        jsonschema.validate(json.loads(text), SCHEMA)
    assert len(set(texts(outputs))) > 20  # random weights, many different valid objects


def test_any_json_object_and_json_whitespace(qwen3_path, llm):
    # any object: its keys and strings have no bound, and a random model may not end one
    outputs = llm.generate(
        PROMPTS * 4, [sampled(s, json_object=True) for s in range(12)], use_tqdm=False
    )
    ended = [c.text for o in outputs for c in o.outputs if c.finish_reason == "stop"]
    assert ended and all(isinstance(json.loads(text), dict) for text in ended)
    for text in texts(
        llm.generate(
            PROMPTS, [sampled(s, json=SCHEMA) for s in range(3)], use_tqdm=False
        )
    ):
        assert (
            json.dumps(json.loads(text), separators=(",", ":"), ensure_ascii=False)
            == text
        )
    # JSON's own whitespace, as vLLM's default; bounded here, so that the model ends its
    # JSON
    spaced = LLM(qwen3_path, max_model_len=512, kvcache_block_size=16)
    params = [sampled(s, json=SCHEMA, whitespace_pattern="[ \n]?") for s in range(6)]
    spaced_texts = texts(spaced.generate(PROMPTS * 2, params, use_tqdm=False))
    for text in spaced_texts:
        jsonschema.validate(json.loads(text), SCHEMA)
    compact = [
        json.dumps(json.loads(t), separators=(",", ":"), ensure_ascii=False)
        for t in spaced_texts
    ]
    assert compact != spaced_texts  # whitespace between the tokens of JSON did appear


@pytest.mark.parametrize(
    "constraint, check",
    [
        (
            dict(regex=r"[0-9]{3}-[a-z]{2,4}"),
            lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", t),
        ),
        (
            dict(choice=["paged", "attention", "blocks"]),
            lambda t: t in ("paged", "attention", "blocks"),
        ),
        (
            dict(grammar='root ::= ("yes" | "no") ", " [a-c]+ "."'),
            lambda t: re.fullmatch(r"(yes|no), [a-c]+\.", t),
        ),
        (
            dict(grammar='start: ("up" | "down") " " NUMBER\nNUMBER: /[0-9]{1,4}/'),
            lambda t: re.fullmatch(r"(up|down) [0-9]{1,4}", t),
        ),
    ],
)
def test_regex_choice_and_grammars_are_followed(llm, constraint, check):
    outputs = llm.generate(
        PROMPTS * 4, [sampled(s, n=2, **constraint) for s in range(12)], use_tqdm=False
    )
    assert all(check(text) for text in texts(outputs))


def test_vllms_guided_decoding_name_and_greedy_requests_beside(
    llm, hf_greedy, qwen3_path
):
    prompts = random_prompts([5, 9], seed=80)
    guided = SamplingParams(
        temperature=0,
        max_tokens=200,
        guided_decoding=GuidedDecodingParams(json=json.dumps(SCHEMA)),
    )
    plain = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    outputs = llm.generate(
        prompts + prompts, [guided, guided, plain, plain], use_tqdm=False
    )
    for output in outputs[:2]:
        jsonschema.validate(json.loads(output.outputs[0].text), SCHEMA)
    assert [o.outputs[0].token_ids for o in outputs[2:]] == hf_greedy(
        qwen3_path, prompts, 10
    )


def test_structured_outputs_under_preemption_and_streamed(qwen3_path):
    """A preempted sequence resumes in its grammar where it was; forks start their
    own."""
    llm = LLM(
        qwen3_path,
        max_model_len=512,
        kvcache_block_size=16,
        num_kvcache_blocks=30,
        structured_outputs_config={"disable_any_whitespace": True},
    )
    prompts = random_prompts([60, 45, 70, 50], seed=81)
    ids = [
        llm.add_request(p, sampled(seed, n=2, json=SCHEMA))
        for seed, p in enumerate(prompts)
    ]
    final, shown = {}, {}
    while not llm.is_finished():
        for output in llm.step():
            for c in output.outputs:
                key = (output.request_id, c.index)
                assert c.text.startswith(shown.get(key, ""))  # text only grows
                shown[key] = c.text
            if output.finished:
                final[output.request_id] = output
    assert llm.engine.scheduler.num_preemptions > 0 and set(final) == set(ids)
    for text in texts(final.values()):
        jsonschema.validate(json.loads(text), SCHEMA)


def nested(depth: int) -> dict:
    schema = {"type": "object"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


def test_min_tokens_does_not_go_with_a_constraint():
    """Rather than a grammar that ends before min_tokens (every token masked, a token
    outside the grammar sampled), the pair is refused: the constraint alone says where
    text ends."""
    with pytest.raises(
        ValueError, match="min_tokens does not go with structured outputs"
    ):
        SamplingParams(
            min_tokens=5, structured_outputs=StructuredOutputsParams(regex="ab")
        )


def test_a_tokenizer_llguidance_cannot_read_is_named_in_words(
    qwen3_path, checkpoint_root
):
    """A tokenizer without a decoder: llguidance says "can't determine decoder type:
    None"."""
    import shutil

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    path = f"{checkpoint_root}/no-decoder"
    shutil.copytree(qwen3_path, path, dirs_exist_ok=True)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator(
        ["paged attention blocks"] * 8,
        trainers.BpeTrainer(
            vocab_size=100, special_tokens=["<eos>"], show_progress=False
        ),
    )
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="<eos>"
    ).save_pretrained(path)
    llm = LLM(path, max_model_len=256)
    params = SamplingParams(structured_outputs=StructuredOutputsParams(regex="ab"))
    with pytest.raises(
        ValueError, match="need a tokenizer that llguidance can read.*decoder"
    ):
        llm.generate(["paged"], params, use_tqdm=False)


def test_a_grammar_that_cannot_finish_ends_by_length(llm):
    params = SamplingParams(
        temperature=1.0,
        seed=3,
        max_tokens=8,
        structured_outputs=StructuredOutputsParams(regex=r"a{50}"),
    )
    [output] = llm.generate(["x"], params, use_tqdm=False)
    completion = output.outputs[0]
    assert completion.finish_reason == "length" and completion.text == "a" * len(
        completion.text
    )


@pytest.mark.parametrize(
    "constraint, message",
    [
        (dict(json='{"type": "objekt"}'), "invalid json.*objekt"),
        (dict(json="{not json"), "the JSON schema is not JSON"),
        (dict(regex="a(b"), "(?s)invalid regex.*unclosed group"),
        (dict(grammar="start: nothing_defined"), "invalid grammar.*nothing_defined"),
        (
            dict(),
            "exactly one of json, regex, choice, grammar and json_object; got none",
        ),
        (dict(choice=[]), r"choice must be a list of strings, got \[\]"),
        (dict(regex="a", choice=["a"]), r"exactly one of .*got \['regex', 'choice'\]"),
        (dict(regex="a", backend="magic"), "backend must be one of"),
        (dict(json=nested(300)), "the JSON schema nests more than 100 levels deep"),
        (
            dict(json='{"items":' * 3000 + "{}" + "}" * 3000),
            "not JSON .or nests too deep",
        ),
        # constraints nothing satisfies: a completion would end at once, empty and not
        # matching
        (
            dict(json={"$ref": "#"}),
            "no text can follow this json: nothing satisfies it",
        ),
        (dict(regex="a[^\\s\\S]b"), "no text can follow this regex"),
        (dict(grammar="start: x\nx: x"), "no text can follow this grammar"),
        # accepted by the parser, but its lexer cannot be built: it would fail at the
        # first token
        (
            dict(regex="a{1000000}"),
            "llguidance cannot follow this regex: lexer error: too many",
        ),
    ],
)
def test_a_bad_constraint_is_a_value_error(llm, constraint, message):
    params = SamplingParams(structured_outputs=StructuredOutputsParams(**constraint))
    with pytest.raises(ValueError, match=message):
        llm.generate(["x"], params, use_tqdm=False)
    assert llm.is_finished() and not llm.requests
    assert llm.generate(["x"], SamplingParams(max_tokens=2), use_tqdm=False)
