"""How a checkpoint pools, and the pooling itself.

What the checkpoint declares: Sentence Transformers' files (`modules.json`, its Pooling
module's `config.json`, a Normalize module, the prompts of
`config_sentence_transformers.json`), else vLLM's defaults (the last token, normalized);
the option `pooler_config` overrides them as vLLM's does. A sequence's hidden states
come a chunk at a time (chunked prefill): `Pooling` folds each in, so that a long input
never holds more than one chunk's rows."""

import json
import math
import os
from dataclasses import dataclass

import torch
from tokenizers import normalizers

# Sentence Transformers' pooling modes (all but "all": one vector per input)
MODES = ("lasttoken", "mean", "cls", "max", "mean_sqrt_len_tokens", "weightedmean")
# vLLM's pooling_type -> the mode
VLLM_TYPES = {"LAST": "lasttoken", "MEAN": "mean", "CLS": "cls", "ALL": "all"}
# Sentence Transformers' older Pooling config: one flag per mode
LEGACY_FLAGS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}


@dataclass
class PoolerConfig:
    """`mode` (one of MODES), whether embeddings are `normalize`d (L2), the `prompt` put
    before each text input (Sentence Transformers' default prompt), whether a text is
    rendered as a `chat` (Sentence Transformers 6's "message" modality: the prompt as
    the system message, the text as the user's), whether texts are lowercased first
    (`lowercase`: Sentence Transformers' `do_lower_case`), the longest input
    `max_seq_length`, and the Matryoshka `dimensions` an embedding may be cut to (None:
    it may not; empty: any)."""

    mode: str = "lasttoken"
    normalize: bool = True
    prompt: str = ""
    chat: bool = False
    lowercase: bool = False
    max_seq_length: int | None = None
    dimensions: list[int] | None = None


def read_pooler_config(path: str, hf_config, overrides: dict | None) -> PoolerConfig:
    """The pooling the checkpoint at `path` declares, with vLLM's `pooler_config`
    overrides (`pooling_type`, `normalize`). What nanopaged does not implement (a Dense
    module, concatenated modes, a prompt excluded from pooling) is a ValueError."""
    config = PoolerConfig()
    modules_file = os.path.join(path, "modules.json")
    if os.path.exists(modules_file):
        config.normalize = False  # unless it has a Normalize module
        for module in _read_json(modules_file, list):
            _read_module(path, module, config)
    bert_file = os.path.join(path, "sentence_bert_config.json")
    if os.path.exists(bert_file):
        bert = _read_json(bert_file, dict)
        config.chat = "message" in (bert.get("modality_config") or {})
        config.max_seq_length = bert.get("max_seq_length")
        config.lowercase = bert.get("do_lower_case") is True
    st_file = os.path.join(path, "config_sentence_transformers.json")
    if os.path.exists(st_file):
        st = _read_json(st_file, dict)
        name = st.get("default_prompt_name")
        config.prompt = (st.get("prompts") or {}).get(name, "") if name else ""
    matryoshka = getattr(hf_config, "matryoshka_dimensions", None)
    if matryoshka or getattr(hf_config, "is_matryoshka", False):
        config.dimensions = list(matryoshka or [])
    _override(config, overrides or {})
    return config


def lowercase_texts(tokenizer) -> None:
    """Makes `tokenizer` lowercase each text before its own normalizer, as Sentence
    Transformers does for `do_lower_case`: a chat's text too, but no special token."""
    backend = tokenizer.backend_tokenizer
    own = backend.normalizer
    steps = list(own) if isinstance(own, normalizers.Sequence) else [own] if own else []
    if not any(isinstance(step, normalizers.Lowercase) for step in steps):
        backend.normalizer = normalizers.Sequence([normalizers.Lowercase(), *steps])


def _read_module(path: str, module: dict, config: PoolerConfig) -> None:
    kind = str(module.get("type", "")).rsplit(".", 1)[-1]
    where = module.get("path", "")
    if kind == "Transformer" and where == "":
        return
    if kind == "Normalize":
        config.normalize = True
    elif kind == "Pooling":
        settings = _read_json(os.path.join(path, where, "config.json"), dict)
        modes = (
            settings.get("pooling_mode")
            or [mode for flag, mode in LEGACY_FLAGS.items() if settings.get(flag)]
            or ["mean"]
        )
        modes = [modes] if isinstance(modes, str) else list(modes)
        if len(modes) != 1 or modes[0] not in MODES:
            raise ValueError(
                f"{where}/config.json pools with {modes}; nanopaged implements one "
                f"mode of {', '.join(MODES)}"
            )
        if settings.get("include_prompt", True) is False:
            raise ValueError(
                f"{where}/config.json excludes the prompt from pooling "
                "(include_prompt: false), which nanopaged does not implement"
            )
        config.mode = modes[0]
    else:
        raise ValueError(
            f"the checkpoint's Sentence Transformers module {kind} ({where or '.'}) "
            "is not implemented by nanopaged (it implements Transformer, Pooling, "
            "Normalize)"
        )


def _override(config: PoolerConfig, overrides: dict) -> None:
    unknown = set(overrides) - {"pooling_type", "normalize"}
    if unknown:
        raise ValueError(
            f"pooler_config takes pooling_type and normalize, got {sorted(unknown)}"
        )
    if "pooling_type" in overrides:
        kind = str(overrides["pooling_type"]).upper()
        if kind not in VLLM_TYPES:
            raise ValueError(
                f"pooler_config's pooling_type must be one of {', '.join(VLLM_TYPES)}, "
                f"got {overrides['pooling_type']!r}"
            )
        config.mode = VLLM_TYPES[kind]
    if "normalize" in overrides:
        if not isinstance(overrides["normalize"], bool):
            raise ValueError("pooler_config's normalize must be true or false")
        config.normalize = overrides["normalize"]


def _read_json(file: str, kind: type):
    try:
        with open(file) as f:
            value = json.load(f)
    except (OSError, ValueError) as error:
        raise ValueError(f"cannot read {file}: {error}") from None
    if not isinstance(value, kind):
        raise ValueError(f"{file} must hold a JSON {kind.__name__}")
    return value


class Pooling:
    """One sequence's pooling, as its chunks run: `add(rows, start)` folds in the hidden
    states of its tokens `start:start + len(rows)`; `result()`, once its last token has
    run, is the pooled vector (float32; for "all", one row per token). A chunk from
    position 0 starts over (the sequence was recomputed). Every mode but the last
    token's needs every token: such a sequence must not be served from the prefix
    cache."""

    def __init__(self, mode: str, length: int):
        self.mode, self.length = mode, length
        self.value: torch.Tensor | None = None
        self.parts: list[torch.Tensor] = []

    @property
    def needs_every_token(self) -> bool:
        return self.mode != "lasttoken"

    def add(self, rows: torch.Tensor, start: int) -> None:
        rows, end = rows.float(), start + len(rows)
        if start == 0:
            self.value, self.parts = None, []
        if self.mode == "lasttoken":
            if end == self.length:
                self.value = rows[-1].clone()
        elif self.mode == "cls":
            if start == 0:
                self.value = rows[0].clone()
        elif self.mode == "all":
            self.parts.append(rows.clone())
        elif self.mode == "max":
            part = rows.max(dim=0).values
            self.value = part if self.value is None else self.value.maximum(part)
        else:  # the sums: mean, mean_sqrt_len_tokens, weightedmean
            if self.mode == "weightedmean":  # weights 1, 2, ... by position
                weights = torch.arange(start + 1, end + 1, device=rows.device)
                rows = rows * weights[:, None]
            part = rows.sum(dim=0)
            self.value = part if self.value is None else self.value + part

    def result(self) -> torch.Tensor:
        n = self.length
        if self.mode == "all":
            return torch.cat(self.parts)
        divisor = {
            "mean": n,
            "mean_sqrt_len_tokens": math.sqrt(n),
            "weightedmean": n * (n + 1) / 2,
        }.get(self.mode, 1)
        return self.value / divisor
