"""Benchmark modern architectures DES splits - DCN-v2, AutoInt, DLRM - on criteo-like data: a user's
Keras model through ``des.transform`` with no options (``sample=`` its first global batch), the same architecture over TFRA's
``HvdAllToAllEmbedding`` (data-parallel), and the user's model with every table whole on every
process (classic Horovod data parallelism over hashed Keras tables); per architecture and
(N, hidden): samples/s, CPU s/step/process, seconds to the first step, bytes sent per host and step
(``--netbed``) and table rows held per process. Processes: scripts/arch_runner.py. One run, medians
of ``--repeats`` launches; prints a Markdown table and writes it to ``--report``.

    .venv/bin/python scripts/bench_arch.py --rows 200000 --batch 4096 --steps 40 --repeats 3

Before the sweep, on this machine, each architecture's des at N = 1 (no mpirun) and N = 2 after
``--check-steps`` steps of the same batches: their train losses (equal within 1e-5 by DES's
contract) go into the report's notes. ``--netbed RATE``: on the emulated cluster (des.netbed: one
host per process, a CPU budget ``--cpus`` each), as scripts/bench_peer.py:

    .venv/bin/python scripts/bench_arch.py --rows 200000 --batch 4096 --steps 40 --repeats 3 \
        --configs '4:128,64' --netbed 100mbit --report reports/arch_netbed.md
"""
import contextlib
import json
import os
import platform
import statistics
import sys
import time

from bench_des import ROOT, config_parser, launch, preset_data, write_report

sys.path.insert(0, ROOT)
from des.cluster.netbed import Netbed  # noqa: E402

SYSTEMS = {"des": "DES: the user's model via des.transform, defaults",
           "des-spec": "DES: the user's model via des.transform, defaults, spec= the data's cardinalities",
           "des-offsets": "DES: one Keras table of every field by offsets (DLRM ports), split by key range",
           "tfra": "TFRA HvdAllToAllEmbedding, data-parallel",
           "replicated": "replicated: Horovod data-parallel, whole hashed Keras tables"}
ARCHS = {"dcn": "DCN-v2", "autoint": "AutoInt", "dlrm": "DLRM"}
KEYS = ("samples_per_second", "cpu_seconds_per_step", "seconds_to_first_step", "wire_bytes_per_step")


def runner(system, arch, n, data, a, out, launcher=None, steps=None) -> list[dict]:
    """scripts/arch_runner.py as ``system`` on ``n`` processes (mpirun when n > 1, or ``launcher``: a
    netbed's mpirun); every rank's summary."""
    args = [sys.executable, os.path.join(ROOT, "scripts", "arch_runner.py"), "--system", system, "--arch", arch,
            "--data", data, "--batch", str(a.batch), "--steps", str(steps or a.steps), "--dim", str(a.dim),
            "--hidden", a.hidden, "--vocab", str(a.vocab), "--summary-json", out]
    if launcher:
        args = list(launcher) + args
    elif n > 1:
        args = ["mpirun", "-np", str(n), "--oversubscribe", "--bind-to", "none"] + args
    launch(args, netbed=bool(launcher))
    return [json.load(open(out if n == 1 else f"{out}.rank{r}")) for r in range(n)]


def check(arch, data, a, tmp) -> str:
    """des at N = 1 and N = 2 on this machine after ``a.check_steps`` steps: a note with both losses."""
    losses = [runner("des", arch, n, data, a, os.path.join(tmp, f"check_{arch}_{n}.json"), steps=a.check_steps)
              [0]["train_loss"] for n in (1, 2)]
    diff = abs(losses[0] - losses[1])
    return (f"{ARCHS[arch]}: des train loss after {a.check_steps} steps on this machine, N = 1 {losses[0]:.8f}, N = 2 "
            f"{losses[1]:.8f}, |diff| {diff:.1e} ({'within' if diff <= 1e-5 else 'NOT within'} 1e-5)")


def summarize(launches: list[list[dict]]) -> dict:
    """Medians over launches of rank 0's samples/s, first step and wire bytes, of the mean CPU
    s/step over ranks; table rows held per process (min and max over the last launch's ranks)."""
    med = lambda xs: statistics.median(xs)  # noqa: E731
    got = {k: med(ranks[0].get(k, float("nan")) for ranks in launches) for k in KEYS}
    got["cpu_seconds_per_step"] = med(statistics.mean(r["cpu_seconds_per_step"] for r in ranks) for ranks in launches)
    rows = [r["rows_held"] for r in launches[-1]]
    got["rows"] = f"{min(rows):,}" if min(rows) == max(rows) else f"{min(rows):,}-{max(rows):,}"
    return got


def des_note(arch, n, ranks, system: str = "des") -> str:
    """One line: what des.transform chose on rank 0 and whether any table was left whole."""
    d = ranks[0]["des"]
    whole = sorted({t for r in ranks for t in r["des"]["unsubstituted"]})
    subs = ", ".join(f"{rule} x{k}" for rule, k in d["substitutions"].items())
    return (f"{ARCHS[arch]}, N = {n}: {system} chose tail={d['tail']}, field rows={d['field_rows']}"
            + (f" (floats/sample by rank {d['by_samples']})" if d["by_samples"] else "")
            + (f", first Dense by rows {d['by_rows']}" if d["by_rows"] else "")
            + f"; substitutions: {subs}; " + (d["link"] + "; " if d["link"] else "")
            + (f"tables LEFT WHOLE: {', '.join(whole)}" if whole else "no table left whole")
            + "".join(f"; {line}" for line in d.get("big_fields", []))
            + "".join(f"; rule not applied: {r}" for r in d["rejections"]))


def header(a) -> list[str]:
    """The report's title, command line, date, machine and what each system is."""
    where = (f"the netbed (des.netbed: one host per process at {a.netbed}, CPU budget {a.cpus} each; wire = bytes a "
             f"host sent on its interface per step, median, rank 0's host)" if a.netbed else
             f"this machine ({platform.node()}, {os.cpu_count()} shared cores, {platform.machine()}; N processes "
             f"oversubscribe them, one TF thread each)")
    return [f"# DCN-v2, AutoInt and DLRM: DES vs TFRA's all-to-all embedding vs replicated tables "
            f"({a.preset} synthetic data, {a.rows} rows" + (", read from a columnar copy by every system" if a.columnar
                                                             else "") + ")", "",
            f"`scripts/bench_arch.py --preset {a.preset} --rows {a.rows} --batch {a.batch} --steps {a.steps} --repeats {a.repeats} "
            f"--configs '{a.configs}' --archs {a.archs} --systems {a.systems} --vocab {a.vocab} --check-steps "
            f"{a.check_steps}" + (f" --netbed {a.netbed} --cpus {a.cpus}" if a.netbed else "")
            + (" --columnar" if a.columnar else "")
            + f"`, {time.strftime('%Y-%m-%d %H:%M')}, {where}. Global batch {a.batch}, dim {a.dim}, the 39 sparse "
            f"fields; median over launches of each launch's median step (the first excluded); launches go "
            f"round-robin over the systems. CPU: mean over a launch's processes. Rows: table rows a process "
            f"holds at the end (min-max over processes). des: one TFRA table per field, des.transform(model, sample=the "
            f"first global batch) with no options (the plan balances the fields by their distinct ids in it), "
            f"every process reads the global batch. des-spec: the same with spec= the data's feature spec, whose "
            f"cardinalities size the fields (a field with more than an even share of all fields' rows and at least "
            f"des.Options().stripe_min_rows is split by key stripe over every process). tfra: one HvdAllToAllEmbedding (keys slot << 55 | "
            f"id), each process parses its rows, DynamicEmbeddingOptimizer(legacy Adam(1e-3), synchronous=True). "
            f"replicated: Keras Embedding({a.vocab}, {a.dim}) per field over ids mod {a.vocab} (hashed: colliding "
            f"ids share a row; every table whole on every process), each process its rows, "
            f"horovod.tensorflow.keras.DistributedOptimizer(legacy Adam(1e-3)); Keras's Adam decays a dense "
            f"table's slots in full every step. des-offsets: the user's model with ONE Keras Embedding(fields x "
            f"{a.vocab}, {a.dim}) read as ids mod {a.vocab} + per-field offsets (DLRM / pytorch-fm ports), legacy "
            f"Adam(1e-3), des.transform(model) with no options: the table split by key range, every process reads "
            f"the global batch. Processes: scripts/arch_runner.py.", "",
            "| arch | N | hidden | system | samples/s | CPU s/step/process | first step (s) | wire B/step/host "
            "| table rows/process | samples/s vs TFRA |",
            "|---|---|---|---|---|---|---|---|---|---|"]


def sweep(arch, n, data, a, tmp, chosen) -> tuple[list[str], list[str]]:
    """Every chosen system on one (arch, N, hidden): the table's lines and des's notes."""
    bed = Netbed(n, rate=a.netbed, cpus=a.cpus) if a.netbed else contextlib.nullcontext()
    runs = {key: [] for key in chosen}
    with bed:
        launcher = bed.mpirun(n) if a.netbed else None
        for r in range(a.repeats):       # round-robin, so that a drift in the machine's load hits every system
            for key in chosen:
                runs[key].append(runner(key, arch, n, data, a, os.path.join(tmp, f"{arch}_{n}_{key}_{r}.json"),
                                        launcher))
    got = {key: summarize(rs) for key, rs in runs.items()}
    base = got["tfra"]["samples_per_second"] if "tfra" in got else float("nan")
    lines = []
    for key, g in got.items():
        wire = f"{g['wire_bytes_per_step']:,.0f}" if g["wire_bytes_per_step"] == g["wire_bytes_per_step"] else ""
        lines.append(f"| {ARCHS[arch]} | {n} | {a.hidden} | {key} | {g['samples_per_second']:,.0f} | "
                     f"{g['cpu_seconds_per_step']:.3f} | {g['seconds_to_first_step']:.1f} | {wire} | {g['rows']} | "
                     f"{g['samples_per_second'] / base:.2f}x |")
        print(lines[-1], flush=True)
    return lines, [des_note(arch, n, runs[key][-1], key) for key in ("des", "des-spec", "des-offsets") if key in runs]


def main():
    ap = config_parser("2:128,64;4:128,64", "arch.md")
    ap.add_argument("--archs", default=",".join(ARCHS), help=f"comma-separated, of {','.join(ARCHS)}")
    ap.add_argument("--preset", default="criteo-like", choices=["criteo-like", "criteo-big-field"],
                    help="the synthetic data (criteo-big-field: one field of 1,000,000 values, des.compiler.big_tables)")
    ap.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated, of {','.join(SYSTEMS)}")
    ap.add_argument("--vocab", type=int, default=1 << 18, help="replicated: rows of each hashed Keras table")
    ap.add_argument("--check-steps", type=int, default=4, help="des at N = 1 vs N = 2 after these steps (0: skip)")
    ap.add_argument("--netbed", default=None, metavar="RATE", help="run on the emulated cluster at this rate")
    ap.add_argument("--cpus", default="share", help="--netbed: each host's CPU budget")
    ap.add_argument("--columnar", action="store_true",
                    help="every system reads a columnar copy (des.data.convert) instead of the text, which des "
                         "parses whole on every process and tfra a share on each")
    a = ap.parse_args()
    archs, chosen = a.archs.split(","), a.systems.split(",")
    if set(archs) - set(ARCHS) or set(chosen) - set(SYSTEMS):
        raise SystemExit(f"--archs of {','.join(ARCHS)}, --systems of {','.join(SYSTEMS)}")
    data, _, tmp = preset_data(a.preset, a.rows, "arch_runs", columnar=a.columnar)
    lines, notes = header(a), []
    print("\n".join(lines), flush=True)
    if a.check_steps:
        a.hidden = a.configs.split(";")[0].split(":")[1]      # the first configuration's, on this machine
        for arch in archs:
            notes.append(check(arch, data, a, tmp))
            print(notes[-1], flush=True)
    for arch in archs:
        for config in a.configs.split(";"):
            n, a.hidden = config.split(":")
            got, said = sweep(arch, int(n), data, a, tmp, chosen)
            lines += got
            notes += said
    lines += ["", "Notes:", ""] + [f"- {note}" for note in notes]
    write_report(a.report, lines)


if __name__ == "__main__":
    main()
