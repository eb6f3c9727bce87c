"""What the vLLM-facing engine reads of a checkpoint beyond its weights: where it is (a local
directory, or a Hugging Face id found in the cache or downloaded), its tokenizer, its EOS ids and
its default sampling settings."""
import json
import os

from transformers import AutoTokenizer, GenerationConfig, PretrainedConfig, PreTrainedTokenizerBase

# What the engine reads of a Hugging Face repository: configs, tokenizer files, weights.
MODEL_FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken"]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
GENERATION_SETTINGS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                       "min_p": "min_p", "repetition_penalty": "repetition_penalty",
                       "max_new_tokens": "max_tokens"}


def resolve_model(model: str) -> str:
    """The local directory of `model`: the directory itself, or a Hugging Face id found in the
    local cache or else downloaded (only the files the engine reads). A path (absolute, or
    starting with . or ~) that is not a directory is a ValueError saying so."""
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
            f"model {model!r} is not a local directory, and as a Hugging Face id it is neither in "
            f"the cache nor downloadable ({type(error).__name__}); download it where there is "
            f"network (`hf download {model}`) and copy the cache here, or pass the directory of "
            f"a checkpoint") from None


def load_tokenizer(path: str) -> PreTrainedTokenizerBase:
    # without these, transformers makes an empty tokenizer rather than fail
    if not any(os.path.exists(os.path.join(path, f)) for f in TOKENIZER_FILES):
        raise ValueError(f"cannot load the tokenizer of {path!r}: it has none of "
                         f"{', '.join(TOKENIZER_FILES)}")
    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as error:
        raise ValueError(f"cannot load the tokenizer of {path!r}: {error}") from None


def eos_token_ids(path: str, hf_config: PretrainedConfig, tokenizer: PreTrainedTokenizerBase
                  ) -> frozenset[int]:
    """The generation config's EOS ids, else the model config's, else the tokenizer's."""
    eos = None
    if os.path.exists(os.path.join(path, "generation_config.json")):
        eos = GenerationConfig.from_pretrained(path).eos_token_id
    for fallback in (getattr(hf_config, "eos_token_id", None), tokenizer.eos_token_id):
        eos = fallback if eos is None else eos
    return frozenset([] if eos is None else eos if isinstance(eos, list) else [eos])


def generation_defaults(path: str, generation_config: str) -> dict:
    """The sampling settings of the generation config that `generation_config` names ("auto":
    the checkpoint's at `path`, "vllm": none, or a directory), with SamplingParams' names, as
    vLLM takes them (temperature, top_p, top_k, min_p, repetition_penalty, and max_new_tokens
    as max_tokens)."""
    if generation_config == "vllm":
        return {}
    directory = path if generation_config == "auto" else generation_config
    file = os.path.join(directory, "generation_config.json")
    if not os.path.exists(file):
        if generation_config != "auto":
            raise ValueError(f"generation_config={directory!r} has no generation_config.json")
        return {}
    with open(file) as f:
        settings = json.load(f)
    return {ours: settings[theirs] for theirs, ours in GENERATION_SETTINGS.items()
            if settings.get(theirs) is not None}
