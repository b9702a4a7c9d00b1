#!/usr/bin/env bash
# Issue 28's GPU measurements in one unattended run on one GPU machine, in priority order:
#   1. the regen benchmark (timing, alone on the GPU)
#   2. fp8 acceptance: sf-regen of ~5,000 synthesised SmolLM2 conversations, one capture in bf16
#      and one in float8, EAGLE-3 from each with two seeds (4 trainings side by side), sf-eval
#      chain k=7 on every chat and code prompt (4 evals side by side); `pytest -m gpu` runs beside
#      these (none of them is timed)
#   3. the DFlash train step across batches, 4. the train step and the capture, bf16 against
#      float8 (timing, each alone on the GPU)
# Every step logs to $EV/logs/<step>.log and appends "step rc start end seconds" to $EV/status.tsv;
# a step is skipped when its estimate would end it past the deadline: the epoch second in
# $EV/deadline_epoch when that file exists (a later command may write it), else $DEADLINE seconds
# after the plan began.
#
# Schedule on one H200 (estimates from the kit's timings at 8dd38ca; the step's skip estimate in
# brackets), device time ~1800 s in all:
#   machine start + setup (wheels, editable install)              ~150 s
#   regen_bench   python -m benchmarks.regen --profile             ~330 s  [420]
#   sf_regen      5,504 synthesised conversations (~5,290 kept)     ~150 s  [240]  + gpu tests beside
#   capture       bf16 and float8, side by side                      ~60 s  [120]
#   train         4 x EAGLE-3, 2 epochs, warm-up 30, side by side   ~300 s  [420]
#   eval          4 x sf-eval k=7 chain, chat + code, side by side  ~120 s  [240]
#   dflash_train_step  --batches 1,2,4,8 --impls ours --profile     ~180 s  [240]
#   train_step    --storage bfloat16,float8_e4m3fn --impls ours     ~100 s  [150]
#   capture_bench --storage bfloat16,float8_e4m3fn --batches 20     ~100 s  [150]
#   total ~1,490 s; what does not fit is skipped from the end (priority order).
#
#   bash scripts/gpu_evidence.sh start      copy the tree to $EV/repo, start `plan` (PLAN=rest: `plan_rest`,
#                                           PLAN=next: `plan_next`, PLAN=families: `plan_families`,
#                                           PLAN=moe: `plan_moe`, PLAN=decode: `plan_decode`,
#                                           PLAN=objectives: `plan_objectives`, PLAN=modes: `plan_modes`,
#                                           PLAN=session: `plan_session`, PLAN=train_profile:
#                                           `plan_train_profile`,
#                                           below) in the background
#   bash scripts/gpu_evidence.sh wait [S]   wait until the plan ends or S seconds pass, then pack the
#                                           results into $OUT/evidence.tar.gz and print the status
#   bash scripts/gpu_evidence.sh stop       end the plan's process group
# The plan waits for $EV/gguf.ok (the SmolLM2 weights, joined by a later command) before step 1.
# DRY=1: tiny sizes on the CPU, the GPU-only benchmarks as --help or --tiny, to check the script.
set -uo pipefail
EV=${EV:-$HOME/ev}
RUN=$EV/run
LOGS=$EV/logs
RECIPE=recipes/smollm2-h200.yaml
DEADLINE=${DEADLINE:-$([ "${1:-}" = families ] && echo 1650 || echo 1380)}  # PLAN=families: its own
if [ "${DRY:-0}" = 1 ]; then
  DEV=cpu SYNTH=${SYNTH:-6} EPOCHS=1
else
  DEV=cuda SYNTH=${SYNTH:-5504} EPOCHS=${EPOCHS:-2}
fi
SEEDS="0 1"
STORAGES="bf16:bfloat16 fp8:float8_e4m3fn"

elapsed() { echo $(( $(date +%s) - $(cat "$EV/t0") )); }
deadline() {  # seconds since the plan began by which a step must end
  if [ -f "$EV/deadline_epoch" ]; then echo $(( $(cat "$EV/deadline_epoch") - $(cat "$EV/t0") )); else echo "$DEADLINE"; fi
}

# step NAME ESTIMATE_S CMD...: run CMD, logged; skipped when it would end past the deadline
step() {
  local name=$1 est=$2; shift 2
  local start now rc
  now=$(elapsed)
  if [ $(( now + est )) -gt "$(deadline)" ]; then
    printf '%s\tskipped\t%s\t-\t-\n' "$name" "$now" >> "$EV/status.tsv"
    echo "[$now s] skip $name (estimate ${est}s past the $(deadline)s deadline)"
    return 99
  fi
  start=$now
  echo "[$start s] start $name: $*"
  "$@" > "$LOGS/$name.log" 2>&1
  rc=$?
  now=$(elapsed)
  printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$rc" "$start" "$now" $(( now - start )) >> "$EV/status.tsv"
  echo "[$now s] end $name rc=$rc ($(( now - start )) s)"
  return $rc
}

# together NAME EST "CMD" "CMD" ...: the commands side by side (one GPU), each logged as NAME-k;
# rc is the first non-zero one
together() {
  local name=$1 est=$2; shift 2
  local k=0 pids=() rc=0 start now
  now=$(elapsed)
  if [ $(( now + est )) -gt "$(deadline)" ]; then
    printf '%s\tskipped\t%s\t-\t-\n' "$name" "$now" >> "$EV/status.tsv"
    echo "[$now s] skip $name (estimate ${est}s past the $(deadline)s deadline)"
    return 99
  fi
  start=$now
  for cmd in "$@"; do
    echo "[$start s] start $name-$k: $cmd"
    bash -c "$cmd" > "$LOGS/$name-$k.log" 2>&1 &
    pids+=($!)
    k=$((k + 1))
  done
  k=0
  for pid in "${pids[@]}"; do
    wait "$pid"; local r=$?
    [ $r -ne 0 ] && [ $rc -eq 0 ] && rc=$r
    printf '%s-%s\t%s\t%s\t%s\t%s\n' "$name" "$k" "$r" "$start" "$(elapsed)" $(( $(elapsed) - start )) >> "$EV/status.tsv"
    k=$((k + 1))
  done
  now=$(elapsed)
  echo "[$now s] end $name rc=$rc ($(( now - start )) s)"
  return $rc
}

# what every plan does first: the environment, its start time and heading, the GPU's clocks, and a
# wait for the SmolLM2 weights (the gguf call brings them; "later": the plan waits itself, later)
begin_plan() {
  cd "$EV/repo"
  export PYTHONPATH=$EV/repo${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
  date +%s > "$EV/t0"
  echo "$1"
  [ "$DEV" = cuda ] && nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv
  [ "${2:-}" = later ] || wait_weights
}

wait_weights() {
  for _ in $(seq 150); do [ -f "$EV/gguf.ok" ] && break; sleep 2; done
  [ -f "$EV/gguf.ok" ] || { echo "no SmolLM2 weights after 300 s"; echo done > "$EV/done"; return 1; }
}

plan() {
  begin_plan "plan: commit ${GIT_COMMIT:-?}, device $DEV, synthesize $SYNTH, epochs $EPOCHS, deadline ${DEADLINE}s" || return 1
  echo "[$(elapsed) s] SmolLM2 weights here"

  # 1. regen throughput (alone): before / generate_grouped / after (slots) / ceiling, SmolLM2 and 8B
  if [ "$DEV" = cuda ]; then
    step regen_bench 420 python -m benchmarks.regen --profile
  elif [ "${SKIP_REGEN_BENCH:-0}" = 0 ]; then
    step regen_bench 900 python -m benchmarks.regen --conversations 4 --batch-size 4 --max-new-tokens 4 \
      --second-target tiny --llama8b-conversations 2 --llama8b-batch-size 2 --profile --out dry_regen
  fi

  # 2. fp8 acceptance (shared GPU); the GPU tests beside it
  if [ "$DEV" = cuda ]; then
    LOG=$EV/gpu_tests.log bash benchmarks/gpu_tests.sh > "$LOGS/gpu_tests.out" 2>&1 &
    local tests=$!
  fi
  local regen_opts=(--synthesize "$SYNTH" --device "$DEV")
  [ "$DEV" = cpu ] && regen_opts+=(--batch-size 4 --max-new-tokens 16)
  if step sf_regen 240 sf-regen run -o "$RUN/regen" --recipe "$RECIPE" "${regen_opts[@]}"; then
    local caps=()
    for s in $STORAGES; do
      caps+=("sf-capture run $RUN/regen -o $RUN/feat_${s%%:*} --recipe $RECIPE --storage-dtype ${s#*:} --device $DEV")
    done
    if together capture 120 "${caps[@]}"; then
      local trains=() evals=()
      local train_opts="--epochs $EPOCHS --warmup-steps 30 --num-workers 3"
      [ "$DEV" = cpu ] && train_opts="--epochs 1 --warmup-steps 1 --num-workers 0 --draft-vocab-size 512 --ttt-length 2"
      for s in $STORAGES; do
        for seed in $SEEDS; do
          trains+=("sf-train run $RUN/feat_${s%%:*} -o $RUN/train_${s%%:*}_seed$seed --recipe $RECIPE $train_opts --seed $seed")
          evals+=("sf-eval run $RUN/train_${s%%:*}_seed$seed -o $RUN/eval_${s%%:*}_seed$seed --recipe $RECIPE --prompts chat,code --no-baseline --device $DEV$([ "$DEV" = cpu ] && echo ' --max-new-tokens 4 --limit 2')")
        done
      done
      together train 420 "${trains[@]}"
      together eval 240 "${evals[@]}"
    fi
  fi
  if [ -n "${tests:-}" ]; then
    wait "$tests"; printf 'gpu_tests\t%s\t-\t%s\t-\n' "$?" "$(elapsed)" >> "$EV/status.tsv"
  fi

  # 3, 4. timing benchmarks, each alone
  if [ "$DEV" = cuda ]; then
    step dflash_train_step 240 python -m benchmarks.dflash_train_step --batches 1,2,4,8 --impls ours --steps 4 --profile
    step train_step 150 python -m benchmarks.train_step --storage bfloat16,float8_e4m3fn --impls ours
    step capture_bench 150 python -m benchmarks.capture --storage bfloat16,float8_e4m3fn --batches 20
  else
    step dflash_train_step 60 python -m benchmarks.dflash_train_step --help
    step train_step 300 python -m benchmarks.train_step --tiny --seq 64 --steps 2 --ttt 2
    step capture_bench 60 python -m benchmarks.capture --help
  fi
  echo "[$(elapsed) s] plan done"
  echo done > "$EV/done"
}

# PLAN=rest: what the first run left (issue 28) and issue 26's one-GPU measurement, each alone on
# the GPU, in priority order (estimates on one H200, setup included ~150 s; ~1,450 s in all):
#   regen_bench        python -m benchmarks.regen --profile (the slot engine's memory check fixed)  ~420 s
#   capture_placement  capture through Target against 8dd38ca's runner; half the weights
#                      offloaded to CPU memory against all on the GPU (8B Llama, T=4096)           ~360 s
#   capture_bench      --storage bfloat16,float8_e4m3fn, disk-bound case included                 ~150 s
#   gpu_tests          pytest -m gpu, alone                                                       ~200 s
plan_rest() {
  begin_plan "plan rest: commit ${GIT_COMMIT:-?}, device $DEV, deadline ${DEADLINE}s" || return 1
  if [ "$DEV" = cuda ]; then
    step regen_bench 420 python -m benchmarks.regen --profile
    step capture_placement 360 python -m benchmarks.capture_placement
    step capture_bench 150 python -m benchmarks.capture --storage bfloat16,float8_e4m3fn --batches 20
    step gpu_tests 200 env LOG="$EV/gpu_tests.log" bash benchmarks/gpu_tests.sh
  else
    step regen_bench 900 python -m benchmarks.regen --conversations 4 --batch-size 4 --max-new-tokens 4 \
      --second-target tiny --llama8b-conversations 2 --llama8b-batch-size 2 --out dry_regen
    step capture_placement 300 python -m benchmarks.capture_placement --tiny
    step capture_bench 60 python -m benchmarks.capture --help
  fi
  echo "[$(elapsed) s] plan done"
  echo done > "$EV/done"
}

# PLAN=next: what the run of 2026-12-02 (PLAN=rest) left, and a small run of every draft family
# (issue 27) to find what breaks on a GPU before its full run, in priority order (estimates on one
# H200, setup included ~150 s; ~1,250 s in all):
#   capture_placement  issue 26: capture through Target against 8dd38ca's runner; half the weights
#                      offloaded to CPU memory against all on the GPU (8B Llama, T=4096), alone    ~360 s
#   gpu_tests          pytest -m gpu, alone (test_soft_ce's allocator fix, e279184)             ~300 s
#   families_smoke     scripts/families_gpu.sh at 512 conversations, 1 epoch, 2 prompts per set:
#                      every family trains, exports and decodes on the GPU (not a result)        ~300 s
#   regen_profile      the slot engine's decode step folded against transformers' repeat_kv path
#                      and the DynamicCache step, SmolLM2 at 2048 and the 8B shape at 256, alone    ~200 s
plan_next() {
  begin_plan "plan next: commit ${GIT_COMMIT:-?}, device $DEV, deadline ${DEADLINE}s" || return 1
  if [ "$DEV" = cuda ]; then
    step capture_placement 360 python -m benchmarks.capture_placement
    step gpu_tests 300 env LOG="$EV/gpu_tests.log" bash benchmarks/gpu_tests.sh
    step families_smoke 300 env RUN="$RUN/families" SYNTH=512 EPOCHS=1 RESULT=families_smoke \
      EVAL_OPTS="--limit 2 --max-new-tokens 32" bash scripts/families_gpu.sh
    step regen_profile 200 python -m benchmarks.regen --profile-only
  else
    step capture_placement 300 python -m benchmarks.capture_placement --tiny
    step families_smoke 900 env RUN="$RUN/families" DEV=cpu SYNTH=6 EPOCHS=1 SEQUENTIAL=1 RESULT=dry_families \
      REGEN_OPTS="--batch-size 6 --max-new-tokens 16" EVAL_OPTS="--limit 1 --max-new-tokens 6 --prompts chat" \
      TRAIN_OPTS="--num-workers 0 --max-batch-tokens 1024 --warmup-steps 1" \
      bash scripts/families_gpu.sh
    step regen_profile 300 python -m benchmarks.regen --profile-only --batch-size 4 --second-target tiny \
      --llama8b-batch-size 2 --out dry_regen_profile
  fi
  echo "[$(elapsed) s] plan done"
  echo done > "$EV/done"
}

# PLAN=families (its deadline 1,650 s unless DEADLINE says otherwise): issue 27's quality run, and
# issue 36's item 3 with the decoding core, scripts/families_gpu.sh at EPOCHS=2. Times of the run of
# 2026-12-06 on one H100 80GB (2 trainings at a time; benchmarks/RESULTS.md, "Draft families"), 1,411 s
# from the plan's start to its end, family_step included:
#   machine start + setup, the GGUF                                                  ~120 s
#   regen      from .devkit/carry/regen10240.tar.gz when carried (sf-regen finds it complete), else
#              sf-regen of 10,240 synthesised conversations (41 s), then the capture of 9,849
#              conversations, 2.29 M tokens, every family's layers, and sf-capture verify    ~130 s
#   train      2 epochs (362 steps for the DFlash backbone, 286 for EAGLE-3 and P-EAGLE), two at a
#              time: DSpark and Domino 5:13 each, DFlash and D-PACE 2:34, EAGLE-3 1:09, P-EAGLE
#              1:18; six drafts                                                            ~600 s
#              (dflash_b16_norm01, the seventh, ~+150 s)
#   eval       8 prompts of each of the 4 held-out sets (EVAL_LIMIT), 7 side by side       ~140 s
#   timing     each draft alone, 2 prompts a set, the EAGLE-3 chain with the target alone,
#              --compile-target --dtype bfloat16 and --compile-draft (inductor's disk cache serves
#              the target's compile after the first run; the tree's 4 verify widths compile in
#              its warm-up, ~3 min). bfloat16, the dtype a target is served in: in sf-eval's
#              float32 default a verify of 8 or 16 tokens took 2.2-2.4x a token of the target alone
#              and one of 17 1.5x (cuBLAS's float32 kernels for 2-16 rows; RESULTS.md, "Draft
#              families", 2026-12-06), so float32 tokens/s rank drafts by their verify width. The
#              acceptance evals stay float32 (exact)                                      ~450 s
#   verify_width  the target's verify step by width in float32 (cuBLAS, TF32, cuBLASLt) and
#              bfloat16 (benchmarks/verify_width.py), if time is left                       ~60 s
#   family_step  the DFlash-backbone families' step by gradient path, if time is left        ~80 s
# GPU_TESTS: these test files' GPU tests first; ONLY (read by scripts/families_gpu.sh): the drafts
# to train, e.g. all but dflash_b16_norm01 (issue 27's variant, not a family) to save a training.
# FAMILIES_EST: the families step's skip estimate (1300 s, the six drafts'; ~900 s for four without
# Domino and DSpark, the two slowest trainings).
plan_families() {
  begin_plan "plan families: commit ${GIT_COMMIT:-?}, device $DEV, epochs ${EPOCHS}, deadline ${DEADLINE}s" || return 1
  if [ -n "${GPU_TESTS:-}" ] && [ "$DEV" = cuda ]; then  # these test files' GPU tests first
    step gpu_tests 240 env LOG="$EV/gpu_tests.log" bash benchmarks/gpu_tests.sh $GPU_TESTS
  fi
  local from=""
  [ -f "$EV/carry/regen10240.tar.gz" ] && from=$EV/carry/regen10240.tar.gz
  if [ "$DEV" = cuda ]; then
    # no timing decode starts within 120 s of the deadline: the acceptance figures are written first
    step families "${FAMILIES_EST:-1300}" env RUN="$RUN/families" EPOCHS="$EPOCHS" REGEN_FROM="$from" TIMING_LIMIT="${TIMING_LIMIT:-2}" \
      TRAIN_OPTS="--num-workers 2 --profile-steps 10" \
      TIMING_OPTS="${TIMING_OPTS---compile-target --dtype bfloat16}" DRAFT_TIMING_OPTS="${DRAFT_TIMING_OPTS---compile-draft}" \
      EVAL_OPTS="--limit ${EVAL_LIMIT:-8}" STOP_AT=$(( $(cat "$EV/t0") + $(deadline) - 120 )) bash scripts/families_gpu.sh
    # alone, each if the deadline leaves room: the float32 verify by width (cuBLASLt's kernels among
    # the modes), then the DFlash-backbone families' step
    step verify_width 90 python -m benchmarks.verify_width --profile-widths ""
    step family_step 100 python -m benchmarks.family_step
  else
    step families 900 env RUN="$RUN/families" DEV=cpu SYNTH=6 EPOCHS=1 JOBS=2 EVAL_JOBS=3 TIMING_LIMIT=1 \
      RESULT=dry_families REGEN_OPTS="--batch-size 6 --max-new-tokens 16" \
      EVAL_OPTS="--limit 1 --max-new-tokens 6 --prompts chat" \
      TRAIN_OPTS="--num-workers 0 --max-batch-tokens 1024 --warmup-steps 1" \
      bash scripts/families_gpu.sh
  fi
  echo "[$(elapsed) s] plan done"
  echo done > "$EV/done"
}

# PLAN=moe (issue 38; deadline DEADLINE, 1,380 s by default): the fused experts kernel's GPU tests,
# then benchmarks/capture_moe.py with its profile (dense 8B, Qwen3-30B-A3B and DeepSeek-V3 shapes;
# eager, grouped_mm, sf_fused; 8k, 32k, 64k tokens a batch), then issue 40's train-step bar (LK-lambda
# against ce at the 8B draft shape). Estimates: tests ~60 s, capture_moe ~600 s, train_step ~120 s.
plan_moe() {
  begin_plan "plan moe: commit ${GIT_COMMIT:-?}, device $DEV, deadline ${DEADLINE}s" || return 1
  if [ "$DEV" = cuda ]; then
    step gpu_tests 120 env LOG="$EV/gpu_tests.log" bash benchmarks/gpu_tests.sh tests/test_fused_moe.py tests/test_lk_loss.py
    step capture_moe 700 python -m benchmarks.capture_moe --profile
    step train_step_lk 200 python -m benchmarks.train_step --impls ours --storage bfloat16 --token-losses ce,lk-lambda
  else
    step capture_moe 300 env TRITON_INTERPRET=1 python -m benchmarks.capture_moe --device cpu --shapes tiny
    step train_step_lk 300 python -m benchmarks.train_step --tiny --seq 128 --steps 2 --token-losses ce,lk-lambda
  fi
  echo "[$(elapsed) s] plan done"
  echo done > "$EV/done"
}

# PLAN=decode (issue 36, then issue 38's bar; deadline DEADLINE), each step alone on the GPU, in
# priority order (estimates; setup ~150 s):
#   gpu_tests     pytest -m gpu (GPU_TESTS: only these files), the graph-replayed steps among them ~150 s
#   decode_step   benchmarks/decode_step.py --profile: plain loop, graph reference, the core  ~200 s
#   capture_moe   benchmarks/capture_moe.py at 32k tokens a batch, with its profile            ~60 s
#   (the SmolLM2 weights: the plan waits for the gguf call here)
#   decode_e2e    scripts/decode_gpu.sh: 2,048 conversations, 1 epoch, sf-eval of the 60 prompts
#                 in float32 and bfloat16                                                     ~350 s
#   regen_bench   benchmarks/regen.py: the recipe's stage on 10,240 synthesised prompts, eager
#                 and graph-replayed, with the profile (SmolLM2 only)                          ~330 s
plan_decode() {
  begin_plan "plan decode: commit ${GIT_COMMIT:-?}, device $DEV, deadline ${DEADLINE}s" later
  if [ "$DEV" = cuda ]; then
    step gpu_tests 220 env LOG="$EV/gpu_tests.log" bash benchmarks/gpu_tests.sh ${GPU_TESTS:-}
    step decode_step 300 python -m benchmarks.decode_step --profile
    step capture_moe 120 python -m benchmarks.capture_moe --tokens 32768 --impls grouped_mm,sf_fused --profile
    wait_weights || return 1
    step decode_e2e 450 env RUN="$RUN/decode" SYNTH=2048 EPOCHS=1 bash scripts/decode_gpu.sh
    step regen_bench 330 python -m benchmarks.regen --synthesize 10240 --paths after,graph_step --profile \
      --llama8b-conversations 0
  else
    step decode_step 120 python -m benchmarks.decode_step --device cpu --shapes tiny --iters 3
    wait_weights || return 1
    step decode_e2e 300 env RUN="$RUN/decode" DEV=cpu SYNTH=8 DTYPES=float32 bash scripts/decode_gpu.sh
  fi
  echo "[$(elapsed) s] plan done"
  echo done > "$EV/done"
}

# PLAN=objectives (issue 40; deadline DEADLINE): scripts/objectives_gpu.sh, 8 drafts at
# OBJECTIVES_EPOCHS (default 1, to fit one session; EPOCHS's default of 2 is the other plans') and
# no curve run unless CURVE_EPOCHS says so (a second session: CURVE_EPOCHS=6). On an H100, from
# the run of 2026-12-05: regen and capture ~115 s, a DFlash epoch ~180 s for two side by side.
# OBJECTIVES_EST: the step's skip estimate (1300 s); ONLY and RESULT as scripts/objectives_gpu.sh's.
# GPU_TESTS: these test files' GPU tests first. FAMILY_STEP, AFTER_PROFILE, THEN_ONLY, THEN_EST: below. WITH_RUN
# (read by scripts/objectives_gpu.sh): e.g. benchmarks/results/objectives_h100_e02fe4a, the
# EAGLE-3 drafts of 2026-12-06, so that a run of ONLY="dflash_ce dflash_lk_lambda" completes the table.
# CAPTURE_MOE=1: first, before the weights, issue 38's result file, benchmarks/capture_moe.py at
# 8k and 32k tokens with every implementation and sf-capture's --compile-layers choices (177 s on
# an H100).
plan_objectives() {
  begin_plan "plan objectives: commit ${GIT_COMMIT:-?}, device $DEV, deadline ${DEADLINE}s" later
  if [ "${CAPTURE_MOE:-0}" = 1 ]; then
    if [ "$DEV" = cuda ]; then
      step capture_moe 330 python -m benchmarks.capture_moe --tokens 8192,32768 --impls eager,grouped_mm,sf_fused \
        --compile-layers attention,layer
    else
      step capture_moe 300 python -m benchmarks.capture_moe --device cpu --shapes tiny --impls eager,grouped_mm \
        --compile-layers attention,layer --out dry_capture_moe
    fi
  fi
  if [ -n "${GPU_TESTS:-}" ] && [ "$DEV" = cuda ]; then
    step gpu_tests 120 env LOG="$EV/gpu_tests.log" bash benchmarks/gpu_tests.sh $GPU_TESTS
  fi
  wait_weights || return 1
  local from=""
  [ -f "$EV/carry/regen10240.tar.gz" ] && from=$EV/carry/regen10240.tar.gz
  if [ "$DEV" = cuda ]; then
    step objectives "${OBJECTIVES_EST:-1300}" env RUN="$RUN/objectives" EPOCHS="${OBJECTIVES_EPOCHS:-1}" \
      REGEN_FROM="$from" ONLY="${ONLY:-}" RESULT="${RESULT:-objectives}" \
      TRAIN_OPTS="--num-workers 2 --profile-steps 10" \
      CURVE_EPOCHS="${CURVE_EPOCHS:-0}" EVAL_OPTS="--limit ${EVAL_LIMIT:-8}" bash scripts/objectives_gpu.sh
    # FAMILY_STEP=1: benchmarks/family_step.py alone on the GPU (as PLAN=train_profile's, ~100 s)
    [ "${FAMILY_STEP:-0}" = 1 ] && step family_step 150 python -m benchmarks.family_step
    # AFTER_PROFILE: these families (e.g. "eagle3 dflash domino dspark peagle") each train alone on
    # the same features (the capture's eagle3 and dflash layers serve all five), 25 steps profiled
    # (as PLAN=train_profile's): the step time without a second job on the GPU
    [ -n "${AFTER_PROFILE:-}" ] && profile_trainings "$RUN/objectives/features" "$RUN/train_profile" "$AFTER_PROFILE" \
      --max-steps 25 --warmup-steps 5 --log-every 5 --profile-steps 10 --num-workers 2
    # THEN_ONLY: a second pass of the same script over the same features (regen and capture find
    # theirs complete), training only these drafts, if the deadline leaves THEN_EST seconds
    if [ -n "${THEN_ONLY:-}" ]; then
      step objectives_then "${THEN_EST:-500}" env RUN="$RUN/objectives" EPOCHS="${OBJECTIVES_EPOCHS:-1}" \
        ONLY="$THEN_ONLY" RESULT="${RESULT:-objectives}" TRAIN_OPTS="--num-workers 2 --profile-steps 10" \
        CURVE_EPOCHS=0 EVAL_OPTS="--limit ${EVAL_LIMIT:-8}" bash scripts/objectives_gpu.sh
    fi
  else
    step objectives 900 env RUN="$RUN/objectives" DEV=cpu SYNTH=6 EPOCHS=1 CURVE_EPOCHS=2 CURVE_EVAL_EVERY=1 JOBS=2 \
      EVAL_JOBS=2 RESULT=dry_objectives REGEN_OPTS="--batch-size 6 --max-new-tokens 16" \
      EVAL_OPTS="--limit 1 --max-new-tokens 6 --prompts chat" \
      TRAIN_OPTS="--num-workers 0 --max-batch-tokens 1024 --warmup-steps 1 --eval-fraction 0.3" \
      bash scripts/objectives_gpu.sh
  fi
  echo "[$(elapsed) s] plan done"
  echo done > "$EV/done"
}

# profile_trainings FEATURES OUT "FAMILIES" TRAIN_OPTION...: a training of each family (eagle3, dflash,
# domino, dspark, peagle) from FEATURES alone on the GPU, in OUT/<family>, as the step tp_<family>
# (150 s estimate each): the SmolLM2 recipes, the DFlash backbone at --block-size 16
profile_trainings() {
  local features=$1 out=$2 families=$3 family; shift 3
  for family in $families; do
    case $family in
      eagle3) step tp_eagle3 150 sf-train run "$features" -o "$out/eagle3" --recipe "$RECIPE" "$@" ;;
      peagle) step tp_peagle 150 sf-train run "$features" -o "$out/peagle" --recipe recipes/smollm2-h200-peagle.yaml "$@" ;;
      dflash|domino|dspark) step "tp_$family" 150 sf-train run "$features" -o "$out/$family" \
                --recipe recipes/smollm2-h200-dflash.yaml --family "$family" --block-size 16 "$@" ;;
      *) echo "unknown family $family (eagle3, dflash, domino, dspark, peagle)"; return 1 ;;
    esac
  done
}

# PLAN=train_profile (deadline DEADLINE; ~250 s with the start): why SmolLM2's drafts train at
# ~12,400 tokens/s a job on an H100 (RESULTS.md, the objectives pilot), far below their FLOPs,
# which makes issue 40's comparison and issue 36's families run longer than a session. sf-regen
# of 2,048 synthesised conversations, one capture, then a training of each of TP_FAMILIES (eagle3
# and dflash by default; also domino, dspark, peagle) alone for 25 steps with --profile-steps 10
# (profile.txt in each run folder; the log lines give the data wait and the step's host time).
# GPU_TESTS: these test files' GPU tests first; FAMILY_STEP=1: then benchmarks/family_step.py (the
# DFlash-backbone families' step, each hand-written loss's chunk math compiled and eager, ~100 s).
plan_train_profile() {
  begin_plan "plan train_profile: commit ${GIT_COMMIT:-?}, device $DEV, deadline ${DEADLINE}s" later
  local r=$RUN/train_profile opts=(--device "$DEV") train=(--max-steps 25 --warmup-steps 5 --log-every 5
    --profile-steps 10 --num-workers 2)
  if [ "$DEV" = cuda ]; then
    [ -n "${GPU_TESTS:-}" ] && step gpu_tests 240 env LOG="$EV/gpu_tests.log" bash benchmarks/gpu_tests.sh $GPU_TESTS
    [ "${FAMILY_STEP:-0}" = 1 ] && step family_step 150 python -m benchmarks.family_step
  fi
  wait_weights || return 1
  if [ "$DEV" = cuda ]; then
    step tp_regen 120 sf-regen run -o "$r/regen" --recipe "$RECIPE" --synthesize 2048 "${opts[@]}" || return 1
  else
    step tp_regen 300 sf-regen run -o "$r/regen" --recipe "$RECIPE" --synthesize 6 --batch-size 6 \
      --max-new-tokens 16 "${opts[@]}" || return 1
    train=(--max-steps 4 --warmup-steps 1 --log-every 2 --profile-steps 1 --num-workers 0 --max-batch-tokens 1024
      --eval-fraction 0)
  fi
  step tp_capture 120 sf-capture run "$r/regen" -o "$r/features" --recipe "$RECIPE" \
    --families eagle3,dflash,domino,dspark,peagle "${opts[@]}" || return 1
  profile_trainings "$r/features" "$r" "${TP_FAMILIES:-eagle3 dflash}" "${train[@]}"
  echo "[$(elapsed) s] plan done"
  echo done > "$EV/done"
}

# PLAN=modes (issue 39; deadline DEADLINE): scripts/modes_gpu.sh, SmolLM2 under the reasoning rules
# of Qwen3's template: a draft trained in each mode (SYNTH=2048 conversations, 1 epoch, the two
# side by side) and each evaluated in both modes, 8 prompts a set (EVAL_LIMIT). Estimates on one
# H200: 2 regens and captures ~150 s, 2 trainings ~200 s, 2 evals of 2 modes x 4 sets ~120 s.
plan_modes() {
  begin_plan "plan modes: commit ${GIT_COMMIT:-?}, device $DEV, deadline ${DEADLINE}s" || return 1
  if [ "$DEV" = cuda ]; then
    step modes 600 env RUN="$RUN/modes" SYNTH="${SYNTH_MODES:-2048}" EPOCHS=1 \
      EVAL_OPTS="--limit ${EVAL_LIMIT:-8}" bash scripts/modes_gpu.sh
  else
    step modes 900 env RUN="$RUN/modes" DEV=cpu SYNTH=6 EPOCHS=1 RESULT=dry_modes \
      REGEN_OPTS="--batch-size 6 --max-new-tokens 16" EVAL_OPTS="--limit 1 --max-new-tokens 6 --prompts chat" \
      TRAIN_OPTS="--num-workers 0 --max-batch-tokens 1024 --warmup-steps 1 --eval-fraction 0.3" \
      bash scripts/modes_gpu.sh
  fi
  echo "[$(elapsed) s] plan done"
  echo done > "$EV/done"
}

# PLAN=session (deadline DEADLINE; ~1,610 s in all, so the last step, capture_moe at 64k, fits only
# a deadline past ~1,630 s). First the GPU tests of the compiled layers, of the captured prefill and
# commits, and of the fused experts (a MoE target decoding through captured steps with `auto`, now
# sf_fused). Before the weights, issue 38: the fused kernels' tiles swept at Qwen3-30B-A3B's layer
# (benchmarks/moe_tiles.py; the kernels' loads lost their masks since the last GPU run), then the
# MoE capture at 32k with sf-capture's --compile-layers choices and the sweep's fastest tiles
# (attention measured 42.9% MFU for Qwen3-30B-A3B with sf_fused, bar 45%; `layer` also fuses the
# residual adds and the router, not yet measured). With the weights, issue 36: sf-eval end to end
# in bf16 without and with --compile-target, and with --compile-draft too, now with the captured
# prefill (multiturn's target alone was 291 tok/s, bar 300, most of its gap the 37 ms eager
# prefill); decode_step on SmolLM2 with the back-to-back and host columns (the verify rows'
# 1.6-1.9x); then capture_moe at 64k (grouped_mm rows that do not fit are recorded as out of memory).
# ~150 + ~150 + ~330 + ~480 + ~200 + ~250 s (the eager rows at 32k: the whole item-1 table in one run).
plan_session() {
  begin_plan "plan session: commit ${GIT_COMMIT:-?}, device $DEV, deadline ${DEADLINE}s" later
  if [ "$DEV" = cuda ]; then
    step gpu_tests 150 env LOG="$EV/gpu_tests.log" bash benchmarks/gpu_tests.sh tests/test_compiled_layers.py \
      tests/test_decoding.py tests/test_fused_moe.py
    step moe_tiles 150 python -m benchmarks.moe_tiles --shapes qwen3_30b_a3b --tokens 32768
    local launch  # the sweep's fastest tiles, for every sf_fused row below (none: the default tiles)
    launch=$(python3 -c 'import json; print(json.load(open("benchmarks/results/moe_tiles.json"))["summary"]["qwen3_30b_a3b"]["launch"]["arg"])' 2>/dev/null)
    echo "[$(elapsed) s] sf_fused tiles: ${launch:-the default}"
    step capture_moe 330 python -m benchmarks.capture_moe --tokens 32768 --impls eager,grouped_mm,sf_fused \
      --compile-layers attention,layer ${launch:+--launch $launch}
    wait_weights || return 1
    step decode_e2e 480 env RUN="$RUN/decode" SYNTH=2048 EPOCHS=1 DTYPES=bfloat16 COMPILE="off on all" \
      bash scripts/decode_gpu.sh
    step decode_step 200 python -m benchmarks.decode_step --shapes smollm2 --iters 20 \
      --compiled-rows token,verify_k7,tree
    step capture_moe_64k 250 python -m benchmarks.capture_moe --tokens 65536 --impls grouped_mm,sf_fused \
      --compile-layers attention ${launch:+--launch $launch} --out capture_moe_64k
  else
    step moe_tiles 60 env TRITON_INTERPRET=1 python -m benchmarks.moe_tiles --device cpu --shapes tiny --grid tiny \
      --tokens 40
    step capture_moe 300 python -m benchmarks.capture_moe --device cpu --shapes tiny --impls eager,grouped_mm \
      --compile-layers attention,layer
    wait_weights || return 1
    step decode_e2e 300 env RUN="$RUN/decode" DEV=cpu SYNTH=8 DTYPES=float32 COMPILE=off bash scripts/decode_gpu.sh
    step decode_step 120 python -m benchmarks.decode_step --device cpu --shapes tiny --iters 3
  fi
  echo "[$(elapsed) s] plan done"
  echo done > "$EV/done"
}

pack() {
  local out=${OUT:-$EV/out}
  mkdir -p "$out"
  (cd "$EV" && tar czf "$out/evidence.tar.gz" --exclude='*.safetensors' --exclude='*.pt' --exclude='*.bin' \
    --exclude='checkpoints' --exclude='shards' --exclude='data' --exclude='*.parquet' --exclude='*.zarr' \
    status.tsv logs orchestrator.log run $(ls gpu_tests.log 2>/dev/null) \
    $(find repo/benchmarks/results -type f -newer t0 2>/dev/null))
  ls -la "$out"
}

show() {
  echo "== status ($(elapsed) s since the plan began; done: $([ -f "$EV/done" ] && echo yes || echo no))"
  column -t -s $'\t' "$EV/status.tsv" 2>/dev/null
  echo "== orchestrator (tail)"; tail -n 8 "$EV/orchestrator.log"
  for f in $(ls -t "$LOGS"/*.log 2>/dev/null | head -n 3); do echo "== $f"; tail -n 4 "$f"; done
  [ "${DRY:-0}" = 1 ] || nvidia-smi --query-gpu=utilization.gpu,memory.used,clocks.sm,temperature.gpu --format=csv,noheader
}

case "${1:-}" in
  start)
    rm -rf "$EV" && mkdir -p "$EV/repo" "$LOGS" "$RUN"
    touch "$EV/status.tsv"
    tar cf - --exclude=./.devkit --exclude=./.git --exclude=./.venv --exclude=./runs . | (cd "$EV/repo" && tar xf -)
    [ -d .devkit/carry ] && cp -r .devkit/carry "$EV/carry"  # inputs carried from an earlier session
    setsid nohup bash "$EV/repo/scripts/gpu_evidence.sh" "${PLAN:-plan}" > "$EV/orchestrator.log" 2>&1 < /dev/null &
    echo $! > "$EV/pid"
    sleep 2; echo "plan started (pid $(cat "$EV/pid")) in $EV"; tail -n 3 "$EV/orchestrator.log" ;;
  plan) plan ;;
  rest) plan_rest ;;
  next) plan_next ;;
  families) plan_families ;;
  moe) plan_moe ;;
  decode) plan_decode ;;
  objectives) plan_objectives ;;
  modes) plan_modes ;;
  train_profile) plan_train_profile ;;
  session) plan_session ;;
  wait)
    limit=${2:-540}; t=$(date +%s)
    while [ ! -f "$EV/done" ] && [ $(( $(date +%s) - t )) -lt "$limit" ]; do sleep 5; done
    pack; show ;;
  pack) pack ;;
  show) show ;;
  stop) kill -- -"$(cat "$EV/pid")" && echo "stopped the plan's process group $(cat "$EV/pid")" ;;
  *) echo "usage: $0 start|wait [S]|pack|show|stop" >&2; exit 2 ;;
esac
