"""nanopaged: a small LLM inference engine with paged attention.

The core engine is `nanopaged/core/`; what stands here above it is vLLM's API on top of it."""
from nanopaged.engine_args import EngineArgs
from nanopaged.inputs import TextPrompt, TokensPrompt
from nanopaged.llm import LLM
from nanopaged.outputs import CompletionOutput, Logprob, RequestOutput
from nanopaged.sampling_params import SamplingParams
from nanopaged.vllm_paths import register

register()  # vLLM's other module paths: nanopaged.engine.arg_utils, nanopaged.distributed, ...
LLMEngine = LLM  # vLLM's name for the engine driven a step at a time: the same class here

__all__ = ["LLM", "LLMEngine", "EngineArgs", "CompletionOutput", "Logprob", "RequestOutput",
           "SamplingParams", "TextPrompt", "TokensPrompt"]
