"""Pooling models (nanopaged/pooling/): embeddings equal Sentence Transformers' `encode`
(and transformers' hidden states pooled by hand), class probabilities and scores equal
transformers' `*ForSequenceClassification`, on small random checkpoints written as
their publishers write them."""

import json
import os

import numpy as np
import pytest
import torch
from conftest import random_prompts
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
)

from nanopaged import LLM, PoolingParams, SamplingParams
from nanopaged.core.llm_engine import LLMEngineCore
from nanopaged.core.sequence import SamplingOptions, Sequence
from nanopaged.pooling.pooler import Pooling
from nanopaged.pooling.pooling_llm import PoolingLLM
from nanopaged.random_checkpoint import TINY_QWEN3, build_tokenizer

st = pytest.importorskip("sentence_transformers")
from sentence_transformers.sentence_transformer.modules import (  # noqa: E402
    Normalize,
    Transformer,
)
from sentence_transformers.sentence_transformer.modules import (  # noqa: E402
    Pooling as STPooling,
)

TEXTS = [
    "hello world",
    "the quick brown fox jumps over the lazy dog " * 4,  # chunked at 16 tokens a step
    "a",
    "the quick brown fox jumps over the lazy cat",
]
ATOL = 2e-5


def write_body(path: str, architecture="Qwen3Model", seed=0, **config) -> str:
    """A random bare decoder (or classifier) checkpoint, as transformers saves it."""
    tokenizer = build_tokenizer(512)
    hf_config = AutoConfig.for_model(
        **dict(TINY_QWEN3, architectures=[architecture], **config),
        initializer_range=0.1,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    kind = AutoModel if architecture.endswith("Model") else None
    kind = kind or AutoModelForSequenceClassification
    kind.from_config(hf_config, dtype=torch.float32).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def write_sentence_transformer(path: str, mode: str, normalize: bool, **kw) -> str:
    """An embedding model as Sentence Transformers 6 saves it (its Transformer renders
    text through the tokenizer's chat template: the "message" modality)."""
    write_body(f"{path}/body", **kw.pop("body", {}))
    body = Transformer(f"{path}/body")
    modules = [body, STPooling(body.get_embedding_dimension(), mode)]
    model = st.SentenceTransformer(
        modules=modules + ([Normalize()] if normalize else []), **kw
    )
    model.save(f"{path}/st")
    return f"{path}/st"


def as_sentence_transformers_5(path: str, mode: str) -> str:
    """The same checkpoint as Sentence Transformers 2-5 saved it (their files as they
    wrote them): text tokenized as it is, one flag per pooling mode."""
    with open(f"{path}/sentence_bert_config.json", "w") as f:
        json.dump({"max_seq_length": 512, "do_lower_case": False}, f)
    flags = {
        "word_embedding_dimension": 64,
        "pooling_mode_cls_token": mode == "cls",
        "pooling_mode_mean_tokens": mode == "mean",
        "pooling_mode_max_tokens": mode == "max",
        "pooling_mode_mean_sqrt_len_tokens": mode == "mean_sqrt_len_tokens",
        "pooling_mode_weightedmean_tokens": mode == "weightedmean",
        "pooling_mode_lasttoken": mode == "lasttoken",
    }
    with open(f"{path}/1_Pooling/config.json", "w") as f:
        json.dump(flags, f)
    return path


@pytest.fixture(scope="module")
def st_path(tmp_path_factory) -> str:
    """Last-token pooling, normalized, with a default query prompt (Qwen3-Embedding's
    layout)."""
    return write_sentence_transformer(
        str(tmp_path_factory.mktemp("st")),
        "lasttoken",
        True,
        prompts={"query": "Instruct: find\nQuery: ", "document": ""},
        default_prompt_name="query",
    )


def st_encode(path: str, texts, **kw) -> np.ndarray:
    return st.SentenceTransformer(path, device="cpu").encode(texts, **kw)


def embeddings(outputs) -> np.ndarray:
    return np.array([o.outputs.embedding for o in outputs])


def test_embeddings_equal_sentence_transformers_with_its_prompt_and_chunks(st_path):
    llm = LLM(st_path, max_num_batched_tokens=16, num_kvcache_blocks=64)
    assert isinstance(llm, PoolingLLM)
    got = embeddings(llm.embed(TEXTS, use_tqdm=False))
    want = st_encode(st_path, TEXTS)
    assert np.abs(got - want).max() < ATOL
    assert np.allclose(np.linalg.norm(got, axis=1), 1, atol=1e-5)
    # without its default prompt (token ids are taken as they are) the vector differs
    ids = [llm.tokenizer(t)["input_ids"] for t in TEXTS[:1]]
    assert np.abs(embeddings(llm.embed(ids, use_tqdm=False)) - want[:1]).max() > 0.01


@pytest.mark.parametrize(
    "mode", ["mean", "cls", "max", "mean_sqrt_len_tokens", "weightedmean", "lasttoken"]
)
def test_each_pooling_mode_of_a_sentence_transformers_5_checkpoint(tmp_path, mode):
    path = write_sentence_transformer(str(tmp_path), mode, False)
    path = as_sentence_transformers_5(path, mode)
    llm = LLM(path, max_num_batched_tokens=16, num_kvcache_blocks=64)
    assert llm.pooler.mode == mode and not llm.pooler.chat
    assert not llm.pooler.normalize  # no Normalize module
    got = embeddings(llm.embed(TEXTS, use_tqdm=False))
    assert np.abs(got - st_encode(path, TEXTS)).max() < ATOL
    normalized = llm.embed(TEXTS, PoolingParams(normalize=True), use_tqdm=False)
    want = st_encode(path, TEXTS, normalize_embeddings=True)
    assert np.abs(embeddings(normalized) - want).max() < ATOL


@pytest.mark.parametrize("chat", [True, False])
def test_do_lower_case_lowercases_every_text_as_sentence_transformers(tmp_path, chat):
    """`do_lower_case: true` in sentence_bert_config.json: a text is lowercased before
    it is tokenized (a chat's text too), as Sentence Transformers 5 and 6 do."""
    path = write_sentence_transformer(str(tmp_path), "mean", True)
    if not chat:
        path = as_sentence_transformers_5(path, "mean")
    with open(f"{path}/sentence_bert_config.json") as f:
        bert = json.load(f)
    with open(f"{path}/sentence_bert_config.json", "w") as f:
        json.dump(dict(bert, do_lower_case=True), f)
    texts = ["Hello World", "THE QUICK Brown fox"]
    llm = LLM(path, num_kvcache_blocks=64)
    assert llm.pooler.lowercase and llm.pooler.chat == chat
    got = embeddings(llm.embed(texts, use_tqdm=False))
    assert np.abs(got - st_encode(path, texts)).max() < ATOL
    lowered = embeddings(llm.embed([t.lower() for t in texts], use_tqdm=False))
    assert np.abs(got - lowered).max() < ATOL


def test_a_causal_lm_pools_its_hidden_states_as_transformers_computes_them(
    qwen3_path,
):
    """runner="pooling" on a Qwen3ForCausalLM: its decoder without the LM head; mean
    pooling (pooler_config) of transformers' last hidden states, by hand."""
    llm = LLM(
        qwen3_path,
        runner="pooling",
        pooler_config={"pooling_type": "MEAN", "normalize": False},
        max_num_batched_tokens=16,
    )
    prompts = random_prompts([5, 40, 17])
    got = embeddings(llm.embed(prompts, use_tqdm=False))
    model = AutoModelForCausalLM.from_pretrained(qwen3_path, dtype=torch.float32)
    for prompt, row in zip(prompts, got):
        with torch.no_grad():
            out = model(torch.tensor([prompt]), output_hidden_states=True)
        want = out.hidden_states[-1][0].mean(dim=0)
        assert torch.allclose(torch.tensor(row, dtype=torch.float32), want, atol=ATOL)
    every_token = llm.encode(
        prompts[:1], PoolingParams(normalize=True), pooling_task="token_embed"
    )
    with torch.no_grad():
        out = model(torch.tensor(prompts[:1]), output_hidden_states=True)
    want = torch.nn.functional.normalize(out.hidden_states[-1][0], dim=-1)
    assert every_token[0].outputs.data.shape == (5, 64)
    assert torch.allclose(every_token[0].outputs.data, want, atol=ATOL)


def test_a_sentence_transformers_causal_lm_pools_by_default(tmp_path):
    """Qwen3-Embedding's layout: a causal LM's architecture in config.json, the
    decoder's weights without `model.`, Sentence Transformers' files."""
    path = write_sentence_transformer(str(tmp_path), "lasttoken", True)
    with open(f"{path}/config.json") as f:
        config = json.load(f)
    with open(f"{path}/config.json", "w") as f:
        json.dump(dict(config, architectures=["Qwen3ForCausalLM"]), f)
    llm = LLM(path, num_kvcache_blocks=64)
    assert isinstance(llm, PoolingLLM)
    got = embeddings(llm.embed(TEXTS, use_tqdm=False))
    assert np.abs(got - st_encode(path, TEXTS)).max() < ATOL


def test_matryoshka_dimensions_cut_then_normalize(tmp_path):
    path = write_sentence_transformer(
        str(tmp_path), "lasttoken", True, body={"matryoshka_dimensions": [16, 32]}
    )
    llm = LLM(path, num_kvcache_blocks=64)
    got = embeddings(llm.embed(TEXTS, PoolingParams(dimensions=16), use_tqdm=False))
    want = st_encode(path, TEXTS, truncate_dim=16, normalize_embeddings=True)
    assert got.shape == (4, 16) and np.abs(got - want).max() < ATOL
    with pytest.raises(ValueError, match=r"dimensions=24 is not one the model gives"):
        llm.embed(TEXTS, PoolingParams(dimensions=24))
    assert not llm.requests


def test_last_token_pooling_shares_prefixes_and_mean_pooling_does_not(tmp_path):
    mean = write_sentence_transformer(str(tmp_path / "mean"), "mean", True)
    last = write_sentence_transformer(str(tmp_path / "last"), "lasttoken", True)
    prefix = "the quick brown fox jumps over the lazy dog " * 2
    texts = [prefix + "and runs", prefix + "and sleeps"]
    for path, cached in ((last, True), (mean, False)):
        llm = LLM(path, kvcache_block_size=16, num_kvcache_blocks=64)
        first = llm.embed(texts[:1], use_tqdm=False)
        second = llm.embed(texts[1:], use_tqdm=False)
        assert first[0].num_cached_tokens == 0
        assert (second[0].num_cached_tokens >= 16) == cached
        got = embeddings(first + second)
        assert np.abs(got - st_encode(path, texts)).max() < ATOL


def test_a_long_input_runs_in_chunks_and_is_pooled_once(st_path):
    llm = LLM(st_path, max_num_batched_tokens=16, num_kvcache_blocks=64)
    request_id = llm.add_request(TEXTS[1], PoolingParams(task="embed"))
    outputs = []
    while not llm.is_finished():
        outputs += llm.step()
    assert len(outputs) > 3 and all(o.request_id == request_id for o in outputs)
    assert [o.finished for o in outputs] == [False] * (len(outputs) - 1) + [True]
    assert outputs[0].outputs is None
    want = st_encode(st_path, TEXTS[1:2])[0]
    assert np.abs(np.array(outputs[-1].outputs.embedding) - want).max() < ATOL


def test_pooling_starts_over_from_position_zero():
    """A sequence recomputed from its first token (after preemption) pools afresh."""
    pooling = Pooling("mean", 4)
    pooling.add(torch.ones(3, 2), 0)
    pooling.add(torch.full((4, 2), 2.0), 0)
    assert pooling.result().tolist() == [2.0, 2.0]


@pytest.fixture(scope="module")
def classifier_paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("classifiers")
    return {
        labels: write_body(
            f"{root}/{labels}",
            "Qwen3ForSequenceClassification",
            seed=labels,
            num_labels=labels,
        )
        for labels in (1, 3)
    }


def hf_logits(path: str, token_ids: list[int]) -> torch.Tensor:
    model = AutoModelForSequenceClassification.from_pretrained(
        path, dtype=torch.float32
    )
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0]


def test_class_probabilities_equal_transformers(classifier_paths):
    path = classifier_paths[3]
    llm = LLM(path, max_num_batched_tokens=16)
    assert isinstance(llm, PoolingLLM)
    outputs = llm.classify(TEXTS, use_tqdm=False)
    for text, output in zip(TEXTS, outputs):
        want = hf_logits(path, llm.tokenizer(text)["input_ids"]).softmax(-1)
        assert output.outputs.num_classes == 3
        assert torch.allclose(torch.tensor(output.outputs.probs), want, atol=ATOL)
    raw = llm.classify(TEXTS[:1], PoolingParams(use_activation=False), use_tqdm=False)
    want = hf_logits(path, llm.tokenizer(TEXTS[0])["input_ids"])
    assert torch.allclose(torch.tensor(raw[0].outputs.probs), want, atol=ATOL)


def test_a_cross_encoder_scores_each_pair_as_transformers(classifier_paths):
    path = classifier_paths[1]
    llm = LLM(path, task="score")
    query, documents = "hello world", TEXTS[1:]
    outputs = llm.score(query, documents, use_tqdm=False)
    for document, output in zip(documents, outputs):
        pair = llm.tokenizer(query, document)["input_ids"]
        want = hf_logits(path, pair).sigmoid().item()
        assert output.outputs.score == pytest.approx(want, abs=ATOL)
    with pytest.raises(ValueError, match="one label; this one has 3"):
        LLM(classifier_paths[3]).score(query, documents)


@pytest.mark.parametrize("chat", [True, False])
def test_a_sentence_transformers_cross_encoder_scores_as_its_predict(
    classifier_paths, tmp_path, chat
):
    """A CrossEncoder saved by Sentence Transformers 6 renders a pair as a chat of a
    "query" and a "document" (its "message" modality); without that modality, as the
    tokenizer joins a pair, after the default prompt."""
    prompts = {} if chat else {"rank": "Rank: "}
    encoder = st.CrossEncoder(
        classifier_paths[1],
        device="cpu",
        prompts=prompts,
        default_prompt_name="rank" if prompts else None,
    )
    encoder.save(str(tmp_path))
    if not chat:
        with open(tmp_path / "sentence_bert_config.json") as f:
            bert = json.load(f)
        del bert["modality_config"]["message"]
        with open(tmp_path / "sentence_bert_config.json", "w") as f:
            json.dump(bert, f)
    pairs = [("hello world", text) for text in TEXTS[1:]]
    want = st.CrossEncoder(str(tmp_path), device="cpu").predict(pairs)
    llm = LLM(str(tmp_path), task="score")
    assert llm.pooler.chat == chat
    got = [o.outputs.score for o in llm.score("hello world", TEXTS[1:], use_tqdm=False)]
    assert np.abs(np.array(got) - want).max() < ATOL


def test_an_embedding_model_scores_by_cosine(st_path):
    llm = LLM(st_path, num_kvcache_blocks=64)
    outputs = llm.score(TEXTS[0], TEXTS[1:], use_tqdm=False)
    vectors = st_encode(st_path, TEXTS)
    for i, output in enumerate(outputs, start=1):
        want = float(vectors[0] @ vectors[i])  # both normalized
        assert output.outputs.score == pytest.approx(want, abs=ATOL)
    pairwise = llm.score(TEXTS[:2], TEXTS[2:], use_tqdm=False)
    assert pairwise[1].outputs.score == pytest.approx(
        float(vectors[1] @ vectors[3]), abs=ATOL
    )


def test_tensor_parallel_embeddings_equal_sentence_transformers(st_path):
    llm = LLM(st_path, tensor_parallel_size=2, max_num_batched_tokens=16)
    got = embeddings(llm.embed(TEXTS, use_tqdm=False))
    assert np.abs(got - st_encode(st_path, TEXTS)).max() < ATOL
    llm.close()


def test_the_runner_follows_the_checkpoint_and_the_options(
    st_path, qwen3_path, classifier_paths
):
    assert type(LLM(qwen3_path)) is LLM
    assert isinstance(LLM(qwen3_path, task="embed"), PoolingLLM)
    assert LLM(classifier_paths[3], task="embed").default_task == "embed"
    assert LLM(classifier_paths[3]).default_task == "classify"
    with pytest.raises(ValueError, match="Qwen3Model has no LM head: it cannot"):
        LLM(st_path, runner="generate")
    with pytest.raises(ValueError, match="task='generate' does not go with"):
        LLM(st_path, runner="pooling", task="generate")
    with pytest.raises(ValueError, match="runner must be one of"):
        LLM(st_path, runner="embed")
    with pytest.raises(ValueError, match="task='classify' needs a"):
        LLM(st_path, task="classify")
    with pytest.raises(ValueError, match="data_parallel_size > 1 is not supported"):
        LLM(st_path, data_parallel_size=2)


def test_bad_input_is_a_clear_error_and_leaves_the_engine_as_it_was(
    st_path, qwen3_path
):
    llm = LLM(st_path, max_model_len=48, num_kvcache_blocks=64)
    want = st_encode(st_path, TEXTS[:1])
    cases = [
        (llm.embed, [""], None, "prompt is empty"),
        (llm.embed, [list(range(3, 52))], None, "input has 49 tokens, more than"),
        (llm.embed, ["a"], PoolingParams(dimensions=8), "not support Matryoshka"),
        (llm.embed, ["a"], PoolingParams(dimensions=0), "dimensions must be >= 1"),
        (llm.classify, ["a"], None, "needs a \\*ForSequenceClassification"),
        (llm.encode, ["a"], PoolingParams(task="embedd"), "task must be one of"),
        (llm.embed, ["a"], SamplingParams(), "it takes PoolingParams"),
        (llm.embed, [[1, 10**6]], None, "token id 1000000 is outside the vocabulary"),
        (llm.encode, ["a"], PoolingParams(task="score"), "task='score' needs a"),
        (llm.embed, [{"prompt": [1, 2]}], None, "'prompt' takes a text"),
        (llm.embed, [{"prompt_token_ids": "ab"}], None, "'prompt_token_ids' takes"),
        (
            llm.embed,
            [{"prompt": "a", "multi_modal_data": {"image": b""}}],
            None,
            "this engine takes no images",
        ),
    ]
    for method, prompts, params, message in cases:
        with pytest.raises(ValueError, match=message):
            method(["fine", *prompts], params)
        assert not llm.requests and llm.engine.is_finished()
    with pytest.raises(ValueError, match="task='score' needs a"):
        llm.encode(["a"], pooling_task="score")
    with pytest.raises(ValueError, match="task='score' needs a"):
        llm.add_request("a", PoolingParams(task="score"))
    with pytest.raises(ValueError, match="it cannot generate"):
        llm.generate("hi")
    with pytest.raises(ValueError, match="it cannot generate"):
        llm.chat([{"role": "user", "content": "hi"}])
    got = embeddings(llm.embed(TEXTS[:1], use_tqdm=False))
    assert np.abs(got - want).max() < ATOL
    with pytest.raises(ValueError, match="this engine generates"):
        LLM(qwen3_path).embed("hi")


def test_checkpoint_files_nanopaged_does_not_implement_are_named(tmp_path):
    path = write_sentence_transformer(str(tmp_path), "mean", True)
    with pytest.raises(ValueError, match="pooler_config takes pooling_type and"):
        LLM(path, pooler_config={"pooling": "MEAN"})
    with open(f"{path}/modules.json") as f:
        modules = json.load(f)
    dense = {"idx": 3, "name": "3", "path": "3_Dense", "type": "x.Dense"}
    with open(f"{path}/modules.json", "w") as f:
        json.dump(modules + [dense], f)
    with pytest.raises(ValueError, match=r"module Dense \(3_Dense\) is not"):
        LLM(path)
    with open(f"{path}/modules.json", "w") as f:
        json.dump(modules, f)
    with open(f"{path}/1_Pooling/config.json", "w") as f:
        json.dump({"pooling_mode": ["mean", "max"]}, f)
    with pytest.raises(ValueError, match=r"pools with \['mean', 'max'\]"):
        LLM(path)
    os.remove(f"{path}/1_Pooling/config.json")
    with pytest.raises(ValueError, match="cannot read .*1_Pooling/config.json"):
        LLM(path)


def test_a_pooling_sequence_shares_steps_with_generation_in_the_core(
    qwen3_path, hf_greedy
):
    """The core's seam: a sequence with max_tokens=0 and hidden_states runs its prompt
    in the same steps as a generating one, is never sampled, and ends ("length") once
    its prompt ran; the step's hidden states hold its rows."""
    from nanopaged.core.config import Config

    engine = LLMEngineCore(Config(qwen3_path, max_num_batched_tokens=16))
    prompts = random_prompts([20, 6])
    pooled = Sequence(prompts[0], SamplingOptions(max_tokens=0))
    pooled.hidden_states = True
    generating = Sequence(prompts[1], SamplingOptions(temperature=0, max_tokens=4))
    engine.add(pooled)
    engine.add(generating)
    rows, shared = [], 0
    while not engine.is_finished():
        step, sampled = engine.step()
        assert pooled not in step.sampling_seqs
        if pooled in step.seqs:
            i = step.seqs.index(pooled)
            first = sum(step.num_tokens[:i])
            rows.append(sampled.hidden_states[first : first + step.num_tokens[i]])
            shared += generating in step.seqs
    assert shared and pooled.finish_reason == "length"
    assert pooled.token_ids == prompts[0]
    model = AutoModelForCausalLM.from_pretrained(qwen3_path, dtype=torch.float32)
    with torch.no_grad():
        out = model(torch.tensor(prompts[:1]), output_hidden_states=True)
    assert torch.allclose(torch.cat(rows), out.hidden_states[-1][0], atol=ATOL)
    assert generating.token_ids[6:] == hf_greedy(qwen3_path, prompts[1:], 4)[0]


@pytest.mark.parametrize("scheduling", ["prefill-first", "mixed"])
def test_a_pooled_prompt_beside_preempted_generation_is_pooled_once(
    qwen3_path, hf_greedy, scheduling
):
    """A pool too small for three generating sequences preempts them while a long
    prompt that is never sampled runs in chunks beside them: its hidden rows come once
    each, as transformers computes them, and the generated tokens are transformers'."""
    from nanopaged.core.config import Config

    config = Config(
        qwen3_path,
        max_num_batched_tokens=16,
        kvcache_block_size=16,
        num_kvcache_blocks=8,
        scheduling=scheduling,
    )
    engine = LLMEngineCore(config)
    prompts = random_prompts([20, 20, 20, 45], seed=5)
    generating = [
        Sequence(p, SamplingOptions(temperature=0, max_tokens=40)) for p in prompts[:3]
    ]
    pooled = Sequence(prompts[3], SamplingOptions(max_tokens=0))
    pooled.hidden_states = True
    for seq in generating:
        engine.add(seq)
    rows, steps = [], 0
    while not engine.is_finished():
        if steps == 4:  # while they decode
            engine.add(pooled)
        step, sampled = engine.step()
        steps += 1
        if pooled in step.seqs:
            i = step.seqs.index(pooled)
            first = sum(step.num_tokens[:i])
            rows.append(sampled.hidden_states[first : first + step.num_tokens[i]])
    assert engine.scheduler.num_preemptions > 0 and len(rows) > 2
    model = AutoModelForCausalLM.from_pretrained(qwen3_path, dtype=torch.float32)
    with torch.no_grad():
        out = model(torch.tensor(prompts[3:]), output_hidden_states=True)
    assert torch.allclose(torch.cat(rows), out.hidden_states[-1][0], atol=ATOL)
    # transformers stops at the end-of-text token: the core here does not
    for seq, want in zip(generating, hf_greedy(qwen3_path, prompts[:3], 40)):
        assert seq.token_ids[20 : 20 + len(want)] == want


def test_a_one_token_prompt_never_sampled_makes_its_step_ragged(qwen3_path, hf_greedy):
    """A step of one-token prompts is a decode step only if each is sampled: else the
    logits of a sampled prompt would be taken from the row of one that is not."""
    from nanopaged.core.config import Config

    engine = LLMEngineCore(Config(qwen3_path))
    pooled = Sequence([11], SamplingOptions(max_tokens=0))
    generating = Sequence([7], SamplingOptions(temperature=0, max_tokens=4))
    engine.add(pooled)
    engine.add(generating)
    step, _ = engine.step()
    assert step.seqs == [pooled, generating] and step.ragged
    assert step.ended == [pooled] and step.sampling_seqs == [generating]
    while not engine.is_finished():
        engine.step()
    assert generating.token_ids[1:] == hf_greedy(qwen3_path, [[7]], 4)[0]


def test_a_bad_request_leaves_the_requests_in_flight_as_they_were(st_path):
    llm = LLM(st_path, max_num_batched_tokens=16, num_kvcache_blocks=64)
    good = llm.add_request(TEXTS[1], PoolingParams(task="embed"))
    llm.step()  # its first chunk ran
    for bad in ([], "", [10**6]):
        with pytest.raises(ValueError):
            llm.add_request(bad, PoolingParams(task="embed"))
    outputs = []
    while not llm.is_finished():
        outputs += llm.step()
    assert list(llm.requests) == [] and outputs[-1].request_id == good
    want = st_encode(st_path, TEXTS[1:2])[0]
    assert np.abs(np.array(outputs[-1].outputs.embedding) - want).max() < ATOL
