"""Validate des.cluster.timemodel on the emulated cluster: predicted vs measured step time, DES and PS.

    python scripts/bench_timemodel.py --np 2,4 --rates 30mbit,100mbit,1gbit --cpus share   # root (netbed)

For each N: the computation per step, timed three ways: with no-op collectives (``des.jobs.train
--comm noop``: the first model's term); DES with the processes kept in step by one 4-byte
allreduce per step (``--comm sync``); the PS as it trains, across unshaped emulated hosts
(``--ps-computation unshaped``, the default: its computation with all its meetings, waits and the
CPU its bytes cost, the bytes themselves at the veth's speed; no fixed cost is added), or with
every collective a real call without its payload (``meet``: on 4 hosts of 0.45 CPU that took more
CPU per step than the real runs, 0.364 s against 0.221 s at 1 Gbit/s: README). With ``--cpus``
(a CPU budget per emulated host, des.cluster.netbed) the computation is timed
across N unshaped hosts with that budget and the model is the plain sum of its terms, as on a
cluster; without it, under a local mpirun (``--compute-on netbed``: across unshaped hosts) with
``cores`` = the cores the hosts share: max(computation, computation x cores / N +
communication). All-to-alls at their calibrated bandwidth. The PS's ``overlap`` (the share of
its computation that runs while its bytes travel, ``--ps-overlap``) is calibrated at the PS
point whose communication weighs most and applied to every point. Each row also shows the plain
sum of the terms and the first model (no-op computation, every collective at the allreduce's
bandwidth), and the allreduce's time over its wire-time bound (1 MiB, calibrated).
``--repeats K`` runs every point K times and takes the median step time (one run of the PS on
this machine is not reproducible to 20 %: README). ``--modes`` limits the runs to DES or the PS.
``--reuse-netbed`` recomputes the table from the netbed runs and calibrations a previous run
left in --out (no netbed, no root). For each N and rate:
the netbed up; Horovod's cycle, the cost of a call within a phase and the effective bandwidth
(scripts/bench_collectives.py); one DES and one PS run, whose measured bytes (summaries) feed the
model; the predicted step time next to the measured one (global batch / samples/s). Writes
<out>/timemodel.json, .md and predicted_vs_measured.png.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from des.jobs import compare
from des.cluster import timemodel  # noqa: E402
from des.cluster.netbed import Netbed, parse_cpus  # noqa: E402


def calibrate(bed: Netbed, n: int, attempts: int = 3) -> dict:
    """bench_collectives on the netbed (retried: Open MPI's daemon start across the namespaces
    fails now and then, a segfault of orted before any of our code runs)."""
    cmd = bed.mpirun(n) + [sys.executable, os.path.join(ROOT, "scripts", "bench_collectives.py")]
    for attempt in range(attempts):
        done = subprocess.run(cmd, env=compare.launch_env(), cwd=ROOT, capture_output=True, text=True, timeout=900)
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        if done.returncode == 0 and lines:
            return json.loads(lines[-1])
        print(f"[timemodel] bench_collectives failed (attempt {attempt + 1} of {attempts}): "
              f"{done.stderr.strip().splitlines()[-1:] or ''}", flush=True)
    raise SystemExit(f"bench_collectives failed: {done.stderr[-2000:]}")


class _Saved:
    """Stands in for the netbed with ``--reuse-netbed``: the calibration a previous run measured."""

    def __init__(self, calibration: dict):
        self.calibration = calibration

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def traffic(mode: str, s: dict) -> dict:
    """The model's traffic from a run's summaries (the busiest process: steps are synchronous)."""
    if mode == "des":
        return timemodel.des_traffic(s["bytes_per_step_measured"])
    ranks = s["ranks"]
    if "lookups" not in s:
        raise SystemExit("a PS summary without 'lookups' (the tables it looks up, written since 2026-11-28): "
                         "run again without --reuse-compute")
    return timemodel.ps_traffic(s["lookups"], max(r["wire_out_bytes_per_step"] for r in ranks),
                                max(r["wire_in_bytes_per_step"] for r in ranks),
                                max(r["allreduce_payload_bytes_per_step"] for r in ranks) - 4)


def computation(mode: str, kind: str, n: int, a, data, run_args) -> tuple[float, float | None]:
    """The computation's step time: the median over ``a.repeats`` runs with ``--comm kind``
    (noop / sync / meet; ``unshaped``: the real collectives on unshaped links) of each run's step
    time (global batch / samples/s, itself a median over steps), and the median of their CPU
    seconds per step and process (None in older runs); with ``--reuse-compute`` the runs a
    previous run left in --out, where there are. Under
    a local mpirun, or with ``--compute-on netbed`` across N unshaped emulated hosts (the
    processes then wait for each other over TCP as in the measured runs; on this machine that
    fitted DES better at N=4 and the PS worse: README)."""
    times, cpus = [], []
    options = () if kind == "unshaped" else ("--comm", kind)
    for k in range(a.repeats):
        tag = f"-{kind}-n{n}{repeat_tag(k, a.repeats)}"
        saved = os.path.join(a.out, f"{a.model}-{mode}{tag}.json")
        if a.reuse_compute and os.path.exists(saved + ".rank0"):
            s = compare.load(saved, n)
        elif a.compute_on == "local" and a.cpus is None:
            s = compare.run(mode, a.model, data, run_args, a.out, options=options, tag=tag)
        else:
            with Netbed(n, rate=None, cpus=a.cpus, cpu_period_us=a.cpu_period_us) as bed:
                s = compare.run(mode, a.model, data, run_args, a.out, launcher=bed.mpirun(n),
                                options=options, tag=tag)
        times.append(step_seconds(s, a.batch))
        cpus.append(s.get("cpu_seconds_per_host_step"))     # compare.load: the mean over ranks
    return float(np.median(times)), median_or_none(cpus)


def cpu_cell(r: dict) -> str:
    """'0.41 (91 %) / 0.45 (46 %)': CPU seconds per step and process in the measured runs and in
    the computation runs, each with its share of the host's budget over its step time."""
    def one(cpu, step):
        if cpu is None:
            return "-"
        share = f" ({cpu / (r['budget'] * step):.0%})" if r.get("budget") else ""
        return f"{cpu:.3f}{share}"
    return f"{one(r.get('cpu_per_step'), r['measured'])} / {one(r.get('compute_cpu_per_step'), r['compute'])}"


def repeat_tag(k: int, repeats: int) -> str:
    """A run's file-name suffix: none with one run per point (the layout of earlier reports)."""
    return f"-r{k}" if repeats > 1 else ""


def apply_overlap(rows: list[dict], how: str) -> None:
    """The PS's predictions with the share of its computation that runs while its bytes travel
    (des.cluster.timemodel ``overlap``): ``how`` = a number, or "calibrate": from the PS point whose
    communication is the largest share of its terms (marked ``calibrates``), applied to all."""
    ps = [r for r in rows if r["mode"] == "ps"]
    if not ps:
        return
    if how == "calibrate":
        at = max(ps, key=lambda r: (r["fixed"] + r["bandwidth_term"]) / (r["compute"] + r["fixed"] + r["bandwidth_term"]))
        at["calibrates"] = True
        overlap = timemodel.calibrate_overlap(at["measured"], at["compute"], at["fixed"] + at["bandwidth_term"])
    else:
        overlap = float(how)
    for r in ps:
        t = timemodel.step_time(r["compute"], r["traffic"], r["n"], timemodel.Network(**r["network"]),
                                cores=r["cores"], overlap=overlap)
        r.update(overlap=overlap, predicted=t["total"], error=t["total"] / r["measured"] - 1)


def step_seconds(s: dict, batch: int) -> float:
    return batch / s["samples_per_second"]


def median_or_none(values: list) -> float | None:
    return None if not values or None in values else float(np.median(values))


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    """(the options, the modes to run in the order des, ps); a usage error without a mode or with
    --repeats below 1."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="deepfm")
    ap.add_argument("--preset", default="criteo-like")
    ap.add_argument("--rows", type=int, default=30_000)
    ap.add_argument("--batch", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--np", default="2,4")
    ap.add_argument("--rates", default="100mbit,300mbit,1gbit")
    ap.add_argument("--columnar", action="store_true", help="every run reads a columnar copy (des.data.convert)")
    ap.add_argument("--compute-on", choices=["local", "netbed"], default="local",
                    help="time the computation under a local mpirun (default) or across unshaped emulated hosts")
    ap.add_argument("--cores", type=int, default=os.cpu_count(),
                    help="the cores every emulated host shares (default: this machine's; unused with --cpus)")
    ap.add_argument("--cpus", default=None,
                    help="each emulated host's own CPU budget (des.cluster.netbed: a number of CPUs or 'share' = "
                         "0.9 x cores / N); the computation is then timed across unshaped hosts with the same budget, and the model "
                         "is the plain sum of its terms, as on a cluster")
    ap.add_argument("--cpu-period-us", type=int, default=None,
                    help="with --cpus: the CFS period of a host's CPU quota in us (des.cluster.netbed; default: the "
                         "shortest with a quota >= 1000 us, at least 2500)")
    ap.add_argument("--ps-computation", choices=["unshaped", "meet"], default="unshaped",
                    help="the PS's computation term: its real runs across unshaped hosts (default), or every "
                         "collective without its payload (--comm meet)")
    ap.add_argument("--ps-overlap", default="calibrate",
                    help="the share of the PS's computation that runs while its bytes travel (des.cluster.timemodel): "
                         "a number, or 'calibrate' (default) from the PS point whose communication weighs most")
    ap.add_argument("--modes", default="des,ps", help="the modes to run and model (default both)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="runs per point (each measured and each computation run): the model and the table take "
                         "the median of their step times (a run's step time is already a median over its steps)")
    ap.add_argument("--out", default="reports/timemodel")
    ap.add_argument("--reuse-compute", action="store_true",
                    help="take the computation runs' summaries a previous run left in --out")
    ap.add_argument("--reuse-netbed", action="store_true",
                    help="take the netbed runs and calibrations a previous run left in --out (timemodel.json)")
    a = ap.parse_args(argv)
    modes = [m for m in ("des", "ps") if m in a.modes.split(",")]
    if not modes or a.repeats < 1:
        ap.error("--modes takes des and/or ps, --repeats at least 1")
    return a, modes


def prepare(a: argparse.Namespace) -> tuple[str, argparse.Namespace]:
    """(the data every run reads, columnar with --columnar; des.jobs.compare.run's options, ``np``
    set per N)."""
    data = compare.ensure_data(a.preset, a.rows, 0, os.path.join(a.out, "data"))
    run_args = argparse.Namespace(batch=a.batch, steps=a.steps, holdout=1000, dim=8, hidden="128,64",
                                  optimizer="adam", lr=0.002, shuffle_buffer=5000, cache_size="10%", np=0,
                                  format=None, eval_data=None)
    if a.columnar:
        from des.data.resolve import metadata
        meta = metadata(data)
        data, _ = compare.ensure_columnar([data], meta["format"], None, meta)
        run_args.format = "columnar"
    return data, run_args


def netbed_runs(a: argparse.Namespace, mode: str, n: int, rate: str, data: str, run_args: argparse.Namespace,
                bed: Netbed | _Saved) -> list[dict]:
    """The --repeats runs of ``mode`` on the netbed at ``rate`` (with --reuse-netbed: a previous
    run's, from --out)."""
    runs = []
    for k in range(a.repeats):
        tag = f"-n{n}-{rate}{repeat_tag(k, a.repeats)}"
        runs.append(compare.load(os.path.join(a.out, f"{a.model}-{mode}{tag}.json"), n)
                    if a.reuse_netbed else
                    compare.run(mode, a.model, data, run_args, a.out, launcher=bed.mpirun(n), tag=tag))
    return runs


def networks(cal: dict, rate: str) -> tuple[timemodel.Network, timemodel.Network, float]:
    """(the first model's network, the model's, the allreduce's time over its wire time at
    ``rate``) from the netbed's calibration ``cal``."""
    # the first model: no-op computation, every collective at the allreduce's bandwidth;
    # the model now: computation kept in step (--comm sync), all-to-alls at their own bandwidth
    old = timemodel.Network(cal["effective_bandwidth_Bps_1MiB"], cycle=cal["cycle"],
                            call=max(0.0, cal["per_call_in_a_phase"]))
    net = timemodel.Network(old.bandwidth, cycle=old.cycle, call=old.call,
                            alltoall_bandwidth=cal.get("effective_alltoall_Bps_1MiB"))
    bound = timemodel.parse_rate(rate) / net.bandwidth      # the allreduce's time / its wire time
    return old, net, bound


def model_row(a: argparse.Namespace, mode: str, n: int, rate: str, runs: list[dict], timed: dict, cal: dict,
              nets: tuple[timemodel.Network, timemodel.Network, float], budget: float | None) -> dict:
    """A row of the table: ``mode``'s measured step at N = ``n`` and ``rate`` (``runs``) against the
    model's prediction from the computation (``timed``: {(mode, kind): (seconds, CPU)}), the runs'
    bytes and the netbed's calibration ``cal`` (``nets``: its networks), with the plain sum and the
    first model beside it."""
    compute = {key: seconds for key, (seconds, _) in timed.items()}
    old, net, bound = nets
    s = runs[0]                  # the bytes: the same in every run (the ids are)
    load = traffic(mode, s)
    first = timemodel.step_time(compute[mode, "noop"], load, n, old)
    # DES: its computation kept in step + its one collective; the PS: its computation
    # with every meeting (real runs on unshaped links, or --comm meet), so no fixed cost on
    # top, + its bytes
    kind, model_net = (("sync", net) if mode == "des" else
                       (a.ps_computation, dataclasses.replace(net, cycle=0.0, call=0.0)))
    cores = None if a.cpus is not None else a.cores     # a budget each: the plain sum
    pred = timemodel.step_time(compute[mode, kind], load, n, model_net, cores=cores)
    summed = timemodel.step_time(compute[mode, kind], load, n, model_net)
    measured_runs = [step_seconds(r, a.batch) for r in runs]
    measured = float(np.median(measured_runs))
    cpu = median_or_none([r.get("cpu_seconds_per_host_step") for r in runs])
    return dict(n=n, rate=rate, mode=mode, measured=measured, measured_runs=measured_runs,
                error=pred["total"] / measured - 1, predicted=pred["total"], computation=kind,
                compute=pred["compute"], own_compute=pred["own_compute"], fixed=pred["fixed"],
                bandwidth_term=pred["bandwidth"], cores=cores, cpus_per_host=a.cpus,
                effective_bandwidth=net.bandwidth, alltoall_bandwidth=net.alltoall_bandwidth,
                allreduce_over_wire_bound=bound, cycle=net.cycle, call=net.call,
                sum_predicted=summed["total"], sum_error=summed["total"] / measured - 1,
                noop_predicted=first["total"], noop_error=first["total"] / measured - 1,
                noop_compute=compute[mode, "noop"], calibration=cal, overlap=0.0,
                traffic=load, network=dataclasses.asdict(model_net),
                wire_bytes_per_host_step=s.get("wire_bytes_per_host_step"),
                cpu_per_step=cpu, compute_cpu_per_step=timed[mode, kind][1], budget=budget)


def measure(a: argparse.Namespace, modes: list[str], data: str, run_args: argparse.Namespace) -> list[dict]:
    """A row per (N, rate, mode): for each N the computation runs, then for each rate the netbed up
    (or a previous run's calibration with --reuse-netbed), its calibration and the measured runs."""
    rows = []
    saved = {}
    if a.reuse_netbed:
        with open(os.path.join(a.out, "timemodel.json")) as fh:
            saved = {(r["n"], r["rate"]): r["calibration"] for r in json.load(fh)}
    for n in [int(x) for x in a.np.split(",")]:
        run_args.np = n
        timed = {(m, kind): computation(m, kind, n, a, data, run_args)
                 for m, kinds in (("des", ("noop", "sync")), ("ps", ("noop", a.ps_computation)))
                 if m in modes for kind in kinds}
        budget = parse_cpus(a.cpus, n)
        for rate in a.rates.split(","):
            bed = (_Saved(saved[n, rate]) if a.reuse_netbed else
                   Netbed(n, rate=rate, cpus=a.cpus, cpu_period_us=a.cpu_period_us))
            with bed:
                cal = bed.calibration if a.reuse_netbed else calibrate(bed, n)
                nets = networks(cal, rate)
                for mode in modes:
                    runs = netbed_runs(a, mode, n, rate, data, run_args, bed)
                    rows.append(model_row(a, mode, n, rate, runs, timed, cal, nets, budget))
    return rows


def print_rows(rows: list[dict]) -> None:
    """A line per row: measured, predicted and its terms, the plain sum and the no-op model."""
    for r in rows:
        print(f"[timemodel] N={r['n']} {r['rate']:>8} {r['mode']:<3}: measured {r['measured'] * 1e3:7.1f} ms, predicted "
              f"{r['predicted'] * 1e3:7.1f} ms ({r['error']:+.1%}) = max(compute ({r['computation']}) "
              f"{r['compute'] * 1e3:.1f}, {1 - r['overlap']:.2f} x {r['own_compute'] * 1e3:.1f} + fixed "
              f"{r['fixed'] * 1e3:.1f} + bytes {r['bandwidth_term'] * 1e3:.1f}){' [calibrates the overlap]' if r.get('calibrates') else ''}; "
              f"the sum {r['sum_predicted'] * 1e3:.1f} ({r['sum_error']:+.1%}); the no-op model "
              f"{r['noop_predicted'] * 1e3:.1f} ({r['noop_error']:+.1%})", flush=True)


def write_report(a: argparse.Namespace, rows: list[dict]) -> None:
    """Writes timemodel.json and timemodel.md (printed too)."""
    with open(os.path.join(a.out, "timemodel.json"), "w") as fh:
        json.dump(rows, fh, indent=1)
    head = ("| N | rate | mode | measured ms | predicted ms | error | computation | its ms | with a core each | "
            "fixed | bytes/bw | overlap | eff. MB/s allreduce / all-to-all | allreduce / wire bound | the sum ms | its error | "
            "no-op model ms | its error | CPU s/step: run / computation (share of the budget) |")
    md = [f"# Time model vs the netbed: {a.model}, {a.preset}{' (columnar)' if a.columnar else ''}, global batch "
          f"{a.batch}, " + (f"a CPU budget of {a.cpus} per host" if a.cpus is not None else f"{a.cores} cores shared")
          + (f"; every step time the median of {a.repeats} runs (measured: their range)" if a.repeats > 1 else ""),
          "", compare.command_line("python scripts/bench_timemodel.py") + " The netbed's emulated hosts share "
          "its cores.", "", head, "|" + "---|" * 19]
    for r in rows:
        a2a = r["alltoall_bandwidth"] or r["effective_bandwidth"]
        spread = (f" ({min(r['measured_runs']) * 1e3:.0f}–{max(r['measured_runs']) * 1e3:.0f})"
                  if len(r.get("measured_runs", [])) > 1 else "")
        md.append(f"| {r['n']} | {r['rate']} | {r['mode']} | {r['measured'] * 1e3:.1f}{spread} | {r['predicted'] * 1e3:.1f} | "
                  f"{r['error']:+.1%} | {r['computation']} | {r['compute'] * 1e3:.1f} | {r['own_compute'] * 1e3:.1f} | "
                  f"{r['fixed'] * 1e3:.1f} | {r['bandwidth_term'] * 1e3:.1f} | "
                  f"{r['overlap']:.2f}{' (calibrated here)' if r.get('calibrates') else ''} | "
                  f"{r['effective_bandwidth'] / 1e6:.1f} / "
                  f"{a2a / 1e6:.1f} | {r['allreduce_over_wire_bound']:.2f} | {r['sum_predicted'] * 1e3:.1f} | "
                  f"{r['sum_error']:+.1%} | {r['noop_predicted'] * 1e3:.1f} | {r['noop_error']:+.1%} | "
                  f"{cpu_cell(r)} |")
    with open(os.path.join(a.out, "timemodel.md"), "w") as fh:
        fh.write("\n".join(md) + "\n")
    print("\n".join(md))


def plot(a: argparse.Namespace, rows: list[dict]) -> None:
    """predicted_vs_measured.png: a point per row, the ±20 % band and the point that calibrates the overlap."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(5.5, 5))
    top = max(max(r["measured"], r["predicted"]) for r in rows) * 1.1e3
    ax.plot([0, top], [0, top], "k-", lw=0.8)
    ax.fill_between([0, top], [0, 0.8 * top], [0, 1.2 * top], color="0.9", label="±20 %")
    for mode, marker in (("des", "o"), ("ps", "s")):
        for n, color in ((2, "tab:blue"), (4, "tab:red")):
            pts = [r for r in rows if r["mode"] == mode and r["n"] == n]
            ax.scatter([r["measured"] * 1e3 for r in pts], [r["predicted"] * 1e3 for r in pts], marker=marker,
                       color=color, label=f"{mode.upper()} N={n}")
    for r in rows:
        if r.get("calibrates"):
            ax.scatter([r["measured"] * 1e3], [r["predicted"] * 1e3], marker="o", s=160, facecolors="none",
                       edgecolors="k", label="calibrates the PS's overlap")
    ax.set(xlabel="measured step time on the netbed (ms)", ylabel="predicted (ms)", xlim=(0, top), ylim=(0, top),
           title=f"{a.model}, {a.preset}, batch {a.batch}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(a.out, "predicted_vs_measured.png"), dpi=110)


def main(argv=None) -> int:
    a, modes = parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    data, run_args = prepare(a)
    rows = measure(a, modes, data, run_args)
    apply_overlap(rows, a.ps_overlap)
    print_rows(rows)
    write_report(a, rows)
    plot(a, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
