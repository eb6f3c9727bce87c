"""LoRA adapters: many fine-tunes served at once over one base model, as vLLM does.

`LLM(model, enable_lora=True, max_loras=N)`, then `generate(prompts, params,
lora_request=LoRARequest(name, id, path))`. Read in order: request.py (which adapter),
adapter.py (peft's files, checked and staged in a slot's layout), punica.py (each row's
own delta in one batched operation: the idea), runner.py (the projections wrapped, the
device slots and the rows' slots on every rank), admission.py (at most `max_loras`
adapters in the engine; an adapter's blocks never shared with another's)."""

from nanopaged.lora.request import LoRARequest

__all__ = ["LoRARequest"]
