"""Convert text data (criteo, avazu, libsvm, libffm) to the columnar layout (des.data.columnar).

    python -m des.data.convert --data train.ffm --format libffm --out train.cols

The spec is the one des.train would use (the format's, the generator's metadata, or scanned);
pass ``--eval-data`` files too when evaluation files may hold longer bags. Bad lines stop the
conversion with file:line, or are dropped and counted with ``--skip-bad-lines``.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

from des.data import DataError, SkipReport
from des.data.columnar import convert
from des.data.resolve import metadata, spec_for


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, nargs="+", help="text files (.gz allowed)")
    ap.add_argument("--format", default=None, choices=["criteo", "avazu", "libsvm", "libffm"],
                    help="default: the format in <data>.meta.json if present, else criteo")
    ap.add_argument("--eval-data", nargs="*", default=(), help="also scanned for the spec (not converted)")
    ap.add_argument("--out", required=True, help="the new folder")
    ap.add_argument("--skip-bad-lines", action="store_true")
    a = ap.parse_args(argv)
    meta = metadata(a.data[0])
    fmt = a.format or meta.get("format", "criteo")
    skips = SkipReport()
    t0 = time.perf_counter()
    try:
        spec = spec_for(fmt, a.data, 8, meta, a.eval_data)
        extra = {"bayes_auc": meta["bayes_auc"]} if "bayes_auc" in meta else None   # the generator's facts
        out = convert(a.data, fmt, spec, a.out, skip_bad_lines=a.skip_bad_lines, skip_report=skips, extra=extra)
    except (DataError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    size = sum(os.path.getsize(os.path.join(a.out, f)) for f in os.listdir(a.out))
    print(f"{a.out}: {out['rows']:,} rows, {len(out['columns']) - 1} input columns + labels, "
          f"{size / 2**20:.1f} MiB, {time.perf_counter() - t0:.1f} s"
          + (f"; {skips}" if a.skip_bad_lines else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
