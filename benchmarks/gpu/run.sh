#!/usr/bin/env bash
# On the GPU machine (the `device` calls prepare.sh names): flash-attn built (or its .so kept
# from an earlier build or call), the wheels unpacked, then the parts named (all by default:
# test_gpu bench test_gpu_flash kernels kernels_b8 steps; also serve spec lora kv_fp8), each
# under a time limit, their logs and JSON under $OUT in one archive. On an H200: 334 s for
# `run.sh test_gpu bench test_gpu_flash`, then 110-180 s for `run.sh kernels steps`.
set -uo pipefail
cd "$(dirname "$0")/../.."
# the call's .git may be older than its tree: the sources' hash names what ran
# (`bash benchmarks/gpu/run.sh --hash` on a checkout gives the same)
source_hash() {
    find nanopaged benchmarks bench.py -type f \( -name '*.py' -o -name '*.c' -o -name '*.sh' \) \
        | LC_ALL=C sort | xargs sha1sum | sha1sum | cut -c1-12
}
[ "${1:-}" != --hash ] || { source_hash; exit 0; }
OUT=${OUT:-/tmp/gpu-out}
SITE=$PWD/.gpu-site  # kept while the machine stays warm (ignored, not carried)
mkdir -p "$OUT" "$SITE"
export PYTHONPATH=$PWD:$SITE:$PWD/.gpu/nano-vllm
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt"
source_hash > "$OUT/source.txt"

# flash-attn: this machine's from an earlier call, a kept build, else a build (2 minutes, in
# the background: the tests that do not need it run meanwhile)
build_flash_attn() {
    tar xJf .gpu/fa-src.tar.xz -C /tmp
    if [ -f .gpu/flash_attn_2_cuda.so.xz ]; then
        xz -dc .gpu/flash_attn_2_cuda.so.xz > /tmp/flash_attn_2_cuda.so
    elif timeout 300 python3 .gpu/fa_build.py /tmp/fa /tmp/fabuild > "$OUT/fa_build.log" 2>&1; then
        cp /tmp/fabuild/flash_attn_2_cuda.so /tmp/
        xz -c /tmp/flash_attn_2_cuda.so > "$OUT/flash_attn_2_cuda.so.xz"  # keep it
    else
        return 1
    fi
    cp /tmp/flash_attn_2_cuda.so "$SITE/" && cp -r /tmp/fa/pkg/flash_attn "$SITE/"
    python3 .gpu/fa_smoke.py > "$OUT/fa_smoke.log" 2>&1 || echo "flash-attn unusable" >> "$OUT/fa_smoke.log"
}
flash_pid=
if [ ! -f "$SITE/flash_attn_2_cuda.so" ] && [ -f .gpu/fa-src.tar.xz ]; then
    build_flash_attn & flash_pid=$!
fi
for wheel in .gpu/wheels/*.whl; do
    [ -e "$wheel" ] && python3 -m zipfile -e "$wheel" "$SITE" 2>/dev/null
done

step() {  # name, seconds, command...: its output in $OUT/name.log, its status in status.txt
    local name=$1 seconds=$2; shift 2
    timeout "$seconds" "$@" > "$OUT/$name.log" 2>&1
    echo "$name $?" >> "$OUT/status.txt"
}
TESTS="python3 -m pytest -q -rsfE --durations=12 -p no:cacheprovider tests/test_gpu.py"
flash_later=  # test_gpu ran before flash-attn was built: test_gpu_flash runs its tests then
part() {
    if [ "$1" != test_gpu ] && [ -n "$flash_pid" ]; then wait "$flash_pid"; flash_pid=; fi
    case $1 in
    test_gpu) flash_later=$flash_pid; step test_gpu 240 $TESTS ;;
    test_gpu_flash) [ -z "$flash_later" ] || step test_gpu_flash 120 $TESTS -k flash ;;
    bench) step bench 360 python3 bench.py --engines \
        nanopaged:flash,nanopaged:flash+async,nanopaged:triton,nanopaged:triton+async,nano-vllm \
        --no-progress --out "$OUT/bench.json" ;;
    kernels) step kernels 150 python3 bench.py --kernels --batch-sizes 256 --context 1000 \
        --engines nanopaged:flash,nanopaged:triton,nano-vllm --out "$OUT/kernels.json" ;;
    kernels_b8) step kernels_b8 120 python3 bench.py --kernels --batch-sizes 8 --context 1000 \
        --engines nanopaged:flash,nanopaged:triton,nano-vllm --out "$OUT/kernels_b8.json" ;;
    steps) step steps 90 python3 bench.py --steps --no-progress --out "$OUT/steps.json" ;;
    # issue 48's other figures, each beside its baseline in one run
    serve) step serve 180 python3 bench.py --serve --out "$OUT/serve.json" ;;
    spec) step spec 150 python3 bench.py --spec --out "$OUT/spec.json" ;;
    lora) step lora 150 python3 bench.py --lora 4 --no-progress --out "$OUT/lora.json" ;;
    kv_fp8) step kv_bf16 60 python3 bench.py --engines nanopaged:triton --no-progress \
        --out "$OUT/kv_bf16.json"
        step kv_fp8 60 python3 bench.py --engines nanopaged:triton --kv-cache-dtype fp8 \
        --no-progress --out "$OUT/kv_fp8.json" ;;
    *) echo "unknown part $1" >> "$OUT/status.txt" ;;
    esac
}
[ $# -gt 0 ] || set -- test_gpu bench test_gpu_flash kernels kernels_b8 steps
for name in "$@"; do part "$name"; done
cat "$OUT/status.txt"
for log in test_gpu test_gpu_flash bench kernels kernels_b8 steps serve spec lora kv_bf16 kv_fp8; do
    if [ -f "$OUT/$log.log" ]; then tail -40 "$OUT/$log.log"; fi
done
# the device call brings back few files: the logs and JSON in one archive
(cd "$OUT" && tar czf results.tgz --remove-files ./*.log ./*.txt ./*.json 2>/dev/null)
