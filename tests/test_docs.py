"""What the docs promise holds: every option docs/options.md lists, with the default it
states, the resolved values it describes on this machine, and commands that answer at
once."""

import os
import re
import subprocess
import sys
from dataclasses import MISSING, fields

import pytest
import torch

from nanopaged import LLM, EngineArgs, SamplingParams
from nanopaged.core.config import Config
from nanopaged.engine.arg_utils import ALIASES, HINTS, OPTIONS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def readme_options() -> dict[str, str]:
    """docs/options.md's table: name -> its stated default."""
    with open(os.path.join(ROOT, "docs", "options.md")) as f:
        table = f.read().split("| option | default | meaning |\n")[1].split("\n\n")[0]
        rows = re.findall(r"^\| `(\w+)` \| ([^|]*) \|", table, re.MULTILINE)
    return {name: default.strip() for name, default in rows}


def test_the_readme_lists_every_option_with_its_default():
    documented = readme_options()
    options = {
        f.name: f.default
        for f in fields(EngineArgs)
        if f.name not in ("model", *HINTS, *ALIASES, "guided_decoding_backend")
    }
    assert set(documented) == set(options)
    for name, default in options.items():
        # a literal the table must state
        if default is not MISSING and default is not None:
            stated = documented[name].split(":")[0].strip("` ")
            assert stated == str(default), (name, stated, default)


def test_the_defaults_the_readme_describes_on_a_cpu(qwen3_path):
    llm = LLM(qwen3_path)
    config = llm.config
    assert (config.device, config.dtype.__repr__(), config.attention_backend) == (
        "cpu",
        "torch.float32",
        "cpu",
    )
    assert config.kvcache_block_size == 16  # without flash-attn
    assert config.max_model_len == config.hf_config.max_position_embeddings
    assert llm.tokenizer.name_or_path == config.model


def test_a_steps_token_budget_is_16384_on_a_gpu_and_4096_on_a_cpu(
    qwen3_path, monkeypatch
):
    assert Config(qwen3_path).max_num_batched_tokens == 4096
    assert Config(qwen3_path, max_num_batched_tokens=100).max_num_batched_tokens == 100
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert Config(qwen3_path, attention_backend="torch").max_num_batched_tokens == 16384


def test_default_sampling_samples_16_tokens_from_the_whole_distribution(qwen3_path):
    """SamplingParams() as vLLM's: temperature 1 over the whole vocabulary (not greedy:
    two engine seeds give two texts; one seed, one), 16 tokens, one sample."""
    prompts = [[5, 6, 7]] * 4
    runs = [
        [
            o.outputs
            for o in LLM(qwen3_path, seed=seed, generation_config="vllm").generate(
                prompts, SamplingParams(ignore_eos=True), use_tqdm=False
            )
        ]
        for seed in (0, 0, 1)
    ]
    tokens = [[completions[0].token_ids for completions in run] for run in runs]
    assert all(
        len(completions) == 1 and len(completions[0].token_ids) == 16
        for run in runs
        for completions in run
    )
    assert tokens[0] == tokens[1] != tokens[2]
    assert len({tuple(t) for t in tokens[0]}) > 1  # the batch's samples differ too


@pytest.mark.parametrize(
    "command", [["example.py"], ["bench.py"], ["-m", "nanopaged.serving.cli", "serve"]]
)
def test_help_loads_neither_torch_nor_transformers(command):
    """`--help` answers at once: nothing heavy is imported before the arguments are
    read."""
    result = subprocess.run(
        [sys.executable, "-X", "importtime", *command, "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ, PYTHONPATH=ROOT),
    )
    assert result.returncode == 0 and "usage:" in result.stdout
    imported = {line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines()}
    assert not {"torch", "transformers", "numpy"} & imported


def test_serve_help_says_what_it_serves_uncut():
    result = subprocess.run(
        [sys.executable, "-m", "nanopaged.serving.cli", "serve", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ, PYTHONPATH=ROOT),
    )
    described = " ".join(result.stdout.split("\n\n")[1].split())
    assert described.startswith("Serve a model") and described.endswith(
        "Clients name the model by --served-model-name (default: MODEL)."
    )


def test_every_option_has_its_groups_default_and_type():
    """arg_utils.OPTIONS (read by --help without torch) agrees with the dataclasses
    that check the options: the core's Config, scaling out's ParallelConfig."""
    from nanopaged.core.config import Config
    from nanopaged.parallel.tensor import ParallelConfig

    for cls in (Config, ParallelConfig):
        for f in fields(cls):
            if f.init and f.name not in ("model", "hf_config"):
                kind, default, _ = OPTIONS[f.name]
                # vLLM's name of the default, as make_config gives it to the core
                default = {"kv_cache_dtype": {"auto": None}}.get(f.name, {}).get(
                    default, default
                )
                assert default == f.default, f.name
                # a torch.dtype is its name
                assert kind == f.type or f.name in ("dtype", "kv_cache_dtype"), f.name
