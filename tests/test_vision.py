"""Vision-language models (nanopaged/vision/): greedy tokens equal transformers'
`generate` on small random checkpoints written as their publishers lay them out
(Qwen2.5-VL and Qwen3-VL here, Gemma 3 in test_vision_gemma3.py), with one and two
images of different sizes anywhere in a prompt, beside text-only requests, split by
chunked prefill, preempted, with prefix hits, n > 1 and async scheduling; images in
vLLM's prompts and chat parts; bad input refused by name."""

import base64
import functools
import io

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

from nanopaged import LLM, SamplingParams
from nanopaged.random_checkpoint import write_random_vision_checkpoint

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"


def picture(width: int, height: int, seed: int) -> Image.Image:
    pixels = np.random.RandomState(seed).rand(height, width, 3) * 255
    return Image.fromarray(pixels.astype("uint8"))


WIDE, TALL, SMALL = picture(120, 80, 0), picture(60, 90, 1), picture(56, 56, 2)


@pytest.fixture(scope="module")
def qwen25vl(tmp_path_factory) -> str:
    return write_random_vision_checkpoint(
        str(tmp_path_factory.mktemp("vision") / "qwen2.5-vl"), initializer_range=0.1
    )


@pytest.fixture(scope="module")
def qwen3vl(tmp_path_factory) -> str:
    return write_random_vision_checkpoint(
        str(tmp_path_factory.mktemp("vision") / "qwen3-vl"),
        "qwen3-vl",
        initializer_range=0.1,
    )


@pytest.fixture(params=["qwen2.5-vl", "qwen3-vl"])
def qwen(request) -> str:
    """Each Qwen vision-language family's checkpoint."""
    fixture = {"qwen2.5-vl": "qwen25vl", "qwen3-vl": "qwen3vl"}[request.param]
    return request.getfixturevalue(fixture)


@functools.cache
def _reference(path: str):
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
    return (
        model.eval(),
        AutoTokenizer.from_pretrained(path),
        AutoImageProcessor.from_pretrained(path),
    )


def expanded(path: str, text: str, images: list) -> tuple[list[int], dict]:
    """transformers' inputs of a prompt: the image processor's pixels, and the text
    with each placeholder expanded as Qwen2.5-VL's processor expands it."""
    model, tokenizer, processor = _reference(path)
    inputs = processor(images=images, return_tensors="pt") if images else {}
    sizes = [
        int(g.prod()) // processor.merge_size**2
        for g in inputs.get("image_grid_thw", [])
    ]
    pieces = text.split("<|image_pad|>")
    text = pieces[0] + "".join(
        "<|image_pad|>" * n + p for n, p in zip(sizes, pieces[1:])
    )
    return tokenizer.encode(text), dict(inputs)


@functools.cache
def _hf_greedy(path: str, text: str, images: tuple, max_tokens: int) -> list[int]:
    model = _reference(path)[0]
    ids, inputs = expanded(path, text, [IMAGES[name] for name in images])
    ids = torch.tensor([ids])
    mm = (ids == model.config.image_token_id).int()
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            mm_token_type_ids=mm,
            max_new_tokens=max_tokens,
            do_sample=False,
            **inputs,
        )
    return out[0, ids.shape[1] :].tolist()


IMAGES = {"wide": WIDE, "tall": TALL, "small": SMALL}


def hf_greedy(path: str, text: str, names: tuple = (), max_tokens: int = 12):
    return _hf_greedy(path, text, tuple(names), max_tokens)


# (text, images by name): one image, two of different sizes, at the start, middle and
# end of a prompt, and none
CASES = [
    (f"Describe {IMAGE} in a few words.", ("wide",)),
    (f"{IMAGE} and {IMAGE}: which is taller?", ("wide", "tall")),
    (f"{IMAGE} first", ("small",)),
    (f"Look at the last one: {IMAGE}", ("tall",)),
    ("A block table maps blocks", ()),
]


def prompts_of(cases) -> list:
    return [
        {"prompt": text, "multi_modal_data": {"image": [IMAGES[n] for n in names]}}
        if names
        else text
        for text, names in cases
    ]


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"max_num_batched_tokens": 16},  # images split over chunks of a prefill
        {"num_kvcache_blocks": 12},  # preemption: computed again
        {"async_scheduling": True},
        {"attention_backend": "torch"},
        {"scheduling": "mixed", "max_num_batched_tokens": 24},
    ],
    ids=["plain", "chunked", "preempted", "async", "torch", "mixed"],
)
def test_greedy_tokens_equal_transformers(qwen, options):
    llm = LLM(qwen, max_model_len=512, kvcache_block_size=16, **options)
    outputs = llm.generate(prompts_of(CASES), GREEDY, use_tqdm=False)
    assert tokens(outputs) == [hf_greedy(qwen, t, n) for t, n in CASES]
    if "num_kvcache_blocks" in options:
        assert llm.engine.scheduler.num_preemptions > 0
    # each of the 3 images encoded once (two come twice), however a prefill was split
    if "num_kvcache_blocks" not in options:
        assert llm.vision.num_encoded == 3


def test_the_same_image_is_served_from_the_prefix_cache_and_another_is_not(qwen):
    """Blocks holding an image's tokens are named by the image: the same text and image
    again hit them, the same text and another image only the text before it."""
    llm = LLM(qwen, max_model_len=512, kvcache_block_size=16)
    text = "A few words of text before the picture come first " + IMAGE + " after"
    first = llm.generate({"prompt": text, "multi_modal_data": {"image": WIDE}}, GREEDY)
    again = llm.generate({"prompt": text, "multi_modal_data": {"image": WIDE}}, GREEDY)
    other = llm.generate({"prompt": text, "multi_modal_data": {"image": TALL}}, GREEDY)
    prompt_length = len(first[0].prompt_token_ids)
    before_image = first[0].prompt_token_ids.index(llm.images.image_token_id)
    assert again[0].num_cached_tokens == (prompt_length - 1) // 16 * 16
    assert other[0].num_cached_tokens == before_image // 16 * 16
    assert tokens(again) == tokens(first) == [hf_greedy(qwen, text, ("wide",))]
    assert tokens(other) == [hf_greedy(qwen, text, ("tall",))]
    # the same text and image under a cache_salt: nothing shared
    salted = {"prompt": text, "multi_modal_data": {"image": WIDE}, "cache_salt": "s"}
    [salted] = llm.generate(salted, GREEDY)
    assert salted.num_cached_tokens == 0 and tokens([salted]) == tokens(first)


def test_decode_steps_run_on_one_position_and_replay_their_graphs(qwen):
    """A step without an image's token runs on the text's one position per token (its
    three agree): decode steps replay the backend's graphs, and the tokens hold."""
    llm = LLM(qwen, max_model_len=512)
    graphs = llm.engine.runner.graphs
    replays, replay = [], graphs.replay
    graphs.replay = lambda *args: replays.append(args[1].dim()) or replay(*args)
    outputs = llm.generate(prompts_of(CASES), GREEDY, use_tqdm=False)
    assert tokens(outputs) == [hf_greedy(qwen, t, n) for t, n in CASES]
    assert len(replays) >= 10 and set(replays) == {1}


def test_an_image_sent_again_is_processed_once_while_among_the_latest(
    qwen25vl, monkeypatch
):
    from nanopaged.vision import processing

    llm = LLM(qwen25vl, max_model_len=512)
    calls, processor = [], llm.images.processor
    llm.images.processor = lambda **kw: calls.append(1) or processor(**kw)
    # wide, then wide and tall: wide is processed once
    outputs = llm.generate(prompts_of([CASES[0], CASES[1]]), GREEDY, use_tqdm=False)
    assert len(calls) == 2
    assert tokens(outputs) == [hf_greedy(qwen25vl, *case) for case in CASES[:2]]
    monkeypatch.setattr(processing, "PROCESSED_KEPT", 1)
    llm.generate(prompts_of([CASES[2], CASES[0]]), GREEDY, use_tqdm=False)
    assert len(calls) == 4  # small pushed wide out
    # vLLM's reset_mm_cache: nothing processed or encoded kept; wide processed again
    llm.reset_mm_cache()
    assert not llm.images.processed and not llm.vision.cache
    again = llm.generate(prompts_of(CASES[:1]), GREEDY, use_tqdm=False)
    assert len(calls) == 5 and tokens(again) == [hf_greedy(qwen25vl, *CASES[0])]


@pytest.mark.parametrize("family", ["qwen2.5-vl", "qwen3-vl"])
def test_new_weights_and_a_sleep_leave_no_image_encoded_by_the_old_tower(
    family, tmp_path
):
    """The encoder cache holds what the tower computed: new weights (RL's updates)
    and a sleep empty it, so the same image is encoded again by the new tower and the
    tokens are transformers' on the new weights. The weights go by transformers'
    names (`model.visual.`, `model.language_model.`), as a trainer sends them, though
    the checkpoint was published with others."""
    old, new = (
        write_random_vision_checkpoint(
            str(tmp_path / name), family, seed=seed, initializer_range=0.1
        )
        for name, seed in (("old", 0), ("new", 1))
    )
    llm = LLM(old, max_model_len=512, enable_sleep_mode=True)
    [case] = CASES[:1]
    assert tokens(llm.generate(prompts_of([case]), GREEDY)) == [hf_greedy(old, *case)]
    trained = AutoModelForImageTextToText.from_pretrained(new, dtype=torch.float32)
    model = llm.llm_engine.model_executor.driver_worker.model_runner.model
    model.load_weights(trained.named_parameters())
    assert tokens(llm.generate(prompts_of([case]), GREEDY)) == [hf_greedy(new, *case)]
    assert llm.vision.num_encoded == 2
    llm.sleep(level=1)
    assert not llm.vision.cache
    llm.wake_up()
    assert tokens(llm.generate(prompts_of([case]), GREEDY)) == [hf_greedy(new, *case)]
    assert llm.vision.num_encoded == 3
    # sleep(2) dropped the weights: transformers' names fill all of them again
    llm.sleep(level=2)
    llm.wake_up()
    model.load_weights(trained.named_parameters())
    assert tokens(llm.generate(prompts_of([case]), GREEDY)) == [hf_greedy(new, *case)]


def test_an_array_or_a_tensor_of_pixels_is_the_same_image(qwen25vl):
    """vLLM takes images as arrays too: a numpy (H, W, C) array and a torch (C, H, W)
    tensor of uint8 pixels are the PIL image of the same pixels, down to its name in
    the prefix cache (the third request finds the first's blocks)."""
    llm = LLM(qwen25vl, max_model_len=512, kvcache_block_size=16)
    pixels = np.asarray(WIDE)
    text, names = CASES[0]
    outputs = [
        llm.generate(
            {"prompt": text, "multi_modal_data": {"image": image}},
            GREEDY,
            use_tqdm=False,
        )[0]
        for image in (pixels, torch.from_numpy(pixels).permute(2, 0, 1), WIDE)
    ]
    assert tokens(outputs) == [hf_greedy(qwen25vl, text, names)] * 3
    assert outputs[2].num_cached_tokens > 0 and llm.vision.num_encoded == 1


def test_a_prompts_own_mm_processor_kwargs_are_the_engines_for_its_images(qwen25vl):
    """vLLM's per-prompt `mm_processor_kwargs` process that prompt's images as the
    engine's option would, and name them apart in the prefix cache."""
    small = {"max_pixels": 28 * 28 * 4}
    text, _ = CASES[0]
    prompt = {"prompt": text, "multi_modal_data": {"image": WIDE}}
    engine_wide = LLM(qwen25vl, max_model_len=512, mm_processor_kwargs=small)
    [expected] = engine_wide.generate(prompt, GREEDY, use_tqdm=False)
    llm = LLM(qwen25vl, max_model_len=512, kvcache_block_size=16)
    [default] = llm.generate(prompt, GREEDY, use_tqdm=False)
    [own] = llm.generate({**prompt, "mm_processor_kwargs": small}, GREEDY)
    assert own.prompt_token_ids == expected.prompt_token_ids
    assert tokens([own]) == tokens([expected])
    assert len(own.prompt_token_ids) < len(default.prompt_token_ids)
    before_image = own.prompt_token_ids.index(llm.images.image_token_id)
    assert own.num_cached_tokens == before_image // 16 * 16
    # chat's, as vLLM's LLM.chat takes them
    messages = [{"role": "user", "content": [{"type": "image_pil", "image_pil": WIDE}]}]
    [chat_small] = llm.chat(messages, GREEDY, mm_processor_kwargs=small)
    [chat_default] = engine_wide.chat(messages, GREEDY)
    assert chat_small.prompt_token_ids == chat_default.prompt_token_ids


def test_data_parallel_replicas_take_images(qwen25vl):
    """Each replica reads and checks its own prompts' images: the tokens of one
    engine, a bad image refused by name, and the replicas go on."""
    llm = LLM(qwen25vl, max_model_len=512, data_parallel_size=2)
    outputs = llm.generate(prompts_of(CASES), GREEDY, use_tqdm=False)
    assert tokens(outputs) == [hf_greedy(qwen25vl, t, n) for t, n in CASES]
    bad = {"prompt": "no placeholder", "multi_modal_data": {"image": WIDE}}
    with pytest.raises(ValueError, match="0 image placeholders"):
        llm.generate([prompts_of(CASES[:1])[0], bad], GREEDY, use_tqdm=False)
    again = llm.generate(prompts_of(CASES[:2]), GREEDY, use_tqdm=False)
    assert tokens(again) == tokens(outputs[:2])
    messages = [{"role": "user", "content": [{"type": "image_pil", "image_pil": TALL}]}]
    single = LLM(qwen25vl, max_model_len=512)
    assert tokens(llm.chat(messages, GREEDY)) == tokens(single.chat(messages, GREEDY))
    llm.close()


def test_n_samples_and_token_id_prompts(qwen25vl):
    llm = LLM(qwen25vl, max_model_len=512)
    text, names = CASES[1]
    ids = _reference(qwen25vl)[1].encode(text)  # one placeholder token per image
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, n=2)
    [output] = llm.generate(
        {"prompt_token_ids": ids, "multi_modal_data": {"image": [WIDE, TALL]}}, params
    )
    expected = hf_greedy(qwen25vl, text, names)
    assert [c.token_ids for c in output.outputs] == [expected, expected]


def test_logprobs_are_transformers_within_tolerance(qwen):
    llm = LLM(qwen, max_model_len=512)
    text, names = CASES[0]
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=0, ignore_eos=True)
    [output] = llm.generate(prompts_of([CASES[0]]), params, use_tqdm=False)
    model = _reference(qwen)[0]
    ids, inputs = expanded(qwen, text, [WIDE])
    completion = output.outputs[0].token_ids
    full = torch.tensor([ids + completion])
    with torch.no_grad():
        logits = model(
            input_ids=full,
            mm_token_type_ids=(full == model.config.image_token_id).int(),
            **inputs,
        ).logits[0, len(ids) - 1 : -1]
    expected = logits.log_softmax(-1)[torch.arange(len(completion)), completion]
    got = [e[t].logprob for e, t in zip(output.outputs[0].logprobs, completion)]
    assert torch.allclose(torch.tensor(got), expected, atol=1e-4)


def data_url(image: Image.Image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def test_chat_takes_image_url_and_image_pil_parts(qwen25vl, tmp_path):
    """OpenAI's image_url parts (a data URL; a file:// URL under
    allowed_local_media_path) and vLLM's image_pil, rendered by the chat template."""
    WIDE.save(tmp_path / "wide.png")
    llm = LLM(qwen25vl, max_model_len=512, allowed_local_media_path=str(tmp_path))
    parts = [
        {"type": "text", "text": "Compare"},
        {"type": "image_url", "image_url": {"url": data_url(WIDE)}},
        {"type": "image_pil", "image_pil": TALL},
        {"type": "image_url", "image_url": {"url": f"file://{tmp_path}/wide.png"}},
    ]
    [output] = llm.chat([{"role": "user", "content": parts}], GREEDY, use_tqdm=False)
    tokenizer = _reference(qwen25vl)[1]
    text = tokenizer.apply_chat_template(
        [
            {
                "role": "user",
                "content": [{"type": "text", "text": "Compare"}]
                + [{"type": "image"}] * 3,
            }
        ],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert output.outputs[0].token_ids == hf_greedy(
        qwen25vl, text, ("wide", "tall", "wide")
    )
    with pytest.raises(ValueError, match="an image_url part without its 'image_url'"):
        llm.chat([{"role": "user", "content": [{"type": "image_url"}]}], GREEDY)


@pytest.mark.parametrize(
    "prompt, message",
    [
        (
            {"prompt": f"{IMAGE}", "multi_modal_data": {"image": [WIDE] * 5}},
            "more than limit_mm_per_prompt",
        ),
        (
            {"prompt": f"{IMAGE}", "multi_modal_data": {"image": b"not an image"}},
            "no image PIL can read",
        ),
        (
            {"prompt": f"{IMAGE} {IMAGE}", "multi_modal_data": {"image": WIDE}},
            "2 image placeholders",
        ),
        (
            {"prompt": "no placeholder", "multi_modal_data": {"image": WIDE}},
            "0 image placeholders",
        ),
        (f"a placeholder without its image {IMAGE}", "but no images"),
        (
            {"prompt": IMAGE, "multi_modal_data": {"image": np.zeros((8, 8, 3))}},
            "must hold uint8 pixels",
        ),
        (
            {
                "prompt": IMAGE,
                "multi_modal_data": {"image": WIDE},
                "mm_processor_kwargs": {"max_pixelz": 10},
            },
            "cannot take image 0 with mm_processor_kwargs=.*max_pixelz",
        ),
        (
            {"prompt": IMAGE, "multi_modal_data": {"image": np.zeros((8, 8, 5), "u1")}},
            r"must be \(H, W\), \(H, W, C\) or \(C, H, W\)",
        ),
        ({"prompt": f"{IMAGE}", "multi_modal_data": {"video": WIDE}}, "takes 'image'"),
        (
            {"prompt": f"{IMAGE}", "multi_modal_data": {"image": "https://x/a.png"}},
            "is remote",
        ),
        (
            {"prompt": f"{IMAGE}", "multi_modal_data": {"image": "file:///etc/passwd"}},
            "local image files are off",
        ),
        (
            {
                "prompt": f"{IMAGE}",
                "multi_modal_data": {"image": picture(2000, 2000, 3)},
            },
            "max_model_len",
        ),
        (
            {"prompt": f"{IMAGE}", "multi_modal_data": {"image": picture(1, 300, 5)}},
            "the image processor cannot take image 0",
        ),
    ],
)
def test_bad_images_are_refused_by_name_and_the_engine_goes_on(
    qwen25vl, prompt, message
):
    llm = _engine(qwen25vl)
    with pytest.raises(ValueError, match=message):
        llm.generate([prompt, prompts_of(CASES[:1])[0]], GREEDY, use_tqdm=False)
    assert llm.is_finished() and not llm.requests
    assert tokens(llm.generate(prompts_of(CASES[:1]), GREEDY, use_tqdm=False)) == [
        hf_greedy(qwen25vl, *CASES[0])
    ]


@functools.cache
def _engine(path: str) -> LLM:
    return LLM(
        path, max_model_len=128, mm_processor_kwargs={"max_pixels": 28 * 28 * 256}
    )


def test_a_text_model_refuses_images(qwen3_path):
    llm = LLM(qwen3_path, max_model_len=128)
    with pytest.raises(ValueError, match="this model takes no images"):
        llm.generate({"prompt": "hi", "multi_modal_data": {"image": WIDE}})
    with pytest.raises(ValueError, match="images need a vision-language model"):
        llm.chat(
            [
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": data_url(WIDE)}}
                    ],
                }
            ]
        )


def test_penalties_count_the_prompts_text_beside_its_images(qwen25vl):
    """An image's tokens hold its pad id, past the vocabulary: penalties count the
    prompt's text tokens and pass over them."""
    llm = LLM(qwen25vl, max_model_len=512)
    params = SamplingParams(
        temperature=0, max_tokens=12, ignore_eos=True, repetition_penalty=1.5
    )
    [output] = llm.generate(prompts_of(CASES[:1]), params, use_tqdm=False)
    assert len(output.outputs[0].token_ids) == 12


@pytest.mark.parametrize("replicas", ["1", "2"])
def test_the_server_takes_images_in_chat_completions(qwen25vl, replicas):
    """Base64 data URLs in image_url parts, with the request's mm_processor_kwargs too,
    on one engine or data-parallel replicas; a remote URL is a 400 that says why; the
    model's card lists its modalities."""
    from test_server import Server

    server = Server(
        qwen25vl, "--max-model-len", "512", "--data-parallel-size", replicas
    )
    try:
        card = server.client.models.list().data[0]
        assert card.modalities == ["text", "image"]
        parts = [
            {"type": "text", "text": "Compare"},
            {"type": "image_url", "image_url": {"url": data_url(WIDE)}},
        ]
        answer = server.client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": parts}],
            max_tokens=12,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        offline = LLM(qwen25vl, max_model_len=512)
        [expected] = offline.chat(
            [{"role": "user", "content": parts}], GREEDY, use_tqdm=False
        )
        assert answer.choices[0].message.content == expected.outputs[0].text
        small = {"max_pixels": 28 * 28 * 4}
        answer = server.client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": parts}],
            max_tokens=12,
            temperature=0,
            extra_body={"ignore_eos": True, "mm_processor_kwargs": small},
        )
        [expected] = offline.chat(
            [{"role": "user", "content": parts}], GREEDY, mm_processor_kwargs=small
        )
        assert answer.usage.prompt_tokens == len(expected.prompt_token_ids)
        assert answer.choices[0].message.content == expected.outputs[0].text
        remote = [{"type": "image_url", "image_url": {"url": "https://x.test/a.png"}}]
        with pytest.raises(Exception) as refused:
            server.client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": remote}]
            )
        assert refused.value.status_code == 400 and "is remote" in str(refused.value)
    finally:
        server.stop()
