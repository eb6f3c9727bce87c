"""Gemma 3 with images (nanopaged/vision/gemma3.py): greedy tokens and logprobs equal
transformers' on a small random checkpoint written as Google lays one out (config,
safetensors, tokenizer and `Gemma3Processor`), its prompts expanded by transformers'
own processor. An image's tokens see each other both ways: however a prefill is
chunked, preempted or served in part by the prefix cache, the answer is the same."""

import functools

import pytest
import torch
from test_vision import IMAGES, TALL, WIDE, data_url, picture, prompts_of, tokens
from transformers import AutoModelForImageTextToText, AutoProcessor

from nanopaged import LLM, SamplingParams
from nanopaged.random_checkpoint import write_random_vision_checkpoint

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
IMAGE = "<start_of_image>"
# one image, two, one at the start, none; 16 tokens an image, 20 with its markers
CASES = [
    (f"Describe {IMAGE} in a few words.", ("wide",)),
    (f"{IMAGE} and {IMAGE}: which one is taller, and why?", ("wide", "tall")),
    (f"{IMAGE} first", ("tall",)),
    ("A block table maps blocks", ()),
]


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory) -> str:
    return write_random_vision_checkpoint(
        str(tmp_path_factory.mktemp("vision") / "gemma3"), "gemma3"
    )


@functools.cache
def _reference(path: str):
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
    return model.eval(), AutoProcessor.from_pretrained(path)


def hf_inputs(path: str, text: str, names: tuple) -> dict:
    """transformers' inputs: the text expanded and the images processed by
    `Gemma3Processor`, with the token types that mark the images' tokens."""
    processor = _reference(path)[1]
    images = [IMAGES[n] for n in names] or None
    return dict(processor(text=text, images=images, return_tensors="pt"))


@functools.cache
def hf_greedy(path: str, text: str, names: tuple = ()) -> list[int]:
    inputs = hf_inputs(path, text, names)
    with torch.no_grad():
        out = _reference(path)[0].generate(**inputs, max_new_tokens=12, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"max_num_batched_tokens": 8},  # an image runs whole, past the budget
        {"max_num_batched_tokens": 24},  # a chunk ends before an image
        {"num_kvcache_blocks": 10},  # preemption: computed again
        {"async_scheduling": True},
        {"attention_backend": "torch"},
        {"scheduling": "mixed", "max_num_batched_tokens": 24},
    ],
    ids=["plain", "budget-8", "budget-24", "preempted", "async", "torch", "mixed"],
)
def test_greedy_tokens_equal_transformers(gemma3, options):
    llm = LLM(gemma3, max_model_len=256, kvcache_block_size=16, **options)
    outputs = llm.generate(prompts_of(CASES), GREEDY, use_tqdm=False)
    assert tokens(outputs) == [hf_greedy(gemma3, t, n) for t, n in CASES]
    if "num_kvcache_blocks" in options:
        assert llm.engine.scheduler.num_preemptions > 0


def test_the_images_tokens_see_each_other(gemma3, monkeypatch):
    """The test above fails where an image's tokens attend causally, as text does."""
    from nanopaged.vision.gemma3 import Gemma3VL

    monkeypatch.setattr(Gemma3VL, "bidirectional_images", False)
    llm = LLM(gemma3, max_model_len=256)
    outputs = llm.generate(prompts_of(CASES[:1]), GREEDY, use_tqdm=False)
    assert tokens(outputs) != [hf_greedy(gemma3, *CASES[0])]


def test_a_prefix_hit_inside_an_image_computes_the_rest_of_it(gemma3):
    """The prefix cache serves full blocks, which may end inside an image: the rest of
    the image sees the part the cache holds, as it did when it was computed."""
    llm = LLM(gemma3, max_model_len=256, kvcache_block_size=16)
    text = f"Some words of text first {IMAGE} then more"
    prompt = {"prompt": text, "multi_modal_data": {"image": WIDE}}
    first = llm.generate(prompt, GREEDY, use_tqdm=False)
    again = llm.generate(prompt, GREEDY, use_tqdm=False)
    ids = first[0].prompt_token_ids
    image = ids.index(llm.images.image_token_id)
    assert image < again[0].num_cached_tokens < image + 16
    assert tokens(again) == tokens(first) == [hf_greedy(gemma3, text, ("wide",))]


def test_logprobs_are_transformers_within_tolerance(gemma3):
    llm = LLM(gemma3, max_model_len=256)
    text, names = CASES[1]
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=0, ignore_eos=True)
    [output] = llm.generate(prompts_of([CASES[1]]), params, use_tqdm=False)
    inputs = hf_inputs(gemma3, text, names)
    completion = output.outputs[0].token_ids
    prompt_length = inputs["input_ids"].shape[1]
    extra = torch.tensor([completion])
    inputs["input_ids"] = torch.cat([inputs["input_ids"], extra], 1)
    inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
    inputs["token_type_ids"] = torch.cat(
        [inputs["token_type_ids"], torch.zeros_like(extra)], 1
    )
    with torch.no_grad():
        logits = _reference(gemma3)[0](**inputs).logits[0, prompt_length - 1 : -1]
    expected = logits.log_softmax(-1)[torch.arange(len(completion)), completion]
    got = [e[t].logprob for e, t in zip(output.outputs[0].logprobs, completion)]
    assert torch.allclose(torch.tensor(got), expected, atol=1e-4)


def test_chat_image_parts_become_the_templates_image_markers(gemma3):
    llm = LLM(gemma3, max_model_len=256)
    parts = [
        {"type": "text", "text": "Compare"},
        {"type": "image_url", "image_url": {"url": data_url(WIDE)}},
        {"type": "image_pil", "image_pil": TALL},
    ]
    [output] = llm.chat([{"role": "user", "content": parts}], GREEDY, use_tqdm=False)
    processor = _reference(gemma3)[1]
    text = processor.apply_chat_template(
        [{"role": "user", "content": [parts[0], {"type": "image"}, {"type": "image"}]}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert output.outputs[0].token_ids == hf_greedy(gemma3, text, ("wide", "tall"))


def test_pan_and_scan_is_refused_by_name(gemma3):
    llm = LLM(
        gemma3,
        max_model_len=256,
        mm_processor_kwargs={"do_pan_and_scan": True, "pan_and_scan_min_crop_size": 28},
    )
    panorama = {"prompt": IMAGE, "multi_modal_data": {"image": picture(1200, 300, 4)}}
    with pytest.raises(ValueError, match="do_pan_and_scan"):
        llm.generate(panorama, GREEDY, use_tqdm=False)
    assert llm.is_finished() and not llm.requests
