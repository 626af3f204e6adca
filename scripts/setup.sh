#!/usr/bin/env bash
# Idempotent set-up: apt packages, a project virtualenv (.venv), pinned pip
# packages, Horovod built against that TensorFlow with MPI, and a check that the
# build works. Every step is skipped when already done; a warm run takes seconds.
#
#   bash scripts/setup.sh        # then use .venv/bin/python
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
VENV="$ROOT/.venv"
PY="$VENV/bin/python"
HOROVOD_VERSION=0.28.1
say() { printf '[setup] %s\n' "$*" >&2; }

# 0. A Python TensorFlow 2.15.1 has wheels for (3.9-3.11): PYTHON, else python3.
PYTHON=${PYTHON:-python3}
PYV=$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null) || {
  say "ERROR: $PYTHON not found: install Python 3.9-3.11 (TensorFlow 2.15.1 has wheels for those) or set PYTHON"
  exit 1; }
case "$PYV" in
  3.9|3.10|3.11) ;;
  *) say "ERROR: $PYTHON is Python $PYV; TensorFlow 2.15.1 needs 3.9-3.11: set PYTHON=python3.11 (or 3.10, 3.9)"
     exit 1 ;;
esac

# 1. System packages: Open MPI (runtime + headers, for mpi4py and Horovod), a C++ toolchain and,
#    when this Python lacks them, its venv module and headers (Debian's python3-venv, python3-dev).
APT_PKGS="libopenmpi-dev openmpi-bin cmake g++ make iproute2"
"$PYTHON" -c "import venv, ensurepip" 2>/dev/null || APT_PKGS="$APT_PKGS python3-venv"
"$PYTHON" -c "import os, sysconfig; assert os.path.exists(os.path.join(sysconfig.get_paths()['include'], 'Python.h'))" \
  2>/dev/null || APT_PKGS="$APT_PKGS python3-dev"
missing=""
for p in $APT_PKGS; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
done
if [ -n "$missing" ]; then
  say "installing apt packages:$missing (Open MPI for mpirun/mpi4py/Horovod; compilers for the Horovod build)"
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq $missing >/dev/null
fi

# 2. Virtualenv.
if [ ! -x "$PY" ]; then
  say "creating virtualenv $VENV"
  "$PYTHON" -m venv "$VENV"
fi

# 3. Pinned pip packages (re-run only when requirements.txt changes).
REQ_HASH=$(sha256sum requirements.txt | cut -c1-16)
STAMP="$VENV/.req-$REQ_HASH"
if [ ! -f "$STAMP" ]; then
  say "installing pinned Python packages from requirements.txt (TensorFlow, TFRA, mpi4py, ...)"
  "$PY" -m pip install -q --upgrade pip==24.0
  "$PY" -m pip install -q -r requirements.txt
  rm -f "$VENV"/.req-*; touch "$STAMP"
fi

# 4. Horovod, compiled against this TensorFlow with MPI (about 3.5 minutes).
horovod_ok() {
  "$PY" - <<'PY' 2>/dev/null
import horovod, horovod.tensorflow as hvd
assert horovod.__version__ == "0.28.1", horovod.__version__
assert hvd.mpi_built(), "Horovod built without MPI"
hvd.init()
import tensorflow as tf
assert float(hvd.allreduce(tf.constant(2.0), op=hvd.Sum)) == 2.0
PY
}
if ! horovod_ok; then
  if "$PY" -m pip show horovod >/dev/null 2>&1; then
    say "the installed Horovod does not work with this TensorFlow/MPI: rebuilding it"
    "$PY" -m pip uninstall -y -q horovod
  fi
  say "building Horovod $HOROVOD_VERSION from source with TensorFlow + MPI (about 4 minutes)"
  HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_MPI=1 HOROVOD_WITHOUT_PYTORCH=1 \
  HOROVOD_WITHOUT_MXNET=1 HOROVOD_WITHOUT_GLOO=1 MAKEFLAGS=-j2 \
    "$PY" -m pip install -q --no-build-isolation --no-cache-dir "horovod==$HOROVOD_VERSION"
  if ! horovod_ok; then
    say "ERROR: Horovod $HOROVOD_VERSION was built but its TensorFlow/MPI ops do not work."
    say "Run: $PY -c 'import horovod.tensorflow as hvd; hvd.init()' to see the error."
    exit 1
  fi
fi

# 5. Test/extra dependency: DeepCTR, whose models the bring-your-own-model tests substitute. It
#    pins an old TensorFlow in its metadata but builds on this one, so it goes in without deps.
DEEPCTR_VERSION=0.9.4
if ! "$PY" -c "import importlib.metadata as m; assert m.version('deepctr') == '$DEEPCTR_VERSION'" 2>/dev/null; then
  say "installing deepctr $DEEPCTR_VERSION (tests only; --no-deps: it runs on this TensorFlow)"
  "$PY" -m pip install -q --no-deps "deepctr==$DEEPCTR_VERSION"
fi

# 5b. Test/extra dependency: TensorFlow Recommenders, whose subclassed models the tests trace and
#     substitute; like deepctr it goes in without its dependencies (it runs on this TensorFlow).
TFRS_VERSION=0.7.3
if ! "$PY" -c "import importlib.metadata as m; assert m.version('tensorflow-recommenders') == '$TFRS_VERSION'" 2>/dev/null; then
  say "installing tensorflow-recommenders $TFRS_VERSION (tests only; --no-deps)"
  "$PY" -m pip install -q --no-deps "tensorflow-recommenders==$TFRS_VERSION"
fi

# 6. This project, editable.
if [ ! -f "$VENV/.des-installed" ] || [ setup.cfg -nt "$VENV/.des-installed" ]; then
  say "installing this project in editable mode"
  "$PY" -m pip install -q --no-build-isolation --no-deps -e .
  touch "$VENV/.des-installed"
fi
