"""transformers' engines for the benchmarks: its continuous batching (`hf`), one
request per prompt, and plain `generate` with a static cache over batches of similar
output length (`hf-static`)."""

import os
import time

from benchmarks.workload import Workload, bar, timed, warmup_prompts


def _hf_model(model: str, args):
    import torch
    from transformers import AutoModelForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    return AutoModelForCausalLM.from_pretrained(model, dtype=dtype).to(device).eval()


def run_hf(model: str, work: Workload, args) -> dict:
    """transformers' continuous batching (paged attention), one request per prompt."""
    from transformers import GenerationConfig

    os.environ["HF_HUB_OFFLINE"] = (
        "1"  # else transformers may look for attention kernels online
    )
    hf = _hf_model(model, args)
    hf.set_attn_implementation(args.hf_attn)
    config = GenerationConfig(
        do_sample=work.temperature > 0,
        temperature=work.temperature,
        max_new_tokens=max(work.output_lens),
        eos_token_id=-1,
    )
    manager = hf.init_continuous_batching(generation_config=config)
    manager.start()

    def generate(prompts, lens, progress=False):
        for i, (p, n) in enumerate(zip(prompts, lens)):
            manager.add_request(
                p,
                request_id=f"r{len(p)}-{i}-{time.time()}",
                max_new_tokens=n,
                eos_token_id=-1,
            )
        results = [
            manager.get_result(timeout=args.timeout)
            for _ in bar(prompts, "Generating", progress)
        ]
        if None in results:
            raise RuntimeError("transformers' continuous batching returned no result")
        return results

    generate(warmup_prompts(work), work.output_lens[:4])
    elapsed, outputs = timed(
        lambda: generate(work.prompts, work.output_lens, args.progress)
    )
    manager.stop(block=True)
    return dict(
        elapsed=elapsed,
        output_tokens=sum(len(o.generated_tokens) for o in outputs),
        attention=args.hf_attn,
    )


def run_hf_static(model: str, work: Workload, args) -> dict:
    """Plain `generate` with a static cache, batches of similar output length (no early
    exit)."""
    import torch

    hf = _hf_model(model, args)
    hf.generation_config.eos_token_id = None
    order = sorted(range(len(work.prompts)), key=lambda i: work.output_lens[i])
    batches = [
        order[i : i + args.hf_batch_size]
        for i in range(0, len(order), args.hf_batch_size)
    ]

    def generate(batches, progress=False):
        tokens = 0
        # a bar of output tokens, moved at each step (a batch can take minutes)
        total = sum(work.output_lens[i] for batch in batches for i in batch)
        shown = bar(range(total), "Generating", progress)
        for batch in batches:
            width = max(len(work.prompts[i]) for i in batch)
            n = max(work.output_lens[i] for i in batch)
            ids = torch.tensor(
                [[0] * (width - len(work.prompts[i])) + work.prompts[i] for i in batch],
                device=hf.device,
            )
            mask = (
                torch.arange(width, device=hf.device)[None, :]
                >= torch.tensor(
                    [width - len(work.prompts[i]) for i in batch], device=hf.device
                )[:, None]
            )
            hf.generate(
                ids,
                attention_mask=mask.long(),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=work.temperature > 0,
                temperature=work.temperature,
                cache_implementation="static",
                pad_token_id=0,
                streamer=StepCounter(shown, batch, work.output_lens)
                if progress
                else None,
            )
            # the tokens the requests asked for
            tokens += sum(work.output_lens[i] for i in batch)
        shown.close()
        return tokens

    generate([batches[0][:2]])
    elapsed, tokens = timed(lambda: generate(batches, args.progress))
    return dict(elapsed=elapsed, output_tokens=tokens, batch_size=args.hf_batch_size)


class StepCounter:
    """A `generate` streamer that moves a bar by the tokens each step gives the requests
    of `batch` (those past a request's length are padding to the batch's longest)."""

    def __init__(self, shown, batch: list[int], output_lens: list[int]):
        self.shown, self.lens, self.steps = shown, [output_lens[i] for i in batch], -1

    def put(self, value) -> None:
        self.steps += 1  # the first call brings the prompts
        if self.steps:
            self.shown.update(sum(n >= self.steps for n in self.lens))

    def end(self) -> None:
        pass
