"""Serving: the workload sent to a server as streamed completions, arriving as a Poisson
process at each request rate; what its users feel, as vLLM's benchmark_serving reports
it."""

import asyncio
import json
import signal
import subprocess
import sys
import time

from benchmarks.floor import model_shape
from benchmarks.workload import Workload, make_workload, percentile


def serve_times(model: str, args) -> dict:
    """Each of nanopaged's scheduling policies behind its own server, then the --url
    server, at each request rate, on the same workload and arrival times."""
    work = make_workload(args, model_shape(model)["vocab_size"])
    results = {}
    flags = {
        f"nanopaged {policy}": ["--scheduling", policy]
        for policy in ("prefill-first", "mixed")
    }
    if args.data_parallel_size > 1:  # the routing policies instead
        size = str(args.data_parallel_size)
        flags = {
            f"nanopaged dp{size} {router}": [
                "--data-parallel-size",
                size,
                "--router",
                router,
            ]
            for router in ("prefix", "least")
        }
    for name, server_flags in flags.items():
        with NanopagedServer(model, args, server_flags) as url:
            results[name] = {
                rate: asyncio.run(send_workload(url, work, rate, args))
                for rate in args.request_rate
            }
    if args.url:
        results[args.url] = {
            rate: asyncio.run(send_workload(args.url, work, rate, args))
            for rate in args.request_rate
        }
    return results


class NanopagedServer:
    """`python -m nanopaged serve` in a subprocess, for the length of a `with` block."""

    def __init__(self, model: str, args, flags: list[str]):
        from nanopaged.parallel.tensor import free_port

        self.port = free_port()
        self.command = [
            sys.executable,
            "-m",
            "nanopaged",
            "serve",
            model,
            "--port",
            str(self.port),
            *flags,
            "--max-model-len",
            str(args.max_model_len),
            "--max-waiting",
            str(args.num_requests + 1),
            "--log-level",
            "warning",
        ]
        if args.max_num_batched_tokens:
            self.command += [
                "--max-num-batched-tokens",
                str(args.max_num_batched_tokens),
            ]

    def __enter__(self) -> str:
        import httpx

        self.process = subprocess.Popen(self.command, stdout=subprocess.DEVNULL)
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health").status_code == 200:
                    return f"http://127.0.0.1:{self.port}/v1"
            except httpx.HTTPError:
                if self.process.poll() is not None:
                    raise RuntimeError(
                        f"the server exited with code {self.process.returncode}"
                    ) from None
                time.sleep(0.1)

    def __exit__(self, *exc_info) -> None:
        self.process.send_signal(signal.SIGTERM)
        self.process.wait(timeout=120)


async def send_workload(url: str, work: Workload, rate: float, args) -> dict:
    """Streams every request of the workload, started at Poisson arrival times of `rate`
    a second; with --long-prompt, one more request of that many prompt tokens arrives
    halfway, and `itl_max_ms` shows how long it stalled the others' streams."""
    import httpx
    import torch

    limits = httpx.Limits(max_connections=None)
    async with httpx.AsyncClient(timeout=args.timeout, limits=limits) as client:
        model = (await client.get(f"{url}/models")).json()["data"][0]["id"]
        warmup = work.prompts[0][::-1]
        await stream_completion(client, url, model, warmup, 4, work.temperature)
        g = torch.Generator().manual_seed(args.seed)
        arrivals = (
            torch.empty(len(work.prompts)).exponential_(generator=g) / rate
        ).cumsum(0)
        start = time.perf_counter()

        async def request_at(delay, prompt, max_tokens):
            await asyncio.sleep(delay)
            return await stream_completion(
                client, url, model, prompt, max_tokens, work.temperature
            )

        requests = [
            request_at(*r)
            for r in zip(arrivals.tolist(), work.prompts, work.output_lens)
        ]
        if args.long_prompt:
            # reversed: no prefix-cache hits on the workload's prompts
            tokens = [token for prompt in work.prompts for token in prompt[::-1]]
            long_prompt = tokens[: args.long_prompt]
            requests.append(
                request_at(arrivals[len(arrivals) // 2].item(), long_prompt, 1)
            )
        records = await asyncio.gather(*requests)
        duration = time.perf_counter() - start
    long_record = records.pop() if args.long_prompt else None
    return dict(
        serving_stats(records, duration),
        request_rate=rate,
        long_prompt_ttft_ms=long_record and 1e3 * long_record["ttft"],
    )


def serving_stats(records: list[dict], duration: float) -> dict:
    ttft = [r["ttft"] for r in records]
    tpot = [
        (r["latency"] - r["ttft"]) / (r["tokens"] - 1)
        for r in records
        if r["tokens"] > 1
    ]
    itl = [gap for r in records for gap in r["itl"]]
    output_tokens = sum(r["tokens"] for r in records)
    prompt_tokens = sum(r["prompt_tokens"] for r in records)
    return dict(
        duration=duration,
        requests_per_s=len(records) / duration,
        prefix_hit_rate=sum(r["cached_tokens"] for r in records)
        / max(1, prompt_tokens),
        output_tok_per_s=output_tokens / duration,
        output_tokens=output_tokens,
        itl_max_ms=1e3 * max(itl),
        **{
            f"{name}_{q}_ms": 1e3 * percentile(values, q)
            for name, values in (("ttft", ttft), ("tpot", tpot), ("itl", itl))
            for q in (50, 99)
        },
    )


async def stream_completion(
    client, url: str, model: str, prompt: list[int], max_tokens: int, temperature: float
) -> dict:
    """One streamed completion: when its chunks came, and how many tokens it had."""
    body = dict(
        model=model,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=temperature,
        ignore_eos=True,
        stream=True,
        stream_options={"include_usage": True},
    )
    start = time.perf_counter()
    times, usage = [], {}
    async with client.stream("POST", f"{url}/completions", json=body) as response:
        if response.status_code != 200:
            error = (await response.aread())[:300]
            raise RuntimeError(f"{url}: HTTP {response.status_code}: {error!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if chunk.get("choices"):
                times.append(time.perf_counter())
            usage = chunk.get("usage") or usage
    return dict(
        ttft=times[0] - start,
        latency=times[-1] - start,
        tokens=usage["completion_tokens"],
        prompt_tokens=usage["prompt_tokens"],
        cached_tokens=(usage.get("prompt_tokens_details") or {}).get(
            "cached_tokens", 0
        ),
        itl=[b - a for a, b in zip(times, times[1:])],
    )


def print_serving(results: dict) -> None:
    print(
        f"{'server':28} {'req/s in':>8} {'req/s':>6} {'out tok/s':>9} "
        f"{'TTFT p50':>9} {'p99':>8} {'TPOT p50':>9} {'p99':>7} {'ITL p50':>8} "
        f"{'p99':>7} {'max':>7}  (ms)"
    )
    for server, rates in results.items():
        for rate, r in rates.items():
            print(
                f"{server[:28]:28} {rate:8g} {r['requests_per_s']:6.2f} "
                f"{r['output_tok_per_s']:9,.0f} {r['ttft_50_ms']:9.1f} "
                f"{r['ttft_99_ms']:8.1f} {r['tpot_50_ms']:9.2f} {r['tpot_99_ms']:7.2f} "
                f"{r['itl_50_ms']:8.2f} {r['itl_99_ms']:7.2f} {r['itl_max_ms']:7.1f}  "
                f"prefix hits {100 * r['prefix_hit_rate']:.0f}%"
                + (
                    f"  long prompt's TTFT {r['long_prompt_ttft_ms']:,.0f}"
                    if r["long_prompt_ttft_ms"]
                    else ""
                )
            )
