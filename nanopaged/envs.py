"""vLLM's `vllm.envs`: the environment variables nanopaged reads, with vLLM's
defaults."""

import os

ENVIRONMENT = {
    "VLLM_TORCH_PROFILER_DIR": None,
    "VLLM_WORKER_MULTIPROC_METHOD": "fork",
    "VLLM_USE_V1": "1",
    "VLLM_LOGGING_LEVEL": "INFO",
    "VLLM_HOST_IP": "",
    "VLLM_PORT": None,
    "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "0",
    "VLLM_ALLOW_LONG_MAX_MODEL_LEN": "0",
    "VLLM_SERVER_DEV_MODE": "0",
    "VLLM_BATCH_INVARIANT": "0",
}
FLAGS = (
    "VLLM_USE_V1",
    "VLLM_ALLOW_RUNTIME_LORA_UPDATING",
    "VLLM_ALLOW_LONG_MAX_MODEL_LEN",
    "VLLM_SERVER_DEV_MODE",
    "VLLM_BATCH_INVARIANT",
)  # "1" or "true": True


def __getattr__(name: str):
    if name not in ENVIRONMENT:
        raise AttributeError(
            f"nanopaged.envs has no {name!r}; it reads {', '.join(ENVIRONMENT)}"
        )
    value = os.environ.get(name, ENVIRONMENT[name])
    return value.lower() in ("1", "true") if name in FLAGS else value
