#!/usr/bin/env bash
# Sourced by scripts/families_gpu.sh and scripts/objectives_gpu.sh (which set RUN).
# side_by_side NAME MAX "CMD" ...: the commands in the background, at most MAX at once (1: one
# after another), each logged to $RUN/logs/NAME-k.log; fails, naming the failed logs, when any failed
side_by_side() {
  local name=$1 max=$2; shift 2
  [ "${SEQUENTIAL:-0}" = 1 ] && max=1
  local k=0 running=0 pid rc failed=()
  declare -A log_of=()
  for cmd in "$@"; do
    if [ "$running" -ge "$max" ]; then  # a slot frees when any one ends
      rc=0; wait -n -p pid || rc=$?
      [ "$rc" -ne 0 ] && failed+=("${log_of[$pid]}"); running=$((running - 1))
    fi
    local log="$RUN/logs/$name-$k.log"
    echo "$(date +%T) start $name-$k: $cmd" | tee "$log"
    bash -c "$cmd" >> "$log" 2>&1 &
    log_of[$!]=$log; running=$((running + 1)); k=$((k + 1))
  done
  while [ "$running" -gt 0 ]; do
    rc=0; wait -n -p pid || rc=$?
    [ "$rc" -ne 0 ] && failed+=("${log_of[$pid]}"); running=$((running - 1))
  done
  echo "$(date +%T) end $name: ${#failed[@]} of $k failed"
  if [ ${#failed[@]} -gt 0 ]; then
    for log in "${failed[@]}"; do echo "== $log"; tail -n 15 "$log"; done
    return 1
  fi
}

# train_jobs: how many SmolLM2 draft trainings share the GPU (JOBS when set). One training of the
# smollm2-h200 recipes was seen to need up to ~35 GB (4 fit an H200's 141 GB, a fifth overflowed),
# so one per 35 GiB of the GPU's memory, 1 to 4: 4 on an H200, 2 on an 80 GB H100; 2 on the CPU.
train_jobs() {
  if [ -n "${JOBS:-}" ]; then echo "$JOBS"; return; fi
  local mib
  mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -n 1)
  if [ -z "$mib" ]; then echo 2; return; fi
  local jobs=$(( mib / 1024 / 35 ))
  [ "$jobs" -lt 1 ] && jobs=1; [ "$jobs" -gt 4 ] && jobs=4
  echo "$jobs"
}

# keep_only ARRAY: drop the entries "NAME|..." of the array named ARRAY whose NAME is not in $ONLY
# (space-separated); with ONLY unset or empty, every entry stays
keep_only() {
  local -n entries=$1
  [ -n "${ONLY:-}" ] || return 0
  local kept=() entry
  for entry in "${entries[@]}"; do [[ " $ONLY " == *" ${entry%%|*} "* ]] && kept+=("$entry"); done
  entries=("${kept[@]}")
}
