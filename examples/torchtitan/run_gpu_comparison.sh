#!/usr/bin/env bash
# Loss and speed comparison on 2 GPUs: CP=1 vs CP=2 with dtcp vs CP=2 with torchtitan's own CP.
#
#   bash examples/torchtitan/run_gpu_comparison.sh eager      # seed + cp1, dtcp_cp2, titan_cp2
#   bash examples/torchtitan/run_gpu_comparison.sh compile    # seed + the same with --compile.enable
#   bash examples/torchtitan/run_gpu_comparison.sh docmask    # seed + document-masked cp1_doc, dtcp_cp2_doc,
#                                                             # and both again with --compile.enable
#   REPEATS=4 bash examples/torchtitan/run_gpu_comparison.sh eager   # 4 pairs of dtcp and torchtitan
#       CP=2 runs in ABBA order (dtcp_cp2_r1, titan_cp2_r1, titan_cp2_r2, dtcp_cp2_r2, ...): tokens/s
#       on these machines drifts by 10-30% within a call and from run to run, so one pair of runs
#       does not settle which is faster; ABBA cancels a steady drift
#   SIDE_BY_SIDE=1 REPEATS=4 ... (4 GPUs): each pair runs at the same time, dtcp on GPUs 0,1 and
#       torchtitan on GPUs 2,3 (then swapped), each job pinned to its own half of the physical
#       cores (swapped with the GPUs): both see the same host drift, which back-to-back runs on 2
#       GPUs do not
#   STEPS=100 ...: train 100 steps instead of the config's 20 (every run, CP=1 too, so the loss
#       columns stay comparable); a step of the debug model is ~60 ms against ~25 s of start-up and
#       compile, so more steps give many more tokens/s samples per run for little device time
#
# Run from the repository root with the wheels of download_wheels.sh in .whl/ (and .whl-arrow/
# where the machine lacks pyarrow/pandas). Every run starts from one seed checkpoint made on one
# GPU, reads the same batches (CP=1 on 1 GPU, CP=2 on 2 GPUs: data-parallel degree 1 in both) and
# trains 20 steps in bf16 (FSDP/autocast, torchtitan's defaults). Logs (rank 0) go to
# $LOGS (default $OUT/logs if $OUT is set, else examples/torchtitan/outputs/logs);
# compare_losses.py prints the loss columns and tokens/s and exits 1 if a check fails.
set -uo pipefail
cd "$(dirname "$0")/../.."
what=${1:-eager}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export NCCL_NVLS_ENABLE=0 HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 HF_HOME=${HF_HOME:-/tmp/hf_home}
DUMP=examples/torchtitan/outputs
LOGS=${LOGS:-${OUT:+$OUT/logs}}
LOGS=${LOGS:-$DUMP/logs}
mkdir -p "$LOGS"

wheel_dirs=(); for d in .whl .whl-arrow; do [ -d "$d" ] && wheel_dirs+=("$d"); done
python examples/torchtitan/install_wheels.py "${wheel_dirs[@]}" || exit 1
python examples/torchtitan/make_assets.py || exit 1

CFG=examples/torchtitan/llama3_debug_cp2.toml
run() {  # run NAME NGPU [torchtitan args...]
  local name=$1 ngpu=$2; shift 2
  local t0=$SECONDS
  torchrun --standalone --nproc-per-node "$ngpu" --role rank --tee 3 --local-ranks-filter 0 \
    -m torchtitan.train --job.config_file "$CFG" --job.dump_folder "$DUMP/$name" "$@" \
    > "$LOGS/$name.log" 2>&1
  local rc=$?
  echo "== $name: rc=$rc, $((SECONDS - t0)) s, last: $(grep -o 'step:.*' "$LOGS/$name.log" | tail -1)"
  [ $rc -eq 0 ] || grep -E "Error|error:|Exception" "$LOGS/$name.log" | grep -v "^\s*$" | tail -4
  return 0
}

SEED=$DUMP/seed/checkpoint/step-0
if [ ! -d "$SEED" ]; then
  run seed 1 --parallelism.context_parallel_degree 1 --parallelism.data_parallel_shard_degree 1 \
    --checkpoint.enable --checkpoint.create_seed_checkpoint
fi
LOAD=(--checkpoint.enable --checkpoint.load_only --checkpoint.initial_load_path "$SEED")
[ -n "${STEPS:-}" ] && LOAD+=(--training.steps "$STEPS")
CP1=(--parallelism.context_parallel_degree 1)
TITAN=(--model.name llama3)   # torchtitan's own CP (PyTorch experimental context_parallel, head-tail balancer)

REPEATS=${REPEATS:-1}
SIDE_BY_SIDE=${SIDE_BY_SIDE:-0}
if [ "$SIDE_BY_SIDE" = 1 ]; then
  # Two halves of the host's physical cores (hyperthread siblings stay together), one per job.
  mapfile -t CPU_HALVES < <(python - <<'PY'
import glob, os
cores = {}
for cpu in sorted(glob.glob("/sys/devices/system/cpu/cpu[0-9]*"), key=lambda p: int(p.rsplit("cpu", 1)[1])):
    n = int(cpu.rsplit("cpu", 1)[1])
    if n not in os.sched_getaffinity(0):
        continue
    try:
        key = (open(f"{cpu}/topology/physical_package_id").read().strip(), open(f"{cpu}/topology/core_id").read().strip())
    except OSError:
        key = ("0", str(n))
    cores.setdefault(key, []).append(n)
groups = list(cores.values())
half = len(groups) // 2
print(",".join(str(c) for g in groups[:half] for c in g))
print(",".join(str(c) for g in groups[half:] for c in g))
PY
)
  echo "side by side: GPUs 0,1 with cores ${CPU_HALVES[0]}; GPUs 2,3 with cores ${CPU_HALVES[1]}"
fi

run_on() {  # run_on SLOT NAME NGPU [torchtitan args...]: run() on GPU pair SLOT (0: 0,1; 1: 2,3) and its cores
  local slot=$1; shift
  (
    export CUDA_VISIBLE_DEVICES=$((2 * slot)),$((2 * slot + 1))
    taskset -pc "${CPU_HALVES[$slot]}" "$BASHPID" > /dev/null
    run "$@"
  )
}

pairs_side_by_side() {  # dtcp and torchtitan CP=2 at the same time on GPUs 0,1 and 2,3; they swap GPUs and cores each repeat
  local suffix=$1; shift
  ARGS=()
  for i in $(seq 1 "$REPEATS"); do
    local tag=""; [ "$REPEATS" -gt 1 ] && tag="_r$i"
    local dslot=$(((i + 1) % 2)) tslot=$((i % 2))
    run_on "$dslot" "dtcp_cp2$suffix$tag" 2 "$@" "${LOAD[@]}" &
    run_on "$tslot" "titan_cp2$suffix$tag" 2 "${TITAN[@]}" "$@" "${LOAD[@]}" &
    wait
    ARGS+=("dtcp_cp2$suffix$tag=$LOGS/dtcp_cp2$suffix$tag.log" "titan_cp2$suffix$tag=$LOGS/titan_cp2$suffix$tag.log")
  done
}

pairs() {  # pairs SUFFIX [torchtitan args...]: dtcp and torchtitan CP=2, REPEATS pairs, ABBA order
  [ "$SIDE_BY_SIDE" = 1 ] && { pairs_side_by_side "$@"; return; }
  local suffix=$1; shift
  ARGS=()
  for i in $(seq 1 "$REPEATS"); do
    local tag=""; [ "$REPEATS" -gt 1 ] && tag="_r$i"
    if [ $((i % 2)) -eq 1 ]; then
      run "dtcp_cp2$suffix$tag" 2 "$@" "${LOAD[@]}"
      run "titan_cp2$suffix$tag" 2 "${TITAN[@]}" "$@" "${LOAD[@]}"
    else
      run "titan_cp2$suffix$tag" 2 "${TITAN[@]}" "$@" "${LOAD[@]}"
      run "dtcp_cp2$suffix$tag" 2 "$@" "${LOAD[@]}"
    fi
    ARGS+=("dtcp_cp2$suffix$tag=$LOGS/dtcp_cp2$suffix$tag.log" "titan_cp2$suffix$tag=$LOGS/titan_cp2$suffix$tag.log")
  done
}

case $what in
  eager)
    run cp1 1 "${CP1[@]}" "${LOAD[@]}"
    pairs ""
    python examples/torchtitan/compare_losses.py cp1="$LOGS/cp1.log" "${ARGS[@]}" --faster-than dtcp_cp2=titan_cp2
    ;;
  compile)
    C=(--compile.enable)
    run cp1_compile 1 "${CP1[@]}" "${C[@]}" "${LOAD[@]}"
    pairs _compile "${C[@]}"
    python examples/torchtitan/compare_losses.py cp1_compile="$LOGS/cp1_compile.log" "${ARGS[@]}" \
      --faster-than dtcp_cp2_compile=titan_cp2_compile
    ;;
  docmask)
    CFG=examples/torchtitan/llama3_debug_cp2_docmask.toml
    # No torchtitan CP=2 run: torchtitan 0.2.2 refuses CP with varlen (document-masked) flavors.
    run cp1_doc 1 "${CP1[@]}" "${LOAD[@]}"            # torchtitan's own varlen attention, one GPU
    run dtcp_cp2_doc 2 "${LOAD[@]}"                   # dtcp with each row's document boundaries
    run cp1_doc_compile 1 "${CP1[@]}" --compile.enable "${LOAD[@]}"
    run dtcp_cp2_doc_compile 2 --compile.enable "${LOAD[@]}"
    python examples/torchtitan/compare_losses.py cp1_doc="$LOGS/cp1_doc.log" dtcp_cp2_doc="$LOGS/dtcp_cp2_doc.log"
    rc=$?
    python examples/torchtitan/compare_losses.py cp1_doc_compile="$LOGS/cp1_doc_compile.log" \
      dtcp_cp2_doc_compile="$LOGS/dtcp_cp2_doc_compile.log" || rc=1
    exit $rc
    ;;
  *) echo "usage: $0 eager|compile|docmask" >&2; exit 2 ;;
esac
