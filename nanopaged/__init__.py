"""nanopaged: a small LLM inference engine with paged attention."""
from nanopaged.compat import EngineArgs
from nanopaged.inputs import TextPrompt, TokensPrompt
from nanopaged.llm_engine import LLM, LLMEngine
from nanopaged.outputs import CompletionOutput, Logprob, RequestOutput
from nanopaged.sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "EngineArgs", "CompletionOutput", "Logprob", "RequestOutput",
           "SamplingParams", "TextPrompt", "TokensPrompt"]
