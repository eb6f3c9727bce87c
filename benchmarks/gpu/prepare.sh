#!/usr/bin/env bash
# On the CPU machine, before a `device` call: puts into .gpu/ (kept out of git) what the GPU
# machine cannot fetch: the trimmed flash-attn build (../shared/gpu), nano-vllm at a pinned
# commit, and the wheels the tests need that it lacks (Python 3.12). Then the device calls are
#   run(command="bash benchmarks/gpu/run.sh test_gpu bench test_gpu_flash", carry=[".gpu"], timeout_s=480)
#   run(command="bash benchmarks/gpu/run.sh kernels kernels_b8 steps", carry=[".gpu"], timeout_s=300)
# and with the minutes left: run.sh serve spec lora kv_fp8 (about 4 minutes in all)
# NANO_VLLM_GIT: the git directory `fetch github:GeeeekExplorer/nano-vllm` returned.
set -euo pipefail
cd "$(dirname "$0")/../.."
NANO_VLLM_COMMIT=${NANO_VLLM_COMMIT:-bb823b3}
exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
for path in /.gpu/ /.gpu-site/; do grep -qsx "$path" "$exclude" || echo "$path" >> "$exclude"; done
mkdir -p .gpu/wheels
cp ../shared/gpu/fa-src.tar.xz ../shared/gpu/fa_build.py ../shared/gpu/fa_smoke.py .gpu/
if [ -n "${NANO_VLLM_GIT:-}" ]; then
    rm -rf .gpu/nano-vllm
    git --git-dir "$NANO_VLLM_GIT" archive --prefix=nano-vllm/ "$NANO_VLLM_COMMIT" | tar x -C .gpu
else
    echo "NANO_VLLM_GIT unset: the bench will list nano-vllm as not importable" >&2
fi
# compressed-tensors needs loguru and pydantic, the server fastapi and uvicorn: none is in
# the GPU machine's image
for package in "llguidance>=1.7" compressed-tensors "sentence-transformers>=6" loguru \
    pydantic pydantic-core annotated-types typing-inspection typing-extensions fastapi \
    starlette uvicorn opentelemetry-api; do
    python3 -m pip download -q --only-binary=:all: --no-deps --python-version 3.12 \
        --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
        -d .gpu/wheels "$package" || echo "no wheel of $package: its GPU tests skip" >&2
done
du -sh .gpu
