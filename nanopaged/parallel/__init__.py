"""Tensor parallelism (`tensor.py`): a `ModelRunner` subclass that runs each step on
every rank, spawned or under torchrun. Data parallelism, replicas of the whole engine
behind `LLM`'s API, stands above the engine, in `engine/data_parallel.py`; vLLM's
`vllm.distributed` names are `nanopaged/distributed/`."""
