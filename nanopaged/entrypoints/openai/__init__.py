"""vLLM's `vllm.entrypoints.openai`: `api_server`, the OpenAI-compatible server."""
