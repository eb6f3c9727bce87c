"""One place that builds an engine from its options: every feature an option turns on,
and how it is put together. `LLM(model, **options)` checks the options and reads the
checkpoint (`engine/arg_utils.py`), then calls `assemble`; `features.py` names the
registries and the seams by which each feature enters the core.

In order, once the options' check has entered the features' registry entries
(`add_features`: backends, model families, quantized formats...): speculative decoding's
proposer (`speculative_config`); LoRA's
runner extension (`enable_lora`) or a vision-language model's (its checkpoint); the
model runner, on one process or on every tensor-parallel rank (`tensor_parallel_size`),
its device's part on a thread for async scheduling on a CPU; the trace around it
(`trace`); and the engine that steps it: the core's `LLMEngineCore`, or speculative
decoding's or async scheduling's subclass of it. A feature no option asks for is
never imported.
"""

from dataclasses import dataclass

from nanopaged.checkpoint import is_multimodal
from nanopaged.core.config import Config
from nanopaged.core.llm_engine import LLMEngineCore
from nanopaged.core.model_runner import ModelRunner
from nanopaged.parallel.tensor import ParallelConfig, make_runner
from nanopaged.sampling.vllm_sampler import VLLMSampler


@dataclass
class Assembly:
    """An engine and the features' parts that the layer above speaks to: LoRA's
    admission of adapters, a vision-language model's image processor and runner
    extension, the tracer (each None when off)."""

    engine: LLMEngineCore
    lora: object | None = None
    images: object | None = None
    vision: object | None = None
    tracer: object | None = None


def assemble(llm, config: Config, parallel: ParallelConfig, surface: dict) -> Assembly:
    """The engine `llm` (an `LLM`, whose requests the trace reads) steps, built as its
    options say (`surface`: the options above the core; checked, and the features'
    registries filled, by `engine/arg_utils.split_options`)."""
    spec = proposer = None
    if surface["speculative_config"]:
        from nanopaged import speculative

        spec = speculative.SpeculativeConfig.from_dict(
            surface["speculative_config"], config, parallel.tensor_parallel_size
        )
        proposer = speculative.make_proposer(spec, config)
    lora = admission = None
    if surface["enable_lora"]:
        from nanopaged.lora.admission import LoRAAdmission
        from nanopaged.lora.runner import LoRAConfig, LoRAExtension

        lora = LoRAExtension(
            LoRAConfig(
                surface["max_loras"], surface["max_lora_rank"], surface["max_cpu_loras"]
            )
        )
        admission = LoRAAdmission(lora, surface["max_loras"])
    vision = images = None
    if is_multimodal(config.hf_config):
        if spec or lora or parallel.tensor_parallel_size > 1:
            raise ValueError(
                "a vision-language model runs without speculative decoding, LoRA "
                "and tensor parallelism (each of them is off for images)"
            )
        from nanopaged.vision import vision_parts

        vision, images = vision_parts(config, surface, llm.inputs.tokenizer)
    # speculation and the trace run each step synchronously
    overlap = surface["async_scheduling"] and not spec and not surface["trace"]
    single = ModelRunner
    if overlap:
        from nanopaged import async_scheduling

        if parallel.tensor_parallel_size > 1:
            raise ValueError(
                "async_scheduling does not run with tensor_parallel_size > 1"
            )
        single = async_scheduling.single_runner(config)
    extra_kv = proposer.kv_bytes_per_block() if spec else 0
    runner = make_runner(
        config, parallel, extra_kv, lora or vision, VLLMSampler, single
    )
    tracer = None
    try:
        if surface["trace"]:
            from nanopaged.trace import TracedRunner, Tracer

            tracer = Tracer(surface["trace"], llm)
            runner = TracedRunner(runner, tracer)
        if spec:
            engine = speculative.SpeculativeEngine(config, runner, spec, proposer)
        elif overlap:
            engine = async_scheduling.AsyncEngine(config, runner)
        else:
            engine = LLMEngineCore(config, runner)
    except BaseException:  # tensor-parallel workers exit with the runner
        runner.close()
        raise
    if tracer:
        tracer.attach(engine, config)
    return Assembly(engine, admission, images, vision, tracer)
