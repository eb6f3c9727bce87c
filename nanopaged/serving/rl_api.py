"""vLLM's development routes for RL, on the server when $VLLM_SERVER_DEV_MODE is set
(as vLLM's): sleep mode (`/sleep`, `/wake_up`, `/is_sleeping`) and the weight transfer
from a trainer (`/init_weight_transfer_engine`, `/start_weight_update`,
`/update_weights`, `/finish_weight_update`, `/get_world_size`). Each runs the engine's
method of that name on its loop (`nanopaged/engine/training.py`); a wrong argument
is a 400 naming it.
"""

import asyncio

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from nanopaged.serving.openai_responses import bad_request, read_body


def add_rl_routes(app: FastAPI, engine) -> None:
    """`engine`: the server's `EngineLoop` (one engine: no replicas)."""

    async def run(method: str, *args):
        try:
            return await asyncio.wrap_future(engine.call(method, *args))
        except ValueError as error:
            return bad_request(error)

    async def body_of(request: Request) -> dict | JSONResponse:
        if not await request.body():
            return {}
        return await read_body(request)

    @app.post("/sleep")
    async def sleep(level: int = 1, mode: str = "abort"):
        if mode == "wait":  # the loop runs them to their end meanwhile
            while not await asyncio.wrap_future(engine.call("is_finished")):
                await asyncio.sleep(0.05)
        elif mode == "abort":  # their clients are told (a 503), then they end
            engine.fail_all(
                "the engine was put to sleep (mode=abort): send the request again "
                "after /wake_up"
            )
        answer = await run("sleep", level, "abort" if mode == "wait" else mode)
        return answer if isinstance(answer, JSONResponse) else {}

    @app.post("/wake_up")
    async def wake_up(request: Request):
        tags = request.query_params.getlist("tags") or None
        answer = await run("wake_up", tags)
        return answer if isinstance(answer, JSONResponse) else {}

    @app.get("/is_sleeping")
    async def is_sleeping():
        return {"is_sleeping": await run("is_sleeping")}

    @app.get("/get_world_size")
    async def get_world_size():
        return {"world_size": engine.llm.parallel.tensor_parallel_size}

    for name, field in (
        ("init_weight_transfer_engine", "init_info"),
        ("update_weights", "update_info"),
    ):

        async def with_body(request: Request, name=name, field=field):
            body = await body_of(request)
            if isinstance(body, JSONResponse):
                return body
            answer = await run(name, {field: body.get(field)})
            return answer if isinstance(answer, JSONResponse) else {}

        app.post(f"/{name}")(with_body)

    @app.post("/start_weight_update")
    async def start_weight_update():
        answer = await run("start_weight_update")
        return answer if isinstance(answer, JSONResponse) else {}

    @app.post("/finish_weight_update")
    async def finish_weight_update(request: Request):
        body = await body_of(request)
        if isinstance(body, JSONResponse):
            return body
        answer = await run("finish_weight_update", body.get("weight_version"))
        return answer if isinstance(answer, JSONResponse) else {}
