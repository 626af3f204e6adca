#!/usr/bin/env bash
# The test suite, one pytest process per test file: TensorFlow does not give back the memory
# of the hundreds of models the suite builds, and in one process it grew past 15 GiB before
# the mpirun tests (which start 2-4 TensorFlow processes more) ran. Extra arguments go to
# every pytest call (e.g. -x, -k name, --durations=10). Exit status: non-zero if any file failed.
# The last line adds up every file's counts: "suite: N passed, N failed".
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
failed=()
passed_total=0
failed_total=0
log=$(mktemp)
trap 'rm -f "$log"' EXIT
start=$(date +%s)
count() { grep -oE "[0-9]+ $1" "$log" | tail -1 | cut -d' ' -f1; }
for f in tests/test_*.py; do
  echo "=== $f"
  "$PY" -m pytest -q "$f" "$@" 2>&1 | tee "$log"
  rc=${PIPESTATUS[0]}
  passed_total=$(( passed_total + $(count passed || true) + 0 ))
  failed_total=$(( failed_total + $(count failed || true) + 0 + $(count error || true) + 0 ))
  # 5: no test collected (e.g. -k matched nothing in this file)
  if [ $rc -ne 0 ] && [ $rc -ne 5 ]; then
    failed+=("$f")
    [ "$(count failed)$(count error)" = "" ] && failed_total=$(( failed_total + 1 ))
  fi
done
echo "=== $(( ($(date +%s) - start) / 60 )) min; files failed: ${#failed[@]} ${failed[*]:-}"
echo "suite: $passed_total passed, $failed_total failed"
[ ${#failed[@]} -eq 0 ]
