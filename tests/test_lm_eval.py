"""lm-evaluation-harness's `local-completions` model against `nanopaged serve` scores a
multiple-choice (loglikelihood) task and a perplexity (loglikelihood_rolling) task as
its own `hf` model does on the same weights. The tasks are built from local jsonl files:
no hub."""

import json
import math

import pytest
from test_server import Server

lm_eval = pytest.importorskip("lm_eval")
pytest.importorskip("tenacity")  # lm-eval's API models need the [api] extra
pytest.importorskip("accelerate")  # and its hf model the [hf] one

TEXT = "Paged attention stores the key and value cache in fixed-size blocks. "
TASKS = {
    "tiny_mc": dict(
        output_type="multiple_choice",
        doc_to_text="{{question}}",
        doc_to_target="{{answer}}",
        doc_to_choice="{{choices}}",
        metric_list=[{"metric": "acc"}, {"metric": "acc_norm"}],
    ),
    "tiny_ppl": dict(
        output_type="loglikelihood_rolling",
        doc_to_text="",
        doc_to_target="{{text}}",
        metric_list=[
            {"metric": m}
            for m in ("word_perplexity", "byte_perplexity", "bits_per_byte")
        ],
    ),
}


def write_tasks(directory) -> None:
    docs = {
        "tiny_mc": [
            {
                "question": f"Question {i}: what does paged attention store?",
                "choices": ["blocks of keys", "a kind of cat", "the sea", "primes"],
                "answer": i % 4,
            }
            for i in range(8)
        ],
        # within one window: lm-eval cuts a longer text into windows of max_length -
        # 2 tokens for its API models and of max_length for its hf model, so that
        # past one window the two score different windows whatever the server
        "tiny_ppl": [{"text": TEXT * repeat} for repeat in (1, 4, 12)],
    }
    for name, task in TASKS.items():
        data = directory / f"{name}.jsonl"
        data.write_text("\n".join(json.dumps(doc) for doc in docs[name]))
        config = dict(
            task=name,
            dataset_path="json",
            test_split="test",
            dataset_kwargs={"data_files": {"test": str(data)}},
            **task,
        )
        (directory / f"{name}.yaml").write_text(json.dumps(config))  # JSON is YAML


def evaluate(model: str, model_args: str, tasks_dir) -> dict:
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=list(TASKS),
        # these tasks only: indexing lm-eval's thousands
        # takes seconds
        task_manager=TaskManager(include_path=str(tasks_dir), include_defaults=False),
        log_samples=True,
        device="cpu",
    )


def loglikelihoods(result: dict, task: str) -> list[float]:
    # (loglikelihood, is_greedy) per choice, or one rolling loglikelihood per text
    return [
        response if isinstance(response, float) else response[0]
        for sample in result["samples"][task]
        for response in sample["filtered_resps"]
    ]


def test_local_completions_scores_as_transformers(qwen3_path, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    write_tasks(tmp_path)
    server = Server(qwen3_path, "--max-model-len", "512", "--kvcache-block-size", "16")
    try:
        served = evaluate(
            "local-completions",
            f"base_url={server.url}/v1/completions,model=tiny,"
            f"max_length=256,num_concurrent=1,max_retries=1",
            tmp_path,
        )
    finally:
        server.stop()
    reference = evaluate(
        "hf", f"pretrained={qwen3_path},dtype=float32,max_length=256", tmp_path
    )
    for task in TASKS:
        ours, theirs = loglikelihoods(served, task), loglikelihoods(reference, task)
        assert len(ours) == len(theirs) > 0 and all(-math.inf < lp < 0 for lp in ours)
        assert ours == pytest.approx(theirs, abs=1e-3)
    for metric in ("acc,none", "acc_norm,none"):
        assert (
            served["results"]["tiny_mc"][metric]
            == reference["results"]["tiny_mc"][metric]
        )
    for metric in (
        "word_perplexity,none",
        "byte_perplexity,none",
        "bits_per_byte,none",
    ):
        assert served["results"]["tiny_ppl"][metric] == pytest.approx(
            reference["results"]["tiny_ppl"][metric], rel=1e-3
        )
