"""Benchmark DES against the peer users pick today, TFRA's own all-to-all embedding
(scripts/peer_tfra.py): samples/s, CPU seconds per step per process and seconds to the first
step of a DeepFM (or W&D) under mpirun, for each (N, hidden) given; DES with its joined tables
(des.train's default) and its defaults (``des``: the tail, the first Dense and the communicator
chosen by cost, the report saying which and why), the replicated or the data-parallel tail, and
this project's PS mode (``--mode ps``, joined tables). One run, medians of ``--repeats`` launches; prints a Markdown
table and writes it to ``--report``.

    .venv/bin/python scripts/bench_peer.py --rows 200000 --batch 4096 --steps 40 --repeats 3

``--preset wide`` (~950 features per sample, libffm) reads a columnar copy of the data in every
system (des.data.convert: a text parser reading the global batch would decide DES's speed there).
``--netbed RATE``: on the emulated cluster (des.netbed: one host per process, a CPU budget
``--cpus`` each); the report then has each system's bytes sent per host and step, from the
interface counters:

    .venv/bin/python scripts/bench_peer.py --preset wide --models deepfm,wdl --rows 30000 --batch 2048 \
        --steps 10 --repeats 2 --configs '4:128,64' --netbed 15mbit --report reports/peer_wide_netbed.md

``--systems tfra,des-user,des-user-rows``: next to the peer, a user's own DeepFM of one TFRA table per
field through ``des.transform`` with the defaults, or a data-parallel tail with the first Dense by rows
(scripts/user_deepfm.py; criteo-like preset only):

    .venv/bin/python scripts/bench_peer.py --rows 200000 --batch 4096 --steps 40 --repeats 3 --configs '4:128,64' \
        --systems tfra,des-user,des-user-rows --netbed 100mbit --report reports/peer_user_netbed.md

Steps: 40 (a launch's median step) so that the tables hold most keys, as in a long run; with 12,
most steps insert many new keys and the medians move by 10-20% from launch to launch.
"""
import contextlib
import json
import os
import statistics
import sys
import time

from bench_des import ROOT, config_parser, launch, preset_data, run, write_report

sys.path.insert(0, ROOT)
from des.cluster.netbed import Netbed  # noqa: E402


SYSTEMS = {"tfra": "TFRA HvdAllToAllEmbedding",
           "des": "DES, des.train's defaults (tail, first Dense and communicator chosen by cost)",
           "des-replicated": "DES, replicated tail (--comm auto: mpi4py, settled by des.transform)",
           "des-replicated-horovod": "DES, replicated tail, Horovod (--comm horovod)",
           "des-replicated-mpi4py": "DES, replicated tail, mpi4py's allreduce waited sleeping (--comm mpi4py)",
           "des-data-parallel": "DES, data-parallel tail", "des-rows": "DES, data-parallel tail, first Dense by rows",
           "ps": "PS (this project)", "des-user": "DES, a user's DeepFM via des.transform, defaults",
           "des-user-rows": "DES, a user's DeepFM via des.transform, data-parallel tail, first Dense by rows",
           "des-user-operators": "DES, a user's DeepFM via des.transform, operators split (first_layer=operators)",
           "des-user-ps": "a user's DeepFM via des.transform(mode=ps): this project's PS",
           "des-user-auto": "a user's DeepFM via des.transform(mode=auto, sample=first batch)",
           "des-user-onetable": "DES, a user's one-table DeepFM (TFRA's style) via des.transform, defaults",
           "des-user-mpi4py": "DES, a user's DeepFM via des.transform, defaults, on the mpi4py communicator",
           "des-user-horovod": "DES, a user's DeepFM via des.transform, defaults, on Horovod's communicator",
           "des-rows-mpi4py": "DES, data-parallel tail, first Dense by rows, --comm mpi4py"}
USER_OPTIONS = {"des-user": "", "des-user-rows": "first_layer=operators,tail=data_parallel,first_dense=rows",
                "des-user-operators": "first_layer=operators", "des-user-ps": "mode=ps",
                "des-user-auto": "mode=auto"}   # des.Options of each


def peer(n, model, data, a, out, launcher=None, script="peer_tfra.py", extra=()):
    """``script`` (scripts/peer_tfra.py, or scripts/user_deepfm.py with ``extra`` arguments) on ``n``
    processes under mpirun, or ``launcher`` (a netbed's mpirun); rank 0's summary."""
    args = [sys.executable, os.path.join(ROOT, "scripts", script), "--data", data, "--batch", str(a.batch),
            "--steps", str(a.steps), "--dim", str(a.dim), "--hidden", a.hidden, "--model", model, "--summary-json", out,
            *extra]
    launch(list(launcher or ["mpirun", "-np", str(n), "--oversubscribe", "--bind-to", "none"]) + args,
           netbed=bool(launcher))
    return json.load(open(out + ".rank0" if n > 1 else out))


def user(n, model, data, a, out, launcher=None, options="", tables="per-field", comm="auto"):
    """A user's DeepFM (or W&D) of TFRA tables through des.transform (scripts/user_deepfm.py), every
    process reading the global batch; ``options``: des.Options as KEY=VALUE,... (empty: the defaults);
    ``tables``: per-field or one (TFRA's one-table style); ``comm``: auto (des.transform's), mpi4py or horovod."""
    return peer(n, model, data, a, out, launcher, "user_deepfm.py",
                (("--options", options) if options else ()) + ("--tables", tables, "--comm", comm))


def launchers_for(n, model, data, reader, a, launcher):
    """Each system's launch of one configuration: a function of the summary's path."""
    def des_run(out, extra):
        return run(n, "des", model, data, a, out, (*extra, *reader), launcher)
    return {"tfra": lambda out: peer(n, model, data, a, out, launcher),
            "des": lambda out: des_run(out, ()),
            "des-replicated": lambda out: des_run(out, ("--tail", "replicated")),
            "des-replicated-mpi4py": lambda out: des_run(out, ("--tail", "replicated", "--comm", "mpi4py")),
            "des-replicated-horovod": lambda out: des_run(out, ("--tail", "replicated", "--comm", "horovod")),
            "des-data-parallel": lambda out: des_run(out, ("--tail", "data_parallel", "--first-dense", "partials")),
            "des-rows": lambda out: des_run(out, ("--tail", "data_parallel", "--first-dense", "rows")),
            "ps": lambda out: run(n, "ps", model, data, a, out, reader, launcher),
            **{key: (lambda out, o=o: user(n, model, data, a, out, launcher, o)) for key, o in USER_OPTIONS.items()},
            "des-user-onetable": lambda out: user(n, model, data, a, out, launcher, tables="one"),
            "des-user-mpi4py": lambda out: user(n, model, data, a, out, launcher, comm="mpi4py"),
            "des-user-horovod": lambda out: user(n, model, data, a, out, launcher, comm="horovod"),
            "des-rows-mpi4py": lambda out: des_run(out, ("--tail", "data_parallel", "--first-dense", "rows",
                                                         "--comm", "mpi4py"))}


def checked_models(a, chosen: list[str]) -> list[str]:
    """--models as a list, refusing what the chosen systems cannot run."""
    users = set(USER_OPTIONS) | {"des-user-onetable", "des-user-mpi4py", "des-user-horovod"}
    if a.preset == "wide" and set(chosen) & users:
        raise SystemExit("--systems des-user*: the user's DeepFM (scripts/user_deepfm.py) has one-hot fields only; "
                         "use --preset criteo-like")
    models = a.models.split(",")
    if set(models) - {"deepfm", "wdl"}:
        raise SystemExit(f"--models {a.models}: deepfm and/or wdl")
    return models


def chosen_notes(config: str, runs: dict) -> list[str]:
    """What mode auto chose (its report's line) and what des.train's defaults chose (the first
    layer, the tail, the first Dense, from its summary), from rank 0 of each launch, once each."""
    notes = []
    for name, rs in runs.items():
        chose = sorted({line for r in rs for line in r.get("report", []) if "mode auto:" in line})
        notes += [f"- {config}, {name}: {line.strip()}" for line in chose]
        if name == SYSTEMS["des"]:
            notes += sorted({f"- {config}, {name}: first layer {r.get('first_layer')} "
                             f"({r.get('first_layer_reason') or 'not chosen by cost'}); tail {r.get('tail')} ("
                             + (r.get("tail_reason") or ("the first layer by rows runs in it"
                                                         if r.get("first_layer") == "rows" else "pinned"))
                             + f"); first Dense by rows: {', '.join(r.get('first_dense_by_rows') or []) or 'none'}"
                             for r in rs})
    return notes


def launch_lines(config: str, runs: dict) -> list[str]:
    """The spread, one line per system: each launch's samples/s and its ratio to TFRA's launch of
    that round."""
    peer = [r.get("samples_per_second", float("nan")) for r in runs["TFRA HvdAllToAllEmbedding"]]
    lines = []
    for name, rs in runs.items():
        each = [r.get("samples_per_second", float("nan")) for r in rs]
        lines.append(f"- {config}, {name}: " + ", ".join(f"{v:,.0f}" for v in each)
                     + ("" if name == "TFRA HvdAllToAllEmbedding" else
                        " (vs TFRA's launch of the round: " + ", ".join(f"{v / p:.2f}x" for v, p in zip(each, peer)) + ")"))
    return lines


def main():
    ap = config_parser("2:128,64;4:128,64;4:400,400,400", "peer.md")
    ap.add_argument("--systems", default=",".join(SYSTEMS),
                    help=f"which systems to launch, comma-separated, of {','.join(SYSTEMS)} (tfra is the baseline)")
    ap.add_argument("--models", default="deepfm", help="deepfm and/or wdl, comma-separated")
    ap.add_argument("--preset", default="criteo-like", choices=["criteo-like", "wide"])
    ap.add_argument("--netbed", default=None, metavar="RATE", help="run on the emulated cluster at this rate")
    ap.add_argument("--cpus", default="share", help="--netbed: each host's CPU budget")
    ap.add_argument("--columnar", action="store_true",
                    help="criteo-like: every system reads a columnar copy (des.data.convert) instead of the text")
    a = ap.parse_args()
    chosen = a.systems.split(",")
    if "tfra" not in chosen or set(chosen) - set(SYSTEMS):
        raise SystemExit(f"--systems {a.systems}: a comma-separated subset of {','.join(SYSTEMS)} with tfra")
    models = checked_models(a, chosen)
    data, reader, tmp = preset_data(a.preset, a.rows, "peer_runs", columnar=a.columnar)
    where = (f"the netbed (des.netbed: one host per process at {a.netbed}, CPU budget {a.cpus} each; "
             f"wire = bytes a host sent on its interface per step, median, rank 0's host)" if a.netbed else
             "this machine (2 shared cores; N processes oversubscribe them, one TF thread each)")
    data_name = ("wide synthetic data (~950 features per sample, libffm read from a columnar copy by every system)"
                 if a.preset == "wide" else "criteo-like synthetic data"
                 + (", read from a columnar copy by every system" if a.columnar else ""))
    lines = [f"# DES vs TFRA's all-to-all embedding ({', '.join(models)}, {data_name}, {a.rows} rows)", "",
             f"`scripts/bench_peer.py --preset {a.preset} --models {a.models} --rows {a.rows} --batch {a.batch} "
             f"--steps {a.steps} --repeats {a.repeats} --configs '{a.configs}' --systems {a.systems}"
             + (f" --netbed {a.netbed} --cpus {a.cpus}" if a.netbed else "") + (" --columnar" if a.columnar else "")
             + f"`, {time.strftime('%Y-%m-%d')}, {where}. Global batch {a.batch}, dim {a.dim}; median over "
             f"launches of each launch's median step (the first step excluded); the launches go round-robin over "
             f"the systems. DES: joined tables (one per process: each field's embedding and linear weight in "
             f"one row); the peer: "
             f"HvdAllToAllEmbedding, all fields in one table per width, Adam, dense gradients averaged by "
             f"Horovod (scripts/peer_tfra.py). PS: this project's `--mode ps`, joined tables, its byte check "
             f"on 2 steps (scripts/bench_des.py). DES via des.transform: a user's own model of one TFRA table per "
             f"field, transformed with des.Options' defaults (or those named) and sample= its first global batch, "
             f"every process reading the global batch (scripts/user_deepfm.py).", "",
             "| model | N | hidden | system | samples/s | CPU s/step/process | first step (s) | wire B/step/host "
             "| samples/s vs TFRA |",
             "|---|---|---|---|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    notes = []                         # what mode auto chose, per configuration
    launches = []                      # samples/s of each launch, per system
    for model in models:
        for config in a.configs.split(";"):
            n, a.hidden = config.split(":")
            n = int(n)
            bed = Netbed(n, rate=a.netbed, cpus=a.cpus) if a.netbed else contextlib.nullcontext()
            with bed:
                launcher = bed.mpirun(n) if a.netbed else None
                launchers = launchers_for(n, model, data, reader, a, launcher)
                systems = {SYSTEMS[key]: launchers[key] for key in SYSTEMS if key in chosen}
                runs = {name: [] for name in systems}
                for r in range(a.repeats):      # round-robin, so that a drift in the machine's load hits every system
                    for k, (name, start) in enumerate(systems.items()):
                        runs[name].append(start(os.path.join(tmp, f"{model}_{n}_{k}_{r}.json")))
            got = {name: [statistics.median(r.get(key, float("nan")) for r in rs)
                          for key in ("samples_per_second", "cpu_seconds_per_step", "seconds_to_first_step",
                                      "wire_bytes_per_step")]
                   for name, rs in runs.items()}
            notes += chosen_notes(f"{model}, N = {n}, {a.hidden}", runs)
            base = got["TFRA HvdAllToAllEmbedding"][0]
            launches += launch_lines(f"{model}, N = {n}, {a.hidden}", runs)
            for name, (sps, cpu, first, wire) in got.items():
                wire = f"{wire:,.0f}" if wire == wire else ""
                line = (f"| {model} | {n} | {a.hidden} | {name} | {sps:,.0f} | {cpu:.3f} | {first:.1f} | {wire} | "
                        f"{sps / base:.2f}x |")
                lines.append(line)
                print(line, flush=True)
    lines += ["", "Samples/s of each launch, in launch order (round r launches every system once):", "", *launches]
    print("\n".join(lines[-len(launches) - 2:]), flush=True)
    if notes:
        lines += ["", "What mode auto and the defaults chose (from rank 0 of each launch):", "", *notes]
        print("\n".join(lines[-len(notes) - 2:]), flush=True)
    write_report(a.report, lines)


if __name__ == "__main__":
    main()
