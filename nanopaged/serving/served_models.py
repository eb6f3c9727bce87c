"""The models the server answers to: the base model, and with `--enable-lora` each LoRA
adapter of `--lora-modules` by its name (docs/lora.md), in /v1/models and as a request's
`model`; vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter change the adapters at
run time."""

import asyncio
import itertools

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from nanopaged.lora.request import LoRARequest
from nanopaged.serving.openai_responses import bad_request, error_response, read_body


class ServedModels:
    """The base model's card, and each adapter by name; `engine` (an engine loop, or a
    router of several) runs `add_lora` and `remove_lora` on every replica's engine."""

    def __init__(self, engine, base_card: dict, lora_modules: list[LoRARequest]):
        self.engine, self.base_card, self.base = engine, base_card, base_card["id"]
        self.adapters = {lora.lora_name: lora for lora in lora_modules}
        first_id = max((lora.lora_int_id for lora in lora_modules), default=0) + 1
        self.lora_ids = itertools.count(first_id)

    def __contains__(self, name) -> bool:
        return name == self.base or isinstance(name, str) and name in self.adapters

    def names(self) -> list[str]:
        return [self.base, *self.adapters]

    def card(self, name: str) -> dict:
        if name == self.base:
            return self.base_card
        lora = self.adapters[name]
        return {
            **self.base_card,
            "id": name,
            "root": lora.lora_path,
            "parent": lora.base_model_name or self.base,
        }

    def not_found(self, name) -> JSONResponse:
        return error_response(
            404,
            f"the model {name!r} does not exist; this server serves "
            f"{', '.join(map(repr, self.names()))}",
            "model",
            "model_not_found",
        )

    async def _on_every_engine(self, method: str, *args) -> None:
        # each replica's engine
        for loop in getattr(self.engine, "loops", [self.engine]):
            await asyncio.wrap_future(loop.call(method, *args))

    def add_lora_routes(self, app: FastAPI) -> None:
        """vLLM's endpoints (which it serves when VLLM_ALLOW_RUNTIME_LORA_UPDATING is
        set)."""

        @app.post("/v1/load_lora_adapter")
        async def load_lora_adapter(request: Request):
            body = await read_body(request)
            if isinstance(body, JSONResponse):
                return body
            name, path = body.get("lora_name"), body.get("lora_path")
            if not (isinstance(name, str) and name and isinstance(path, str) and path):
                return error_response(
                    400,
                    "Both 'lora_name' and 'lora_path' must be provided.",
                    "lora_name",
                )
            lora = LoRARequest(name, next(self.lora_ids), path)
            # read and checked now: a bad adapter is refused here, not by its requests
            try:
                if name not in self:
                    await self._on_every_engine("add_lora", lora)
            except ValueError as error:
                return bad_request(error)
            if name in self:  # loaded before, or by another call meanwhile
                return error_response(
                    400,
                    f"The lora adapter '{name}' has already been loaded.",
                    "lora_name",
                )
            self.adapters[name] = lora
            return PlainTextResponse(
                f"Success: LoRA adapter '{name}' added successfully."
            )

        @app.post("/v1/unload_lora_adapter")
        async def unload_lora_adapter(request: Request):
            body = await read_body(request)
            if isinstance(body, JSONResponse):
                return body
            name = body.get("lora_name")
            lora = self.adapters.pop(name, None) if isinstance(name, str) else None
            if lora is None:
                return error_response(
                    404, f"The lora adapter '{name}' cannot be found.", "lora_name"
                )
            await self._on_every_engine("remove_lora", lora.lora_int_id)
            return PlainTextResponse(
                f"Success: LoRA adapter '{name}' removed successfully."
            )
