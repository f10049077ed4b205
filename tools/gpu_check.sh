#!/usr/bin/env bash
# The CUDA / NCCL / bf16 check, for a machine with NVIDIA GPUs (CI has none; nothing depends on this script):
#
#   tools/gpu_check.sh [OUT_DIR]        (default runs/gpu-check; a summary is printed and kept in OUT_DIR/summary.md)
#
# 1. On one GPU, a short bf16 training of each method (dense AdamW, SMET at d = 0.25 with RigL's regrowth, whose
#    update steps run collectives inside the backward pass and eagerly, Spectron at rank 0.25) at
#    ZeRO-2 and ZeRO-3, with selective activation checkpointing and compiled blocks: each run must finish, its
#    loss must fall, and its tokens/s per device, TFLOPS per device and MFU are reported (median of the steps
#    after the compilation). A layout megasparse refuses is reported as refused.
# 2. With two or more GPUs, the NCCL path: each method on 2 ranks (dense data-parallel at ZeRO-2, SMET at
#    ZeRO-3, Spectron at 2 tensor-parallel ranks) in fp32 with TF32 off, against the same run on one GPU: the loss
#    curves must agree to 1e-4 relative, as they do on CPU with gloo at 1e-5.
# 3. The test suite on CUDA (DS_ACCELERATOR=cuda: NCCL, one GPU per rank; tests of more ranks than there are
#    GPUs are skipped), Spectron's optimizer step alone (benchmarks/spectron_step.py, its one-GPU layouts) and the
#    memory of RigL's update step (benchmarks/rigl_memory.py).
# Exits non-zero if any run that megasparse accepted failed or disagreed.
set -uo pipefail
out=$(realpath -m "${1:-$(dirname "$0")/../runs/gpu-check}")  # from the caller's directory
cd "$(dirname "$0")/.."
mkdir -p "$out"
export DS_ACCELERATOR=cuda NVIDIA_TF32_OVERRIDE=0
gpus=$(python -c 'import torch; print(torch.cuda.device_count())') || exit 1
[ "$gpus" -ge 1 ] || { echo "gpu_check: no CUDA device visible" >&2; exit 1; }
nvidia-smi -L
python -c 'import torch, deepspeed; print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl",
  ".".join(map(str, torch.cuda.nccl.version())), "bf16", torch.cuda.is_bf16_supported(), "deepspeed", deepspeed.__version__)'

declare -A METHOD=(
    [dense]=""
    [smet]="--set model.layer=sparse --set optimizer.name=smet --set sparse.density=0.25 --set sparse.update_interval=10 --set sparse.regrow=gradient"
    [spectron]="--set model.layer=lowrank --set optimizer.name=spectron"
)
COMMON="--set model.preset=llama-130m --set data.seq_len=1024 --set training.micro_batch_size=8
        --set training.global_batch_size=8 --set training.eval_samples=0 --set checkpoint.interval=0
        --set checkpoint.save_final=false --set logging.log_interval=1 --set logging.progress_bar=false
        --set optimizer.warmup_steps=5"
failed=0

summary() {  # RUN_DIR LABEL: one table row from metrics.jsonl (steps after the first 5: compilation excluded)
    python - "$1" "$2" <<'EOF'
import json, statistics, sys
from pathlib import Path
records = [json.loads(l) for l in (Path(sys.argv[1]) / "metrics.jsonl").read_text().splitlines() if '"train"' in l]
later = records[5:] or records
def median(key):
    values = [r[key] for r in later if key in r]
    return statistics.median(values) if values else float("nan")
falls = records[-1]["loss"] < records[0]["loss"]
print(f"| {sys.argv[2]} | {records[0]['loss']:.3f} -> {records[-1]['loss']:.3f} | {median('tokens_per_s_per_device'):,.0f} "
      f"| {median('tflops_per_device'):.1f} | {median('mfu'):.1%} | {median('memory_gb'):.1f} |")
sys.exit(0 if falls else 1)
EOF
}

compare() {  # ONE TWO METHOD: the loss curves of the 1-GPU and the 2-GPU run agree to 1e-4 relative
    python - "$@" <<'EOF'
import json, sys
from pathlib import Path
def losses(run):
    return [json.loads(l)["loss"] for l in (Path(run) / "metrics.jsonl").read_text().splitlines() if '"train"' in l]
a, b = losses(sys.argv[1]), losses(sys.argv[2])
worst = max(abs(x - y) / abs(x) for x, y in zip(a, b))
print(f"- {sys.argv[3]}: largest relative loss difference over {len(a)} steps {worst:.2e}")
sys.exit(0 if len(a) == len(b) and worst <= 1e-4 else 1)
EOF
}

train() {  # DIR NPROC ARGS...: a training run; returns 3 when megasparse refused the config before training
    local dir=$1 nproc=$2
    shift 2
    rm -rf "$dir"
    megasparse launch local quickstart --nproc "$nproc" $COMMON --set training.output_dir="$dir" "$@" \
        >"$dir.log" 2>&1
    local status=$?
    if [ $status -ne 0 ] && [ ! -e "$dir/metrics.jsonl" ] && grep -q "megasparse: error:" "$dir.log"; then return 3; fi
    return $status
}

{
    echo "## One GPU: bf16, selective activation checkpointing, compiled blocks, 20 steps of 8 x 1024 tokens"
    echo
    echo "| run | loss | tokens/s per device | TFLOPS per device | MFU | memory GB |"
    echo "|---|---|---:|---:|---:|---:|"
} | tee "$out/summary.md"
for method in dense smet spectron; do
    for zero in 2 3; do
        dir="$out/$method-zero$zero"
        train "$dir" 1 ${METHOD[$method]} --set training.precision=bf16 --set parallel.zero_stage=$zero \
            --set training.steps=20 --set training.activation_checkpointing=selective --set training.compile=true
        case $? in
            0) summary "$dir" "$method ZeRO-$zero" | tee -a "$out/summary.md" || failed=1 ;;
            3) echo "| $method ZeRO-$zero | refused: $(grep -m1 'megasparse: error:' "$dir.log") | | | | |" \
                   | tee -a "$out/summary.md" ;;
            *) echo "| $method ZeRO-$zero | FAILED (see $dir.log) | | | | |" | tee -a "$out/summary.md"; failed=1 ;;
        esac
    done
done

if [ "$gpus" -ge 2 ]; then
    printf '\n## NCCL: 2 ranks against 1, fp32, TF32 off, 10 steps\n\n' | tee -a "$out/summary.md"
    declare -A LAYOUT=([dense]="--set parallel.zero_stage=2" [smet]="--set parallel.zero_stage=3"
                       [spectron]="--set parallel.tensor_parallel=2 --set parallel.zero_stage=1")
    for method in dense smet spectron; do
        one="$out/$method-nccl-1" two="$out/$method-nccl-2"
        if ! { train "$one" 1 ${METHOD[$method]} --set training.steps=10 --set training.micro_batch_size=4 ${LAYOUT[$method]/tensor_parallel=2/tensor_parallel=1} \
               && train "$two" 2 ${METHOD[$method]} --set training.steps=10 --set training.micro_batch_size=4 ${LAYOUT[$method]} \
               && compare "$one" "$two" "$method" >>"$out/summary.md"; }; then
            echo "- $method: FAILED (see $one.log, $two.log)" >>"$out/summary.md"
            failed=1
        fi
        tail -1 "$out/summary.md"
    done
fi
printf '\n## The test suite on CUDA (%s GPUs)\n\n' "$gpus" | tee -a "$out/summary.md"
python -m pytest -q -p no:cacheprovider >"$out/pytest.log" 2>&1 || failed=1
echo "- $(tail -1 "$out/pytest.log") (log: $out/pytest.log)" | tee -a "$out/summary.md"

printf '\n## Spectron optimizer step, one GPU\n\n' | tee -a "$out/summary.md"
python benchmarks/spectron_step.py --layouts 130m-zero0 --out "$out/spectron_step.json" 2>"$out/spectron_step.log" \
    | grep '^|' | tee -a "$out/summary.md" || failed=1

printf '\n## RigL update step memory, one GPU\n\n' | tee -a "$out/summary.md"
python benchmarks/rigl_memory.py --out "$out/rigl_memory.json" 2>"$out/rigl_memory.log" \
    | grep '^|' | tee -a "$out/summary.md" || failed=1
exit $failed
