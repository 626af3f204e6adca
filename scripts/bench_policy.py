"""What a row policy costs and keeps: des.train's DeepFM on a generated criteo-like file (its
Bayes-optimal AUC known), several epochs, with no policy and with ``--policy`` (default
``--admit-min-count 3 --evict-idle-steps 20``): one process, DES on 2 and the PS on 2 under the
policy; one process with 2 threads and DES on 2 without one (the noise floor of float32 summation
order over the run). Writes reports/policy.md: held-out AUC (against the Bayes-optimal one) and log loss, DES's
and the PS's log loss against one process's under the same policy, rows held / admitted / evicted
at the end (summed over processes, from the summary's ``table_rows``), peak RSS per process and
samples/s.

    .venv/bin/python scripts/bench_policy.py --rows 300000 --epochs 3

With ``--data FILE`` it runs on a file of Criteo's own (tab-separated: label, 13 integers, 26
categoricals), or on a CSV with Criteo's header (``label,I1,...,C26``, as DeepCTR's
``examples/criteo_sample.txt``: real Criteo lines), which it first writes in Criteo's format into
``--scratch``; the report then has no Bayes-optimal AUC:

    .venv/bin/python scripts/bench_policy.py --data criteo_sample.txt --holdout 40 --batch 8 \
        --out reports/policy_criteo_sample.md
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from des.jobs.runs import launch_env  # noqa: E402


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=300_000)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--policy", default="--admit-min-count 3 --evict-idle-steps 20")
    ap.add_argument("--data", help="a Criteo file (or CSV with Criteo's header) instead of generated data")
    ap.add_argument("--holdout", default="0.1", help="held-out lines at the end: a fraction (<1) or a count")
    ap.add_argument("--scratch", default=os.path.join(tempfile.gettempdir(), "des_policy"))
    ap.add_argument("--out", default=os.path.join(ROOT, "reports", "policy.md"))
    return ap.parse_args()


def run(mode: str, n: int, policy: list[str], data: str, a, out: str, threads: int = 1) -> list[dict]:
    """One des.train run (mpirun for n > 1); every process's summary."""
    cmd = [sys.executable, "-m", "des.train", "--mode", mode, "--model", "deepfm", "--data", data,
           "--epochs", str(a.epochs), "--batch", str(a.batch), "--holdout", a.holdout, "--threads", str(threads), "--summary-json", out,
           *policy]
    if n > 1:
        cmd = ["mpirun", "-np", str(n), "--oversubscribe", "--bind-to", "none", *cmd]
    done = subprocess.run(cmd, env=launch_env(), cwd=ROOT, capture_output=True, text=True, timeout=3600)
    if done.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    paths = [out] if n == 1 else [f"{out}.rank{r}" for r in range(n)]
    return [json.load(open(p)) for p in paths]


def row(name: str, ranks: list[dict], reference: dict | None) -> str:
    s, rows = ranks[0], [r["table_rows"] for r in ranks]
    total = {k: sum(r.get(k, 0) for r in rows) for k in ("held", "admitted", "evicted", "counting")}
    gap = "-" if reference is None else f"{abs(s['logloss'] - reference['logloss']):.1e}"
    return (f"| {name} | {s['auc']:.5f} | {s['logloss']:.6f} | {gap} | {total['held']:,} | {total['admitted']:,} | "
            f"{total['evicted']:,} | {total['counting']:,} | {max(r['peak_rss_mib'] for r in ranks):,.0f} | "
            f"{s['samples_per_second']:,.0f} |")


def criteo_format(path: str, scratch: str) -> tuple[str, int]:
    """``path`` in Criteo's tab-separated format, and its line count: a CSV with Criteo's header
    (``label,I1..I13,C1..C26``) is written as Criteo writes it (integers without DeepCTR's ``.0``)."""
    with open(path, newline="") as fh:
        first = fh.readline()
        if not first.startswith("label,"):
            return path, 1 + sum(1 for _ in fh)
        fh.seek(0)
        rows = list(csv.DictReader(fh))
    out = os.path.join(scratch, os.path.basename(path) + ".criteo.txt")
    with open(out, "w") as fh:
        for line, r in enumerate(rows, start=2):
            try:
                ints = ["" if r[f"I{k}"] == "" else str(int(float(r[f"I{k}"]))) for k in range(1, 14)]
                cats = [r[f"C{k}"] for k in range(1, 27)]
            except (KeyError, TypeError, ValueError) as e:
                raise SystemExit(f"{path}:{line}: not a line of Criteo's columns ({e!r})") from None
            fh.write("\t".join([r["label"], *ints, *cats]) + "\n")
    return out, len(rows)


def noise_text(got: dict, unbounded: dict, reference: dict) -> str:
    """What the log-loss gaps of the table are: none, or float32 summation order (the noise floor)."""
    threads = abs(got["one process, 2 threads, no policy"][0]["logloss"] - unbounded["logloss"])
    des = abs(got["DES on 2, no policy"][0]["logloss"] - unbounded["logloss"])
    gaps = [abs(ranks[0]["logloss"] - reference["logloss"]) for name, ranks in got.items() if "policy" in name
            and "no policy" not in name] + [threads, des]
    if max(gaps) == 0:
        return ("Every log loss above equals its one-process reference exactly (as float32): on this little data "
                "the runs sum in the same order, so DES and the PS under the policy give one process's result "
                "to the bit.")
    return ("The log-loss gaps are float32 summation order grown over the epochs' steps, not the policy: the same "
            "single process with 2 TensorFlow threads instead of 1 (another order of the kernels' sums, nothing "
            f"else changed) ends {threads:.1e} from it, and DES on 2 without a policy {des:.1e}.")


def again_text(got: dict) -> str:
    """Whether the same DES job, launched twice, gave the same bits."""
    first, again = got["DES on 2, policy"], got["DES on 2, policy, launched again"]
    same = all(x["logloss"] == y["logloss"] and x["auc"] == y["auc"] and x["table_rows"] == y["table_rows"]
               for x, y in zip(first, again))
    return ("DES on 2 under the policy, launched twice: " + ("the same log loss, AUC and rows on every process, to "
            "the bit." if same else f"NOT the same: log loss {first[0]['logloss']!r} then {again[0]['logloss']!r}."))


def main() -> None:
    a = parse()
    os.makedirs(a.scratch, exist_ok=True)
    if a.data:
        data, lines_in = criteo_format(a.data, a.scratch)
        what = f"`{os.path.basename(a.data)}` ({lines_in:,} lines in Criteo's format"
    else:
        data, lines_in = os.path.join(a.scratch, f"criteo_like_{a.rows}.txt"), a.rows
        what = f"generated criteo-like data ({a.rows:,} lines"
        if not os.path.exists(data + ".meta.json"):
            subprocess.run([sys.executable, "-m", "des.data.synth", "--preset", "criteo-like", "--rows", str(a.rows),
                            "--out", data], env=launch_env(), cwd=ROOT, check=True, capture_output=True)
    held = float(a.holdout)
    held_text = f"the last {held:.0%} of the lines" if held < 1 else f"the last {int(held):,} lines"
    bayes = "" if a.data else " Bayes-optimal AUC of the data: {bayes}."
    policy = shlex.split(a.policy)
    runs = [("one process, no policy", "single", 1, []), ("one process, 2 threads, no policy", "single", 1, []),
            ("DES on 2, no policy", "des", 2, []),
            ("one process, policy", "single", 1, policy), ("DES on 2, policy", "des", 2, policy),
            ("PS on 2, policy", "ps", 2, policy), ("DES on 2, policy, launched again", "des", 2, policy)]
    got = {}
    for name, mode, n, flags in runs:
        threads = 2 if "2 threads" in name else 1
        got[name] = run(mode, n, flags, data, a, os.path.join(a.scratch, f"{mode}{n}t{threads}{'p' if flags else ''}{'a' if 'again' in name else ''}.json"),
                        threads)
        print(name, "done:", got[name][0]["logloss"], got[name][0]["table_rows"]["held"], flush=True)
    reference = got["one process, policy"][0]
    lines = [f"# A row policy on {what}, {a.epochs} epochs, batch {a.batch})", "",
             "Written by `scripts/bench_policy.py " + " ".join(shlex.quote(x) for x in sys.argv[1:]) + "` on "
             f"{platform.node()} ({os.cpu_count()} cores); policy `{a.policy}`. Held out: {held_text}."
             + bayes.format(bayes=reference["bayes_auc"]), "",
             "| run | AUC | log loss | log loss vs one process, same policy (or none) | rows held | admitted | evicted | "
             "keys counted, no row | peak RSS MiB / process | samples/s |", "|" + "---|" * 10]
    unbounded = got["one process, no policy"][0]
    lines += [row(name, ranks, None if name in ("one process, no policy", "one process, policy")
                  else unbounded if "no policy" in name else reference) for name, ranks in got.items()]
    none, bounded = got["one process, no policy"][0], reference
    lines += ["", f"Under the policy one process holds {bounded['table_rows']['held']:,} rows at the end against "
              f"{none['table_rows']['held']:,} without ({bounded['table_rows']['held'] / none['table_rows']['held']:.2f}x); "
              f"its held-out AUC moves {bounded['auc'] - none['auc']:+.5f} and its log loss "
              f"{bounded['logloss'] - none['logloss']:+.6f}. Rows held, admitted and evicted are counted per table "
              "(a joined row is the embedding's and the linear weight's), summed over processes; DES and the PS "
              "admit and evict the same keys as one process, so their totals match it.", "",
              noise_text(got, unbounded, reference), "", again_text(got)]
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as fh:
        fh.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
