"""Samples/s of DES and the PS on a cluster you do not have: des.cluster.timemodel fed with this
machine's computation per process and the data's own bytes at each N.

    python -m des.compare --models deepfm --bandwidth 10gbit --latency 20us --np 4,8,16,64

Per model and N: each mode's step is timed with no-op collectives in ONE process that takes
rank 0 of N (``des.train --comm noop`` with the launcher's variables set: on a real cluster each
host has its own cores); the bytes per process come from the formulas on the data's first
global batch (DES 4 B w; PS the all-to-all of distinct remote ids, rows and gradient rows, mean
over the N slices, and the dense allreduce); the model adds Horovod's cycles and the calls.
``--ps-overlap F``: the share of the PS's computation that runs while its bytes travel
(scripts/bench_timemodel.py calibrates it on the netbed; default 0, the plain sum).
"""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import des
import models
from des.cluster import timemodel
from des.jobs.auto import traffic
from des.data.readers import make_dataset
from des.data.resolve import metadata, spec_for
from des.jobs.runs import describe_source, launch_env
from des_ops.comm import LocalCommunicator

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # the checkout


def compute_seconds(mode: str, model: str, data: list[str], fmt: str, a, n: int, out: str) -> float:
    """Median seconds per step of rank 0 of ``n`` with no-op collectives, alone on this machine."""
    summary = os.path.join(out, f"{model}-{mode}-compute-n{n}.json")
    env = dict(launch_env(), OMPI_COMM_WORLD_RANK="0", OMPI_COMM_WORLD_SIZE=str(n))
    tail = ["--tail", "data_parallel"] if mode == "des-dp" else []
    cmd = [sys.executable, "-m", "des.train", "--mode", mode.removesuffix("-dp"), *tail, "--comm", "noop", "--model", model, "--data", *data, "--format", fmt,
           "--batch", str(a.batch), "--steps", str(a.steps), "--holdout", "0", "--dim", str(a.dim),
           "--hidden", a.hidden, "--optimizer", a.optimizer, "--lr", str(a.lr), "--threads", "1",
           "--replica-check", "0", "--shuffle-buffer", str(a.shuffle_buffer), "--summary-json", summary]
    print(f"[project] {model} {mode} compute at N={n}", flush=True)
    done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed: {done.stderr[-2000:]}")
    with open(summary + f".rank0") as fh:
        return a.batch / json.load(fh)["samples_per_second"]


def traffic_at(model: str, data: list[str], fmt: str, a, n: int) -> dict[str, dict]:
    """The model's per-process traffic of DES and the PS at ``n`` processes, from the data's first
    global batch (the same formulas plan="auto" decides by: des.jobs.auto.traffic)."""
    spec = spec_for(fmt, data, a.dim, metadata(data[0]), a.eval_data or [])
    build = lambda: models.build(model, spec, hidden=tuple(int(h) for h in a.hidden.split(",") if h))  # noqa: E731
    plain = build()
    x, _ = next(iter(make_dataset(data, fmt, spec, a.batch, take_lines=a.batch)))
    t = traffic(plain, {k: v.numpy() for k, v in x.items()}, n)
    out = {"des": timemodel.des_traffic(t["des_payload"])}
    tail = tail_floats(build)
    if tail is not None:
        out["des-dp"] = timemodel.des_tail_traffic(t["des_payload"], 4.0 * a.batch, 4.0 * tail)
    out["ps"] = timemodel.ps_traffic(t["ps_lookups"], t["ps_alltoall"], t["ps_alltoall"], t["ps_dense_payload"])
    return out


def tail_floats(build) -> int | None:
    """The floats of the tail's gradients when ``build()``'s model runs with the data-parallel
    tail (des_ops.tail), or None when its tail cannot run data-parallel."""
    try:
        new, _ = des.transform(build(), des.Options(tail="data_parallel"), comm=LocalCommunicator())
    except ValueError:
        return None
    return sum(int(v.shape.num_elements()) for v in des.distributed(new).tail_variables)


def project(models_: list[str], data: list[str], fmt: str, a, nps: list[int], out: str,
            timed: tuple[list[str], str] | None = None) -> list[dict]:
    """Rows of projected step times. ``timed``: the (files, format) the computation is timed on,
    e.g. the columnar copy (default: ``data``, ``fmt``); the bytes always come from ``data``."""
    net = timemodel.Network.parse(a.bandwidth, a.latency, a.cycle / 1e3)
    if a.call:
        net = dataclasses.replace(net, call=timemodel.parse_time(a.call))
    timed_data, timed_fmt = timed or (data, fmt)
    rows = []
    for model in models_:
        for n in nps:
            traffic = traffic_at(model, data, fmt, a, n)
            for mode in traffic:
                compute = compute_seconds(mode, model, timed_data, timed_fmt, a, n, out)
                overlap = a.ps_overlap if mode == "ps" else 0.0
                t = timemodel.step_time(compute, traffic[mode], n, net, overlap=overlap)
                rows.append(dict(t, model=model, mode=mode, samples_per_s=a.batch / t["total"]))   # t has "n"
    return rows


def markdown(rows: list[dict], a, made_by: str = "") -> str:
    """The projection as a report; ``made_by``: how it was made (des.jobs.compare.command_line)."""
    lines = [f"# Projected samples/s - {describe_source(a)}, global batch {a.batch}, {a.bandwidth} per host, "
             f"{a.latency} per message, Horovod cycle {a.cycle} ms, "
             f"{a.call or '2(N-1) x latency'} per collective call, "
             f"{a.ps_overlap:.2f} of the PS's computation overlapping its bytes", ""]
    if made_by:
        lines += [f"{made_by} Each computation timed in one process alone.", ""]
    lines += ["Computation measured here (rank 0 of N alone, no-op collectives); communication by "
              "des.cluster.timemodel from the data's bytes. DES/PS = the speed-up.", "",
              "| model | N | DES samples/s | PS samples/s | DES/PS | DES comm share | PS comm share | "
              "PS ms: compute + fixed + bytes |", "|" + "---|" * 8]
    by = {(r["model"], r["n"], r["mode"]): r for r in rows}
    for model, n in dict.fromkeys((r["model"], r["n"]) for r in rows):
        d, p = by[(model, n, "des")], by[(model, n, "ps")]
        lines.append(f"| {model} | {n} | {d['samples_per_s']:,.0f} | {p['samples_per_s']:,.0f} | "
                     f"{d['samples_per_s'] / p['samples_per_s']:.2f}x | {d['comm_share']:.0%} | {p['comm_share']:.0%} | "
                     f"{p['compute'] * 1e3:.1f} + {p['fixed'] * 1e3:.1f} + {p['bandwidth'] * 1e3:.1f} |")
    tails = [(m, n) for m, n in dict.fromkeys((r["model"], r["n"]) for r in rows) if (m, n, "des-dp") in by]
    if tails:
        lines += ["", "DES with the data-parallel tail (des_ops.tail): computation per process (ms, measured "
                  "as above) and samples/s, against the replicated tail and the PS.", "",
                  "| model | N | compute ms: replicated / data-parallel / PS | DES samples/s: replicated / "
                  "data-parallel | data-parallel / PS |", "|" + "---|" * 5]
        for model, n in tails:
            d, t, p = by[(model, n, "des")], by[(model, n, "des-dp")], by[(model, n, "ps")]
            lines.append(f"| {model} | {n} | {d['compute'] * 1e3:.1f} / {t['compute'] * 1e3:.1f} / "
                         f"{p['compute'] * 1e3:.1f} | {d['samples_per_s']:,.0f} / {t['samples_per_s']:,.0f} | "
                         f"{t['samples_per_s'] / p['samples_per_s']:.2f}x |")
    return "\n".join(lines) + "\n"
