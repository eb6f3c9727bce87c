"""Host work per decode step: the engine's own step with the forward left out."""

import os
import sys

from benchmarks.workload import CACHE_DIR, repeated_time
from nanopaged.random_checkpoint import TINY_QWEN3


class HostOnlyRunner:
    """The model runner less the model: builds each step's inputs and, for the rows with
    logits processors (a grammar), applies them; then "samples" token 0, or for a row
    with processors the allowed token that a fixed random score prefers (a model whose
    choices a grammar steers)."""

    def __init__(self, runner):
        import torch

        self.runner, self.proposer, self.steps = runner, None, 0
        vocab_size = runner.config.hf_config.vocab_size
        self.scores = torch.rand(
            1024, vocab_size, generator=torch.Generator().manual_seed(0)
        )

    def launch(self, step, pending=None):
        self.runner.prepare_inputs(step)
        return step

    def collect(self, step):
        from nanopaged.core.step import SamplerOutput

        tokens = [[0]] * len(step.sampling_seqs)
        if any(seq.logits_processors for seq in step.sampling_seqs):
            first = self.steps % (len(self.scores) - len(step.sampling_seqs))
            self.steps += 1
            logits = self.runner.sampler.apply_processors(
                self.scores[first : first + len(step.sampling_seqs)], step.sampling_seqs
            )
            tokens = logits.argmax(dim=-1).view(-1, 1).tolist()
        return SamplerOutput(tokens)


# What --host --structured constrains each request to: a 10-field object
HOST_SCHEMA = {
    "type": "object",
    "properties": {
        f"field_{i}": [
            {"type": "string", "maxLength": 40},
            {"type": "integer"},
            {"enum": ["red", "green", "blue"]},
            {"type": "array", "items": {"type": "number"}, "maxItems": 4},
        ][i % 4]
        for i in range(10)
    },
    "required": [f"field_{i}" for i in range(10)],
}


def host_times(model: str, args) -> list[dict]:
    """Host time of one decode step without the model: the engine's own step (schedule,
    build the inputs, apply the sampled tokens) with the forward left out. The GPU waits
    that long between two steps. With --structured, each request follows a JSON schema,
    on a checkpoint with a 32k-token vocabulary, beside the same requests without
    one."""
    from nanopaged.sampling_params import StructuredOutputsParams

    rows = []
    schemas = [None]
    if args.structured:
        model, schemas = (
            realistic_checkpoint(),
            [
                None,
                StructuredOutputsParams(json=HOST_SCHEMA, disable_any_whitespace=True),
            ],
        )
    for batch in args.batch_sizes:
        for block_size in (16,) if args.structured else (16, 256):
            for schema in schemas:
                kind = f"decode b={batch} block={block_size}" + (
                    " json schema" if schema else ""
                )
                rows.append(
                    dict(
                        kind=kind,
                        **_host_step_time(model, args, batch, block_size, schema),
                    )
                )
    return rows


def _host_step_time(model: str, args, batch: int, block_size: int, schema) -> dict:
    import torch

    from nanopaged import LLM, SamplingParams

    max_model_len = args.context + 512
    from nanopaged.trace import TracedRunner

    trace = args.trace and "{0}.b{2}.block{3}{1}".format(
        *os.path.splitext(args.trace), batch, block_size
    )
    llm = LLM(
        model,
        device="cpu",
        kvcache_block_size=block_size,
        max_model_len=max_model_len,
        num_kvcache_blocks=batch * -(-max_model_len // block_size),
        trace=trace,
    )
    runner = HostOnlyRunner(llm.engine.runner.runner if trace else llm.engine.runner)
    llm.engine.runner = TracedRunner(runner, llm.tracer) if trace else runner
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(
        temperature=0.6,
        ignore_eos=True,
        max_tokens=max_model_len,
        structured_outputs=schema,
    )
    vocab_size = min(llm.config.hf_config.vocab_size, len(llm.tokenizer))
    for _ in range(batch):
        llm.add_request(
            torch.randint(0, vocab_size, (args.context,), generator=g).tolist(), params
        )
    while llm.engine.scheduler.waiting:
        llm.run_step()
    generated = llm.stats().num_generated_tokens
    ms = repeated_time(llm.run_step, repeat=100) * 1e3
    return dict(
        ms=ms, tokens_per_step=(llm.stats().num_generated_tokens - generated) / 101
    )


def realistic_checkpoint() -> str:
    """The tiny model with a 32k-token byte-level BPE tokenizer trained on Python's own
    library (once, cached): grammar masks cost what they cost with a real vocabulary."""
    import glob
    import sysconfig

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from nanopaged.random_checkpoint import write_random_checkpoint

    path = os.path.join(CACHE_DIR, "random-tiny-qwen3-32k-vocab")
    if os.path.exists(os.path.join(path, "tokenizer.json")):
        return path
    print(
        f"training a 32k-token tokenizer for {path} (about a minute, once)",
        file=sys.stderr,
    )

    def texts():
        for name in glob.glob(
            os.path.join(sysconfig.get_paths()["stdlib"], "**/*.py"), recursive=True
        ):
            with open(name, encoding="utf-8", errors="ignore") as f:
                yield f.read()

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(
        texts(),
        trainers.BpeTrainer(
            vocab_size=32000,
            special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    write_random_checkpoint(path, dict(TINY_QWEN3, vocab_size=32000))
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    ).save_pretrained(path)
    return path


def print_host(rows: list[dict]) -> None:
    print(f"{'host work per step':28} {'ms':>7}")
    for r in rows:
        print(f"{r['kind']:28} {r['ms']:7.3f}")
