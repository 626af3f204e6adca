"""Benchmark DES against the peer users pick today, TFRA's own all-to-all embedding
(scripts/peer_tfra.py): samples/s, CPU seconds per step per process and seconds to the first
step of a DeepFM on criteo-like synthetic data under mpirun, for each (N, hidden) given; DES with
its joined tables (des.train's default) and the replicated or the data-parallel tail, and this
project's PS mode (``--mode ps``, joined tables). One run, medians of ``--repeats``
launches; prints a Markdown table and writes it to ``--report``.

    .venv/bin/python scripts/bench_peer.py --rows 200000 --batch 4096 --steps 40 --repeats 3

Steps: 40 (a launch's median step) so that the tables hold most keys, as in a long run; with 12,
most steps insert many new keys and the medians move by 10-20% from launch to launch.
"""
import json
import os
import statistics
import subprocess
import sys
import time

from bench_des import ENV, ROOT, config_parser, run, synth_data, write_report


SYSTEMS = {"tfra": "TFRA HvdAllToAllEmbedding", "des-replicated": "DES, replicated tail",
           "des-data-parallel": "DES, data-parallel tail", "ps": "PS (this project)"}


def peer(n, data, a, out):
    args = ["mpirun", "-np", str(n), "--oversubscribe", "--bind-to", "none", sys.executable,
            os.path.join(ROOT, "scripts", "peer_tfra.py"), "--data", data, "--batch", str(a.batch),
            "--steps", str(a.steps), "--dim", str(a.dim), "--hidden", a.hidden, "--summary-json", out]
    p = subprocess.run(args, env=ENV, cwd=ROOT, capture_output=True, text=True)
    if p.returncode:
        raise SystemExit(f"{' '.join(args)} failed:\n{p.stderr[-2000:]}")
    return json.load(open(out + ".rank0"))


def main():
    ap = config_parser("2:128,64;4:128,64;4:400,400,400", "peer.md")
    ap.add_argument("--systems", default=",".join(SYSTEMS),
                    help=f"which systems to launch, comma-separated, of {','.join(SYSTEMS)} (tfra is the baseline)")
    a = ap.parse_args()
    chosen = a.systems.split(",")
    if "tfra" not in chosen or set(chosen) - set(SYSTEMS):
        raise SystemExit(f"--systems {a.systems}: a comma-separated subset of {','.join(SYSTEMS)} with tfra")
    data = synth_data(a.rows)
    tmp = os.path.dirname(data)
    lines = [f"# DES vs TFRA's all-to-all embedding (DeepFM, criteo-like synthetic data, {a.rows} rows)", "",
             f"`scripts/bench_peer.py --rows {a.rows} --batch {a.batch} --steps {a.steps} --repeats {a.repeats} "
             f"--configs '{a.configs}' --systems {a.systems}`, {time.strftime('%Y-%m-%d')}, this machine "
             f"(2 shared cores; N processes oversubscribe them, one TF thread each). Global batch {a.batch}, dim {a.dim}; median over "
             f"launches of each launch's median step (the first step excluded); the launches go round-robin over "
             f"the systems. DES: joined tables (one per process: each field's embedding and linear weight in "
             f"one row); the peer: "
             f"HvdAllToAllEmbedding, all fields in one table per width, Adam, dense gradients averaged by "
             f"Horovod (scripts/peer_tfra.py). PS: this project's `--mode ps`, joined tables, its byte check "
             f"on 2 steps (scripts/bench_des.py).", "",
             "| N | hidden | system | samples/s | CPU s/step/process | first step (s) | samples/s vs TFRA |",
             "|---|---|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    launchers = {"tfra": lambda n, out: peer(n, data, a, out),
                 "des-replicated": lambda n, out: run(n, "des", "deepfm", data, a, out, ("--tail", "replicated")),
                 "des-data-parallel": lambda n, out: run(n, "des", "deepfm", data, a, out,
                                                         ("--tail", "data_parallel")),
                 "ps": lambda n, out: run(n, "ps", "deepfm", data, a, out)}
    systems = {SYSTEMS[key]: launchers[key] for key in SYSTEMS if key in chosen}
    for config in a.configs.split(";"):
        n, a.hidden = config.split(":")
        runs = {name: [] for name in systems}
        for r in range(a.repeats):      # round-robin, so that a drift in the machine's load hits every system
            for k, (name, launch) in enumerate(systems.items()):
                runs[name].append(launch(int(n), os.path.join(tmp, f"{n}_{k}_{r}.json")))
        got = {name: [statistics.median(r[key] for r in rs)
                      for key in ("samples_per_second", "cpu_seconds_per_step", "seconds_to_first_step")]
               for name, rs in runs.items()}
        base = got["TFRA HvdAllToAllEmbedding"][0]
        for name, (sps, cpu, first) in got.items():
            line = f"| {n} | {a.hidden} | {name} | {sps:,.0f} | {cpu:.3f} | {first:.1f} | {sps / base:.2f}x |"
            lines.append(line)
            print(line, flush=True)
    write_report(a.report, lines)


if __name__ == "__main__":
    main()
