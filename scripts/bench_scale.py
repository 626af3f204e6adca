"""Memory and speed of the tables as the number of distinct keys grows: des.train's DeepFM (dim 8,
Adam) on generated Criteo-format files of a given number of distinct keys, one process, DES and
the PS; per run the peak RSS per process, the keys each process holds, bytes per key held, samples/s
in epoch 1 (every key new) and epoch 2 (every key seen), the checkpoint's size and the seconds to
save and to restore it; the same with a row policy (admission and idle eviction) at the largest
size. Writes reports/scale.md and prints its table.

    .venv/bin/python scripts/bench_scale.py                      # 1M, 5M, 15M keys; single, des2, ps2
    .venv/bin/python scripts/bench_scale.py --keys 1000000,5000000 --systems single,des2,des4 --timeout 3600
    .venv/bin/python scripts/bench_scale.py --quick             # a smoke run: writes /tmp/scale_quick.md

The data (``--scratch``, default /tmp/des_scale, cached by keys, repeat and seed): 26 categorical
fields of 8 hex digits, key k of field f on ``--repeat`` consecutive lines, so that every batch of
epoch 1 meets new keys and epoch 2 none; 13 integer fields of 0-9 and a random label (p=0.25).
Each configuration (system, policy) also runs on a file of ``--baseline-keys`` keys: its peak RSS
is the baseline that bytes per key subtracts.
"""
import argparse
import json
import math
import os
import platform
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")       # des.jobs.compare imports TensorFlow

from des.jobs.compare import command_line, load  # noqa: E402
from des.jobs.runs import launch_env  # noqa: E402

NCAT, NINT = 26, 13
WIDTH = 1 + 2 * NINT + 9 * NCAT + 1      # label, 13 x (tab, digit), 26 x (tab, 8 hex digits), newline
HEX = np.frombuffer(b"0123456789abcdef", np.uint8)
PAYLOAD = 27 * 4                         # a joined row (dim 8 + linear 1) and Adam's two slots of it, float32
POLICY_PAYLOAD = 16                      # the policy's seen table: count and last step, int64
QUICK = {"keys": "20000,40000", "systems": "single,des2", "batch": 256, "out": "/tmp/scale_quick.md"}


def lines(start: int, n: int, repeat: int, rng: np.random.Generator) -> np.ndarray:
    """Lines ``start`` .. ``start + n - 1`` as bytes [n, WIDTH]: a label (1 with p=0.25), 13 integers
    0-9 and in categorical field f of line i the key (i // repeat) * 26 + f, as 8 hex digits of a
    bijection of 32 bits (x 2654435761 mod 2**32): every key distinct, each on ``repeat`` consecutive lines.

        >>> bytes(lines(0, 3, 2, np.random.default_rng(0))[2, 27:45]).split(b"\\t")[1:3]
        [b'11a25bfa', b'afd9d5ab']
    """
    out = np.empty((n, WIDTH), np.uint8)
    out[:, 0] = ord("0") + (rng.random(n) < 0.25)
    out[:, 1:2 * NINT:2] = ord("\t")
    out[:, 2:2 * NINT + 1:2] = ord("0") + rng.integers(0, 10, (n, NINT))
    key = np.arange(start, start + n, dtype=np.uint64) // np.uint64(repeat)
    ids = (key[:, None] * np.uint64(NCAT) + np.arange(NCAT, dtype=np.uint64)) * np.uint64(2654435761) % np.uint64(2**32)
    cat = out[:, 1 + 2 * NINT:-1].reshape(n, NCAT, 9)
    cat[:, :, 0] = ord("\t")
    for k in range(8):
        cat[:, :, 1 + k] = HEX[(ids >> np.uint64(28 - 4 * k)) & np.uint64(15)]
    out[:, -1] = ord("\n")
    return out


def ensure_data(scratch: str, keys: int, repeat: int, seed: int, chunk: int = 100_000) -> str:
    """The file of ``keys`` distinct categorical keys (rounded up to a multiple of 26), each on
    ``repeat`` lines; written in chunks (bounded memory) once, reused while its .meta.json is there."""
    path = os.path.join(scratch, f"keys{keys}-r{repeat}-s{seed}.txt")
    if os.path.exists(path + ".meta.json"):
        return path
    os.makedirs(scratch, exist_ok=True)
    per_field = -(-keys // NCAT)
    rows, rng, began = per_field * repeat, np.random.default_rng([seed, keys, repeat]), time.perf_counter()
    with open(path + ".tmp", "wb") as fh:
        for start in range(0, rows, chunk):
            fh.write(lines(start, min(chunk, rows - start), repeat, rng).tobytes())
    os.replace(path + ".tmp", path)
    with open(path + ".meta.json", "w") as fh:
        json.dump({"format": "criteo", "rows": rows, "categorical_keys": per_field * NCAT, "repeat": repeat,
                   "seed": seed, "bayes_auc": 0.5, "generator": "scripts/bench_scale.py"}, fh, indent=1)
    print(f"[scale] wrote {path}: {rows:,} lines, {per_field * NCAT:,} categorical keys "
          f"({time.perf_counter() - began:.0f} s)", flush=True)
    return path


def parse_system(name: str) -> tuple[str, int]:
    """``single`` -> ("single", 1); ``des2``, ``ps4`` -> ("des", 2), ("ps", 4).

        >>> parse_system("des4")
        ('des', 4)
    """
    if name == "single":
        return "single", 1
    for mode in ("des", "ps"):
        if name.startswith(mode) and name[len(mode):].isdigit() and int(name[len(mode):]) >= 2:
            return mode, int(name[len(mode):])
    raise ValueError(f"system {name!r}: single, desN or psN (N >= 2)")


def command(a, system: str, data: str, summary: str, extra: list[str]) -> list[str]:
    """The des.train command of one run: a single process with TensorFlow's threads (both cores),
    N processes under mpirun with one thread each."""
    mode, n = parse_system(system)
    argv = [sys.executable, "-m", "des.train", "--mode", mode, "--model", "deepfm", "--dim", "8", "--optimizer",
            "adam", "--batch", str(a.batch), "--holdout", "0", "--shuffle-buffer", "0", "--data", data,
            "--summary-json", summary, *(["--threads", "1"] if n > 1 else []), *extra]
    return ["mpirun", "-np", str(n), "--oversubscribe", "--bind-to", "none", *argv] if n > 1 else argv


def launch(cmd: list[str], log: str, timeout: float) -> tuple[float, str | None]:
    """Run ``cmd`` (its output to ``log``) in a session of its own, killed whole after ``timeout``
    seconds; (wall seconds, None or what went wrong)."""
    began = time.perf_counter()
    with open(log, "w") as fh:
        p = subprocess.Popen(cmd, env=launch_env(), cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT,
                             start_new_session=True)
        try:
            code = p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGTERM)
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
            return time.perf_counter() - began, f"timed out after {timeout:.0f} s"
    return time.perf_counter() - began, None if code == 0 else f"exit {code}, see {log}"


def run(a, system: str, data: str, name: str, extra: list[str]) -> dict:
    """One des.train invocation: its summary (des.jobs.compare.load: rank 0's, the peak over ranks and
    every rank's) and ``seconds`` of wall time, or ``error``."""
    summary = os.path.join(a.work, name + ".json")
    for stale in [summary] + [f"{summary}.rank{r}" for r in range(parse_system(system)[1])]:
        if os.path.exists(stale):
            os.remove(stale)
    cmd = command(a, system, data, summary, extra)
    seconds, error = launch(cmd, os.path.join(a.work, name + ".log"), a.timeout)
    print(f"[scale] {name}: {error or 'done'} ({seconds:.0f} s): {shlex.join(cmd)}", flush=True)
    if error:
        return {"error": error, "seconds": seconds}
    return dict(load(summary, parse_system(system)[1]), seconds=seconds)


def folder_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def measure(a, system: str, policy: str, data: str, tag: str) -> dict:
    """One configuration on one file: a 2-epoch run that saves a checkpoint at each epoch's end
    (memory before and with the saves, keys held, samples/s per epoch, each save's seconds, the size
    of the newest checkpoint's state/ folder), then the invocation that restores it (``--restore DIR
    --epochs 2``: nothing left to train; the summary's ``restore_seconds``)."""
    extra, ckpt = shlex.split(policy), os.path.join(a.work, tag + ".ckpt")
    shutil.rmtree(ckpt, ignore_errors=True)
    out = {"train": run(a, system, data, tag, ["--epochs", "2", "--checkpoint", ckpt, *extra])}
    if "error" not in out["train"]:
        out["checkpoint_bytes"] = folder_bytes(os.path.join(ckpt, "state"))
        out["restore"] = run(a, system, data, tag + "-restore", ["--epochs", "2", "--restore", ckpt, *extra])
    shutil.rmtree(ckpt, ignore_errors=True)
    return out


def keys_of(table_rows: dict, count: str = "held") -> int:
    """A table_rows count (held, admitted, evicted) in keys: table_rows counts a joined row once per
    member (``emb8_C1/emb1_C1``: the embedding and the linear weight, one key, one row of 9 floats)."""
    return sum(t.get(count, 0) // len(name.split("/")) for name, t in table_rows["tables"].items())


def per_key(run_: dict, base: dict, rss: str = "peak_rss_mib_before_first_save") -> float | None:
    """Mean over processes of (peak RSS ``rss`` - the baseline's, same rank) / keys the process
    holds, bytes (``rss``: before the first save, or ``peak_rss_mib``: with the saves)."""
    got = [(r[rss] - b[rss]) * 2**20 / keys_of(r["table_rows"])
           for r, b in zip(run_["ranks"], base["ranks"]) if keys_of(r["table_rows"])]
    return statistics.mean(got) if got else None


def row(keys: int, system: str, policy: str, got: dict, base: dict) -> dict:
    """The report's row of one measured configuration (``base``: the same on the baseline file)."""
    r = {"keys": keys, "system": system, "policy": policy}
    train = got["train"]
    if "error" in train or "error" in base["train"]:
        return dict(r, error=train.get("error") or "baseline: " + base["train"]["error"])
    held = [keys_of(x["table_rows"]) for x in train["ranks"]]
    by_epoch = train["ranks"][0].get("samples_per_second_by_epoch") or []
    r.update(rss=max(x["peak_rss_mib_before_first_save"] for x in train["ranks"]), held=max(held),
             held_total=sum(held), bytes_per_key=per_key(train, base["train"]),
             epoch1=by_epoch[0] if by_epoch else None, epoch2=by_epoch[1] if len(by_epoch) > 1 else None,
             admitted=sum(keys_of(x["table_rows"], "admitted") for x in train["ranks"]),
             evicted=sum(keys_of(x["table_rows"], "evicted") for x in train["ranks"]),
             checkpoint_mib=got["checkpoint_bytes"] / 2**20, save_rss=train["peak_rss_mib"],
             save_bytes_per_key=per_key(train, base["train"], "peak_rss_mib"),
             save_s=max(x["checkpoint_save_seconds"][0] for x in train["ranks"]))
    restore = got.get("restore", {"error": "no checkpoint"})
    if "error" in restore:
        r["restore_error"] = restore["error"]
    else:
        r["restore_s"] = max(x["restore_seconds"] for x in restore["ranks"])
    return r


def _f(v, spec: str = ",.0f") -> str:
    return "" if v is None else format(v, spec)


def table(rows: list[dict]) -> list[str]:
    out = ["| keys | system | policy | peak RSS/process MiB | keys held/process | keys held, all | bytes/key "
           "| samples/s epoch 1 (new) | samples/s epoch 2 (seen) | checkpoint MiB | save s | peak RSS with saves MiB "
           "| restore s | admitted | evicted |",
           "|" + "---|" * 15]
    for r in rows:
        head = f"| {r['keys']:,} | {r['system']} | {'on' if r['policy'] else 'off'}"
        if "error" in r:
            out.append(head + f" | failed: {r['error']} |" + " |" * 11)
            continue
        on = bool(r["policy"])
        out.append(head + " | ".join(["", _f(r["rss"]), _f(r["held"]), _f(r["held_total"]), _f(r["bytes_per_key"]),
                                      _f(r["epoch1"]), _f(r["epoch2"]), _f(r["checkpoint_mib"], ",.1f"),
                                      _f(r["save_s"], ".1f"), _f(r["save_rss"]),
                                      _f(r.get("restore_s"), ".1f") or f"failed: {r.get('restore_error')}",
                                      _f(r["admitted"]) if on else "", _f(r["evicted"]) if on else ""]) + " |")
    return out


def mem_total() -> int:
    with open("/proc/meminfo") as fh:
        return next(int(line.split()[1]) * 1024 for line in fh if line.startswith("MemTotal:"))


def projection(rows: list[dict], baselines: dict, systems: list[str]) -> list[str]:
    """Where one process, and DES on N, would run out of this machine's memory, from the bytes per
    key at the largest size each was measured at (no policy), without and with the peak of a
    checkpoint's save."""
    total, out = mem_total(), []
    gib = total / 2**30
    for system in [s for s in systems if s == "single" or s.startswith("des")]:
        measured = [r for r in rows if r["system"] == system and not r["policy"] and r.get("bytes_per_key")]
        if not measured:
            out.append(f"- {system}: not measured without a policy: no projection.")
            continue
        r = max(measured, key=lambda r: r["keys"])
        largest = r["keys"]
        n, ranks = parse_system(system)[1], baselines[(system, "")]["train"]["ranks"]
        base = {k: max(x[k] for x in ranks) * 2**20 for k in ("peak_rss_mib_before_first_save", "peak_rss_mib")}
        train, save = base["peak_rss_mib_before_first_save"], base["peak_rss_mib"]
        fits = (total / n - train) / r["bytes_per_key"]          # keys one process holds in its share
        if n == 1:
            text = (f"- single: {r['bytes_per_key']:,.0f} B/key at {largest:,} keys: one process fills the {gib:.1f} GiB "
                    f"at about {fits / 1e6:,.0f}M keys (({gib:.1f} GiB - its {train / 2**20:,.0f} MiB baseline) "
                    f"/ bytes per key)")
        else:
            text = (f"- {system}: {r['bytes_per_key']:,.0f} B/key per process at {largest:,} keys: its {n} processes share "
                    f"the {gib:.1f} GiB here, {gib / n:.1f} GiB each, so about {fits / 1e6:,.0f}M keys a process, "
                    f"{n * fits / 1e6:,.0f}M in all; with one process on each machine of {gib:.1f} GiB, about "
                    f"{(total - train) / r['bytes_per_key'] / 1e6:,.0f}M keys a process, "
                    f"{n * (total - train) / r['bytes_per_key'] / 1e6:,.0f}M in all")
        if r.get("save_bytes_per_key"):
            text += (f". A checkpoint's save peaks at {r['save_bytes_per_key']:,.0f} B/key (after its baseline): a job "
                     f"that saves fills this machine at about "
                     f"{n * (total / n - save) / r['save_bytes_per_key'] / 1e6:,.0f}M keys in all")
        out.append(text + ".")
    return out


TABLE_ALONE = """
import json, os, sys
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
import tensorflow as tf
from tensorflow_recommenders_addons import dynamic_embedding as de
def rss():
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) * 1024 for line in fh if line.startswith("VmRSS:"))
keys, width, tables = (int(x) for x in sys.argv[1:4])
made = [de.Variable(key_dtype=tf.int64, value_dtype=tf.float32, dim=width, name=f"t{i}", initializer=0.0)
        for i in range(tables)]
before = rss()
for start in range(0, keys, 100_000):
    ids = tf.range(start, min(keys, start + 100_000), dtype=tf.int64) * 2654435761
    for t in made:
        t.upsert(ids, tf.zeros([int(ids.shape[0]), width]))
print(json.dumps({"bytes_per_key": (rss() - before) / keys, "size": int(made[0].size())}))
"""


def table_alone(keys: int, width: int, tables: int) -> float:
    """Bytes per key of ``tables`` TFRA CPU tables of ``width`` float32 (keys int64) holding ``keys``
    keys, alone in a fresh process: its resident memory after the inserts minus before."""
    out = subprocess.run([sys.executable, "-c", TABLE_ALONE, str(keys), str(width), str(tables)], capture_output=True,
                         text=True, check=True, env=launch_env())
    return json.loads(out.stdout.strip().splitlines()[-1])["bytes_per_key"]


def tables_alone(sizes: list[int]) -> list[str]:
    """The report's section on what TFRA's tables cost alone: a joined row and Adam's two slots in
    three tables of 9 floats (what every system here holds), and the same 27 floats in one table."""
    got = [(keys, table_alone(keys, 9, 3), table_alone(keys, 27, 1)) for keys in sizes]
    out = ["| keys in a process | 3 tables of 9 float32 (row, Adam m, v) B/key | 1 table of 27 float32 B/key |",
           "|---|---|---|"]
    out += [f"| {keys:,} | {three:,.0f} | {one:,.0f} |" for keys, three, one in got]
    ratios = [x / p for _, three, one in got for x, p in ((three, 3 * (8 + 36)), (one, 8 + 108))]
    fewer = sum(one < three for _, three, one in got)
    out += ["", f"Payload: 3 x (8 + 36) = 132 B for three tables, 8 + 108 = 116 B for one. The tables alone cost "
            f"{min(ratios):.1f}x to {max(ratios):.1f}x their payload: TFRA's CPU tables are cuckoo hash maps that "
            "double their buckets as they fill, so the share of empty buckets moves with where a size falls "
            "between two doublings (and a doubling holds the old and the new buckets at once). One table of 27 "
            f"floats costs less than three of 9 at {fewer} of {len(got)} sizes (one key and one bucket a key, "
            "not three): a row stored with its slots would cut the cost a key, which TFRA's optimizer wrapper, "
            "keeping each slot in a table of its own, does not allow. The runs above hold more than the tables "
            "alone: TensorFlow's and the allocator's (a step's ids and rows, freed memory not given back)."]
    return out


def options(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--keys", help="distinct categorical keys of each file, comma-separated (default "
                    "1000000,5000000,15000000; --quick: 20000,40000)")
    ap.add_argument("--systems", help="single, desN, psN, comma-separated (default single,des2,ps2; --quick: single,des2)")
    ap.add_argument("--systems-at", default="", help="systems of some sizes, instead of --systems: "
                    "KEYS=SYSTEM,SYSTEM;KEYS=... (e.g. 40000000=single,des4)")
    ap.add_argument("--policy-systems", help="systems of the policy runs (default: --systems)")
    ap.add_argument("--policy", default="--evict-idle-steps 20",
                    help="des.train's row policy flags of the policy runs")
    ap.add_argument("--policy-keys", help="sizes run once more with --policy, comma-separated (default: the largest "
                    "of --keys; '' for none)")
    ap.add_argument("--repeat", type=int, default=1, help="lines of each key (consecutive)")
    ap.add_argument("--seed", type=int, default=0, help="the labels and integer fields")
    ap.add_argument("--batch", type=int, help="global batch (default 4096; --quick: 256)")
    ap.add_argument("--baseline-keys", type=int, default=10_000, help="keys of the baseline file")
    ap.add_argument("--scratch", default="/tmp/des_scale", help="data files (cached) and the runs' summaries and logs")
    ap.add_argument("--out", help="the report (default reports/scale.md; --quick: /tmp/scale_quick.md)")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per des.train invocation")
    ap.add_argument("--quick", action="store_true", help="a smoke run of this script: small files, single and des2")
    a = ap.parse_args(argv)
    defaults = QUICK if a.quick else {"keys": "1000000,5000000,15000000", "systems": "single,des2,ps2", "batch": 4096,
                                      "out": os.path.join(ROOT, "reports", "scale.md")}
    for k, v in defaults.items():
        setattr(a, k, v if getattr(a, k) is None else getattr(a, k))
    a.sizes = sorted({int(k) for k in a.keys.split(",") if k})
    a.policy_sizes = [max(a.sizes)] if a.policy_keys is None else sorted({int(k) for k in a.policy_keys.split(",") if k})
    a.policy_sizes = a.policy_sizes if a.policy.strip() else []
    a.system_list = [s for s in a.systems.split(",") if s]
    a.policy_systems = a.system_list if a.policy_systems is None else [s for s in a.policy_systems.split(",") if s]
    try:
        a.systems_at = {int(k): [s for s in v.split(",") if s]
                        for k, v in (part.split("=") for part in a.systems_at.split(";") if part.strip())}
        a.sizes = sorted(set(a.sizes) | set(a.systems_at))
        [parse_system(s) for s in a.system_list + a.policy_systems + sum(a.systems_at.values(), [])]
    except ValueError as e:
        ap.error(f"--systems, --policy-systems or --systems-at: {e}")
    a.all_systems = list(dict.fromkeys(a.system_list + sum(a.systems_at.values(), []) + a.policy_systems))
    a.work = os.path.join(a.scratch, "runs")
    return a


def main(argv=None) -> None:
    a = options(argv)
    began = time.time()
    os.makedirs(a.work, exist_ok=True)
    per_field = -(-a.baseline_keys // NCAT)
    base_repeat = max(a.repeat, math.ceil(3 * a.batch / per_field))       # at least 3 steps an epoch
    base_data = ensure_data(a.scratch, a.baseline_keys, base_repeat, a.seed)
    configs = [(k, s, "") for k in a.sizes for s in a.systems_at.get(k, a.system_list)] + \
              [(k, s, a.policy) for k in a.policy_sizes for s in a.policy_systems]
    baselines, rows, raw = {}, [], []
    for keys, system, policy in configs:
        label = f"{system}-{'policy' if policy else 'plain'}"
        if (system, policy) not in baselines:
            baselines[(system, policy)] = measure(a, system, policy, base_data, f"base-{label}")
        got = measure(a, system, policy, ensure_data(a.scratch, keys, a.repeat, a.seed), f"{keys}-{label}")
        rows.append(row(keys, system, policy, got, baselines[(system, policy)]))
        raw.append({"keys": keys, "system": system, "policy": policy, **got})
    with open(os.path.join(a.work, "results.json"), "w") as fh:
        json.dump({"rows": rows, "runs": raw, "baselines": [{"system": s, "policy": p, **v}
                                                           for (s, p), v in baselines.items()]}, fh, indent=1)
    alone = tables_alone(sorted({k // n for k in a.sizes for n in (1, 4) if 0 < k // n <= 15_000_000}))
    text = report(a, rows, baselines, base_repeat, time.time() - began, alone)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as fh:
        fh.write(text)
    print("\n".join(table(rows)))
    print(f"written to {a.out} ({(time.time() - began) / 60:.1f} min); summaries and logs in {a.work}")


def report(a, rows: list[dict], baselines: dict, base_repeat: int, seconds: float, alone: list[str]) -> str:
    """The markdown report: how it was made, the table, what its columns are, where memory runs out."""
    commit = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip() or "unknown"
    base = "; ".join(
        f"{s}{' with the policy' if p else ''}: {max(x['peak_rss_mib_before_first_save'] for x in v['train']['ranks']):,.0f} MiB"
        if "ranks" in v["train"] else f"{s}{' with the policy' if p else ''}: failed ({v['train']['error']})"
        for (s, p), v in baselines.items())
    lines_ = [f"# Tables as the keys grow: DeepFM, dim 8, Adam, global batch {a.batch}, each key on {a.repeat} lines",
              "",
              "Written by " + command_line(".venv/bin/python scripts/bench_scale.py").rstrip(".")
              + f" ({platform.node()}, {mem_total() / 2**30:.1f} GiB of memory (MemTotal), shared; "
              f"commit {commit}); the benchmark took {seconds / 60:.0f} min.",
              "",
              *table(rows),
              "",
              *EXPLAINED.format(
                  repeat=a.repeat, lines_per_batch=a.batch // a.repeat, batch=a.batch,
                  policy_runs=(f"Policy on: `{a.policy}` at {', '.join(f'{k:,}' for k in a.policy_sizes)} keys."
                               if a.policy_sizes else "No run here has a policy."), base_keys=a.baseline_keys,
                  base_repeat=base_repeat, baselines=base, payload=PAYLOAD, policy_payload=POLICY_PAYLOAD).split("\n"),
              "",
              "## What a key costs: TFRA's tables alone",
              "",
              "The same inserts into TFRA CPU tables in a process of their own (`table_alone`: resident memory "
              "after the inserts minus before), no model, no optimizer:",
              "",
              *alone,
              "",
              f"## Where one machine runs out of memory ({mem_total() / 2**30:.1f} GiB)",
              "",
              *projection(rows, baselines, a.all_systems)]
    return "\n".join(lines_) + "\n"


EXPLAINED = """\
**Data.** A generated Criteo-format file per size: 26 categorical fields, key k of field f (8 hex digits, \
all distinct) on {repeat} consecutive line(s), so each batch of epoch 1 meets about {lines_per_batch:,} new keys \
per field and epoch 2 none; 13 integer fields of 0-9 (a few dozen more keys after des.train's \
log-bucketing) and a random label (p=0.25; nothing is held out, no AUC: not the point here). \
Every run: `des.train --model deepfm --dim 8 --optimizer adam --batch {batch} --shuffle-buffer 0 --holdout 0` \
(the file in order), single with TensorFlow's default threads (both cores), N processes under \
`mpirun -np N --oversubscribe --bind-to none` with `--threads 1` each. {policy_runs}

**Columns.** *Peak RSS/process*: des.train's `peak_rss_mib_before_first_save` (the process's ru_maxrss at the end of epoch 1, when every key is in the tables, before the save exports them), the largest over processes. *Keys held*: the keys with a row at the end of the run, from `table_rows` (which counts a key twice, its embedding and its linear weight: one joined row of 9 floats), the largest process's and all processes' together. *Bytes/key*: per process (that peak RSS - the baseline's) / keys it holds, the mean over processes; the baseline is the same system and policy on a file of {base_keys:,} keys, each on {base_repeat} lines (at least 3 steps an epoch): {baselines}. The payload of a key is {payload} B (a row of 9 float32 and Adam's two slots of it) plus its int64 key in each of the 3 tables (24 B), and with a policy {policy_payload} B (count and last step, int64) and a key more in the seen table; the rest is the hash tables' own overhead (TFRA's CPU tables are cuckoo hash maps that grow by doubling, so bytes per key move with where a size falls between two doublings, and a growth holds the old and the new buckets at once) and the allocator's. *Samples/s epoch 1 / epoch 2*: the global batch over the median step time of each epoch (rank 0; des.train's `samples_per_second_by_epoch`); epoch 1 inserts every key, epoch 2 finds them. With the policy, a key idle for the policy's steps is evicted, so epoch 2 meets new keys again, and the eviction after every 10th step is mostly outside the median. *Checkpoint MiB*: the run saves with `--checkpoint DIR` at each epoch's end; the size of the newest DIR/state (every process's shard). *Save s*: the first save's wall seconds (des.train's `checkpoint_save_seconds`, the slowest process; every key is in the tables then). *Peak RSS with saves*: the run's peak RSS per process (`peak_rss_mib`: a save exports a process's rows to numpy before it writes them). *Restore s*: `restore_seconds` of `des.train ... --restore DIR --epochs 2` (nothing left to train): reading the shards and inserting the rows, the slowest process. *Admitted / evicted*: keys over all processes (policy runs).\
"""


if __name__ == "__main__":
    main()
