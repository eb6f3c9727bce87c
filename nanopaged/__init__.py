"""nanopaged: a small LLM inference engine with paged attention."""
from nanopaged.llm_engine import LLM, LLMEngine
from nanopaged.outputs import CompletionOutput, Logprob, RequestOutput
from nanopaged.sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "CompletionOutput", "Logprob", "RequestOutput", "SamplingParams"]
