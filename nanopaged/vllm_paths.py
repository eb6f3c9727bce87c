"""vLLM's module paths that scripts import beyond `vllm` itself, as thin aliases under
`nanopaged.`: `nanopaged.engine.arg_utils`, `.engine.llm_engine`, `.entrypoints.llm`,
`.distributed` (and `.distributed.parallel_state`), `.envs` and `.profiler`. Each name means
what it means in vLLM; a name vLLM has there and nanopaged does not is an ImportError that says
what to use instead. The package's `__init__` finds these paths here on their first import;
the paths that exist as files (`sampling_params`, `inputs`, `outputs`, `utils`) stay files."""
import gc
import os
import sys
import types

import torch
import torch.distributed as dist

from nanopaged import engine_args, llm

# vLLM's environment variables that nanopaged reads, with vLLM's defaults
ENVIRONMENT = {"VLLM_TORCH_PROFILER_DIR": None, "VLLM_WORKER_MULTIPROC_METHOD": "fork",
               "VLLM_USE_V1": "1", "VLLM_LOGGING_LEVEL": "INFO", "VLLM_HOST_IP": "",
               "VLLM_PORT": None}
INSTEAD = {  # module path -> what a name nanopaged lacks there should be replaced with
    "distributed": "nanopaged.distributed has cleanup_dist_env_and_memory and, in "
                   "parallel_state, get_world_group; nanopaged's tensor parallelism is "
                   "LLM(model, tensor_parallel_size=N)",
    "profiler": "nanopaged profiles with LLM.start_profile() / stop_profile() (torch.profiler, "
                "as vLLM's LLM does), not with a layerwise profiler",
    "engine": "nanopaged.engine has arg_utils (EngineArgs) and llm_engine (LLMEngine); "
              "nanopaged's engines are all synchronous (the server runs one in a thread)",
    "envs": "nanopaged.envs has the variables it reads",
    "entrypoints": "nanopaged.entrypoints has llm (LLM); the server is `nanopaged serve` "
                   "(nanopaged.cli)",
}


def cleanup_dist_env_and_memory(shutdown_ray: bool = False) -> None:
    """vLLM's: leave the process group (if this process joined one) and give back the
    memory that freed engines left to the collectors and the GPU's cache."""
    if dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class WorldGroup:
    """vLLM's `get_world_group()`: this process's place among all ranks, and its groups."""

    def __init__(self):
        if not dist.is_initialized():
            raise RuntimeError("get_world_group(): this process is in no distributed group; "
                               "under torchrun, create the LLM first")
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.ranks = list(range(self.world_size))
        self.rank_in_group = self.rank
        self.local_rank = int(os.environ.get("LOCAL_RANK", self.rank))
        self.device_group = dist.group.WORLD
        self.cpu_group = dist.new_group(backend="gloo")  # for control messages, as vLLM's


def _env(name: str):
    if name not in ENVIRONMENT:
        raise AttributeError(f"nanopaged.envs has no {name!r}; it reads "
                             f"{', '.join(ENVIRONMENT)}")
    value = os.environ.get(name, ENVIRONMENT[name])
    return value == "1" if name == "VLLM_USE_V1" else value


def _module(path: str, names: dict, doc: str) -> types.ModuleType:
    """A module at `nanopaged.<path>` holding `names`; any other name is an ImportError saying
    what to use instead."""
    module = types.ModuleType(f"nanopaged.{path}", doc)
    module.__dict__.update(names)
    top = path.split(".")[0]

    def missing(name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        raise ImportError(f"cannot import {name!r} from nanopaged.{path}: vLLM has it there, "
                          f"nanopaged does not. {INSTEAD.get(top, '')}".rstrip())
    module.__getattr__ = missing
    if "." not in path:
        module.__path__ = []  # a package: its other submodules are looked for, and refused
    sys.modules[module.__name__] = module
    return module


def module(name: str) -> types.ModuleType:
    """The module at vLLM's path `name` (made on the first import of any of them)."""
    if name not in sys.modules:
        _register()
    if name not in sys.modules:
        top = name.split(".")[1]
        raise ModuleNotFoundError(f"no module named {name!r}: vLLM has it, nanopaged does not. "
                                  f"{INSTEAD.get(top, '')}".rstrip())
    return sys.modules[name]


def _register() -> None:
    parallel_state = _module("distributed.parallel_state", {
        "get_world_group": WorldGroup, "destroy_model_parallel": lambda: None,
        "destroy_distributed_environment": cleanup_dist_env_and_memory},
        "vLLM's parallel_state: get_world_group().rank, .world_size, .cpu_group")
    _module("distributed", {"cleanup_dist_env_and_memory": cleanup_dist_env_and_memory,
                            "parallel_state": parallel_state}, "vLLM's vllm.distributed")
    arg_utils = _module("engine.arg_utils", {"EngineArgs": engine_args.EngineArgs},
                        "vLLM's EngineArgs")
    llm_engine = _module("engine.llm_engine", {"LLMEngine": llm.LLM}, "vLLM's LLMEngine")
    _module("engine", {"arg_utils": arg_utils, "llm_engine": llm_engine}, "vLLM's vllm.engine")
    entry = _module("entrypoints.llm", {"LLM": llm.LLM}, "vLLM's LLM")
    _module("entrypoints", {"llm": entry}, "vLLM's vllm.entrypoints")
    envs = _module("envs", {}, "vLLM's environment variables that nanopaged reads")
    envs.__getattr__ = _env
    _module("profiler", {}, "vLLM's profiler: see LLM.start_profile")
