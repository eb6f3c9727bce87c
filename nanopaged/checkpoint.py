"""What the vLLM-facing engine reads of a checkpoint beyond its weights: where it is (a
local directory, or a Hugging Face id found in the cache or downloaded), its tokenizer,
its EOS ids and its default sampling settings."""

import json
import os

from transformers import (
    AutoConfig,
    AutoTokenizer,
    GenerationConfig,
    PretrainedConfig,
    PreTrainedTokenizerBase,
)

from nanopaged.checks import UNSUPPORTED, unsupported_fields

# What the engine reads of a Hugging Face repository: configs, tokenizer files, weights.
MODEL_FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken"]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
# the architectures that pool (vLLM's pooling runner): bare decoders, classifiers
POOLING_SUFFIXES = ("Model", "ForSequenceClassification")
POOLING_TASKS = ("embed", "classify", "score")
GENERATION_SETTINGS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def resolve_model(model: str) -> str:
    """The local directory of `model`: the directory itself, or a Hugging Face id found
    in the local cache or else downloaded (only the files the engine reads). A path
    (absolute, or starting with . or ~) that is not a directory is a ValueError saying
    so."""
    if os.path.isdir(os.path.expanduser(model)):
        return os.path.expanduser(model)
    if os.path.isabs(model) or model.startswith((".", "~")):
        raise ValueError(f"model {model!r}: no such directory")
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(model, local_files_only=True)
    except Exception:
        pass
    try:
        return snapshot_download(model, allow_patterns=MODEL_FILES)
    except Exception as error:
        raise ValueError(
            f"model {model!r} is not a local directory, and as a Hugging Face id it is "
            f"neither in the cache nor downloadable ({type(error).__name__}); download "
            f"it where there is network (`hf download {model}`) and copy the cache "
            "here, or pass the directory of a checkpoint (`python -m "
            "nanopaged.random_checkpoint DIR` writes a small random one to try)"
        ) from None


def pools(architecture: str) -> bool:
    return architecture.endswith(POOLING_SUFFIXES)


def choose_runner(model: str, options: dict) -> str:
    """The runner, "generate" or "pooling": the `runner` option (or vLLM's older
    `task`), and for "auto" what the checkpoint is: one whose first architecture
    `pools`, or a Sentence Transformers model (a `modules.json`: Qwen3-Embedding's
    decoder is a causal LM's). An option or a checkpoint it cannot read is left to the
    engine's checks ("generate")."""
    runner, task = options.get("runner", "auto"), options.get("task")
    if task is not None and task not in ("auto", "generate", *POOLING_TASKS):
        return "generate"  # split_options names the bad value
    wanted = {None: None, "auto": None, "generate": "generate"}.get(task, "pooling")
    if runner != "auto" and wanted not in (None, runner):
        raise ValueError(f"task={task!r} does not go with runner={runner!r}")
    if runner != "auto" or wanted:
        return runner if runner != "auto" else wanted
    try:
        path = resolve_model(model)
        with open(os.path.join(path, "config.json")) as f:
            architectures = json.load(f).get("architectures") or [""]
    except (OSError, ValueError, AttributeError):
        return "generate"
    sentence_transformers = os.path.exists(os.path.join(path, "modules.json"))
    return "pooling" if pools(architectures[0]) or sentence_transformers else "generate"


def checkpoint_architecture(config: PretrainedConfig) -> str:
    """The architecture a checkpoint's model is built as: its first that nanopaged
    has."""
    from nanopaged.core.model import ARCHITECTURES

    return next(a for a in config.architectures if a in ARCHITECTURES)


def read_checkpoint_config(path: str) -> PretrainedConfig:
    """The config of the checkpoint at `path`, once its architecture and fields are
    known to be supported: a ValueError names the first that is not."""
    from nanopaged.core.loader import QUANTIZATIONS  # torch: only once a model is read
    from nanopaged.core.model import ARCHITECTURES
    from nanopaged.features import add_features

    add_features()

    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(
            f"{path!r} has no config.json: it is not a Hugging Face checkpoint"
        )
    try:
        config = AutoConfig.from_pretrained(path)
    except Exception as error:
        raise ValueError(
            f"cannot read {os.path.join(path, 'config.json')}: {error}"
        ) from None
    architectures = getattr(config, "architectures", None) or []
    if not set(architectures) & set(ARCHITECTURES):
        raise ValueError(
            f"unsupported architecture {architectures}; nanopaged supports "
            f"{', '.join(ARCHITECTURES)}"
        )
    flatten_text_config(config)
    architecture = checkpoint_architecture(config)
    found = UNSUPPORTED.get(architecture, unsupported_fields)(config)
    quant = getattr(config, "quantization_config", None)
    if quant and quant.get("quant_method") not in QUANTIZATIONS:
        found["quant_method"] = quant.get("quant_method", "none")
    for name, value in found.items():
        shown = f"{name}={value!r}" if value not in (None, True) else name
        raise ValueError(
            f"the checkpoint's config has {shown}, which nanopaged does not implement"
        )
    return config


def flatten_text_config(config: PretrainedConfig) -> None:
    """A vision-language config keeps its language model's fields in `text_config`:
    they are given to it as its own (where it has none of that name), as the engine
    reads a decoder's config (its vocabulary, its layers, its positions)."""
    text = config.get_text_config()
    if text is config:
        return
    for name, value in text.to_dict().items():
        if not hasattr(config, name):
            setattr(config, name, value)


def is_multimodal(config: PretrainedConfig) -> bool:
    """Whether the checkpoint takes images (its config has a vision tower's)."""
    return getattr(config, "vision_config", None) is not None


def load_tokenizer(path: str) -> PreTrainedTokenizerBase:
    # without these, transformers makes an empty tokenizer rather than fail
    if not any(os.path.exists(os.path.join(path, f)) for f in TOKENIZER_FILES):
        raise ValueError(
            f"cannot load the tokenizer of {path!r}: it has none of "
            f"{', '.join(TOKENIZER_FILES)}"
        )
    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as error:
        raise ValueError(f"cannot load the tokenizer of {path!r}: {error}") from None


def eos_token_ids(
    path: str, hf_config: PretrainedConfig, tokenizer: PreTrainedTokenizerBase
) -> frozenset[int]:
    """The generation config's EOS ids, else the model config's, else the
    tokenizer's."""
    eos = None
    if os.path.exists(os.path.join(path, "generation_config.json")):
        eos = GenerationConfig.from_pretrained(path).eos_token_id
    for fallback in (getattr(hf_config, "eos_token_id", None), tokenizer.eos_token_id):
        eos = fallback if eos is None else eos
    return frozenset([] if eos is None else eos if isinstance(eos, list) else [eos])


def generation_defaults(path: str, generation_config: str) -> dict:
    """The sampling settings of the generation config that `generation_config` names
    ("auto": the checkpoint's at `path`, "vllm": none, or a directory), with
    SamplingParams' names, as vLLM takes them (temperature, top_p, top_k, min_p,
    repetition_penalty, and max_new_tokens as max_tokens)."""
    if generation_config == "vllm":
        return {}
    directory = path if generation_config == "auto" else generation_config
    file = os.path.join(directory, "generation_config.json")
    if not os.path.exists(file):
        if generation_config != "auto":
            raise ValueError(
                f"generation_config={directory!r} has no generation_config.json"
            )
        return {}
    with open(file) as f:
        settings = json.load(f)
    return {
        ours: settings[theirs]
        for theirs, ours in GENERATION_SETTINGS.items()
        if settings.get(theirs) is not None
    }
