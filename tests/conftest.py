"""Tiny random-weight checkpoints of each supported architecture, and transformers as
the reference."""

import functools
import multiprocessing.forkserver
import os
import signal

import pytest

# `-n auto`: a worker per core, one torch thread each
if "PYTEST_XDIST_WORKER" in os.environ:
    os.environ["OMP_NUM_THREADS"] = "1"
import torch

# run Triton kernels on CPU tensors; must precede importing triton
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from nanopaged.core.attention import AttentionMetadata
from nanopaged.core.step import SamplerOutput
from nanopaged.features import add_features
from nanopaged.random_checkpoint import (
    CORPUS,
    SHAPES,
    TINY_QWEN3,
    write_random_checkpoint,
)

# the tests read the registries the features fill (the CPU backend's kernels, the
# families' classes) also without an engine: filled as an engine's assembly fills them
add_features()

TINY = {
    "qwen3": TINY_QWEN3,
    "qwen2": dict(TINY_QWEN3, architectures=["Qwen2ForCausalLM"], model_type="qwen2"),
    "llama": dict(
        TINY_QWEN3,
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        tie_word_embeddings=False,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
}
ARCHITECTURES = list(TINY)  # the core's
# the families of nanopaged/models/: mixtures of experts, sliding windows
FAMILIES = {
    "qwen3-moe": SHAPES["qwen3-moe"],
    "mixtral": SHAPES["mixtral"],
    "mistral": SHAPES["mistral"],
    "qwen2-sliding": dict(
        TINY["qwen2"], use_sliding_window=True, sliding_window=24, max_window_layers=1
    ),  # layer 0 attends fully, layer 1 slides
    "gemma3": SHAPES["gemma3"],
}
TINY.update(FAMILIES)


@functools.cache
def ctrl_c_as_at_a_terminal() -> None:
    """For a child process that a test interrupts: Ctrl-C (SIGINT) raises
    KeyboardInterrupt there even where the tests run in a background job, whose
    children start with it ignored (as Python then leaves it)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def checkpoint(arch: str, root: str) -> str:
    # a wide initialisation spreads the logits, so greedy argmax has no near-ties
    return write_random_checkpoint(
        f"{root}/{arch}", TINY[arch], seed=0, initializer_range=0.1
    )


def pytest_xdist_auto_num_workers(config) -> int:
    """`-n auto`: the cores this process may use, as the engine counts them (affinity
    and cgroup quota), not the machine's."""
    from nanopaged.cpu import usable_cores

    return usable_cores()


@pytest.fixture(scope="module", autouse=True)
def no_fork_server_left():
    """bench runs each engine in a child of multiprocessing's fork server (started on
    its first run); stopped after each module, so that tests counting an engine's
    processes see only theirs. `_stop` is the method CPython's own tests stop it
    with."""
    yield
    multiprocessing.forkserver._forkserver._stop()


@pytest.fixture(scope="session")
def checkpoint_root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("checkpoints"))


@pytest.fixture(scope="session")
def qwen3_path(checkpoint_root) -> str:
    return checkpoint("qwen3", checkpoint_root)


@pytest.fixture(scope="session")
def metaspace_path(checkpoint_root) -> str:
    """A Llama checkpoint whose tokenizer is SentencePiece-style (Metaspace), as Llama
    2's and Mistral's: a word's leading space is part of its token, and dropped at the
    start of a text."""
    path = write_random_checkpoint(
        f"{checkpoint_root}/metaspace", TINY["llama"], seed=1
    )
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if os.path.exists(f"{path}/{name}"):
            os.remove(f"{path}/{name}")
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    tokenizer.decoder = decoders.Metaspace(prepend_scheme="first")
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False
    )
    tokenizer.train_from_iterator([CORPUS], trainer)
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="</s>", bos_token="<s>", unk_token="<unk>"
    ).save_pretrained(path)
    return path


class ScriptedRunner:
    """Stands in for the model runner: records every step, and samples the same token on
    every row: `token`, or the next of `script` while it lasts."""

    def __init__(self, token: int = 7, script: list[int] = ()):
        self.token, self.script, self.steps = token, list(script), []

    def launch(self, step, pending=None):
        self.steps.append(step)
        return step

    def collect(self, step):
        token = self.script.pop(0) if self.script else self.token
        return SamplerOutput([[token] for _ in step.sampling_seqs])


@pytest.fixture(scope="session")
def model_path(checkpoint_root):
    """model_path(arch) -> the path of that architecture's tiny checkpoint."""
    return lambda arch: checkpoint(arch, checkpoint_root)


@functools.cache
def _hf_model(path: str):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@functools.cache
def _hf_greedy(path: str, prompt: tuple[int, ...], max_tokens: int) -> list[int]:
    model = _hf_model(path)
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False
        )
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="session")
def hf_greedy():
    """hf_greedy(path, prompts, max_tokens) -> transformers' greedy completions, one per
    prompt."""
    return lambda path, prompts, max_tokens: [
        _hf_greedy(path, tuple(p), max_tokens) for p in prompts
    ]


def added_text(tokenizer, prompt_ids: list[int], completion_ids: list[int]) -> str:
    """The text a completion adds to its prompt's: what its `text` must be (special
    tokens skipped)."""

    def decode(ids):
        return tokenizer.decode(ids, skip_special_tokens=True)

    return decode(list(prompt_ids) + list(completion_ids))[len(decode(prompt_ids)) :]


def random_prompts(
    lengths: list[int], vocab_size: int = 512, seed: int = 0
) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab_size, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture
def hf_model():
    """hf_model(path) -> the transformers model of a checkpoint (float32, cached)."""
    return _hf_model


@pytest.fixture
def offline_hub(tmp_path, monkeypatch):
    """An empty Hugging Face cache in a temp dir, with the hub offline; returns the
    cache dir."""
    import huggingface_hub.constants

    cache = tmp_path / "hf-cache"
    cache.mkdir()
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return cache


# ---- paged KV caches for the attention backends' tests ----

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HEAD_DIM = 16


def paged_cache(block_size: int, context_lens: list[int], num_kv_heads: int, seed: int):
    """A random KV cache and block tables that scatter each sequence over shuffled
    blocks."""
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in context_lens]
    num_blocks = sum(blocks_per_seq) + 3
    order = torch.randperm(num_blocks, generator=g).tolist()
    tables = torch.full((len(context_lens), max(blocks_per_seq)), -1, dtype=torch.int32)
    for i, n in enumerate(blocks_per_seq):
        tables[i, :n] = torch.tensor([order.pop() for _ in range(n)])
    shape = (num_blocks, block_size, num_kv_heads, HEAD_DIM)
    k_cache, v_cache = (torch.randn(shape, generator=g).to(DEVICE) for _ in range(2))
    return k_cache, v_cache, tables.to(DEVICE)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def metadata(
    context_lens: list[int], tables: torch.Tensor, **ragged
) -> AttentionMetadata:
    """A decode step's metadata, or a ragged step's with `cu_seqlens_q` and
    `max_seqlen_q`."""
    lens = torch.tensor(context_lens, dtype=torch.int32, device=DEVICE)
    return AttentionMetadata(
        ragged=bool(ragged),
        slot_mapping=torch.empty(0, device=DEVICE),
        context_lens=lens,
        block_tables=tables,
        max_seqlen_k=max(context_lens),
        **ragged,
    )
