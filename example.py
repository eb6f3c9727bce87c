"""Generate completions for a few chat prompts and show what the engine did.

    python example.py                      # Qwen/Qwen3-0.6B if reachable, else random weights
    python example.py --model /path/to/checkpoint
"""
import argparse
import os
import time

from nanopaged import LLM, SamplingParams
from nanopaged.random_checkpoint import TINY_QWEN3, write_random_checkpoint

CACHE_DIR = os.path.join(os.path.expanduser("~"), ".cache", "nanopaged")
SYSTEM = "You are a concise assistant who explains how inference engines work."
QUESTIONS = ["Introduce yourself.", "List all prime numbers within 100.",
             "Explain paged attention in two sentences.", "Write a short poem about the sea."]


def resolve_model(name: str) -> tuple[str, bool]:
    """A local checkpoint path for `name`, and whether it is the random-weight stand-in."""
    if os.path.isdir(name):
        return name, False
    try:
        from huggingface_hub import snapshot_download
        try:
            return snapshot_download(name, local_files_only=True), False
        except Exception:
            return snapshot_download(name, etag_timeout=5), False
    except Exception as error:
        path = os.path.join(CACHE_DIR, "random-tiny-qwen3")
        print(f"No model {name!r} available ({type(error).__name__}); "
              f"running on a random-weight checkpoint in {path}")
        if not os.path.exists(os.path.join(path, "model.safetensors")):
            write_random_checkpoint(path, TINY_QWEN3, initializer_range=0.1)
        return path, True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="Qwen/Qwen3-0.6B", help="local path or Hugging Face id")
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()
    path, is_random = resolve_model(args.model)
    # Random weights run in seconds; a small pool there makes preemption visible too.
    llm = LLM(path, num_kvcache_blocks=24, kvcache_block_size=16) if is_random else LLM(path)
    tokenizer = llm.tokenizer
    prompts = [tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM},
                                              {"role": "user", "content": q}],
                                             tokenize=False, add_generation_prompt=True)
               if tokenizer.chat_template else f"{SYSTEM}\n{q}\n" for q in QUESTIONS]
    params = SamplingParams(temperature=0.6, top_p=0.95, max_tokens=args.max_tokens, seed=0)

    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    for prompt, out in zip(prompts, outputs):
        print(f"\n--- prompt ({len(out.prompt_token_ids)} tokens, {out.num_cached_tokens} from the "
              f"prefix cache)\n{prompt!r}\n--- completion ({len(out.token_ids)} tokens, "
              f"finish: {out.finish_reason})\n{out.text!r}")
    num_generated = sum(len(o.token_ids) for o in outputs)
    print(f"\n{len(outputs)} requests, {num_generated} tokens in {elapsed:.2f} s "
          f"({num_generated / elapsed:,.0f} tok/s); {llm.scheduler.num_preemptions} preemptions; "
          f"{llm.block_manager.num_blocks} KV blocks of {llm.config.kvcache_block_size} tokens "
          f"on {llm.config.device} ({llm.config.attention_backend} attention)")


if __name__ == "__main__":
    main()
