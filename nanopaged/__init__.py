"""nanopaged: a small offline LLM inference engine with paged attention."""
from nanopaged.llm_engine import LLM, RequestOutput
from nanopaged.sampling_params import SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams"]
