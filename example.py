"""Ask a model a few questions and show what the engine did.

    python example.py                   # Qwen/Qwen3-0.6B from the Hugging Face cache or
                                        # the hub; if it cannot be had: a random-weight
                                        # stand-in
    python example.py --model PATH_OR_ID
    python example.py --stream          # print one answer as it is generated
    python example.py --trace run.jsonl # and a page (run.html) playing the steps back
    python example.py --enforce-eager   # the reading mode: every step runs the model's
                                        # Python, so a breakpoint in Attention.forward
                                        # stops on every layer of every step

The random-weight stand-in prints gibberish by design: it is there to show the engine at
work (prefix-cache hits, chunked prefill, preemption, throughput) on a machine with no
model and no network. Its answers ignore EOS (random weights would end them at a random
EOS within a few tokens), so that they grow and fill its small KV pool.
"""

import argparse
import os
import shutil
import sys
import tempfile
import time

DEFAULT_MODEL = "Qwen/Qwen3-0.6B"
CACHE_DIR = os.path.join(os.path.expanduser("~"), ".cache", "nanopaged")
SYSTEM = "You are a concise assistant who explains how inference engines work."
QUESTIONS = [
    "Introduce yourself.",
    "List all prime numbers within 100.",
    "Explain paged attention in two sentences.",
    "Write a short poem about the sea.",
]


def load(model: str | None, trace: str | None, enforce_eager: bool = False):
    """The model asked for (an error if it cannot be loaded), else the default model,
    else the random-weight stand-in; and whether it is the stand-in."""
    from nanopaged import LLM
    from nanopaged.random_checkpoint import TINY_QWEN3, write_random_checkpoint

    options = dict(trace=trace, enforce_eager=enforce_eager)
    if model is not None:
        return LLM(model, **options), False
    try:
        return LLM(DEFAULT_MODEL, **options), False
    except ValueError as error:
        path = os.path.join(CACHE_DIR, "random-tiny-qwen3")
        print(
            f"{error}\n\nSo running on a random-weight checkpoint in {path}: "
            "expect gibberish."
        )
        if not os.path.exists(os.path.join(path, "model.safetensors")):
            # written aside, then moved in whole: Ctrl-C never leaves half of one
            os.makedirs(CACHE_DIR, exist_ok=True)
            aside = tempfile.mkdtemp(dir=CACHE_DIR)
            write_random_checkpoint(aside, TINY_QWEN3, initializer_range=0.1)
            shutil.rmtree(path, ignore_errors=True)
            os.replace(aside, path)
        # a small pool and token budget, so that preemption and chunked prefill show too
        return LLM(
            path,
            num_kvcache_blocks=24,
            kvcache_block_size=16,
            max_num_batched_tokens=64,
            **options,
        ), True


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n".join(__doc__.splitlines()[1:]),
    )
    parser.add_argument(
        "--model",
        help=f"local checkpoint or Hugging Face id (default: {DEFAULT_MODEL})",
    )
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--stream", action="store_true", help="stream the first answer")
    parser.add_argument(
        "--trace",
        metavar="PATH",
        help="write a trace of every step to PATH "
        "(JSON lines), and the page that plays it back beside it (.html)",
    )
    parser.add_argument(
        "--enforce-eager",
        action="store_true",
        help="no graphs: the reading mode, where breakpoints in the model stop on "
        "every step",
    )
    args = parser.parse_args()  # before nanopaged is imported: --help answers at once
    try:
        llm, stand_in = load(args.model, args.trace, args.enforce_eager)
    except ValueError as error:
        sys.exit(f"error: {error}")
    try:
        ask(llm, args, stand_in)
    except ValueError as error:  # a request the engine refuses, and why
        if stand_in:  # its pool is small on purpose: what the example lets one change
            tokens = llm.stats().num_blocks * llm.config.kvcache_block_size
            error = f"{error}\n(the stand-in's KV pool holds {tokens} tokens, a "
            error += "question and its answer together: give a smaller --max-tokens)"
        sys.exit(f"error: {error}")


def ask(llm, args: argparse.Namespace, stand_in: bool) -> None:
    """Asks the questions and prints the answers, or streams the first."""
    from nanopaged import SamplingParams

    conversations = [
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]
        for q in QUESTIONS
    ]
    params = SamplingParams(
        temperature=0.6,
        top_p=0.95,
        max_tokens=args.max_tokens,
        seed=0,
        ignore_eos=stand_in,
    )
    if args.stream:
        prompt = (
            llm.tokenizer.apply_chat_template(
                conversations[0], tokenize=False, add_generation_prompt=True
            )
            if llm.tokenizer.chat_template
            else QUESTIONS[0]
        )
        for delta in llm.stream(prompt, params):
            print(delta, end="", flush=True)
        print()
        return write_trace_page(llm, args.trace)

    start = time.perf_counter()
    if llm.tokenizer.chat_template:
        outputs = llm.chat(conversations, params)
    else:  # a base model: plain text prompts
        outputs = llm.generate([f"{SYSTEM}\n{q}\n" for q in QUESTIONS], params)
    elapsed = time.perf_counter() - start
    for question, output in zip(QUESTIONS, outputs):
        completion = output.outputs[0]
        print(
            f"\n--- {question!r} ({len(output.prompt_token_ids)} prompt tokens, "
            f"{output.num_cached_tokens} from the prefix cache)\n--- answer "
            f"({len(completion.token_ids)} tokens, finish: "
            f"{completion.finish_reason})\n"
            f"{completion.text!r}"
        )
    num_generated, stats = (
        sum(len(o.outputs[0].token_ids) for o in outputs),
        llm.stats(),
    )
    print(
        f"\n{len(outputs)} requests, {num_generated} tokens in {elapsed:.2f} s "
        f"({num_generated / elapsed:,.0f} tok/s); {stats.num_preemptions} preemptions; "
        f"{stats.num_blocks} KV blocks of {llm.config.kvcache_block_size} tokens "
        f"on {llm.config.device} ({llm.config.attention_backend} attention"
        f"{', eager: no graphs' if llm.config.enforce_eager else ''})"
    )
    write_trace_page(llm, args.trace)


def write_trace_page(llm, trace: str | None) -> None:
    if trace:
        from nanopaged.trace import write_page

        llm.close()  # the trace is complete
        page = write_page(trace, os.path.splitext(trace)[0] + ".html")
        print(f"the steps: {trace}; the page that plays them back: {page}")


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # Ctrl-C: a line, as a command-line tool says it
        sys.exit("\ninterrupted")
