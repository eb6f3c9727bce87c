"""The shape of the package: a core of at most 1,400 code lines that imports no feature,
every module importing only modules below it (no circles), every folder one floor of
that order, and an engine that `del` frees at once."""

import ast
import gc
import io
import os
import re
import subprocess
import sys
import tokenize
import weakref

import psutil
import pytest
from conftest import random_prompts

from nanopaged import LLM, SamplingParams
from nanopaged.sampling_params import StructuredOutputsParams

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "nanopaged")
# Every module, lowest layer first: a module may import only modules before it. The
# core, in the order its files build on each other; then the features, each above what
# it uses.
LAYERS = [
    "core.sequence",
    "core.block_manager",
    "core.triton_attention",
    "core.triton_decode_attention",
    "core.layers",
    "core.attention",
    "core.model",
    "core.config",
    "core.loader",
    "core.step",
    "core.scheduler",
    "core.cuda_graphs",
    "core.sampler",
    "core.model_runner",
    "core.llm_engine",
    "core",
    "checks",
    "cpu.kernels",
    "cpu.step_graph",
    "cpu.device_thread",
    "cpu",
    "sampling.triton_kernel",
    "quantization.int4_triton",
    "quantization.dequantize",
    "quantization.fp8",
    "quantization.compressed_tensors",
    "quantization.awq",
    "quantization.gptq",
    "quantization",
    "models.moe_triton",
    "models.moe",
    "models.gemma3",
    "models.rope",
    "models.pooling",
    "models",
    "pooling.pooler",
    "pooling",
    "vision.images",
    "vision.mrope",
    "vision.model",
    "vision.gemma3",
    "vision.qwen2_5_vl",
    "vision.qwen3_vl",
    "vision.runner",
    "vision.processing",
    "vision",
    "features",
    "chat",
    "checkpoint",
    "random_checkpoint",
    "sampling_params",
    "sampling.vllm_sampler",
    "sampling.logits_processors",
    "outputs",
    "pooling.params",
    "lora.request",
    "lora.punica_triton",
    "lora.punica",
    "lora.adapter",
    "lora.runner",
    "lora.admission",
    "lora",
    "sampling.structured_outputs",
    "sampling",
    "parallel.tensor",
    "rl.weights",
    "rl.sleep",
    "rl.transfer",
    "rl.worker",
    "rl.control",
    "rl",
    "envs",
    "engine.arg_utils",
    "utils",
    "inputs",
    "beam_search",
    "engine.compat",
    "engine.training",
    "speculative",
    "async_scheduling",
    "engine.data_parallel",
    "parallel",
    "serving.router",
    "trace",
    "trace.__main__",
    "assembly",
    "engine.llm",
    "pooling.pooling_llm",
    "engine.llm_engine",
    "engine",
    "entrypoints.llm",
    "entrypoints",
    "distributed",
    "distributed.parallel_state",
    "distributed.weight_transfer.base",
    "distributed.weight_transfer.nccl_engine",
    "distributed.weight_transfer",
    "config",
    "profiler",
    "",
    "serving.tool_calls",
    "serving.openai_api",
    "serving.openai_responses",
    "serving.beam_api",
    "serving.pooling_api",
    "serving.rl_api",
    "serving.served_models",
    "serving.args",
    "serving.server",
    "serving.cli",
    "serving",
    "entrypoints.openai.api_server",
    "entrypoints.openai",
    "__main__",
]
# code lines (docstrings, comments and blanks apart) of the core as ruff writes them:
# no more than all of nano-vllm's (1,379); its Triton kernels apart, with their own
CORE_BUDGET, TRITON_BUDGET, CORE_FILE_LIMIT = 1400, 500, 250


def modules() -> dict[str, str]:
    """Module name (relative to nanopaged, "" for the package itself) -> its file."""
    found = {}
    for directory, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(directory, name)
                module = os.path.relpath(path, PACKAGE)[:-3].replace(os.sep, ".")
                found[module.removesuffix("__init__").rstrip(".")] = path
    return found


def imports(path: str, known: dict[str, str]) -> set[str]:
    """The package's modules a file imports, anywhere in it (inside functions too)."""
    found = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [f"{node.module}.{alias.name}" for alias in node.names] + [
                node.module
            ]
        else:
            continue
        for name in names:
            if name == "nanopaged" or name.startswith("nanopaged."):
                module = name.removeprefix("nanopaged").lstrip(".")
                # `from package import module` names the module itself
                if module in known:
                    found.add(module)
                    break
    return found


def core_files() -> dict[str, str]:
    return {m: p for m, p in modules().items() if m == "core" or m.startswith("core.")}


def code_lines(path: str) -> int:
    """The lines of the file as `ruff format` writes it at its defaults that are code:
    neither blank, nor a docstring, nor a comment alone (prose has no budget)."""
    text = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--isolated", "-"],
        stdin=open(path),
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    prose = set()
    for node in ast.walk(ast.parse(text)):
        body = getattr(node, "body", None)
        is_scope = isinstance(
            node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
        )
        if is_scope and body and isinstance(body[0], ast.Expr):
            if isinstance(body[0].value, ast.Constant) and isinstance(
                body[0].value.value, str
            ):
                prose.update(range(body[0].lineno, body[0].end_lineno + 1))
    lines = text.splitlines()
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if (
            token.type == tokenize.COMMENT
            and lines[token.start[0] - 1].lstrip()[0] == "#"
        ):
            prose.add(token.start[0])
    return sum(1 for i, line in enumerate(lines, 1) if line.strip() and i not in prose)


def test_the_core_is_at_most_1400_code_lines_and_its_triton_kernels_500():
    """As ruff writes them, docstrings and comments apart; no file over 250."""
    sizes = {m: code_lines(p) for m, p in core_files().items()}
    kernels = [sizes.pop(m) for m in list(sizes) if "triton" in m]  # a backend, apart
    assert sum(sizes.values()) <= CORE_BUDGET, sizes
    assert sum(kernels) <= TRITON_BUDGET, kernels
    assert max([*sizes.values(), *kernels]) <= CORE_FILE_LIMIT, sizes


def test_every_benchmark_file_is_at_most_300_lines():
    """A benchmark is a file a reader can take in whole: a mode of bench.py each."""
    folder = os.path.join(ROOT, "benchmarks")
    for name in os.listdir(folder):
        if name.endswith(".py"):
            with open(os.path.join(folder, name)) as f:
                assert len(f.read().splitlines()) <= 300, name


def test_the_repository_is_as_ruff_formats_and_lints_it():
    """`ruff format` (its defaults) and `ruff check` (pyproject's rules) change
    nothing."""
    for command in (["format", "--check"], ["check"]):
        result = subprocess.run(
            [sys.executable, "-m", "ruff", *command, ROOT],
            capture_output=True,
            text=True,
        )
        assert result.returncode == 0, result.stdout[-3000:]


def test_no_core_module_imports_a_feature():
    known = modules()
    for module, path in core_files().items():
        outside = {
            m for m in imports(path, known) if m != "core" and not m.startswith("core.")
        }
        assert not outside, (module, outside)


def test_every_module_imports_only_modules_below_it():
    known = modules()
    assert sorted(LAYERS) == sorted(known), "place each module in LAYERS"
    for module, path in known.items():
        above = [
            m for m in imports(path, known) if LAYERS.index(m) >= LAYERS.index(module)
        ]
        assert not above, f"{module} imports {above}, which are not below it"


def floor(module: str) -> str:
    """A module's node in the folders' graph: its folder under nanopaged (a folder's
    subfolders with it), or the module itself at the top of the package."""
    folder = module.partition(".")[0]
    return folder + "/" if os.path.isdir(os.path.join(PACKAGE, folder)) else module


def circle(arrows: dict[str, set[str]]) -> list[str]:
    """A circle in a graph (node -> the nodes it imports), or [] if it has none."""
    done, path = set(), []

    def visit(node: str) -> list[str]:
        if node in path:
            return path[path.index(node) :] + [node]
        if node in done:
            return []
        path.append(node)
        for target in sorted(arrows.get(node, ())):
            if found := visit(target):
                return found
        path.pop()
        done.add(node)
        return []

    for node in sorted(arrows):
        if found := visit(node):
            return found
    return []


def test_every_folder_is_one_floor():
    """Taking each folder, and each module at the top of the package, as one node: no
    import runs back up, so a folder's files stand on one floor of the layering (vLLM's
    paths, such as `entrypoints/`, name what the floors below define)."""
    known = modules()
    arrows: dict[str, set[str]] = {}
    for module, path in known.items():
        targets = {floor(m) for m in imports(path, known)} - {floor(module)}
        arrows.setdefault(floor(module), set()).update(targets)
    assert circle(arrows) == []
    # the check itself: one arrow back up (the server's path imported by the engine)
    arrows["engine/"].add("entrypoints/")
    assert circle(arrows) == ["engine/", "entrypoints/", "engine/"]


def test_a_layer_that_imports_upwards_is_caught(tmp_path):
    """The check itself: an import of a higher module fails it."""
    known = modules()
    upwards = tmp_path / "block_manager.py"
    upwards.write_text("def f():\n    from nanopaged.entrypoints.llm import LLM\n")
    assert imports(str(upwards), known) == {"entrypoints.llm"}


def nanopaged_objects() -> set[int]:
    """The ids of the live objects of nanopaged's classes (the engine, its modules and
    layers, its sequences...), unreachable ones in a reference cycle included: with the
    cyclic collector off, those stay listed."""
    return {
        id(o)
        for o in gc.get_objects()
        if str(getattr(type(o), "__module__", "")).startswith("nanopaged")
    }


@pytest.fixture
def gc_off():
    gc.collect()
    gc.disable()
    yield
    gc.enable()


def test_del_frees_the_engine_at_once(qwen3_path, gc_off):
    """No reference cycle keeps an engine alive: its model and KV cache go with the last
    name, also after requests with logprobs, stop strings, penalties and a grammar, and
    with a draft model proposing."""
    grammar = StructuredOutputsParams(regex="[ab]{3,6}")
    before = nanopaged_objects()
    llm = LLM(
        qwen3_path,
        max_model_len=256,
        num_kvcache_blocks=32,
        speculative_config={"model": qwen3_path, "num_speculative_tokens": 2},
    )
    llm.generate(
        random_prompts([5, 9], seed=3),
        [
            SamplingParams(
                max_tokens=8, logprobs=2, stop=["x"], presence_penalty=0.5, n=2
            ),
            SamplingParams(max_tokens=8, structured_outputs=grammar),
        ],
        use_tqdm=False,
    )
    kv_cache = weakref.ref(llm.engine.runner.kv_cache)
    del llm
    assert kv_cache() is None and nanopaged_objects() <= before


def worker_processes() -> list[psutil.Process]:
    return [
        p
        for p in psutil.Process().children(recursive=True)
        if "resource_tracker" not in " ".join(p.cmdline())
    ]


def test_two_tensor_parallel_engines_one_after_the_other(qwen3_path, gc_off, hf_greedy):
    """`del llm` stops the workers and leaves the process group at once: the next engine
    of the same script can start its own."""
    prompt = [5, 6, 7]
    want = hf_greedy(qwen3_path, [prompt], 8)[0]
    for _ in range(2):
        before = nanopaged_objects()
        llm = LLM(qwen3_path, max_model_len=256, tensor_parallel_size=2)
        [output] = llm.generate(
            [prompt],
            SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
            use_tqdm=False,
        )
        assert output.outputs[0].token_ids == want
        del llm, output
        assert nanopaged_objects() <= before and not worker_processes()


def test_no_core_line_assigns_two_fields_at_once():
    """`self.a, self.b = x, y` packs two facts into a line: one assignment a line in the
    core (unpacking a function's pair into plain names stays)."""
    for module, path in core_files().items():
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    if isinstance(target, ast.Tuple):
                        fields = [e for e in target.elts if not isinstance(e, ast.Name)]
                        assert not fields, (
                            f"{module}:{node.lineno} assigns {len(target.elts)}"
                        )


def test_speculation_reaches_the_core_through_one_seam(qwen3_path, hf_greedy):
    """The core knows no proposer: an engine that extends the two ends of a step (here
    one that proposes transformers' own continuation) gets its proposals verified and
    applied."""
    import inspect

    from nanopaged.core.config import Config
    from nanopaged.core.llm_engine import LLMEngineCore
    from nanopaged.core.model_runner import ModelRunner
    from nanopaged.core.scheduler import Scheduler
    from nanopaged.core.sequence import SamplingOptions, Sequence

    for cls in (Scheduler, ModelRunner, LLMEngineCore):
        # its code, past the docstring
        assert not re.search(
            r"propos(er|e\()|lookahead|speculat",
            inspect.getsource(cls).split('"""', 2)[2],
        ), cls
    prompt = [5, 6, 7]
    want = hf_greedy(qwen3_path, [prompt], 12)[0]

    class Oracle(LLMEngineCore):
        def schedule(self):
            step = super().schedule()
            for i, seq in enumerate(step.seqs):
                done = seq.num_completion_tokens
                if 0 < done < 9 and step.num_tokens[i] == 1:
                    slots = self.block_manager.reserve(seq, 3)
                    step.proposals[i] = want[done : done + slots]
            return step

        def apply(self, step, sampled):
            # the oracle's proposals are all right
            applied = super().apply(step, sampled)
            for i in step.proposals:
                self.block_manager.trim(step.seqs[i])
            return applied

    engine = Oracle(
        Config(qwen3_path, max_model_len=256),
        ModelRunner(Config(qwen3_path, max_model_len=256)),
    )
    seq = Sequence(prompt, SamplingOptions(temperature=0, max_tokens=12))
    engine.add(seq)
    steps = 0
    while not engine.is_finished():
        engine.step()
        steps += 1
    assert seq.completion_token_ids == want and steps < 12


@pytest.mark.parametrize(
    "feature",
    [
        "speculative",
        "trace",
        "engine/data_parallel.py",
        "sampling/structured_outputs.py",
        "lora",
        "quantization",
        "models",
        "cpu",
        "pooling models/pooling.py serving/pooling_api.py",
        "beam_search serving/beam_api.py",
        "sampling/triton_kernel.py",
        "rl",
        "vision",
    ],
)
def test_a_feature_deleted_leaves_a_plain_generate_working(
    feature, tmp_path, qwen3_path, hf_greedy
):
    import shutil
    import subprocess
    import sys

    copy = tmp_path / "nanopaged"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    for name in feature.split():
        if (copy / name).is_dir():  # a subpackage
            shutil.rmtree(copy / name)
        else:
            (copy / (name if "." in name else f"{name}.py")).unlink()
    script = (
        "from nanopaged import LLM, SamplingParams\n"
        f"llm = LLM({qwen3_path!r}, max_model_len=128)\n"
        "params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)\n"
        "print(llm.generate([[5, 6, 7]], params, "
        "use_tqdm=False)[0].outputs[0].token_ids)"
    )
    result = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(tmp_path)),
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == str(hf_greedy(qwen3_path, [[5, 6, 7]], 6)[0])


@pytest.mark.parametrize("missing", ["triton", "safetensors"])
def test_a_feature_skipped_only_for_an_optional_package(missing):
    """A machine without triton samples with `sampler.sample` (add_features skips
    sampling/triton_kernel.py); a feature missing any other package is an error, not a
    silent skip."""
    import subprocess
    import sys

    script = (
        f"import sys; sys.modules[{missing!r}] = None\n"
        "from nanopaged.features import add_features\n"
        "add_features()\n"
        "from nanopaged.core.sampler import SAMPLING_KERNELS\n"
        "print(SAMPLING_KERNELS.get('triton'), SAMPLING_KERNELS.get('flash'))"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    if missing == "triton":
        assert result.stdout.split() == ["None", "None"], result.stderr[-2000:]
    else:
        assert result.returncode != 0 and "safetensors" in result.stderr


def test_features_enter_the_core_only_through_add_features_and_only_add():
    """Importing every module of the package enters nothing in the core's registries
    (none calls `add_features` as it is imported: checking an engine's options does);
    `add_features` then adds the features' entries and leaves each entry the core
    defines the same object."""
    import subprocess
    import sys

    script = """
import importlib, pkgutil
import nanopaged, nanopaged.features as features
from nanopaged.checks import UNSUPPORTED
from nanopaged.core import attention, layers, loader, model, sampler

registries = dict(
    backends=attention.BACKENDS, rope=layers.ROPE_SCALINGS,
    quantizations=loader.QUANTIZATIONS, architectures=model.ARCHITECTURES,
    qk_norm=model.QK_NORM, qkv_bias=model.QKV_BIAS,
    kernels=sampler.SAMPLING_KERNELS, unsupported=UNSUPPORTED,
)
snapshot = lambda: {k: r.copy() for k, r in registries.items()}
core = snapshot()
imported = 0
for info in pkgutil.walk_packages(nanopaged.__path__, "nanopaged."):
    if info.name.endswith("__main__"):  # a command, run as it is imported
        continue
    try:
        importlib.import_module(info.name)
        imported += 1
    except ModuleNotFoundError as error:  # a server's or a GPU's package
        assert not error.name.startswith("nanopaged"), error
assert imported > 80 and snapshot() == core, "a module entered itself on import"
features.add_features()
after = snapshot()
for name, entries in core.items():
    if isinstance(entries, dict):
        assert all(after[name][key] is value for key, value in entries.items()), name
    else:
        assert entries <= after[name], name
print(sorted(k for k in after["backends"] if k not in core["backends"]),
      len(after["architectures"]) - len(core["architectures"]))
"""
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split()[0] == "['cpu']"
    assert int(result.stdout.split()[1]) >= 12  # families, pooling architectures


def test_a_plain_request_walks_at_most_55_functions_of_the_core(tmp_path):
    """docs/architecture.md's walk (benchmarks/walk.py): the core's functions one plain
    request enters, held where they are."""
    from benchmarks.walk import walk
    from nanopaged.random_checkpoint import SHAPES, write_random_checkpoint

    entered = walk(write_random_checkpoint(str(tmp_path), SHAPES["qwen3"]))
    core = [f for f in entered if f[0].startswith("core")]
    assert 40 < len(core) <= 55, core
    assert ("core/llm_engine.py", "step") in {f[:2] for f in core}
