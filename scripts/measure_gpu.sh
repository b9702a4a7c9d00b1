#!/usr/bin/env bash
# GPU measurements, one plan per area of benchmarks/RESULTS.md, run unattended on one GPU machine.
# A plan runs in a copy of the tree ($EV/repo): its benchmarks write their usual files there
# (benchmarks/results/<benchmark>.json and .log), its pipelines write under $EV/run, and every step
# logs to $EV/logs/<step>.log and appends "step rc start end seconds" to $EV/status.tsv.
#
#   bash scripts/measure_gpu.sh start PLAN...   copy the tree, run the plans in order, in the background
#   bash scripts/measure_gpu.sh wait [S]        wait until they end or S seconds (540) pass, then pack
#                                               $OUT/measured.tar.gz (the new result files, logs, reports)
#   bash scripts/measure_gpu.sh run PLAN...     copy the tree and run the plans in the foreground
#   bash scripts/measure_gpu.sh pack | show | stop
#
# Plans, with their device time on one H100 (the machine's start not included):
#   tests        pytest -m gpu through benchmarks/gpu_tests.sh (GPU_TESTS: test files or pytest
#                arguments; default every GPU test)                                               ~300 s
#   kernels      the TTT attention block by length and the soft-target CE by shape (kernels), the
#                block's parts (attention_breakdown), the fused MoE kernels' tiles (moe_tiles)     ~400 s
#   train_step   the EAGLE-3 step at the 8B draft shape, bf16 and float8 features, ce and LK-lambda
#                (train_step); DFlash's step by batch (dflash_train_step); the DFlash-backbone
#                families' step (family_step); FlexAttention over variable widths (flex_shapes);
#                ZeRO-2 on two GPUs against one (train_scaling, where two GPUs are present)        ~700 s
#   decode       the target's and every draft's decode steps against their CUDA-graph references,
#                SmolLM2 and the 8B shape (decode_step); a draft's read of a prompt, eager and captured,
#                beside the target's prefill (prompt_read); the target's verify step by width
#                (verify_width)                                                                   ~600 s
#   eval         sf-eval end to end: an EAGLE-3 draft from a short pipeline (EVAL_SYNTH conversations,
#                2,048; 1 epoch) decodes all 60 built-in prompts, chain k=7 with the target alone beside it,
#                in each of EVAL_DTYPES (bfloat16) and EVAL_COMPILE (off on: --compile-target)     ~450 s
#   regen        sf-regen's stage on 10,240 synthesised prompts, the slot engine's step eager and
#                replayed as a CUDA graph (regen)                                                 ~330 s
#   capture      capture speed with bf16 and float8 storage (capture), through the Target and half
#                offloaded (capture_placement), MoE targets against dense (capture_moe), and
#                sf-capture verify on the host (featureset_verify)                                ~800 s
#   families     every draft family from one capture (SYNTH conversations, 12,800; STEPS steps, else
#                EPOCHS epochs, 3): each draft decoding alone every built-in prompt, its acceptance and
#                tokens/s, bf16, the target compiled (families)                                   ~1,400 s
#   objectives   token losses at equal steps: EAGLE-3 with ce, LK-alpha and LK-lambda, two seeds
#                each, and DFlash with ce and LK-lambda (objectives)                             ~1,300 s
#   modes        acceptance per serving mode (thinking off and on) of a draft trained in each (modes) ~500 s
#   codecs       acceptance of EAGLE-3 drafts trained from captures of one set in each encoding (bf16,
#                float8, fp6, fp4, fp4 with a top-32 teacher; CODECS), two seeds for bf16 and the
#                smallest, and of DFlash drafts from bf16 and the smallest (featureset_codecs
#                --acceptance)                                                                    ~1,200 s
#   sweep        sf-eval sweep of an EAGLE-3 and a DFlash draft from one capture (SYNTH conversations;
#                EPOCHS, 2): 12 EAGLE-3 serving settings and 3 DFlash blocks on every built-in prompt,
#                and the static tree beside them (sweep)                                            ~900 s
# A step whose estimate would end it past the deadline is skipped: the epoch second in
# $EV/deadline_epoch when that file exists (a later command may write it), else DEADLINE seconds
# (1,380) after the plans began. Plans that run SmolLM2 (eval, regen, families, objectives, modes,
# codecs, sweep) first wait for $EV/weights.ok, unless WEIGHTS_READY=1 or DRY=1.
#
# With the device kit (../shared/device/README.md: `bash ../shared/device/prepare.sh` here first):
#   call 1  . .devkit/on-device.sh setup && bash scripts/measure_gpu.sh start decode eval && bash scripts/measure_gpu.sh wait 400
#   call 2  . .devkit/on-device.sh && . .devkit/on-device.sh gguf && touch ~/ev/weights.ok && bash scripts/measure_gpu.sh wait
#   call 3+ . .devkit/on-device.sh && bash scripts/measure_gpu.sh wait        (until `done: yes`)
# Inputs from an earlier machine go in .devkit/carry/ (copied to $EV/carry): regen<SYNTH>.tar.gz, a
# finished regen/ folder of SYNTH synthesised conversations (12,800 by default) that families and
# objectives reuse; families_<part>.tar.gz with families_<part>.features.sha256, an earlier families
# run's eval_<draft> and draft folders (weights left out) and its capture's digest: their drafts join
# this run's table where the two captures' arrays are equal (benchmarks/families.py); this run's evaluation
# of a draft replaces a part's of the same name.
#
# DRY=1: tiny sizes on the CPU, the GPU-only benchmarks as --help, to check the script.
# Environment: EV ($HOME/ev), DEADLINE, SYNTH, EPOCHS, STEPS, EVAL_LIMIT (prompts a set in the
# eval, objectives, modes and fp8 evals: 8), FAMILIES_LIMIT (prompts a set in families: all), JOBS
# (trainings at once; default one per 35 GiB of GPU memory), EVAL_JOBS (8), FAMILIES_DFLASH2_ALONE (1;
# 0 trains a DFlash2 draft beside the others, where one at most is among them; on an H100 it ran out of
# memory beside Domino's), FAMILIES_ONLY and
# OBJECTIVES_ONLY (the drafts to train, by name; default all), FAMILIES_ANCHORS (dflash_b16: added to
# FAMILIES_ONLY where a carried families part's capture differs from this run's), SWEEP_EAGLE3 (the
# sweep's EAGLE-3 settings, S,K,N each: 12 by default), SWEEP_EST (the EAGLE-3 sweep's estimate, 600 s),
# SWEEP_DFLASH (1; 0 leaves the DFlash draft and its sweep out), CURVE_EPOCHS (objectives: one more
# EAGLE-3 run of that many epochs with --keep-best; 0), WITH_RUN (objectives: an earlier run's
# reports joined to this run's, benchmarks/objectives.py --with-run), TIMING_OPTS
# (--compile-target --dtype bfloat16) and DRAFT_TIMING_OPTS (none; --compile-draft fuses the
# drafts' steps further, one compile per eval): the families' evals.
set -uo pipefail
EV=${EV:-$HOME/ev}
RUN=$EV/run
LOGS=$EV/logs
DEADLINE=${DEADLINE:-1380}
DRY=${DRY:-0}
EAGLE3=recipes/smollm2-h200.yaml
DFLASH=recipes/smollm2-h200-dflash.yaml
PEAGLE=recipes/smollm2-h200-peagle.yaml
if [ "$DRY" = 1 ]; then
  DEV=cpu
  REGEN_OPTS="--batch-size 6 --max-new-tokens 16"
  TRAIN_OPTS="--num-workers 0 --max-batch-tokens 1024 --warmup-steps 1 --eval-fraction 0.3"
  EVAL_OPTS="--device cpu --limit 1 --max-new-tokens 6 --prompts chat"
  FAMILIES_EVAL_OPTS="--device cpu --max-new-tokens 6 --prompts chat"
  TIMING_OPTS="" DRAFT_TIMING_OPTS="" FAMILIES_LIMIT=${FAMILIES_LIMIT:-1}
else
  DEV=cuda
  REGEN_OPTS=""
  TRAIN_OPTS="--num-workers 2"
  EVAL_OPTS="--device cuda --limit ${EVAL_LIMIT:-8}"
  FAMILIES_EVAL_OPTS="--device cuda"
  TIMING_OPTS=${TIMING_OPTS---compile-target --dtype bfloat16}
  DRAFT_TIMING_OPTS=${DRAFT_TIMING_OPTS:-}
fi
dry() { [ "$DRY" = 1 ]; }
# the allocator returns freed blocks' tails to the other processes sharing the GPU; up to 8
# processes share the CPU cores too, so each keeps to 2 threads (their work is on the GPU)
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
dry || export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}

elapsed() { echo $(( $(date +%s) - $(cat "$EV/t0") )); }
deadline() {  # seconds since the plans began by which a step must end
  if [ -f "$EV/deadline_epoch" ]; then echo $(( $(cat "$EV/deadline_epoch") - $(cat "$EV/t0") )); else echo "$DEADLINE"; fi
}
fits() {  # fits NAME ESTIMATE_S: whether the step ends before the deadline; else it is recorded as skipped
  local now; now=$(elapsed)
  [ $(( now + $2 )) -le "$(deadline)" ] && return 0
  printf '%s\tskipped\t%s\t-\t-\n' "$1" "$now" >> "$EV/status.tsv"
  echo "[$now s] skip $1 (estimate $2 s past the $(deadline) s deadline)"
  return 1
}

# step NAME ESTIMATE_S CMD...: run CMD, logged to $LOGS/NAME.log; 99 when skipped
step() {
  local name=$1 est=$2 start now rc; shift 2
  fits "$name" "$est" || return 99
  start=$(elapsed)
  echo "[$start s] start $name: $*"
  "$@" > "$LOGS/$name.log" 2>&1
  rc=$?
  now=$(elapsed)
  printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$rc" "$start" "$now" $(( now - start )) >> "$EV/status.tsv"
  echo "[$now s] end $name rc=$rc ($(( now - start )) s)"
  [ "$rc" -eq 0 ] || STEP_FAILED=1
  return $rc
}

# together NAME ESTIMATE_S MAX "CMD"...: the commands side by side on the one GPU, at most MAX at once,
# each logged to $LOGS/NAME-k.log; 1 when any failed (their logs' tails printed), 99 when skipped
together() {
  local name=$1 est=$2 max=$3; shift 3
  [ $# -gt 0 ] || return 0
  fits "$name" "$est" || return 99
  local k=0 running=0 pid rc start failed=()
  declare -A log_of=() k_of=()
  start=$(elapsed)
  reap() {
    rc=0; wait -n -p pid || rc=$?
    printf '%s-%s\t%s\t%s\t%s\t%s\n' "$name" "${k_of[$pid]}" "$rc" "$start" "$(elapsed)" $(( $(elapsed) - start )) >> "$EV/status.tsv"
    [ "$rc" -ne 0 ] && failed+=("${log_of[$pid]}"); running=$((running - 1))
  }
  for cmd in "$@"; do
    [ "$running" -ge "$max" ] && reap  # a slot frees when any one ends
    echo "[$(elapsed) s] start $name-$k: $cmd"
    bash -c "$cmd" > "$LOGS/$name-$k.log" 2>&1 &
    log_of[$!]=$LOGS/$name-$k.log; k_of[$!]=$k; running=$((running + 1)); k=$((k + 1))
  done
  while [ "$running" -gt 0 ]; do reap; done
  echo "[$(elapsed) s] end $name: ${#failed[@]} of $k failed"
  for log in "${failed[@]}"; do echo "== $log"; tail -n 15 "$log"; done
  [ ${#failed[@]} -eq 0 ] || { STEP_FAILED=1; return 1; }
}

# train_jobs: SmolLM2 draft trainings sharing the GPU (JOBS when set): one of the smollm2-h200
# recipes takes up to ~35 GB, so one per 35 GiB of the GPU's memory, 1 to 4; 2 on a CPU
train_jobs() {
  if [ -n "${JOBS:-}" ]; then echo "$JOBS"; return; fi
  local mib jobs
  mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -n 1)
  [ -n "$mib" ] || { echo 2; return; }
  jobs=$(( mib / 1024 / 35 ))
  [ "$jobs" -lt 1 ] && jobs=1; [ "$jobs" -gt 4 ] && jobs=4
  echo "$jobs"
}

# keep_only ARRAY NAMES: drop the entries "NAME|..." of the array named ARRAY whose NAME is not in
# NAMES (space-separated); with NAMES empty, every entry stays
keep_only() {
  local -n entries=$1
  [ -n "$2" ] || return 0
  local kept=() entry
  for entry in "${entries[@]}"; do [[ " $2 " == *" ${entry%%|*} "* ]] && kept+=("$entry"); done
  entries=("${kept[@]}")
}

weights() {  # the SmolLM2 weights: here already, or joined by a later command that touches weights.ok
  { dry || [ "${WEIGHTS_READY:-0}" = 1 ]; } && return 0
  for _ in $(seq 300); do [ -f "$EV/weights.ok" ] && return 0; sleep 2; done
  echo "no SmolLM2 weights ($EV/weights.ok) after 600 s"; return 1
}

# carried_regen DIR SYNTH: $EV/carry/regen<SYNTH>.tar.gz, a finished regen of SYNTH conversations from an
# earlier machine, unpacked as DIR/regen where there is one and DIR has none yet (not under DRY)
carried_regen() {
  if ! dry && [ -f "$EV/carry/regen$2.tar.gz" ] && [ ! -e "$1/regen" ]; then tar xzf "$EV/carry/regen$2.tar.gz" -C "$1"; fi
}

# features DIR FAMILIES [sf-capture options]: SYNTH synthesised conversations (12,800) regenerated into
# DIR/regen (or unpacked from $EV/carry/regen<SYNTH>.tar.gz), captured into DIR/features with the
# layers of FAMILIES, and verified
features() {
  local dir=$1 families=$2 name synth; shift 2
  name=$(basename "$dir")
  synth=${SYNTH:-$(dry && echo 6 || echo 12800)}
  mkdir -p "$dir"
  carried_regen "$dir" "$synth"
  step "${name}_regen" 120 sf-regen run -o "$dir/regen" --recipe "$EAGLE3" --device "$DEV" \
    --synthesize "$synth" $REGEN_OPTS || return 1
  step "${name}_capture" 150 sf-capture run "$dir/regen" -o "$dir/features" --recipe "$EAGLE3" \
    --families "$families" --device "$DEV" "$@" || return 1
  step "${name}_verify" 120 sf-capture verify "$dir/features"
}

plan_tests() {
  if dry; then step tests 300 python -m pytest -m gpu -n 0 --collect-only -q -p no:cacheprovider ${GPU_TESTS:-}
  else step tests 300 env LOG="$EV/gpu_tests.log" bash benchmarks/gpu_tests.sh ${GPU_TESTS:-}; fi
}

plan_kernels() {
  if dry; then
    step kernels_attention 60 python -m benchmarks.kernels --help
    step kernels_loss 60 python -m benchmarks.kernels --help
    step attention_breakdown 60 python -m benchmarks.attention_breakdown --help
    step moe_tiles 300 env TRITON_INTERPRET=1 python -m benchmarks.moe_tiles --device cpu --shapes tiny --grid tiny --tokens 40
  else
    step kernels_attention 200 python -m benchmarks.kernels --only attention
    step kernels_loss 60 python -m benchmarks.kernels --only loss
    step attention_breakdown 90 python -m benchmarks.attention_breakdown --seq 4096 --no-profile --no-tuned-flex
    step moe_tiles 150 python -m benchmarks.moe_tiles --shapes qwen3_30b_a3b --tokens 32768
  fi
}

plan_train_step() {
  if dry; then
    step train_step 300 python -m benchmarks.train_step --tiny --seq 64 --steps 2 --ttt 2 --impls ours \
      --storage bfloat16,float8_e4m3fn --token-losses ce,lk-lambda
    for b in dflash_train_step family_step flex_shapes train_scaling; do step "$b" 60 python -m "benchmarks.$b" --help; done
    return 0
  fi
  step train_step 200 python -m benchmarks.train_step --impls ours --storage bfloat16,float8_e4m3fn \
    --token-losses ce,lk-lambda
  step dflash_train_step 240 python -m benchmarks.dflash_train_step --batches 1,2,4,8 --impls ours --steps 4 --profile
  step family_step 120 python -m benchmarks.family_step
  step flex_shapes 150 python -m benchmarks.flex_shapes --budget-s 25
  if [ "$(nvidia-smi -L 2>/dev/null | wc -l)" -ge 2 ]; then
    step train_scaling 150 python -m benchmarks.train_scaling --worlds 1,2
  fi
}

plan_decode() {
  if dry; then
    step decode_step 120 python -m benchmarks.decode_step --device cpu --shapes tiny --iters 3
    step verify_width 120 python -m benchmarks.verify_width --device cpu --widths 1,8 --prompt 16 --iters 2 \
      --profile-widths ""
    step prompt_read 60 python -m benchmarks.prompt_read --help
  else
    step decode_step 400 python -m benchmarks.decode_step --iters 20 --compiled-rows token,verify_k7,tree
    step prompt_read 90 python -m benchmarks.prompt_read
    step verify_width 90 python -m benchmarks.verify_width --profile-widths ""
  fi
}

# eval: the EAGLE-3 draft of a short pipeline, then sf-eval of every built-in prompt set per dtype and
# compile choice, its wall time printed (each sf-eval alone on the GPU)
plan_eval() {
  weights || return 1
  local r=$RUN/eval dtype compile out opts synth
  synth=${EVAL_SYNTH:-$(dry && echo 8 || echo 2048)}
  mkdir -p "$r"
  step eval_regen 150 sf-regen run -o "$r/regen" --recipe "$EAGLE3" --synthesize "$synth" --device "$DEV" $REGEN_OPTS || return 1
  step eval_capture 60 sf-capture run "$r/regen" -o "$r/features" --recipe "$EAGLE3" --device "$DEV" || return 1
  step eval_train 150 sf-train run "$r/features" -o "$r/train" --recipe "$EAGLE3" --epochs 1 --warmup-steps 20 \
    --eval-every 100000 --save-every 100000 $TRAIN_OPTS || return 1
  for dtype in ${EVAL_DTYPES:-$(dry && echo float32 || echo bfloat16)}; do
    for compile in ${EVAL_COMPILE:-$(dry && echo off || echo off on)}; do
      case $compile in
        off) out=$r/eval-$dtype opts= ;;
        on) out=$r/eval-$dtype-compiled opts=--compile-target ;;
        all) out=$r/eval-$dtype-compiled-draft opts="--compile-target --compile-draft" ;;
        *) echo "EVAL_COMPILE: off, on or all, not $compile"; return 2 ;;
      esac
      # dry: the chat set's first prompt; else every prompt of every set
      step "eval_${dtype}_$compile" 150 sf-eval run "$r/train" -o "$out" --recipe "$EAGLE3" --device "$DEV" \
        --dtype "$dtype" $opts $(dry && echo "--max-new-tokens 8 --prompts chat --limit 1") \
        && cat "$out/eval.txt"
    done
  done
}

plan_regen() {
  weights || return 1
  if dry; then
    # the CPU recipe's stage (40 slots; the GPU recipe's 2,048 slots do not fit a CPU's memory)
    step regen 900 python -m benchmarks.regen --synthesize 6 --recipe recipes/smollm2-cpu.yaml --paths after,graph_step \
      --llama8b-conversations 0 --profile --out regen
  else
    step regen 330 python -m benchmarks.regen --synthesize 10240 --paths after,graph_step --profile \
      --llama8b-conversations 0
  fi
}

plan_capture() {
  if dry; then
    step capture 60 python -m benchmarks.capture --help
    step capture_placement 300 python -m benchmarks.capture_placement --tiny
    step capture_moe 300 python -m benchmarks.capture_moe --device cpu --shapes tiny --impls eager,grouped_mm \
      --compile-layers attention,layer
    step featureset_verify 120 python -m benchmarks.featureset_verify --shards 2 --samples 4 --tokens 64 --repeats 1
  else
    step capture 150 python -m benchmarks.capture --storage bfloat16,float8_e4m3fn --batches 20
    step capture_placement 360 python -m benchmarks.capture_placement
    step capture_moe 330 python -m benchmarks.capture_moe --tokens 8192,32768 --impls eager,grouped_mm,sf_fused \
      --compile-layers attention,layer
    step featureset_verify 60 python -m benchmarks.featureset_verify --shards 8 --repeats 2
  fi
}

# families: every family's draft from one capture (SYNTH conversations), trained for STEPS optimizer
# steps each (else EPOCHS epochs): DFlash2 alone, then the others JOBS at a time; a training that
# failed (out of memory beside another) runs again alone, resuming. Then each draft decodes alone, one after another, every
# built-in prompt (FAMILIES_LIMIT prompts a set where set), bf16 with the target compiled
# (TIMING_OPTS, and DRAFT_TIMING_OPTS for the drafts that take them): each report gives both the
# acceptance and the speed, the first one (the chain's) the target alone too.
plan_families() {
  weights || return 1
  local r=$RUN/families d e name draft recipe opts base draft_opts est length trains=() retries=() trained=()
  local epochs=${EPOCHS:-$(dry && echo 1 || echo 3)}
  length=$([ -n "${STEPS:-}" ] && echo "--max-steps $STEPS" || echo "--epochs $epochs")
  features "$r" eagle3,dflash,domino,dspark,dflash2,peagle || return 1
  # the capture's content (its arrays, not the manifest's times), so that drafts trained from a capture
  # of the same conversations on another machine can be shown to have read the same features
  (cd "$r/features" && find . -type f ! -name '*.json' | LC_ALL=C sort | xargs sha256sum) > "$r/features.sha256"
  cp "$r/features.sha256" "$LOGS/families_features.sha256"
  echo "features digest: $(sha256sum < "$r/features.sha256" | cut -c1-16)"
  # drafts of an earlier machine's run of this plan (families_<part>.tar.gz, its eval_ and draft folders,
  # beside families_<part>.features.sha256) join the table when their capture's digest is this one's
  # (a capture that differs from the part's cannot join it: this run then trains FAMILIES_ANCHORS too,
  # dflash_b16 by default, so that its own table keeps the block drafters' baseline)
  local part parts=() only=${FAMILIES_ONLY:-}
  for part in "$EV"/carry/families_*.tar.gz; do
    [ -f "$part" ] || continue
    name=$(basename "$part" .tar.gz)
    if ! cmp -s "$EV/carry/$name.features.sha256" "$r/features.sha256"; then
      echo "features differ from $name's: its drafts do not join this run's table"
      if [ -n "$only" ]; then echo "training ${FAMILIES_ANCHORS-dflash_b16} here too"; only="$only ${FAMILIES_ANCHORS-dflash_b16}"; fi
      continue
    fi
    mkdir -p "$RUN/$name"
    tar xzf "$part" -C "$RUN/$name" && cp "$EV/carry/$name.features.sha256" "$RUN/$name/features.sha256" && parts+=("$RUN/$name")
  done
  # name|recipe|options; the longest first, so that the last slots hold the short ones
  local drafts=("dflash2_b16|$DFLASH|--block-size 16 --family dflash2"
                "dflash2_b16_gold|$DFLASH|--block-size 16 --family dflash2 --selector-loss gold"
                "dflash2_b16_selector_only|$DFLASH|--block-size 16 --family dflash2 --freeze-convolutions"
                "domino_b16|$DFLASH|--block-size 16 --family domino"
                "dspark|$DFLASH|--block-size 16 --family dspark"
                "dflash_b16|$DFLASH|--block-size 16"
                "eagle3|$EAGLE3|"
                "peagle_k7|$PEAGLE|--num-depths 7"
                "dflash_b16_dpace|$DFLASH|--block-size 16 --objective dpace")
  keep_only drafts "$only"
  # DFlash2 trains alone (each objective) unless FAMILIES_DFLASH2_ALONE=0: it held 42 GiB of an H100
  # (its convolution eager) and ran out beside DFlash; 45 GiB of the GPU in use with it compiled
  local alone=()
  for d in "${drafts[@]}"; do
    IFS='|' read -r name recipe opts <<< "$d"
    if [[ $name == dflash2_* ]] && [ "${FAMILIES_DFLASH2_ALONE:-1}" = 1 ]; then alone+=("sf-train run $r/features -o $r/$name --recipe $recipe $opts $length $TRAIN_OPTS")
    else trains+=("sf-train run $r/features -o $r/$name --recipe $recipe $opts $length $TRAIN_OPTS"); fi
  done
  together families_train_dflash2 "${FAMILIES_DFLASH2_EST:-600}" 1 "${alone[@]}"
  together families_train "${FAMILIES_EST:-600}" "$(train_jobs)" "${trains[@]}"
  for d in "${drafts[@]}"; do
    IFS='|' read -r name recipe opts <<< "$d"
    [ -f "$r/$name/export/config.json" ] || retries+=("sf-train run $r/features -o $r/$name --recipe $recipe $opts $length $TRAIN_OPTS")
  done
  together families_train_alone "${FAMILIES_RETRY_EST:-300}" 1 "${retries[@]}"
  # name|draft|recipe|options: the EAGLE-3 draft decodes as a chain and as a tree; DFlash2 and DFlash
  # first, so that a deadline leaves their comparison whole
  local runs=()
  for name in dflash2_b16 dflash2_b16_gold dflash2_b16_selector_only dflash_b16; do runs+=("$name|$name|$DFLASH|"); done
  runs+=("eagle3_chain_k7|eagle3|$EAGLE3|")
  for name in domino_b16 dspark; do runs+=("$name|$name|$DFLASH|"); done
  runs+=("peagle_k7|peagle_k7|$PEAGLE|" "dflash_b16_dpace|dflash_b16_dpace|$DFLASH|"
         "eagle3_tree|eagle3|$EAGLE3|--tree 8,4,2,1,1,1,1")
  for e in "${runs[@]}"; do
    IFS='|' read -r name draft recipe opts <<< "$e"
    [ -f "$r/$draft/export/config.json" ] && trained+=("$e") || echo "no export in $r/$draft: $name not evaluated"
  done
  base=--baseline  # the target alone decodes beside the first draft evaluated
  for e in "${trained[@]}"; do
    IFS='|' read -r name draft recipe opts <<< "$e"
    case $name in eagle3_tree|peagle*) draft_opts= ;; *) draft_opts=$DRAFT_TIMING_OPTS ;; esac
    # the static tree's warm-up compiles its 360-node verify: 159 s on an H100 once, unfinished after 278 s once
    case $name in eagle3_tree) est=360 ;; *) est=75 ;; esac
    step "families_eval_$name" "$(dry && echo 120 || echo $est)" sf-eval run "$r/$draft" -o "$r/eval_$name" \
      --recipe "$recipe" $opts $base $FAMILIES_EVAL_OPTS $TIMING_OPTS $draft_opts ${FAMILIES_LIMIT:+--limit $FAMILIES_LIMIT}
    base=--no-baseline
  done
  # an evaluation made here replaces a carried part's of the same name (a draft trained again)
  for e in "$r"/eval_*; do
    [ -d "$e" ] || continue
    for part in "${parts[@]}"; do [ -d "$part/${e##*/}" ] && echo "${e##*/}: this run's replaces $part's" && rm -rf "${part:?}/${e##*/}"; done
  done
  step families_result 30 python -m benchmarks.families "$r" "${parts[@]}" --each-alone --out families \
    || { [ ${#parts[@]} -gt 0 ] && step families_result_this_run 30 python -m benchmarks.families "$r" --each-alone --out families; }
}

# objectives: from one capture, at equal steps, EAGLE-3 with each token loss and seeds 0 and 1, and
# DFlash b16 (soft teacher for both: the LK losses take the target's whole distribution) with ce and
# LK-lambda; EAGLE-3 decodes as a chain of k=7, DFlash in blocks of 16
plan_objectives() {
  weights || return 1
  local r=$RUN/objectives d name recipe opts eopts loss seed trains=() evals=()
  local epochs=${EPOCHS:-$(dry && echo 1 || echo 2)} curve=${CURVE_EPOCHS:-0}
  features "$r" eagle3,dflash || return 1
  local drafts=("dflash_ce|$DFLASH|--block-size 16 --teacher soft|"
                "dflash_lk_lambda|$DFLASH|--block-size 16 --teacher soft --token-loss lk-lambda|")
  for loss in ce lk-alpha lk-lambda; do
    for seed in 0 1; do drafts+=("eagle3_${loss//-/_}_seed$seed|$EAGLE3|--token-loss $loss --seed $seed|-k 7"); done
  done
  keep_only drafts "${OBJECTIVES_ONLY:-}"
  [ "$curve" -gt 0 ] && trains+=("sf-train run $r/features -o $r/curve_eagle3 --recipe $EAGLE3 --token-loss ce --seed 0 \
--keep-best --eval-every ${CURVE_EVAL_EVERY:-$(dry && echo 1 || echo 40)} --epochs $curve $TRAIN_OPTS")
  for d in "${drafts[@]}"; do
    IFS='|' read -r name recipe opts _ <<< "$d"
    trains+=("sf-train run $r/features -o $r/$name --recipe $recipe $opts --epochs $epochs $TRAIN_OPTS")
  done
  together objectives_train "${OBJECTIVES_EST:-1000}" "$(train_jobs)" "${trains[@]}"
  for d in "${drafts[@]}"; do
    IFS='|' read -r name recipe _ eopts <<< "$d"
    if [ -f "$r/$name/export/config.json" ]; then
      evals+=("sf-eval run $r/$name -o $r/eval_$name --recipe $recipe $eopts --no-baseline $EVAL_OPTS")
    else echo "no export in $r/$name: not evaluated"; fi
  done
  together objectives_eval 200 "${EVAL_JOBS:-8}" "${evals[@]}"
  step objectives_result 30 python -m benchmarks.objectives "$r" --out objectives ${WITH_RUN:+--with-run "$WITH_RUN"}
}

# modes: SmolLM2 under the reasoning rules of Qwen3's chat template (ChatML, so SmolLM2's tokenizer
# renders it). For each mode (nothink: {"enable_thinking": false}, think: the template's default)
# sf-regen regenerates SYNTH synthesised conversations in that mode, sf-capture renders them in
# their recorded mode, and an EAGLE-3 draft trains 1 epoch; each draft is evaluated in both modes.
plan_modes() {
  weights || return 1
  local r=$RUN/modes mode trains=() evals=() synth
  synth=${SYNTH:-$(dry && echo 6 || echo 2048)}
  mkdir -p "$r"
  local template=$r/qwen3-reasoning-rules.jinja both='[{"enable_thinking": false}, {"enable_thinking": true}]'
  python -c "from specfoundry.testing import QWEN3_THINKING_TEMPLATE as t; print(t, end='')" > "$template"
  declare -A kwargs=([nothink]='{"enable_thinking": false}' [think]='{"enable_thinking": true}')
  for mode in nothink think; do
    step "modes_regen_$mode" 120 sf-regen run -o "$r/regen_$mode" --recipe "$EAGLE3" --synthesize "$synth" \
      --device "$DEV" --chat-template "$template" --chat-template-kwargs "${kwargs[$mode]}" $REGEN_OPTS || return 1
    step "modes_capture_$mode" 60 sf-capture run "$r/regen_$mode" -o "$r/features_$mode" --recipe "$EAGLE3" \
      --device "$DEV" --chat-template "$template" || return 1
    trains+=("sf-train run $r/features_$mode -o $r/train_$mode --recipe $EAGLE3 --epochs 1 --warmup-steps 20 \
--eval-every 100000 --save-every 100000 $TRAIN_OPTS")
    evals+=("sf-eval run $r/train_$mode -o $r/eval_$mode --recipe $EAGLE3 -k 7 --no-baseline \
--chat-template $template --modes '$both' $EVAL_OPTS")
  done
  together modes_train 250 2 "${trains[@]}" || return 1
  together modes_eval 150 2 "${evals[@]}"
  step modes_result 30 python -m benchmarks.modes "$r" --out modes
}

# codecs: one regenerated set (SYNTH conversations, 12,800; the carried regen when there is one) captured
# in each encoding of CODECS (name|storage dtype|teacher storage|seeds), an EAGLE-3 draft trained from
# each (EPOCHS, 2; every draft the same steps: one set of conversations), evaluated on every built-in
# prompt (chain k=7); and a DFlash draft (block 16) from bf16 and from CODECS_DFLASH (the smallest
# encoding by default), evaluated alike
plan_codecs() {
  weights || return 1
  local r=$RUN/codecs c name dtype teacher seeds seed caps=() trains=() evals=() train_opts eagle_opts= eval_opts
  local synth=${SYNTH:-$(dry && echo 6 || echo 12800)}
  local codecs=${CODECS:-"bf16|bfloat16|final|2 fp8|float8_e4m3fn|final|1 fp6|fp6_e2m3|final|1 fp4|fp4_e2m1|final|1 fp4topk32|fp4_e2m1|topk:32|2"}
  local dflash_from=${CODECS_DFLASH:-fp4topk32}
  if dry; then
    train_opts="--epochs 1 --warmup-steps 1 --num-workers 0" eagle_opts="--draft-vocab-size 512 --ttt-length 2"
    eval_opts="--device cpu --max-new-tokens 4 --limit 1 --prompts chat"
  else
    train_opts="--epochs ${EPOCHS:-2} --warmup-steps 30 --num-workers 2" eval_opts="--device cuda"
  fi
  mkdir -p "$r"
  carried_regen "$r" "$synth"
  step codecs_regen 240 sf-regen run -o "$r/regen" --recipe "$EAGLE3" --device "$DEV" --synthesize "$synth" \
    $(dry && echo "--batch-size 4 --max-new-tokens 16") || return 1
  for c in $codecs; do
    IFS='|' read -r name dtype teacher seeds <<< "$c"
    # the layers of both families read here, so that the DFlash drafts read the same captures
    caps+=("sf-capture run $r/regen -o $r/feat_$name --recipe $EAGLE3 --families eagle3,dflash --storage-dtype $dtype \
--teacher-storage $teacher --device $DEV")
    for seed in $(seq 0 $((seeds - 1))); do
      trains+=("sf-train run $r/feat_$name -o $r/train_${name}_seed$seed --recipe $EAGLE3 $train_opts $eagle_opts --seed $seed")
      evals+=("sf-eval run $r/train_${name}_seed$seed -o $r/eval_${name}_seed$seed --recipe $EAGLE3 --no-baseline $eval_opts")
    done
  done
  for name in bf16 "$dflash_from"; do
    trains+=("sf-train run $r/feat_$name -o $r/dflash_$name --recipe $DFLASH --block-size 16 $train_opts")
    evals+=("sf-eval run $r/dflash_$name -o $r/dflash_eval_$name --recipe $DFLASH --no-baseline $eval_opts")
  done
  together codecs_capture 240 2 "${caps[@]}" || return 1
  together codecs_train "${CODECS_EST:-600}" "$(train_jobs)" "${trains[@]}"
  together codecs_eval 300 4 "${evals[@]}"
  step codecs_result 30 python -m benchmarks.featureset_codecs --acceptance "$r" ${GIT_COMMIT:+--commit "$GIT_COMMIT"}
}

# sweep: sf-eval sweep (docs/serving.md) of an EAGLE-3 and a DFlash draft (block 16) trained side by
# side from one capture of SYNTH conversations (the carried regen when there is one; EPOCHS, 2), every
# built-in prompt (FAMILIES_LIMIT where set), bf16 with the target compiled (TIMING_OPTS), each sweep
# alone on the GPU: EAGLE-3 at SWEEP_EAGLE3 (SGLang's S,K,N: 12 settings, chains and trees up to 64
# draft tokens), DFlash at its defaults (k 3, 7, 15: blocks of 4, 8 and 16); then EAGLE-3's full static
# tree 8,4,2,1,1,1,1 over the same prompts, its target uncompiled, for its acceptance (sweep)
SWEEP_EAGLE3_DEFAULT="3,1,4 5,1,6 7,1,8 3,4,8 5,4,8 7,4,8 5,4,16 7,4,16 5,8,32 7,8,32 7,8,64 8,8,64"
plan_sweep() {
  weights || return 1
  local r=$RUN/sweep epochs=${EPOCHS:-$(dry && echo 1 || echo 2)} settings=${SWEEP_EAGLE3:-$SWEEP_EAGLE3_DEFAULT}
  local eval_opts="$FAMILIES_EVAL_OPTS $TIMING_OPTS ${FAMILIES_LIMIT:+--limit $FAMILIES_LIMIT}"
  dry && settings=${SWEEP_EAGLE3:-"3,1,4 7,1,8 3,2,6"}
  local trains=("sf-train run $r/features -o $r/eagle3 --recipe $EAGLE3 --epochs $epochs $TRAIN_OPTS")
  [ "${SWEEP_DFLASH:-1}" = 1 ] && trains+=(
    "sf-train run $r/features -o $r/dflash_b16 --recipe $DFLASH --block-size 16 --epochs $epochs $TRAIN_OPTS")
  features "$r" eagle3,dflash || return 1
  together sweep_train "${SWEEP_TRAIN_EST:-420}" 2 "${trains[@]}" || return 1
  step sweep_eagle3 "${SWEEP_EST:-$(dry && echo 300 || echo 600)}" sf-eval sweep "$r/eagle3" -o "$r/sweep_eagle3" \
    --recipe "$EAGLE3" --settings "$settings" $eval_opts
  [ "${SWEEP_DFLASH:-1}" = 1 ] && step sweep_dflash_b16 "$(dry && echo 120 || echo 240)" sf-eval sweep "$r/dflash_b16" \
    -o "$r/sweep_dflash_b16" --recipe "$DFLASH" $eval_opts
  # the static tree's acceptance only (benchmarks/sweep.py): its target uncompiled, as a compile per
  # verify width (one per accepted depth) would cost minutes a width
  step sweep_tree "$(dry && echo 120 || echo 90)" sf-eval run "$r/eagle3" -o "$r/eval_eagle3_tree" --recipe "$EAGLE3" \
    --tree 8,4,2,1,1,1,1 --no-baseline ${eval_opts//--compile-target/}
  step sweep_result 30 python -m benchmarks.sweep "$r" --status "$EV/status.tsv" --out sweep
}

PLANS="tests kernels train_step decode eval regen capture families objectives modes codecs sweep"

plans() {  # plans PLAN...: each in order, in the copy of the tree; 1 when any plan failed
  local p rc failed=0
  cd "$EV/repo" || return 1
  export PYTHONPATH=$EV/repo${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
  date +%s > "$EV/t0"
  echo "plans $*: commit ${GIT_COMMIT:-?}, device $DEV, deadline $(deadline) s"
  dry || nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv
  for p in "$@"; do
    echo "[$(elapsed) s] plan $p"
    STEP_FAILED=0
    "plan_$p"; rc=$?
    if { [ "$rc" -ne 0 ] && [ "$rc" -ne 99 ]; } || [ "$STEP_FAILED" = 1 ]; then  # 99: its last step skipped
      failed=1; echo "[$(elapsed) s] plan $p: a step failed (status.tsv names it)"
    fi
  done
  echo "[$(elapsed) s] plans done"
  echo done > "$EV/done"
  return $failed
}

copy_tree() {  # a fresh $EV with a copy of the tree (and the carried inputs); PLANS checked first
  for p in "$@"; do [[ " $PLANS " == *" $p "* ]] || { echo "unknown plan '$p' (plans: $PLANS)" >&2; exit 2; }; done
  [ $# -gt 0 ] || { echo "name a plan (plans: $PLANS)" >&2; exit 2; }
  rm -rf "$EV" && mkdir -p "$EV/repo" "$LOGS" "$RUN" && touch "$EV/status.tsv"
  tar cf - --exclude=./.devkit --exclude=./.git --exclude=./.venv --exclude=./runs . | (cd "$EV/repo" && tar xf -)
  [ -d .devkit/carry ] && cp -r .devkit/carry "$EV/carry"
}

pack() {
  local out=${OUT:-$EV/out}
  mkdir -p "$out"
  (cd "$EV" && tar czf "$out/measured.tar.gz" --exclude='*.safetensors' --exclude='*.pt' --exclude='*.bin' \
    --exclude='checkpoints' --exclude='shards' --exclude='data' --exclude='*.parquet' --exclude='*.zarr' \
    status.tsv logs plans.log run $(ls gpu_tests.log 2>/dev/null) \
    $(find repo/benchmarks/results -type f -newer t0 2>/dev/null))
  ls -la "$out"
}

show() {
  echo "== status ($(elapsed) s since the plans began; done: $([ -f "$EV/done" ] && echo yes || echo no))"
  column -t -s $'\t' "$EV/status.tsv" 2>/dev/null
  echo "== plans.log (tail)"; tail -n 8 "$EV/plans.log"
  for f in $(ls -t "$LOGS"/*.log 2>/dev/null | head -n 3); do echo "== $f"; tail -n 4 "$f"; done
  dry || nvidia-smi --query-gpu=utilization.gpu,memory.used,clocks.sm,temperature.gpu --format=csv,noheader
}

cd "$(dirname "$0")/.." || exit 1
case "${1:-}" in
  start)
    shift; copy_tree "$@"
    setsid nohup bash "$EV/repo/scripts/measure_gpu.sh" plans "$@" > "$EV/plans.log" 2>&1 < /dev/null &
    echo $! > "$EV/pid"
    sleep 2; echo "plans $* started (pid $(cat "$EV/pid")) in $EV"; tail -n 3 "$EV/plans.log" ;;
  run)
    shift; copy_tree "$@"
    bash "$EV/repo/scripts/measure_gpu.sh" plans "$@" 2>&1 | tee "$EV/plans.log"
    rc=${PIPESTATUS[0]}
    pack; show; exit "$rc" ;;
  plans) shift; plans "$@" ;;
  wait)
    limit=${2:-540}; t=$(date +%s)
    while [ ! -f "$EV/done" ] && [ $(( $(date +%s) - t )) -lt "$limit" ]; do sleep 5; done
    pack; show ;;
  pack) pack ;;
  show) show ;;
  stop) kill -- -"$(cat "$EV/pid")" && echo "stopped the plans' process group $(cat "$EV/pid")" ;;
  *) echo "usage: $0 start PLAN...|run PLAN...|wait [S]|pack|show|stop (plans: $PLANS)" >&2; exit 2 ;;
esac
