"""What the README promises holds: every option it lists, with the default it states, and the
resolved values it describes on this machine."""
import os
import re
import subprocess
import sys
from dataclasses import MISSING, fields

import pytest

from nanopaged import LLM, EngineArgs, SamplingParams
from nanopaged.engine_args import ALIASES, HINTS, OPTIONS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def readme_options() -> dict[str, str]:
    """The README's option table: name -> its stated default."""
    with open(os.path.join(ROOT, "README.md")) as f:
        table = f.read().split("| option | default | meaning |\n")[1].split("\n\n")[0]
        rows = re.findall(r"^\| `(\w+)` \| ([^|]*) \|", table, re.MULTILINE)
    return {name: default.strip() for name, default in rows}


def test_the_readme_lists_every_option_with_its_default():
    documented = readme_options()
    options = {f.name: f.default for f in fields(EngineArgs)
               if f.name not in ("model", *HINTS, *ALIASES, "guided_decoding_backend")}
    assert set(documented) == set(options)
    for name, default in options.items():
        if default is not MISSING and default is not None:  # a literal the table must state
            stated = documented[name].split(":")[0].strip("` ")
            assert stated == str(default), (name, stated, default)


def test_the_defaults_the_readme_describes_on_a_cpu(qwen3_path):
    llm = LLM(qwen3_path)
    config = llm.config
    assert (config.device, config.dtype.__repr__(), config.attention_backend) == \
        ("cpu", "torch.float32", "cpu")
    assert config.kvcache_block_size == 16  # without flash-attn
    assert config.max_model_len == config.hf_config.max_position_embeddings
    assert llm.tokenizer.name_or_path == config.model


def test_sampling_defaults_are_vllms():
    params = SamplingParams()
    assert (params.n, params.temperature, params.top_p, params.top_k, params.max_tokens,
            params.min_tokens, params.logprobs, params.skip_special_tokens) == \
        (1, 1.0, 1.0, 0, 16, 0, None, True)


def test_the_readme_api_snippet_runs_on_any_checkpoint(qwen3_path, capsys):
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    snippet = re.search(r"## The API.*?```python\n(.*?)```", readme, re.DOTALL).group(1)
    exec(snippet.replace('"Qwen/Qwen3-0.6B"', repr(qwen3_path)), {})
    assert capsys.readouterr().out.strip()  # it printed the answers


@pytest.mark.parametrize("command", [["example.py"], ["bench.py"],
                                     ["-m", "nanopaged.cli", "serve"]])
def test_help_loads_neither_torch_nor_transformers(command):
    """`--help` answers at once: nothing heavy is imported before the arguments are read."""
    result = subprocess.run([sys.executable, "-X", "importtime", *command, "--help"], cwd=ROOT,
                            capture_output=True, text=True, timeout=60,
                            env=dict(os.environ, PYTHONPATH=ROOT))
    assert result.returncode == 0 and "usage:" in result.stdout
    imported = {line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines()}
    assert not {"torch", "transformers", "numpy"} & imported


def test_serve_help_says_what_it_serves_uncut():
    result = subprocess.run([sys.executable, "-m", "nanopaged.cli", "serve", "--help"], cwd=ROOT,
                            capture_output=True, text=True, timeout=60,
                            env=dict(os.environ, PYTHONPATH=ROOT))
    described = " ".join(result.stdout.split("\n\n")[1].split())
    assert described.startswith("Serve a model") and described.endswith(
        "Clients name the model by --served-model-name (default: MODEL).")


def test_every_option_has_its_groups_default_and_type():
    """engine_args.OPTIONS (read by --help without torch) agrees with the dataclasses that
    check the options: the core's Config, scaling out's ParallelConfig."""
    from nanopaged.core.config import Config
    from nanopaged.parallel import ParallelConfig
    for cls in (Config, ParallelConfig):
        for f in fields(cls):
            if f.init and f.name != "model":
                kind, default, _ = OPTIONS[f.name]
                assert default == f.default, f.name
                assert kind == f.type or f.name == "dtype", f.name  # a torch.dtype is its name
