#!/usr/bin/env bash
# The CUDA / NCCL / bf16 check, for a machine with NVIDIA GPUs (CI has none; nothing depends on this script):
#
#   tools/gpu_check.sh [--dry-run] [OUT_DIR]     (default runs/gpu-check)
#
# Sized for ten minutes on one GPU (an H200) once installed: pip install torch==2.13.0 (its CUDA build, from
# PyPI), then pip install -e ".[test]" (DeepSpeed 0.19.8 with no compiled ops; the first process group JIT-builds
# one small op, cached in TORCH_EXTENSIONS_DIR). Every part runs under its own timeout; their sum is at most 600 s.
# OUT_DIR/summary.md gets the versions, then one PASS / FAIL / SKIPPED line per part with its time, and the
# tokens/s, TFLOPS and MFU of each training run; each part's output is in OUT_DIR/PART.log.
#
#  data       the embedded corpus prepared for the runs (200 documents, a 4000-piece tokenizer)
#  METHOD-eager, METHOD-compiled   (METHOD: dense AdamW; SMET at d = 0.25 with RigL's regrowth, a topology
#             update every 4 steps, so 2 on the NCCL path, with its rank-agreement check; Spectron at rank 0.25):
#             llama-60m, bf16, ZeRO-2, 10 steps of 8 x 512 tokens, eager and with compiled blocks and selective
#             activation checkpointing; the loss must fall; rates are the median of the steps after the third
#  nccl-METHOD  with 2 or more GPUs only: 2 ranks against 1 (dense DP at ZeRO-2, SMET at ZeRO-3, Spectron at 2
#             tensor-parallel ranks), fp32 with TF32 off, loss curves within 1e-4
#  tests      a one-GPU selection of the suite on CUDA (below, with what it leaves out and why)
#  spectron-step, rigl-memory   benchmarks/spectron_step.py (its one-GPU layout) and benchmarks/rigl_memory.py
#             (RigL's update step against an ordinary one, one micro-batch), their tables in their logs
#
# --dry-run prints this plan, the commands and the timeouts, and runs nothing (it needs no GPU).
# Exits non-zero if any part failed.
set -uo pipefail
dry_run=0
if [ "${1:-}" = "--dry-run" ]; then dry_run=1; shift; fi
out=$(realpath -m "${1:-$(dirname "$0")/../runs/gpu-check}")  # from the caller's directory
cd "$(dirname "$0")/.."

# the suite's one-GPU selection: single-process tests that exercise the device (layers, optimizers, sampling,
# compiled blocks, one-rank training); tests of 2+ ranks skip themselves where the GPUs cannot hold one rank each
TESTS="tests/test_model.py tests/test_smet.py tests/test_spectron.py tests/test_generate.py tests/test_execution.py"
# left out, and why
LEFT_OUT="tests/test_training_equivalence.py::test_reference_loss_curve (CPU's fp32 loss figures)
tests/test_training_equivalence.py::test_a_random_state_saved_on_another_accelerator_is_left_out (asserts a CPU run)
the launcher, Slurm, packaging, config, bad-input and docs tests (no device work, and they run in CI)
the multi-rank layout tests (one GPU: NCCL needs a device per rank; they run on CPU with gloo in CI)"

METHODS="dense smet spectron"
method_args() {
    case $1 in
        dense) echo "" ;;
        smet) echo "--set model.layer=sparse --set optimizer.name=smet --set sparse.density=0.25 --set sparse.regrow=gradient --set sparse.update_interval=4" ;;
        spectron) echo "--set model.layer=lowrank --set optimizer.name=spectron" ;;
    esac
}
DATA="$out/data"
COMMON="--set model.preset=llama-60m --set data.path=$DATA --set data.seq_len=512 --set training.micro_batch_size=8
        --set training.global_batch_size=8 --set training.eval_samples=0 --set checkpoint.interval=0
        --set checkpoint.save_final=false --set logging.log_interval=1 --set logging.progress_bar=false
        --set logging.tensorboard=false --set optimizer.warmup_steps=2 --set training.steps=10
        --set training.output_dir=$out/unused"
BF16="--set training.precision=bf16 --set parallel.zero_stage=2"
COMPILED="--set training.compile=true --set training.activation_checkpointing=selective"

failed=0
total_timeout=0
summary="$out/summary.md"

part() {  # NAME TIMEOUT COMMAND: run the shell COMMAND under the timeout, one PASS/FAIL line with its time
    local name=$1 limit=$2 command=$3
    total_timeout=$((total_timeout + limit))
    if [ $dry_run -eq 1 ]; then
        echo "- $name (timeout ${limit} s): $command"
        return 0
    fi
    local start=$SECONDS status
    timeout --kill-after=10 "$limit" bash -c "$command" >"$out/$name.log" 2>&1
    status=$?
    local took=$((SECONDS - start)) verdict=PASS
    if [ $status -eq 124 ] || [ $status -eq 137 ]; then verdict="FAIL (timed out after ${limit} s)"
    elif [ $status -ne 0 ]; then verdict="FAIL (exit $status; $(grep -m1 -E 'megasparse: error:|Error' "$out/$name.log" | cut -c1-160))"
    fi
    [ "$verdict" = PASS ] || failed=1
    echo "- $name: $verdict in ${took} s" | tee -a "$summary"
    return $status
}

skipped() {  # NAME REASON
    [ $dry_run -eq 1 ] && echo "- $1: skipped ($2)" || echo "- $1: SKIPPED ($2)" | tee -a "$summary"
}

train() {  # DIR NPROC ARGS...: a training run through megasparse launch local
    local dir=$1 nproc=$2
    shift 2
    rm -rf "$dir"
    megasparse launch local quickstart --nproc "$nproc" $COMMON --set training.output_dir="$dir" "$@"
}

rates() {  # RUN_DIR LABEL: one table row from metrics.jsonl; fails if the loss did not fall
    python - "$1" "$2" <<'EOF'
import json, statistics, sys
from pathlib import Path
records = [json.loads(l) for l in (Path(sys.argv[1]) / "metrics.jsonl").read_text().splitlines() if '"train"' in l]
later = records[3:] or records
def median(key):
    values = [r[key] for r in later if key in r]
    return statistics.median(values) if values else float("nan")
print(f"| {sys.argv[2]} | {records[0]['loss']:.3f} -> {records[-1]['loss']:.3f} | {median('tokens_per_s_per_device'):,.0f} "
      f"| {median('tflops_per_device'):.1f} | {median('mfu'):.1%} | {median('memory_gb'):.1f} |")
sys.exit(0 if records[-1]["loss"] < records[0]["loss"] else 1)
EOF
}

compare() {  # ONE TWO: the loss curves of the 1-GPU and the 2-GPU run agree to 1e-4 relative
    python - "$@" <<'EOF'
import json, sys
from pathlib import Path
def losses(run):
    return [json.loads(l)["loss"] for l in (Path(run) / "metrics.jsonl").read_text().splitlines() if '"train"' in l]
a, b = losses(sys.argv[1]), losses(sys.argv[2])
worst = max(abs(x - y) / abs(x) for x, y in zip(a, b))
print(f"largest relative loss difference over {len(a)} steps {worst:.2e}")
sys.exit(0 if len(a) == len(b) and worst <= 1e-4 else 1)
EOF
}

export -f train method_args compare
export out COMMON

if [ $dry_run -eq 1 ]; then
    echo "gpu_check plan (dry run: nothing runs)"
    gpus=1
else
    export DS_ACCELERATOR=cuda NVIDIA_TF32_OVERRIDE=0
    export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$out/torch_extensions}
    gpus=$(python -c 'import torch; print(torch.cuda.device_count())') || exit 1
    [ "$gpus" -ge 1 ] || { echo "gpu_check: no CUDA device visible" >&2; exit 1; }
    mkdir -p "$out"
    {
        echo "# gpu_check $(date -u +%FT%TZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
        echo
        nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | sed 's/^/- GPU: /'
        python -c 'import torch, deepspeed, sys; print(f"- python {sys.version.split()[0]}, torch {torch.__version__}, CUDA {torch.version.cuda}, NCCL {\".\".join(map(str, torch.cuda.nccl.version()))}, bf16 {torch.cuda.is_bf16_supported()}, deepspeed {deepspeed.__version__}")'
        echo
        echo "## Parts"
        echo
    } >"$summary"
    cat "$summary"
fi

part data 60 "megasparse prepare-data --out '$DATA' --vocab-size 4000 --set data.max_documents=200"

rows=()
for method in $METHODS; do
    for kind in eager compiled; do
        limit=45 extra=""
        [ $kind = compiled ] && limit=75 extra=$COMPILED
        if part "$method-$kind" $limit "train '$out/$method-$kind' 1 $(method_args $method) $BF16 $extra" \
                && [ $dry_run -eq 0 ]; then
            rows+=("$(rates "$out/$method-$kind" "$method, $kind" || echo "| $method, $kind | loss did not fall | | | | |")")
        fi
    done
done

if [ "$gpus" -ge 2 ]; then
    for method in $METHODS; do
        case $method in
            dense) layout="--set parallel.zero_stage=2" one="$layout" ;;
            smet) layout="--set parallel.zero_stage=3" one="$layout" ;;
            spectron) layout="--set parallel.tensor_parallel=2 --set parallel.zero_stage=1"
                      one="--set parallel.zero_stage=1" ;;
        esac
        part "nccl-$method" 90 "train '$out/$method-nccl-1' 1 $(method_args $method) --set training.micro_batch_size=4 $one &&
            train '$out/$method-nccl-2' 2 $(method_args $method) --set training.micro_batch_size=4 $layout &&
            compare '$out/$method-nccl-1' '$out/$method-nccl-2'"
    done
else
    for method in $METHODS; do skipped "nccl-$method" "one GPU: 2 ranks need 2"; done
fi

part tests 90 "python -m pytest -q -p no:cacheprovider $TESTS"
part spectron-step 40 "python benchmarks/spectron_step.py --layouts 130m-zero0 --out '$out/spectron_step.json'"
part rigl-memory 45 "python benchmarks/rigl_memory.py --accumulation 1 --data '$DATA' --out '$out/rigl_memory.json'"
if [ $dry_run -eq 1 ]; then
    echo "  left out of the suite:"
    echo "$LEFT_OUT" | sed 's/^/    /'
    echo "total of the timeouts: ${total_timeout} s (at most 600)"
    [ $total_timeout -le 600 ] || exit 1
    exit 0
fi
{
    echo
    echo "Left out of the suite: $(echo "$LEFT_OUT" | paste -sd ';' -)"
    echo
    echo "## Training runs: llama-60m, bf16, ZeRO-2, 8 x 512 tokens per step, 1 GPU"
    echo
    echo "| run | loss | tokens/s per device | TFLOPS per device | MFU | memory GB |"
    echo "|---|---|---:|---:|---:|---:|"
    for row in "${rows[@]}"; do echo "$row"; done
} | tee -a "$summary"
exit $failed
