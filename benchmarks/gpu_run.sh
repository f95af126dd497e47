#!/usr/bin/env bash
# Everything this project measures on a GPU, in one call of at most ~9 minutes (run it with timeout_s 585), into one folder.
#
#   bash benchmarks/gpu_run.sh OUT_DIR              # on a CUDA machine (PYTHONPATH=. is set here: no install)
#   bash benchmarks/gpu_run.sh OUT_DIR --dry-run    # every part on CPU with tiny shapes (CI runs this)
#   bash benchmarks/gpu_run.sh OUT_DIR --budget 420 # seconds for all parts (default 540; the report after)
#
# Parts, most valuable first, each under its own `timeout` and never past the budget's deadline; a part that
# fails or runs out of time is a row in the results, never the end of the run (the last ones rarely fit: ~9 min):
#   env       nvidia-smi, versions, a bf16 matmul TFLOP/s probe                       (benchmarks/gpu_env.py)
#   vit_h14   ViT-H/14 224 px, plain AMP O1, VitScaleStrategy() as written and DDP at batch 32 then 64, then at
#             each one's largest batch (the recipe is in cap40's table; run 5's recipe and kernels="auto" rows here
#             were cut by the part's limit)
#   cap40     the same model with every process capped at 40 GB (the seed's A100-40GB regime): plain AMP O1,
#             VitScaleStrategy(), DDP and the recipe, each at its largest batch under the cap
#   vit_b16   ViT-B/16 224 px, plain AMP O1, VitScaleStrategy() and DDP at batch 128 (the targets' rows first:
#             a part cut by its limit has measured them)
#   profile   torch.profiler on ViT-B/16's VitScaleStrategy() row and plain AMP O1: where the host time goes
#   planner   ViT-L/16 at batch 32 and 64, AC off/full/auto: predicted vs max_memory_allocated, Trainer.fit
#   host      host time per step of a ViT-H-shaped model at tiny widths: the CPU side alone (benchmarks/host_overhead.py)
#   pytest    pytest -m gpu tests/gpu, per-test timeouts, JUnit XML
# OUT_DIR receives at most 4 files (the device tool brings back 8): gpu_results.json (every number),
# gpu_results.md (the section for benchmarks/RESULTS.md), gpu_throughput.png and gpu_run.log.
# Exit status: 0 when every part succeeded, 1 otherwise (after writing everything).
set -uo pipefail  # no -e: a failing part is recorded, the next one runs

usage() { echo "usage: bash benchmarks/gpu_run.sh OUT_DIR [--dry-run] [--budget SECONDS]" >&2; exit 2; }
[[ $# -ge 1 ]] || usage
out=$1
shift
dry=()
budget=540
while [[ $# -gt 0 ]]; do
    case $1 in
        --dry-run) dry=(--dry-run) ;;
        --budget) budget=${2:?--budget needs seconds}; shift ;;
        *) usage ;;
    esac
    shift
done
command="bash benchmarks/gpu_run.sh $out${dry:+ ${dry[*]}} --budget $budget"

cd "$(dirname "$0")/.." || exit 2
mkdir -p "$out" || exit 2
out=$(cd "$out" && pwd)
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python=${PYTHON:-python3}
work=$(mktemp -d)  # the parts' own files; only the merged ones go to OUT_DIR
trap 'rm -rf "$work"' EXIT
log="$out/gpu_run.log"
: >"$log"
deadline=$(($(date +%s) + budget))
failed=0

# part NAME CAP_SECONDS COMMAND...: run COMMAND under `timeout` (CAP, or what is left of the budget if less);
# append its outcome to parts.jsonl. An argument @DEADLINE@ becomes the part's deadline (Unix time, 10 s before
# its timeout), so vit_gpu.py stops starting trials in time to write its results.
part() {
    local name=$1 cap=$2 left status rc t0 seconds
    shift 2
    left=$((deadline - $(date +%s)))
    if ((left < 15)); then
        echo "{\"part\": \"$name\", \"status\": \"skipped: out of time\", \"rc\": null, \"seconds\": 0}" >>"$work/parts.jsonl"
        echo "=== $name: skipped, ${left}s of the budget left" | tee -a "$log"
        failed=1
        return
    fi
    # A dry run checks that every part runs, not how fast: CI runs it on 2 CPU cores beside the test suite, where
    # the host part alone took 70 s of its 60 (35 s on an idle AMD EPYC): its caps are 3x the GPU's.
    ((${#dry[@]} == 0)) || cap=$((cap * 3))
    local limit=$((cap < left ? cap : left))
    local part_deadline=$(($(date +%s) + limit - 10))
    local args=("${@//@DEADLINE@/$part_deadline}")
    echo "=== $name (at most ${limit}s) $(date -u +%H:%M:%S)" | tee -a "$log"
    t0=$(date +%s)
    timeout --kill-after=15 "$limit" "${args[@]}" >>"$log" 2>&1 </dev/null
    rc=$?
    seconds=$(($(date +%s) - t0))
    case $rc in
        0) status=ok ;;
        124 | 137) status="timeout after ${limit}s" ;;
        *) status="failed (exit $rc)" ;;
    esac
    [[ $rc -eq 0 ]] || failed=1
    echo "{\"part\": \"$name\", \"status\": \"$status\", \"rc\": $rc, \"seconds\": $seconds}" >>"$work/parts.jsonl"
    echo "=== $name: $status in ${seconds}s" | tee -a "$log"
}

vit=("$python" benchmarks/vit_gpu.py "${dry[@]}" --out-dir "$work" --deadline @DEADLINE@)

if [[ ${#dry[@]} -eq 0 ]]; then
    part nvidia-smi 20 nvidia-smi
fi
part env 60 "$python" benchmarks/gpu_env.py "${dry[@]}" --out "$work/env.json"
part vit_h14 200 "${vit[@]}" --stem vit_h14 --models vit-h14 --rows single default ddp \
    --tables same largest --batch 32 --second-batch 64 --search-limit 512 --memory-fraction 0.85 --warmup 3 --steps 4 \
    --windows 3 --largest-steps 2 2 3 --timeout 150
part cap40 170 "${vit[@]}" --stem cap40 --models vit-h14 --rows single default ddp recipe --memory-cap-gib 40 \
    --tables largest --batch 32 --second-batch 48 --search-limit 512 --memory-fraction 0.9 --warmup 2 --steps 2 \
    --windows 1 --largest-steps 2 2 3 --timeout 120
part vit_b16 90 "${vit[@]}" --stem vit_b16 --models vit-b16 --rows single default ddp --tables same --batch 128 \
    --warmup 3 --steps 4 --windows 3 --timeout 80
part profile 90 "$python" benchmarks/gpu_profile.py "${dry[@]}" --model vit-b16 --batch 128 --rows single default \
    --out "$work/profile.json"
part planner 60 "${vit[@]}" --stem planner --planner --planner-model vit-l16 --planner-batches 32 64 \
    --warmup 2 --steps 2 --windows 1 --timeout 60
if [[ ${#dry[@]} -eq 0 ]]; then
    part host 60 "$python" benchmarks/host_overhead.py --accelerator cuda --rounds 2 --steps 10 --time-calls --json "$work/host.json"
else
    part host 60 "$python" benchmarks/host_overhead.py --dry-run --time-calls --json "$work/host.json"
fi
part pytest 200 "$python" -m pytest -m gpu tests/gpu -v -rfE -p no:cacheprovider --timeout 100 \
    --junitxml "$work/pytest.xml"
# The report runs whatever happened, past the budget too: it only reads files.
timeout 120 "$python" benchmarks/gpu_report.py --work "$work" --out "$out" --command "$command" >>"$log" 2>&1 ||
    { echo "=== report failed" | tee -a "$log"; failed=1; }
echo "=== done: $(ls "$out" | tr '\n' ' ')" | tee -a "$log"
exit $failed
