#!/usr/bin/env bash
# `make demo`: the main job in about 3 minutes on 2 cores. A DeepFM written by hand in Keras
# (examples/byom.py) trains on one process, then the same script with DES on 2 processes under
# mpirun: the same held-out AUC and log loss. The parameter server trains a DeepFM on the same
# data and processes for its bytes per step; a table and one plot put the two side by side.
# `make tour` runs the longer walk (checkpoints, predict, export, the comparison grid).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
OUT=data/demo/quick
DATA=$OUT/train.txt
ROWS=${DEMO_ROWS:-60000}
STEPS=${DEMO_STEPS:-40}
MPI=(mpirun -np 2 --oversubscribe --bind-to none)
quiet() { grep -v "^WARNING\|deepctr/#history\|cuda_\|^$" || true; }
took() { echo "   ($((SECONDS - T0)) s so far)"; }
T0=$SECONDS
mkdir -p "$OUT"
if [ ! -f "$DATA" ] || [ ! -f "$DATA.meta.json" ]; then
  echo "== generating $ROWS rows of Criteo-like data (39 fields, seeded) into $DATA"
  $PY -m des.data.synth --preset criteo-like --rows "$ROWS" --seed 0 --out "$DATA"
fi
DIM=${DEMO_DIM:-32}
BYOM=(examples/byom.py --model keras --data "$DATA" --steps "$STEPS" --batch 1024 --dim "$DIM" --holdout 10000)
echo "== 1 process: a Keras DeepFM written by hand, $STEPS steps of 1024 rows"
$PY "${BYOM[@]}" --summary-json $OUT/single.json 2>&1 | quiet | grep "held-out"
took
echo "== the same script, DES on 2 processes (mpirun + Horovod): des.transform(model) is its one extra line"
"${MPI[@]}" $PY "${BYOM[@]}" --summary-json $OUT/des.json 2>&1 | quiet | grep -v "^ \+[0-9]\+ tables\|^[0-9]*/[0-9]* - "
took
echo "== a parameter server on 2 processes (des.train --mode ps), the same data, batch and steps"
"${MPI[@]}" $PY -m des.train --mode ps --model deepfm --data "$DATA" --batch 1024 --steps "$STEPS" --dim "$DIM" \
  --hidden 64,32 --lr 0.001 --holdout 10000 --threads 1 --summary-json $OUT/ps.json 2>&1 | quiet | grep "AUC\|bytes/step"
took
echo "== side by side"
mkdir -p reports
$PY scripts/demo_plot.py $OUT/single.json $OUT/des.json $OUT/ps.json.rank0 $OUT/demo.png reports/demo.md \
  "$ROWS generated Criteo-like rows (39 fields, seed 0), last 10,000 held out; $STEPS steps of 1024 rows; Adam 1e-3; dim $DIM; MLP 64-32; 2 processes on one machine (mpirun, Horovod)"
printf '\n`make demo` took %d s after set-up, the data generation included.\n' $((SECONDS - T0)) >> reports/demo.md
echo "== done in $((SECONDS - T0)) s: the table above is reports/demo.md, the plot $OUT/demo.png"
