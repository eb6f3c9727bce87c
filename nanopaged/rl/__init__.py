"""Rollouts for reinforcement learning: the engine's side of an RL loop (generate,
score, train, push the new weights, generate again), entered by `LLM`'s RL methods
(`engine/training.py`, vLLM's names). Read `control.py` first (what the engine
keeps: the weight version, the prefix cache, what refuses generation), then the rank's
parts: `worker.py` (a rank as `collective_rpc` reaches it), `weights.py` (new weights in
place), `transfer.py` (weights from a trainer in another process), `sleep.py` (memory
given back between rounds). docs/rl.md runs a whole loop.
"""
