#!/usr/bin/env bash
# The test suite, one pytest process per test file: TensorFlow does not give back the memory
# of the hundreds of models the suite builds, and in one process it grew past 15 GiB before
# the mpirun tests (which start 2-4 TensorFlow processes more) ran. Extra arguments go to
# every pytest call (e.g. -x, -k name, --durations=10). Exit status: non-zero if any file failed.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
failed=()
start=$(date +%s)
for f in tests/test_*.py; do
  echo "=== $f"
  "$PY" -m pytest -q "$f" "$@"
  rc=$?
  # 5: no test collected (e.g. -k matched nothing in this file)
  if [ $rc -ne 0 ] && [ $rc -ne 5 ]; then failed+=("$f"); fi
done
echo "=== suite: $(( ($(date +%s) - start) / 60 )) min; files failed: ${#failed[@]} ${failed[*]:-}"
[ ${#failed[@]} -eq 0 ]
