"""DES vs the parameter-server baseline (and the HET cache) vs one process, on the same data, in one command.

    python -m des.compare --models lr,wdl,deepfm --np 4 --preset criteo-like --batch 4096 --steps 40
    python -m des.compare --models deepfm --modes single,des,ps,cache --staleness 0,10,100,inf
    python -m des.compare --models lr,deepfm --np 4 --data train.txt --format criteo --eval-data test.txt
    python -m des.compare --models deepfm --modes des,ps --tables per-field   # any des.train option: every run

For each model it runs ``des.train`` once per mode - one process (the reference), ``--mode des``,
``--mode ps`` and (``--modes ...,cache``) ``--mode cache`` once per staleness, under
``mpirun -np N`` - at the same global batch, on a generated preset (``--preset``, ``--rows``) or on
your own files (``--data FILE... --format F [--eval-data FILE...]``), then writes to
``--out``/<preset> (with ``--data``: ``--out``/<name of the first data file>):

- ``comparison.md`` / ``comparison.csv`` (and stdout): AUC, log loss, samples/s, bytes sent
  per step per process (measured and analytic), CPU seconds per step per process, DES saving,
  unique ids per step, peak memory;
  the cost model's verdict per substituted operator;
- ``bytes_vs_batch.png``: bytes/step/process vs global batch per mode (the formulas on the
  data's own ids at each batch size, with the measured points of the runs);
- ``throughput.png`` and ``auc_vs_steps.png``; with the cache, ``auc_vs_bytes.png`` (DES and PS
  are points, the cache a curve over its staleness).
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import csv
import dataclasses
import io
import json
import os
import shlex
import shutil
import subprocess
import sys
import time

import numpy as np

import models
from des.jobs import projection
from des.jobs.auto import traffic
from des.jobs.config import AllocationOptions, CacheOptions, RunConfig
from des.data import columnar
from des.data.readers import make_dataset
from des.data.resolve import metadata, spec_for
from des.jobs.inputs import bayes_auc
from des.jobs.modes import MODES as MODE_CHOICES
from des.cluster.netbed import Netbed, down
from des.jobs.runs import ROOT, data_files, describe_source, launch_env


def ensure_data(preset: str, rows: int, seed: int, folder: str) -> str:
    """The generated training file of a preset (written once; reused if the metadata matches)."""
    ext = "ffm" if preset == "wide" else "txt"
    path = os.path.join(folder, f"{preset}-{rows}-{seed}.{ext}")
    if not os.path.exists(path + ".meta.json"):
        subprocess.run([sys.executable, "-m", "des.data.synth", "--preset", preset, "--rows", str(rows),
                        "--seed", str(seed), "--out", path], check=True, env=launch_env(), cwd=ROOT)
    return path


def ensure_columnar(files: list[str], fmt: str, eval_files: list[str] | None, meta: dict) -> tuple[str, str | None]:
    """Columnar copies (des.data.columnar) of the data and evaluation files, written once beside
    them (``<first file>.cols``) and reused while newer than the files."""
    spec = spec_for(fmt, files, 8, meta, eval_files or [])
    made = []
    for group in (files, eval_files):
        if not group:
            made.append(None)
            continue
        folder = group[0] + ".cols"
        fresh = columnar.is_columnar([folder]) and columnar.manifest(folder)["source"] == list(group) and \
            os.path.getmtime(os.path.join(folder, columnar.MANIFEST)) >= max(os.path.getmtime(f) for f in group)
        if not fresh:
            if os.path.exists(folder):
                shutil.rmtree(folder)
            print(f"[compare] converting {', '.join(group)} to {folder} (columnar)", flush=True)
            columnar.convert(group, fmt, spec, folder,
                             extra={"bayes_auc": meta["bayes_auc"]} if "bayes_auc" in meta and group is files else None)
        made.append(folder)
    return made[0], made[1]


@dataclasses.dataclass(frozen=True)
class Cell:
    """One column of the comparison: a mode, for ps and cache an allocation, for the cache a
    staleness and its on-demand / plan-pushes plans. ``key`` is its label ("cache+laia s=0")."""
    mode: str
    allocation: str = "contiguous"
    on_demand: bool = False
    plan_pushes: bool = False
    staleness: str | None = None

    @property
    def key(self) -> str:
        plan = [self.allocation] * (self.allocation != "contiguous") + ["on-demand"] * self.on_demand \
            + ["plan-pushes"] * self.plan_pushes
        return "+".join([self.mode, *plan]) + (f" s={self.staleness}" if self.mode == "cache" else "")

    @classmethod
    def parse(cls, key: str) -> "Cell":
        """``"cache+laia+on-demand s=0"`` -> Cell("cache", "laia", True, False, "0") (ValueError if unknown)."""
        name, _, stale = key.partition(" s=")
        base, *plan = name.split("+")
        known = {"contiguous", "random", "laia"} | ({"on-demand", "plan-pushes"} if base == "cache" else set())
        if base not in (*MODE_CHOICES, "auto") or (plan and (base not in ("ps", "cache") or not set(plan) <= known)) \
                or (base == "cache") != bool(stale):
            raise ValueError(f"unknown mode {name!r} (ps and cache also as ps+laia, cache+random, "
                             f"cache+laia+on-demand, ...)")
        allocation = next((p for p in plan if p not in ("on-demand", "plan-pushes")), "contiguous")
        return cls(base, allocation, "on-demand" in plan, "plan-pushes" in plan, stale or None)


def cells(modes: str, staleness: str) -> list[Cell]:
    """--modes and --staleness -> the runs, in order (a cache mode once per staleness)."""
    out = []
    for name in [m for m in modes.split(",") if m]:
        stales = [s for s in staleness.split(",") if s] if name.split("+")[0] == "cache" else [None]
        out += [Cell.parse(name if s is None else f"{name} s={s}") for s in stales]
    return out


def train_config(cell: Cell, model: str, data, a, summary: str) -> RunConfig:
    """The des.train run of one cell on ``data`` with the comparison's options ``a`` (batch, steps,
    holdout, dim, hidden, optimizer, lr, shuffle_buffer, cache_size, format, eval_data)."""
    return RunConfig(
        data=data_files(data), mode=cell.mode, model=model, format=a.format, eval_data=a.eval_data,
        holdout=0.1 if a.eval_data else a.holdout, batch=a.batch, steps=a.steps, dim=a.dim, hidden=a.hidden,
        optimizer=a.optimizer, lr=a.lr, threads=1, summary_json=summary, shuffle_buffer=a.shuffle_buffer,
        cache=CacheOptions(staleness=cell.staleness or "100", size=a.cache_size, on_demand=cell.on_demand,
                           plan_pushes=cell.plan_pushes),
        allocation=AllocationOptions(strategy=cell.allocation))


class Progress:
    """One line per finished run: runs done of all, the run, elapsed and an estimate of what is left
    (the mean run so far times the runs to go).

        >>> p = Progress(4, clock=iter([0.0, 30.0, 50.0]).__next__)
        >>> p.done("lr des"); p.done("lr ps")
        [compare] 1/4 done: lr des (0:30); elapsed 0:30, about 1:30 left
        [compare] 2/4 done: lr ps (0:20); elapsed 0:50, about 0:50 left
    """

    def __init__(self, total: int, clock=time.perf_counter):
        self.total, self.count, self.clock = total, 0, clock
        self.start = self.last = clock()

    def done(self, name: str) -> None:
        now = self.clock()
        self.count += 1
        elapsed = now - self.start
        left = elapsed / self.count * (self.total - self.count)
        print(f"[compare] {self.count}/{self.total} done: {name} ({_clock(now - self.last)}); elapsed "
              f"{_clock(elapsed)}, about {_clock(left)} left", flush=True)
        self.last = now


def _clock(seconds: float) -> str:
    m, s = divmod(int(round(seconds)), 60)
    return f"{m // 60}:{m % 60:02d}:{s:02d}" if m >= 60 else f"{m}:{s:02d}"


def run(key: str, model: str, data: str, a, out: str, launcher: list[str] | None = None,
        options: tuple[str, ...] = (), tag: str = "") -> dict:
    """One des.train run (``key``: a Cell's key, e.g. ``des`` or ``cache+laia s=0``); returns rank 0's
    summary plus the peak memory over processes and, on the netbed, the mean over hosts of the bytes
    per step each host sent on its interface. ``launcher``: the mpirun command (default: local
    mpirun). ``data``: a file or a list of files; ``a``: the comparison's options (train_config),
    with ``a.np`` processes; ``options``: more des.train flags."""
    cell = Cell.parse(key)
    summary = os.path.join(out, f"{model}-{key.replace(' ', '-').replace('=', '').replace('+', '-')}{tag}.json")
    args = ["-m", "des.train", *train_config(cell, model, data, a, summary).to_argv(), *options]
    mode = cell.mode
    cmd = [sys.executable, *args]
    if mode != "single":
        cmd = [*(launcher or ["mpirun", "-np", str(a.np), "--oversubscribe", "--bind-to", "none"]), *cmd]
    print(f"[compare] {model} {key}: {' '.join(cmd)}", flush=True)
    log = summary[:-len(".json")] + ".log"
    for attempt in range(3):      # Open MPI's daemons across the netbed's namespaces fail to start now and then
        with open(log, "w") as fh:
            done = subprocess.run(cmd, env=launch_env(), cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT)
        with open(log) as fh:
            if done.returncode == 0 or not launcher or "ORTE was unable to reliably start" not in fh.read():
                break
        print(f"[compare] mpirun could not start its daemons (attempt {attempt + 1} of 3); again", flush=True)
    if done.returncode != 0:
        raise SystemExit(f"{model} {key} failed (exit {done.returncode}); see {log}")
    return load(summary, 1 if mode == "single" else a.np)


def load(summary: str, n: int) -> dict:
    """The summary a run left (``summary``, or ``summary.rank<r>`` for r < ``n`` under mpirun) as
    ``run`` returns it: rank 0's, with the peak memory, the ranks and their wire bytes."""
    paths = [summary] if n == 1 and os.path.exists(summary) else [f"{summary}.rank{r}" for r in range(n)]
    ranks = [json.load(open(p)) for p in paths]
    s = dict(ranks[0])
    s["peak_rss_mib"] = max(r["peak_rss_mib"] for r in ranks)
    s["ranks"] = ranks
    if all("wire_bytes_per_step" in r for r in ranks):
        s["wire_bytes_per_host_step"] = float(np.mean([r["wire_bytes_per_step"] for r in ranks]))
    if all("cpu_seconds_per_step" in r for r in ranks):
        s["cpu_seconds_per_host_step"] = float(np.mean([r["cpu_seconds_per_step"] for r in ranks]))
    return s


def bytes_curve(model: str, data, fmt: str, a, batches: list[int], meta: dict | None = None) -> dict[str, list[float]]:
    """Analytic bytes/step/process at each global batch, on the data's first rows:
    DES 2(N-1)/N*4*B*floats; PS: the all-to-all of each process's remote distinct ids + dense ring.
    ``data``: a file or a list of files; the spec is des.train's (from ``meta``, default the first
    file's .meta.json if any, else scanned from the files and ``a.eval_data``). A batch larger
    than the data is computed on the rows there are (PS; DES's bytes do not depend on the ids)."""
    files = data_files(data)
    meta = metadata(files[0]) if meta is None else meta
    spec = spec_for(fmt, files, a.dim, meta, a.eval_data or [])
    plain = models.build(model, spec, hidden=tuple(int(h) for h in a.hidden.split(",") if h))
    out = {"des": [], "ps": []}
    for b in batches:
        x, _ = next(iter(make_dataset(files, fmt, spec, b, take_lines=b)))
        t = traffic(plain, {k: v.numpy() for k, v in x.items()}, a.np)   # t["batch"] < b: the data is shorter
        out["ps"].append(t["ps_bytes"])
        out["des"].append(t["des_bytes"] * b / t["batch"])
    return out


def table_rows(results: dict) -> list[dict]:
    rows = []
    for model, by_mode in results.items():
        ps_sent = by_mode.get("ps", {}).get("sent_bytes_per_step")
        for mode, s in by_mode.items():
            sent = s.get("sent_bytes_per_step")
            saving = 100.0 * (1 - sent / ps_sent) if mode not in ("single", "ps") and ps_sent and sent else None
            rows.append({"model": model, "mode": mode, "processes": s["world_size"],
                         "auc": s["auc"], "logloss": s["logloss"], "samples_per_s": s["samples_per_second"],
                         "bytes_step_measured": sent, "bytes_step_analytic": s.get("analytic_sent_bytes_per_step"),
                         "des_saving_pct": saving, "unique_ids_step": s.get("unique_ids_per_step"),
                         "remote_ids_step": s.get("remote_ids_per_step"),
                         "hit_rate": s.get("hit_rate"), "rows_fetched_step": s.get("rows_fetched_per_step"),
                         "rows_pushed_step": s.get("rows_pushed_per_step"),
                         "het_rows_per_lookup": s.get("het_rows_per_lookup"),
                         "wire_bytes_host_step": s.get("wire_bytes_per_host_step"),
                         "cpu_s_step": s.get("cpu_seconds_per_host_step"), "peak_mib": s["peak_rss_mib"]})
    return rows


def _fmt(v, spec: str = ",.0f") -> str:
    if v is None:
        return "-"
    return format(v, spec) if isinstance(v, (int, float)) else str(v)


def markdown(rows: list[dict], results: dict, a, meta: dict) -> str:
    head = ["model", "mode", "N", "AUC", "log loss", "samples/s", "bytes/step/proc (a2a measured + ring model)",
            "analytic (formulas)", "wire B/step/host (interface)", "CPU s/step/proc",
            "saving vs PS", "unique ids/step", "PS remote ids/step", "cache hit rate", "rows fetched+pushed/step", "peak MiB"]
    net = (f", netbed: one process per emulated host, {a.rate} per host"
           + (f", a CPU budget of {a.cpus} per host" if a.cpus else "")
           if a.net == "netbed" else "")
    bayes = meta.get("bayes_auc")
    lines = [f"# DES vs PS vs one process - {describe_source(a)}, N={a.np}, global batch {a.batch}, "
             f"{a.steps} steps{net}", "",
             *([meta["command"], ""] if meta.get("command") else []),
             f"Bayes-optimal AUC of the data: {'unknown' if bayes is None else bayes}. Bytes per process per step, rank 0. "
             f"Measured where each collective is called: the size of every tensor handed to all-to-all for "
             f"another process (PS: ids out, rows in, gradient rows out of this process's lookups; cache: "
             f"ids + clocks, clocks, stale rows, pushed rows leaving the process) and every allreduce payload "
             f"(DES: the partials, plus the replica check's; PS/cache: dense gradients). An allreduce's wire "
             f"bytes depend on MPI's algorithm: shown as the ring model 2(N-1)/N x payload, an analytic "
             f"figure. 'analytic (formulas)': the same from the ids by formula. 'wire' (--net netbed only): "
             f"what each host put on its interface per step (kernel counter; headers, MPI's algorithm and "
             f"Horovod's coordination included), mean over hosts. 'CPU s/step/proc': the CPU time a "
             f"process used per step (median; every thread), mean over processes: next to the step time "
             f"(global batch / samples/s) and a host's CPU budget it tells a CPU-bound step from one that "
             f"waits. Cache size {a.cache_size} "
             f"of each field. samples/s = global batch / median step time.", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lines.append("| " + " | ".join([
            r["model"], r["mode"], str(r["processes"]), _fmt(r["auc"], ".4f"), _fmt(r["logloss"], ".4f"),
            _fmt(r["samples_per_s"]), _fmt(r["bytes_step_measured"]), _fmt(r["bytes_step_analytic"]),
            _fmt(r.get("wire_bytes_host_step")), _fmt(r.get("cpu_s_step"), ".3f"),
            _fmt(r["des_saving_pct"], ".1f") + ("%" if r["des_saving_pct"] is not None else ""),
            _fmt(r["unique_ids_step"]), _fmt(r["remote_ids_step"]), _fmt(r["hit_rate"], ".3f"),
            "-" if r["rows_fetched_step"] is None else _fmt(r["rows_fetched_step"] + r["rows_pushed_step"]),
            _fmt(r["peak_mib"], ".0f")]) + " |")
    lines += ["", "Cost model (per substituted operator, from the first batch's distinct ids per process):", ""]
    for model, by_mode in results.items():
        for c in by_mode.get("des", {}).get("costs", []):
            lines.append(f"- {model} `{c['layer']}` ({c['rule']}): DES {c['des_bytes']:,.0f} B/step, "
                         f"PS {c['ps_bytes']:,.0f} B/step - {c['verdict']}")
    return "\n".join(lines) + "\n"


def plots(results: dict, curves: dict, batches: list[int], a, out: str) -> list[str]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    files = []
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for i, (model, c) in enumerate(curves.items()):
        color = f"C{i}"
        ax.plot(batches, c["des"], "-o", color=color, label=f"{model} DES")
        ax.plot(batches, c["ps"], "--s", color=color, label=f"{model} PS")
        for mode, mark in (("des", "*"), ("ps", "x")):
            sent = results[model].get(mode, {}).get("sent_bytes_per_step")
            if sent:
                ax.plot([a.batch], [sent], mark, color="k", markersize=10)
    ax.set(xscale="log", yscale="log", xlabel="global batch", ylabel="bytes sent / step / process",
           title=f"{describe_source(a, short=True)}, N={a.np} (lines: formulas on the data; black: the runs)")
    ax.legend(fontsize=7)
    files.append(_save(fig, out, "bytes_vs_batch.png"))
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    models_ = list(results)
    keys = list(results[models_[0]])
    w = 0.8 / len(keys)
    for j, mode in enumerate(keys):
        ax.bar(np.arange(len(models_)) + w * (j - (len(keys) - 1) / 2),
               [results[m][mode]["samples_per_second"] for m in models_],
               w, label=mode if mode == "single" else f"{mode} (N={a.np})")
    ax.set(xticks=range(len(models_)), xticklabels=models_, ylabel="samples / s (global)",
           title=f"throughput, {describe_source(a, short=True)}, global batch {a.batch}")
    ax.legend()
    files.append(_save(fig, out, "throughput.png"))
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for i, model in enumerate(models_):
        for mode, style in zip(results[model], ("-", "--", ":", "-.", (0, (1, 3)), (0, (5, 1)), (0, (3, 1, 1, 1)))):
            pts = results[model][mode].get("train_auc_by_step") or []
            if pts:
                ax.plot(*zip(*pts), linestyle=style, color=f"C{i}", label=f"{model} {mode}")
    ax.set(xlabel="step", ylabel="training AUC (running, rank 0)", title=f"AUC vs steps, {describe_source(a, short=True)}")
    ax.legend(fontsize=7)
    files.append(_save(fig, out, "auc_vs_steps.png"))
    if any(k.startswith("cache") for k in keys):
        fig, ax = plt.subplots(figsize=(6.5, 4.2))
        for i, model in enumerate(models_):
            by = results[model]
            for j, curve in enumerate(sorted({k.split(" ")[0] for k in by if k.startswith("cache")})):
                cached = [(by[k]["sent_bytes_per_step"], by[k]["auc"], k.split("=")[1]) for k in by
                          if k.split(" ")[0] == curve]
                ax.plot([c[0] for c in cached], [c[1] for c in cached], "-o" if j == 0 else ":o",
                        color=f"C{i}", label=f"{model} {curve}")
                for x, y, s in cached:
                    ax.annotate(f"s={s}", (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
            for mode, mark in (("des", "*"), ("ps", "s")):
                if mode in by:
                    ax.plot([by[mode]["sent_bytes_per_step"]], [by[mode]["auc"]], mark, color=f"C{i}",
                            markersize=11, label=f"{model} {mode}")
        ax.set(xscale="log", xlabel="bytes / step / process (all-to-all measured + allreduce ring model)", ylabel="held-out AUC",
               title=f"AUC vs bytes, {describe_source(a, short=True)}, N={a.np}, cache {a.cache_size}")
        ax.legend(fontsize=7)
        files.append(_save(fig, out, "auc_vs_bytes.png"))
    return files


def _save(fig, out: str, name: str) -> str:
    path = os.path.join(out, name)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def parser() -> argparse.ArgumentParser:
    """des.compare's options (``parser().parse_args([])``: every default, as tests and benchmarks use them)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="lr,wdl,deepfm")
    ap.add_argument("--np", default="4", help="processes; with --bandwidth a list to project (4,8,16,64)")
    ap.add_argument("--preset", default="criteo-like", choices=["criteo-like", "tiny", "wide"],
                    help="generated data (ignored with --data)")
    ap.add_argument("--rows", type=int, default=100_000, help="rows of generated data (ignored with --data)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--data", nargs="+", default=None, metavar="FILE",
                    help="your own training files (.gz allowed) instead of a generated preset")
    ap.add_argument("--format", default=None, choices=["criteo", "avazu", "libsvm", "libffm"],
                    help="with --data: the files' format (default: the one in <first file>.meta.json)")
    ap.add_argument("--eval-data", nargs="+", default=None, metavar="FILE",
                    help="with --data: evaluate on these files (same format) instead of held-out lines")
    ap.add_argument("--batch", type=int, default=4096, help="global batch (every mode)")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--holdout", type=float, default=None,
                    help="held-out lines at the end of the data: a count, or a fraction (<1) "
                         "(default: rows/10 of a preset; 0.1 of --data; unused with --eval-data)")
    ap.add_argument("--batches", default="512,1024,2048,4096,8192", help="batch sizes of the bytes curve")
    ap.add_argument("--dim", type=int, default=8)
    ap.add_argument("--hidden", default="128,64")
    ap.add_argument("--optimizer", default="adam")
    ap.add_argument("--lr", type=float, default=0.002)
    ap.add_argument("--shuffle-buffer", type=int, default=20_000)
    ap.add_argument("--modes", default="single,des,ps",
                    help="of single, des, ps, cache, auto (des or ps by des.jobs.auto); ps and cache also with an "
                         "allocation (des.baselines.allocate): ps+laia, ps+random, cache+laia, and the cache's on-demand "
                         "plan at staleness 0: cache+on-demand, cache+laia+on-demand, with SGD also +plan-pushes")
    ap.add_argument("--staleness", default="0,10,100,inf", help="cache: one run per staleness")
    ap.add_argument("--cache-size", default="10%", help="cache: rows per table, or a fraction of each field")
    ap.add_argument("--net", default="local", choices=["local", "netbed"],
                    help="netbed: one process per emulated host (des.netbed; root), wire bytes measured")
    ap.add_argument("--rate", default="1gbit", help="netbed: each host's sending rate (tc units)")
    ap.add_argument("--cpus", default=None,
                    help="netbed: each host's own CPU budget, a number of CPUs or 'share' (0.9 x cores / N), as a "
                         "cluster's hosts have (default: every host shares all cores)")
    ap.add_argument("--cpu-period-us", type=int, default=None,
                    help="netbed with --cpus: the CFS period of a host's CPU quota in us (default: the shortest "
                         "with a quota >= 1000 us, at least 2500)")
    ap.add_argument("--bandwidth", default=None, help="project samples/s at this bandwidth per host (des.jobs.projection)")
    ap.add_argument("--latency", default="20us", help="with --bandwidth: per message")
    ap.add_argument("--cycle", type=float, default=1.0, help="with --bandwidth: Horovod's cycle time (ms)")
    ap.add_argument("--call", default=None,
                    help="with --bandwidth: the cost of one collective call within a phase (e.g. 170us, as "
                         "scripts/bench_collectives.py measures it; default: 2(N-1) x --latency)")
    ap.add_argument("--ps-overlap", type=float, default=0.0,
                    help="with --bandwidth: the share of the PS's computation that runs while its bytes travel "
                         "(scripts/bench_timemodel.py calibrates it on the netbed; default 0: the plain sum)")
    ap.add_argument("--columnar", action="store_true",
                    help="convert the data once (des.data.convert) and let every run read the columnar copy: "
                         "a DES process reads only its own fields' columns, a PS process only its slice's rows")
    ap.add_argument("--out", default="reports/compare")
    return ap


def main(argv=None) -> int:
    a, train_options, nps = _options(argv)
    data, fmt, meta, out = _source(a)
    if a.bandwidth:
        return _project(a, data, fmt, meta, nps, out)
    a.np = nps[0]
    batches = sorted({int(b) for b in a.batches.split(",")} | {a.batch})
    try:
        keys = [c.key for c in cells(a.modes, a.staleness)]
    except ValueError as e:
        raise SystemExit(f"--modes: {e}") from None
    results, curves = {}, {}
    bed = None
    if a.net == "netbed":
        bed = Netbed(a.np, rate=a.rate, cpus=a.cpus, cpu_period_us=a.cpu_period_us).up()
    run_data, run_a = data, a
    if a.columnar:
        run_a = copy.copy(a)
        run_data, evals = ensure_columnar(data_files(data), fmt, a.eval_data, meta)
        run_a.format, run_a.eval_data = "columnar", [evals] if evals else None
    names = [m for m in a.models.split(",") if m]
    progress = Progress(len(names) * len(keys))
    try:
        for model in names:
            results[model] = {}
            for key in keys:
                results[model][key] = run(key, model, run_data, run_a, out, bed.mpirun(a.np) if bed else None,
                                          options=tuple(train_options))
                progress.done(f"{model} {key}")
            curves[model] = bytes_curve(model, data, fmt, a, batches, meta)
    finally:
        if bed is not None:
            down()
    _write_reports(a, results, curves, batches, meta, out)
    return 0


def _options(argv) -> tuple[argparse.Namespace, list[str], list[int]]:
    """des.compare's options, checked; the des.train options it passes on; the process counts."""
    ap = parser()
    a, train_options = ap.parse_known_args(argv)
    if train_options:      # any other des.train option goes to every run (checked now, once)
        try:
            with contextlib.redirect_stderr(io.StringIO()):
                RunConfig.parse(["--data", "-", *train_options])
        except SystemExit:
            ap.error(f"not an option of des.compare or des.train: {' '.join(train_options)}")
    if a.eval_data and not a.data:
        ap.error("--eval-data needs --data (a preset holds out its last lines)")
    if a.format and not a.data:
        ap.error("--format needs --data (a preset's format is known)")
    if a.cpus and a.net != "netbed":
        ap.error("--cpus needs --net netbed (a CPU budget per emulated host)")
    nps = [int(x) for x in a.np.split(",") if x]
    if len(nps) != 1 and not a.bandwidth:
        ap.error("--np: one number (a list only with --bandwidth, to project)")
    if a.data:
        a.format = a.format or metadata(a.data[0]).get("format")
        if not a.format:
            ap.error(f"--format criteo|avazu|libsvm|libffm is required with --data "
                     f"({a.data[0]}.meta.json, which would name it, does not exist or has no format)")
    return a, train_options, nps


def _source(a) -> tuple[list[str] | str, str, dict, str]:
    """The data the runs read (the user's files, or a generated preset written once), its format,
    metadata and the report folder; sets ``a.holdout`` (default: 0.1 of --data, rows/10 of a preset)."""
    if a.data:   # the user's files: nothing generated; --preset and --rows unused
        meta = metadata(a.data[0])
        a.holdout = a.holdout or 0.1
        data, fmt = list(a.data), a.format
        out = os.path.join(a.out, os.path.basename(a.data[0]))
    else:
        a.holdout = a.holdout or max(1, a.rows // 10)
        data = ensure_data(a.preset, a.rows, a.seed, os.path.join(a.out, "data"))
        meta = json.load(open(data + ".meta.json"))
        fmt = meta["format"]
        out = os.path.join(a.out, a.preset)
    if a.holdout >= 1:
        a.holdout = int(a.holdout)   # a count of lines
    os.makedirs(out, exist_ok=True)
    return data, fmt, meta, out


def _project(a, data, fmt: str, meta: dict, nps: list[int], out: str) -> int:
    """--bandwidth: projected samples/s at each N (des.jobs.projection) instead of runs."""
    timed = None
    if a.columnar:      # the computation is timed reading the columnar copy, as the runs would
        timed_data, _ = ensure_columnar(data_files(data), fmt, None, meta)
        timed = ([timed_data], "columnar")
    rows = projection.project([m for m in a.models.split(",") if m], data_files(data), fmt, a, nps, out, timed)
    md = projection.markdown(rows, a, made_by=command_line("python -m des.compare"))
    with open(os.path.join(out, "projection.md"), "w") as fh:
        fh.write(md)
    with open(os.path.join(out, "projection.json"), "w") as fh:
        json.dump(rows, fh, indent=1)
    print(md)
    return 0


def command_line(program: str) -> str:
    """How a report was made, for its header: ``program`` and this process's arguments, the date and
    the machine.

    >>> command_line("python -m des.compare").startswith("`python -m des.compare ")
    True
    """
    return (f"`{program} {shlex.join(sys.argv[1:])}`, {time.strftime('%Y-%m-%d %H:%M')}, "
            f"on a machine of {os.cpu_count()} cores.")


def _write_reports(a, results: dict, curves: dict, batches: list[int], meta: dict, out: str) -> None:
    """comparison.md / .csv, bytes_vs_batch.json and the plots; the table and curves on stdout."""
    rows = table_rows(results)
    md = markdown(rows, results, a,
                  dict(meta, bayes_auc=bayes_auc(a, meta), command=command_line("python -m des.compare")))
    with open(os.path.join(out, "comparison.md"), "w") as fh:
        fh.write(md)
    with open(os.path.join(out, "comparison.csv"), "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    with open(os.path.join(out, "bytes_vs_batch.json"), "w") as fh:
        json.dump({"batches": batches, "curves": curves}, fh, indent=1)
    files = plots(results, curves, batches, a, out)
    print(md)
    print("bytes/step/process by global batch (formulas on the data's ids):")
    for model, c in curves.items():
        for mode in ("des", "ps"):
            print(f"  {model:<7} {mode:<3} " + "  ".join(f"B={b}: {v:,.0f}" for b, v in zip(batches, c[mode])))
    print(f"\nreport: {os.path.join(out, 'comparison.md')} (and .csv); plots: {', '.join(files)}")


if __name__ == "__main__":
    sys.exit(main())
