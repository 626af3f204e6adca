#!/usr/bin/env bash
# `make tour`: the longer walk through the product (about 15 min on 2 cores): the zoo DeepFM on
# one process and with DES on 2 under mpirun (AUC next to the Bayes-optimal AUC), DeepCTR's DeepFM
# with one des.transform line, the DES checkpoint predicting a generated test.txt, its export (one
# SavedModel) predicting it again on one process, and a DES vs parameter-server vs HET-cache vs
# one-process comparison (table + plots).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
DATA=data/demo/train.txt
ROWS=${DEMO_ROWS:-200000}
if [ ! -f "$DATA" ] || [ ! -f "$DATA.meta.json" ]; then
  echo "== generating $ROWS rows of Criteo-like data (seeded) into $DATA"
  $PY -m des.data.synth --preset criteo-like --rows "$ROWS" --seed 0 --out "$DATA"
fi
COMMON=(--model deepfm --data "$DATA" --batch 1024 --epochs 1 --optimizer adam --lr 0.002
        --dim 8 --hidden 128,64 --seed 0)
echo "== single process"
$PY -m des.train "${COMMON[@]}" --summary-json data/demo/single.json
echo "== DES on 2 processes (mpirun + Horovod)"
mpirun -np 2 --oversubscribe --bind-to none $PY -m des.train --mode des "${COMMON[@]}" \
  --threads 1 --replica-check 50 --checkpoint data/demo/ckpt --summary-json data/demo/des.json
echo "== results: data/demo/single.json, data/demo/des.json.rank0, checkpoint in data/demo/ckpt"
echo "== bring your own model: DeepCTR's DeepFM with one des.transform line, 1 process then DES on 2"
$PY examples/byom.py --model deepctr --data "$DATA" --steps 100 2>&1 | grep "held-out"
mpirun -np 2 --oversubscribe --bind-to none $PY examples/byom.py --model deepctr --data "$DATA" --steps 100 \
  2>&1 | grep -v "^WARNING\|deepctr/#history"
TEST=data/demo/test.txt
if [ ! -f "$TEST" ]; then
  echo "== generating a test.txt (39 columns, no label) of the same task: other rows, same planted model"
  $PY -m des.data.synth --preset criteo-like --rows 20000 --seed 0 --sample-seed 1 --no-label --out "$TEST"
fi
echo "== predicting $TEST with the DES checkpoint on 2 processes"
mpirun -np 2 --oversubscribe --bind-to none $PY -m des.predict --checkpoint data/demo/ckpt \
  --data "$TEST" --out data/demo/predictions.txt --threads 1
echo "   first predictions: $(head -3 data/demo/predictions.txt | tr '\n' ' ')"
echo "== exporting the DES checkpoint as one SavedModel (served without TFRA), predicting with it on 1 process"
rm -rf data/demo/served
$PY -m des.export --checkpoint data/demo/ckpt --out data/demo/served
$PY -m des.predict --checkpoint data/demo/served --data "$TEST" --out data/demo/predictions_served.txt --threads 1
echo "   first predictions: $(head -3 data/demo/predictions_served.txt | tr '\n' ' ')"
echo "== comparison: DES vs parameter server vs HET cache (s=100) vs one process (lr, deepfm; N=2; several minutes)"
$PY -m des.compare --models lr,deepfm --np 2 --preset criteo-like --rows 40000 --batch 2048 \
  --modes single,des,ps,cache --staleness 100 --cache-size 10% \
  --steps 15 --hidden 64,32 --batches 256,512,1024,2048,4096 --out reports/demo
