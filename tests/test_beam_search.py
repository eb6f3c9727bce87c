"""vLLM's beam search (nanopaged/beam_search.py): the beams of transformers' beam search
on the same weights, their cumulative logprobs its forward's; EOS, `length_penalty` and
`max_model_len` as the module says, checked against a plain search written here on
transformers' logprobs; images carried by every beam; bad input refused."""

import dataclasses
import json
import os
import shutil

import pytest
import torch
from conftest import random_prompts

from nanopaged import LLM, SamplingParams
from nanopaged.beam_search import BeamSearchSequence, score
from nanopaged.sampling_params import BeamSearchParams

PROMPTS = random_prompts([21, 7], seed=80)


def hf_beams(model, prompt: list[int], width: int, max_tokens: int, penalty: float):
    """transformers' beam search, never ending at EOS: the generated tokens of its
    `width` best, best first."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            num_beams=width,
            num_return_sequences=width,
            max_new_tokens=max_tokens,
            do_sample=False,
            length_penalty=penalty,
            eos_token_id=None,
            pad_token_id=0,
        )
    return [row[len(prompt) :].tolist() for row in out]


def hf_logprobs(model, tokens: list[int]) -> torch.Tensor:
    """transformers' log-softmax of each next token of `tokens` (float64)."""
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0].double()
    return torch.log_softmax(logits, -1)


@pytest.mark.parametrize("width,penalty", [(1, 1.0), (3, 1.0), (4, 0.5)])
def test_beams_are_transformers_beam_search(qwen3_path, hf_model, width, penalty):
    llm = LLM(qwen3_path, max_model_len=256, kvcache_block_size=16)
    params = BeamSearchParams(
        width, max_tokens=8, ignore_eos=True, length_penalty=penalty
    )
    outputs = llm.beam_search(PROMPTS, params)
    model = hf_model(qwen3_path)
    for prompt, output in zip(PROMPTS, outputs):
        got = [beam.tokens[len(prompt) :] for beam in output.sequences]
        assert got == hf_beams(model, prompt, width, 8, penalty)
        for beam in output.sequences:
            assert beam.tokens[: len(prompt)] == prompt
            logprobs = hf_logprobs(model, beam.tokens)
            expected = sum(
                logprobs[i - 1, beam.tokens[i]].item()
                for i in range(len(prompt), len(beam.tokens))
            )
            assert beam.cum_logprob == pytest.approx(expected, abs=1e-4)
            assert beam.finish_reason == "length"
            # each token chosen among its beam's 2 * width most likely
            assert [len(candidates) for candidates in beam.logprobs] == [2 * width] * 8
            assert all(
                beam.tokens[len(prompt) + i] in c for i, c in enumerate(beam.logprobs)
            )
            assert beam.text == llm.get_tokenizer().decode(beam.tokens)
    # one prompt at a time, as concurrency_limit=1 asks: the same beams; and at a
    # temperature, which changes what each round samples, not the scores
    hot = dataclasses.replace(params, temperature=1.5)
    for other in (
        llm.beam_search(PROMPTS, params, concurrency_limit=1),
        llm.beam_search(PROMPTS, hot),
    ):
        assert [[(b.tokens, b.cum_logprob) for b in o.sequences] for o in other] == [
            [(b.tokens, b.cum_logprob) for b in o.sequences] for o in outputs
        ]


def reference_search(model, prompt, width, max_tokens, eos, penalty, limit):
    """The search the module describes, written plainly on transformers' logprobs:
    (tokens, cumulative logprob, finish reason) of the best `width`, best first."""

    def score(beam):
        tokens, total, _ = beam
        return total / (len(tokens) - (tokens[-1] in eos)) ** penalty

    live, done = [(list(prompt), 0.0, None)], []
    for _ in range(max_tokens):
        candidates = []
        for tokens, total, _ in live:
            logprobs = hf_logprobs(model, tokens)[-1]
            top = torch.topk(logprobs, 2 * width)
            for value, token in zip(top.values.tolist(), top.indices.tolist()):
                beam = (tokens + [token], total + value, None)
                if token in eos:
                    done.append((beam[0], beam[1], "stop"))
                else:
                    candidates.append(beam)
        candidates.sort(key=score, reverse=True)
        live = []
        for tokens, total, _ in candidates[:width]:
            if len(tokens) >= limit:
                done.append((tokens, total, "length"))
            else:
                live.append((tokens, total, None))
        if not live:
            break
    ranked = sorted(done + [(t, c, "length") for t, c, _ in live], key=score)
    return ranked[::-1][:width]


def with_eos(path: str, target: str, eos: int) -> str:
    """A copy of the checkpoint at `path` whose EOS is the token `eos`."""
    shutil.copytree(path, target)
    for name in ("config.json", "generation_config.json"):
        file = os.path.join(target, name)
        with open(file) as f:
            config = json.load(f)
        config["eos_token_id"] = eos
        with open(file, "w") as f:
            json.dump(config, f)
    return target


def test_a_score_counts_the_prompt_and_not_a_final_eos():
    beam = BeamSearchSequence([5, 6, 7, 2], cum_logprob=-3.0)
    assert score(beam, frozenset({2}), 1.0) == -1.0
    assert score(beam, frozenset(), 1.0) == -0.75
    assert score(beam, frozenset({2}), 2.0) == pytest.approx(-1 / 3)


def test_eos_length_penalty_and_the_context_end_as_the_module_says(
    qwen3_path, hf_model, tmp_path
):
    """EOS made a likely token, so that beams end early: complete beams are kept and
    ranked with the live, scored without their EOS; a beam that fills max_model_len
    ends there ("length")."""
    model = hf_model(qwen3_path)
    prompt = PROMPTS[1]
    second = torch.topk(hf_logprobs(model, prompt)[-1], 2).indices[1].item()
    path = with_eos(qwen3_path, str(tmp_path / "eos"), second)
    eos = {second}  # the generation config's, which generate stops at
    for penalty, limit in [(1.0, 64), (2.0, 64), (0.0, len(prompt) + 4)]:
        llm = LLM(path, max_model_len=limit, kvcache_block_size=16)
        params = BeamSearchParams(3, max_tokens=8, length_penalty=penalty)
        [output] = llm.beam_search([prompt], params)
        got = [(b.tokens, b.finish_reason) for b in output.sequences]
        expected = reference_search(model, prompt, 3, 8, eos, penalty, limit)
        assert got == [(tokens, reason) for tokens, _, reason in expected]
        assert [b.cum_logprob for b in output.sequences] == pytest.approx(
            [total for _, total, _ in expected], abs=1e-4
        )
        assert any(b.finish_reason == "stop" for b in output.sequences)
        if limit < 64:
            assert all(len(b.tokens) <= limit for b in output.sequences)


def test_one_beam_is_greedy_decoding(qwen3_path):
    """A width of 1 keeps the most likely token each round: greedy decoding's."""
    llm = LLM(qwen3_path, max_model_len=256)
    greedy = llm.generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    )
    beams = llm.beam_search(PROMPTS, BeamSearchParams(1, 6, ignore_eos=True))
    assert [o.sequences[0].tokens for o in beams] == [
        p + g.outputs[0].token_ids for p, g in zip(PROMPTS, greedy)
    ]


def test_images_ride_with_every_beam(tmp_path):
    """Each beam sends its prompt's image again with its tokens (the image's tokens
    expanded already): encoded once, and one beam is greedy decoding."""
    from PIL import Image

    from nanopaged.random_checkpoint import write_random_vision_checkpoint

    path = write_random_vision_checkpoint(str(tmp_path / "vl"), initializer_range=0.1)
    llm = LLM(path, max_model_len=512)
    image = Image.new("RGB", (84, 56), "teal")
    prompt = {
        "prompt": "Look: <|vision_start|><|image_pad|><|vision_end|> now",
        "multi_modal_data": {"image": image},
    }
    greedy = llm.generate(
        prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    )[0]
    [output] = llm.beam_search([prompt], BeamSearchParams(3, 6, ignore_eos=True))
    best = output.sequences[0]
    assert best.tokens[: len(greedy.prompt_token_ids)] == greedy.prompt_token_ids
    assert len(output.sequences) == 3 and best.multi_modal_data == {"image": image}
    assert llm.vision.num_encoded == 1  # every round's beams from the encoder cache
    one = llm.beam_search([prompt], BeamSearchParams(1, 6, ignore_eos=True))[0]
    assert one.sequences[0].tokens == greedy.prompt_token_ids + (
        greedy.outputs[0].token_ids
    )


def test_a_cache_salt_goes_with_every_round(qwen3_path):
    """The beams' blocks are cached under the prompt's salt, round after round: a
    beam's tokens again hit them under that salt, and not without it."""
    llm = LLM(qwen3_path, max_model_len=256, kvcache_block_size=16)
    prompt = {"prompt_token_ids": PROMPTS[1] * 4, "cache_salt": "a tenant"}  # 28
    [output] = llm.beam_search([prompt], BeamSearchParams(2, 8, ignore_eos=True))
    tokens = output.sequences[0].tokens  # 36: two full blocks computed in the rounds
    one = SamplingParams(max_tokens=1)
    [plain] = llm.generate({"prompt_token_ids": tokens}, one)
    [salted] = llm.generate({"prompt_token_ids": tokens, "cache_salt": "a tenant"}, one)
    assert plain.num_cached_tokens == 0 and salted.num_cached_tokens == 32


@pytest.mark.parametrize(
    "fields,message",
    [
        ({"beam_width": 0}, "beam_width must be in [1, 10], got 0"),
        ({"beam_width": 11}, "beam_width must be in [1, 10], got 11"),
        ({"max_tokens": 0}, "max_tokens must be >= 1, got 0"),
        ({"temperature": -1.0}, "temperature must be a number"),
        ({"length_penalty": float("nan")}, "length_penalty must be a finite number"),
    ],
)
def test_bad_params_are_refused_by_name(fields, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[")):
        BeamSearchParams(**{"beam_width": 2, "max_tokens": 4, **fields})


def test_bad_input_is_refused_and_the_engine_goes_on(qwen3_path):
    llm = LLM(qwen3_path, max_model_len=64)
    with pytest.raises(ValueError, match="params must be a BeamSearchParams"):
        llm.beam_search(PROMPTS, SamplingParams())
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.beam_search([[10**6]], BeamSearchParams(2, 4))
    with pytest.raises(ValueError, match="concurrency_limit must be >= 1"):
        llm.beam_search(PROMPTS, BeamSearchParams(2, 4), concurrency_limit=-1)
    assert llm.beam_search([], BeamSearchParams(2, 4)) == []
    [output] = llm.beam_search([PROMPTS[1]], BeamSearchParams(2, 4, ignore_eos=True))
    assert len(output.sequences) == 2 and llm.is_finished()


def test_the_server_searches_beams_as_llm_beam_search_does(qwen3_path):
    """vLLM's `use_beam_search` on completions (two prompts) and chat: the `n` best
    beams of `LLM.beam_search`, best first, their text the generated tokens'."""
    from test_server import OPTIONS, Server

    server = Server(qwen3_path, *OPTIONS)
    llm = LLM(qwen3_path, max_model_len=512, kvcache_block_size=16)
    tokenizer = llm.get_tokenizer()
    params = BeamSearchParams(3, 6, ignore_eos=True, length_penalty=0.5)
    try:
        texts = ["Paged attention", "A block table"]
        answer = server.client.completions.create(
            model="tiny",
            prompt=texts,
            n=3,
            max_tokens=6,
            extra_body={
                "use_beam_search": True,
                "ignore_eos": True,
                "length_penalty": 0.5,
            },
        )
        expected = [
            tokenizer.decode(beam.tokens[len(tokenizer.encode(text)) :])
            for text, output in zip(texts, llm.beam_search(texts, params))
            for beam in output.sequences
        ]
        assert [c.text for c in answer.choices] == expected
        assert [c.index for c in answer.choices] == list(range(6))
        assert answer.usage.completion_tokens == 36
        messages = [{"role": "user", "content": "Hi!"}]
        chat = server.client.chat.completions.create(
            model="tiny",
            messages=messages,
            n=2,
            max_tokens=5,
            extra_body={"use_beam_search": True, "ignore_eos": True},
        )
        prompt = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        ids = tokenizer.encode(prompt, add_special_tokens=False)
        [output] = llm.beam_search(
            [{"prompt_token_ids": ids}], BeamSearchParams(2, 5, ignore_eos=True)
        )
        assert [c.message.content for c in chat.choices] == [
            tokenizer.decode(beam.tokens[len(ids) :]) for beam in output.sequences
        ]
    finally:
        server.stop()
