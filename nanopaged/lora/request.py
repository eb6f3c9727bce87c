"""vLLM's `LoRARequest` (at vLLM's path, `vllm.lora.request`): which adapter a request
runs."""

from dataclasses import dataclass


@dataclass(frozen=True, eq=False)
class LoRARequest:
    """A LoRA adapter by name, id and path: a directory in peft's format
    (adapter_config.json and adapter_model.safetensors). As vLLM's, two requests are the
    same adapter when their names are; `lora_int_id` must be positive."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(
                f"lora_name must be a non-empty string, got {self.lora_name!r}"
            )
        if (
            isinstance(self.lora_int_id, bool)
            or not isinstance(self.lora_int_id, int)
            or self.lora_int_id < 1
        ):
            raise ValueError(
                f"lora_int_id must be an integer > 0, got {self.lora_int_id!r}"
            )
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(
                f"lora_path must name the adapter's directory, got {self.lora_path!r}"
            )

    def __eq__(self, other) -> bool:
        return isinstance(other, LoRARequest) and self.lora_name == other.lora_name

    def __hash__(self) -> int:
        return hash(self.lora_name)

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path

    @property
    def local_path(self) -> str:
        return self.lora_path
