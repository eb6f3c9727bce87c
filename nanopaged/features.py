"""Every feature, and the seam by which it enters the core: the one place that names
what `LLM(model)` may be made of (`assembly.py` puts an engine together from its
options). The core imports none of them.

The features below add entries to the core's registries, each in its own function here,
which `add_features` calls: no feature module enters anything as it is imported, and
none replaces or removes an entry the core defines (tests/test_layout.py). A feature
whose folder a forker deleted, or that needs a package this machine lacks (triton), is
skipped, and a plain `generate` still works.

The others enter through the seams the core documents, named beside each below. vLLM's
API and its sampling settings make every `LLM`; the rest are turned on by an option and
imported only then, each a file or folder a forker may delete with its option:

- vLLM's API over the core (`engine/`, `inputs.py`, `outputs.py`, `chat.py`; vLLM's
  other module paths, `entrypoints/` among them, name what these define): the engine's
  `add`, `step`, `finish` and `stop`; each step's `SamplerOutput`.
- vLLM's sampling settings (`sampling/vllm_sampler.py`,
  `sampling/logits_processors.py`): the `Sampler` class the runner is given (`adjust`,
  `uniform`), `Sequence.logits_processors`.
- structured outputs (`sampling/structured_outputs.py`): `Sequence.logits_processors`.
- speculative decoding (`speculative.py`): `LLMEngineCore.schedule` and `apply`,
  extended by `SpeculativeEngine`; `ScheduledStep.proposals`; `BlockManager.reserve`,
  `trim`.
- async scheduling (`async_scheduling.py`, `cpu/device_thread.py`): the core's
  `ModelRunner.launch`, `compute` and `collect` in another order (`Launched`);
  `Pending` input ids and `sequence.PENDING`; `BlockManager.commit(count)`,
  `cache_block`, `uncommitted`.
- LoRA adapters (`lora/`): a `RunnerExtension`; `Sequence.cache_salt`.
- pooling's engine (`pooling/pooling_llm.py`, `engine/llm.py`'s `RUNNERS`):
  `SamplingOptions.max_tokens=0`, `SamplerOutput.hidden_states`; a classifier's score
  head, from the runner's `model`.
- RL rollouts (`rl/`, `engine/training.py`, `serving/rl_api.py`): new weights
  where the loader puts them (the model's `checkpoint_param`, its layers'
  `weight_loader`, a packed weight's `LinearMethod.dense_weight` and
  `set_dense_weight`); `BlockManager.reset_prefix_cache` and the runner extension's
  `weights_changed` after them (and after a sleep); sleep through the
  runner's `model`, `kv_cache` and `graphs`, and `Scheduler.preempt_all`; every rank
  through `MultiprocRunner.call`; `LLM`'s refusals (`paused`).
- vision-language models (`vision/`): their model classes in `ARCHITECTURES` and
  Gemma 3's check in `UNSUPPORTED`; a `RunnerExtension` (the step's images, the encoder
  cache; multimodal positions, in `StepInputs.positions` where they agree); images' pad
  ids in `Sequence.token_ids` (the prefix cache's hashes); `Sequence.spans` (an image
  no chunk cuts); the core's `Attention`, `attend` and `gather_blocks` (Gemma 3's).
- the step trace (`trace/`): the runner `LLMEngineCore` is handed (`TracedRunner`, its
  `launch`); after each step, the `BlockManager`'s and `Scheduler`'s state, read.
- tensor parallelism (`parallel/tensor.py`): a `ModelRunner` subclass on every rank.
- beam search (`beam_search.py`, `LLM.beam_search` in `engine/compat.py`,
  `serving/beam_api.py`): `LLM.generate` alone (on the server, its engine loop's
  requests), a token and its logprobs per beam per round.
- data parallelism (`engine/data_parallel.py`) and the OpenAI server (`serving/`):
  `LLM`; the server's router, `block_manager.hash_block` (chained as the prefix cache
  does).
"""

import importlib.util

from nanopaged.checks import UNSUPPORTED
from nanopaged.core.attention import BACKENDS
from nanopaged.core.layers import ROPE_SCALINGS
from nanopaged.core.loader import QUANTIZATIONS
from nanopaged.core.model import ARCHITECTURES, QK_NORM, QKV_BIAS, CausalLM
from nanopaged.core.sampler import SAMPLING_KERNELS


def add_cpu_backend() -> None:
    """The CPU backend (`cpu/`): its attention, C kernels, linear layers and decode
    steps' graphs, and its sampling kernel."""
    from nanopaged import cpu

    BACKENDS["cpu"] = cpu.BACKEND
    SAMPLING_KERNELS["cpu"] = cpu.sample


def add_model_families() -> None:
    """The model families beyond the core's Qwen3, Qwen2 and Llama (`models/`): Mistral
    (the core's decoder, its `sliding_window` on every layer), Qwen3-MoE and Mixtral,
    Gemma 3's text model; and the RoPE scalings of Llama 3 and others."""
    from nanopaged.models import gemma3, moe, rope

    ARCHITECTURES.update(
        MistralForCausalLM=CausalLM,
        Qwen3MoeForCausalLM=moe.MoeForCausalLM,
        MixtralForCausalLM=moe.MoeForCausalLM,
        Gemma3ForCausalLM=gemma3.Gemma3ForCausalLM,
    )
    QK_NORM.add("Qwen3MoeForCausalLM")
    UNSUPPORTED.update(
        Qwen3MoeForCausalLM=moe.unsupported_moe_fields,
        MixtralForCausalLM=moe.unsupported_moe_fields,
        Gemma3ForCausalLM=gemma3.unsupported_gemma3_fields,
    )
    ROPE_SCALINGS.update(llama3=rope.llama3, linear=rope.linear)


def add_quantized_formats() -> None:
    """The quantized checkpoints (`quantization/`), by their `quant_method`."""
    from nanopaged.quantization import awq, compressed_tensors, fp8, gptq

    QUANTIZATIONS.update(
        {
            "fp8": fp8.fp8_method,
            compressed_tensors.METHOD: compressed_tensors.compressed_tensors_method,
            "awq": awq.awq_method,
            "gptq": gptq.gptq_method,
        }
    )


def add_pooling_models() -> None:
    """The pooling architectures (`models/pooling.py`): each family's bare decoder
    (`Qwen3Model`) and its classifier (`Qwen3ForSequenceClassification`)."""
    from nanopaged.models.pooling import FAMILIES, PoolingBody, SequenceClassifier

    for family in FAMILIES:
        ARCHITECTURES[f"{family}Model"] = PoolingBody
        ARCHITECTURES[f"{family}ForSequenceClassification"] = SequenceClassifier
    QK_NORM.update({"Qwen3Model", "Qwen3ForSequenceClassification"})
    QKV_BIAS.update({"Qwen2Model", "Qwen2ForSequenceClassification"})


def add_vision_models() -> None:
    """The vision-language models (`vision/`): Qwen2.5-VL, Qwen3-VL, Gemma 3 (its
    language model's config checked as Gemma 3's text model's)."""
    from nanopaged.models.gemma3 import unsupported_gemma3_fields
    from nanopaged.vision import FAMILIES

    for architecture, (model, _) in FAMILIES.items():
        ARCHITECTURES[architecture] = model
    UNSUPPORTED["Gemma3ForConditionalGeneration"] = unsupported_gemma3_fields


def add_sampling_kernel() -> None:
    """The GPU backends' Triton sampling kernel (`sampling/triton_kernel.py`); without
    it (or without triton) they sample with `sampler.sample`."""
    from nanopaged.sampling.triton_kernel import sample

    SAMPLING_KERNELS.update(triton=sample, flash=sample)


# the module each adds -> the function that enters it
REGISTERED = {
    "nanopaged.cpu": add_cpu_backend,
    "nanopaged.models": add_model_families,
    "nanopaged.quantization": add_quantized_formats,
    "nanopaged.pooling": add_pooling_models,
    "nanopaged.vision": add_vision_models,
    "nanopaged.sampling.triton_kernel": add_sampling_kernel,
}


def add_features() -> None:
    """Enters every feature of `REGISTERED` whose module is here and whose packages
    are installed; calling it again changes nothing."""
    for module, add in REGISTERED.items():
        if importlib.util.find_spec(module) is None:
            continue  # deleted
        try:
            add()
        except ModuleNotFoundError as error:
            if error.name != "triton":
                raise
