"""More than one device or process per engine: tensor parallelism (`tensor.py`: a
`ModelRunner` subclass that runs each step on every rank, spawned or under torchrun) and
data parallelism (`data.py`: replicas of the whole engine, each in its own process,
behind `LLM`'s API). vLLM's `vllm.distributed` names are `nanopaged/distributed/`."""
