#!/usr/bin/env bash
# The test suite, one pytest process per test file: TensorFlow does not give back the memory
# of the hundreds of models the suite builds, and in one process it grew past 15 GiB before
# the mpirun tests (which start 2-4 TensorFlow processes more) ran.
#
# Files run TEST_JOBS at a time (default 2: most files keep one core busy with Python and
# small eager ops, and this machine kind has 2), the longest first; each file's output is
# printed whole when it ends, with its wall time. Files whose checks start many processes or
# measure CPU budgets and timings (ALONE) run afterwards, one at a time, with nothing beside
# them. TEST_JOBS=1 runs every file in turn. Extra arguments go to every pytest call (e.g. -x,
# -k name, --durations=10). Exit status: non-zero if any file failed. The last line adds up
# every file's counts: "suite: N passed, N failed, N skipped" (the netbed tests skip without root).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
JOBS=${TEST_JOBS:-2}
# mpirun with 2-6 TensorFlow processes, netbed CPU budgets, the timing communicators' waits
ALONE=(tests/test_mpi.py tests/test_mpi_saving.py tests/test_launch.py tests/test_mpi_microbatch.py tests/test_netbed.py tests/test_timemodel.py)
# the longest files first (about 9, 5.5, 4 and 3.5 min alone), so that no long one starts last
LONG=(tests/test_equivalence_sim.py tests/test_allocate.py tests/test_cache.py tests/test_models.py
      tests/test_predict.py tests/test_cli.py tests/test_gallery.py tests/test_columnar.py)
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
trap 'kill $(jobs -p) 2>/dev/null; exit 130' INT TERM
start=$(date +%s)
TIMEFORMAT='%U %S'   # bash's time: user and system CPU seconds

run_file() {   # run_file FILE ARGS...: its log, exit status and seconds go to $logs
  local f=$1 name t0
  shift
  name=$(basename "$f" .py)
  t0=$(date +%s)
  # bash's time: the CPU seconds of pytest and every process it waited for (mpirun's ranks too)
  { time "$PY" -m pytest -q "$f" "$@" >"$logs/$name.log" 2>&1; } 2>"$logs/$name.cpu"
  echo $? >"$logs/$name.rc"
  echo $(( $(date +%s) - t0 )) >"$logs/$name.secs"
  {
    flock 9
    echo "=== $f ($(cat "$logs/$name.secs") s, $(awk '{printf "%.0f", $1 + $2}' "$logs/$name.cpu") CPU s)"
    cat "$logs/$name.log"
  } 9>"$logs/.lock"
}

in_list() { local x=$1; shift; for y in "$@"; do [ "$x" = "$y" ] && return 0; done; return 1; }

all=(tests/test_*.py)
queue=()
for f in "${LONG[@]}"; do [ -f "$f" ] && queue+=("$f"); done
for f in "${all[@]}"; do
  in_list "$f" "${LONG[@]}" "${ALONE[@]}" || queue+=("$f")
done
running=0
for f in "${queue[@]}"; do
  if [ "$running" -ge "$JOBS" ]; then wait -n; running=$(( running - 1 )); fi
  run_file "$f" "$@" &
  running=$(( running + 1 ))
done
wait
for f in "${ALONE[@]}"; do [ -f "$f" ] && run_file "$f" "$@"; done

failed=()
passed_total=0
failed_total=0
skipped_total=0
count() { grep -oE "[0-9]+ $1" "$2" | tail -1 | cut -d' ' -f1; }
or0() { local n; n=$(count "$@"); echo "${n:-0}"; }
for f in "${all[@]}"; do
  name=$(basename "$f" .py)
  log="$logs/$name.log"
  [ -f "$logs/$name.rc" ] || continue
  rc=$(cat "$logs/$name.rc")
  passed_total=$(( passed_total + $(count passed "$log" || true) + 0 ))
  skipped_total=$(( skipped_total + $(count skipped "$log" || true) + 0 ))
  failed_total=$(( failed_total + $(count failed "$log" || true) + 0 + $(count error "$log" || true) + 0 ))
  # 5: no test collected (e.g. -k matched nothing in this file)
  if [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ]; then
    failed+=("$f")
    [ "$(count failed "$log")$(count error "$log")" = "" ] && failed_total=$(( failed_total + 1 ))
  fi
done
cpu=$(cat "$logs"/*.cpu 2>/dev/null | awk '{s += $1 + $2} END {printf "%.0f", s}')
minutes=$(( ($(date +%s) - start) / 60 ))
echo "=== $minutes min, $cpu CPU s ($JOBS at a time); files failed: ${#failed[@]} ${failed[*]:-}"
echo "suite: $passed_total passed, $failed_total failed, $skipped_total skipped"
if [ -n "${SUITE_REPORT:-}" ]; then   # e.g. SUITE_REPORT=reports/suite.md: the run as a committed report
  {
    echo "# The test suite: $passed_total passed, $failed_total failed, $skipped_total skipped"
    echo
    echo "\`SUITE_REPORT=$SUITE_REPORT bash scripts/test.sh $*\` at $(git rev-parse --short HEAD 2>/dev/null || echo '?'),"
    echo "$(date -u '+%Y-%m-%d %H:%M UTC'), $(nproc) cores, $JOBS files at a time, the mpirun files alone at the end:"
    echo "**$minutes min, $cpu CPU s**."
    echo
    echo "| file | wall s | CPU s | passed | failed | skipped |"
    echo "|---|---|---|---|---|---|"
    for f in "${all[@]}"; do
      name=$(basename "$f" .py)
      [ -f "$logs/$name.rc" ] || continue
      echo "| $name | $(cat "$logs/$name.secs") | $(awk '{printf "%.0f", $1 + $2}' "$logs/$name.cpu") |" \
           "$(or0 passed "$logs/$name.log") | $(or0 failed "$logs/$name.log") | $(or0 skipped "$logs/$name.log") |"
    done
  } >"$SUITE_REPORT"
  echo "written: $SUITE_REPORT"
fi
[ ${#failed[@]} -eq 0 ]
