"""Benchmark the data-parallel tail against the replicated one: CPU seconds per step per process
and samples/second of DES DeepFM under mpirun, for each (N, hidden) given. One run, medians of
``--repeats`` launches; prints a Markdown table and writes it to ``--report``.

    .venv/bin/python scripts/bench_tail.py --rows 60000 --batch 4096 --steps 12 --repeats 2
"""
import os
import statistics
import time

from bench_des import config_parser, run, synth_data, write_report


def main():
    a = config_parser("2:400,400,400;4:400,400,400;4:128,64", "tail.md").parse_args()
    data = synth_data(a.rows)
    tmp = os.path.dirname(data)
    lines = [f"# Data-parallel vs replicated tail (DES DeepFM, criteo-like synthetic data, {a.rows} rows)", "",
             f"`scripts/bench_tail.py --rows {a.rows} --batch {a.batch} --steps {a.steps} --repeats {a.repeats} "
             f"--configs '{a.configs}'`, {time.strftime('%Y-%m-%d')}, this machine (2 shared cores; N processes "
             f"oversubscribe them, --threads 1). Global batch {a.batch}, dim {a.dim}; median over launches of "
             f"each launch's median step.", "",
             "| N | hidden | tail | CPU s/step/process | samples/s | train AUC at the last step | CPU ratio dp/rep | samples/s ratio |",
             "|---|---|---|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    for config in a.configs.split(";"):
        n, hidden = config.split(":")
        a.hidden = hidden
        got = {}
        for tail in ("replicated", "data_parallel"):
            runs = [run(int(n), "des", "deepfm", data, a, os.path.join(tmp, f"{n}_{tail}_{k}.json"),
                        extra=("--tail", tail)) for k in range(a.repeats)]
            got[tail] = (statistics.median(r["cpu_seconds_per_step"] for r in runs),
                         statistics.median(r["samples_per_second"] for r in runs), runs[0]["train_auc_by_step"][-1][1])
        for tail, (cpu, sps, auc) in got.items():
            ratio = (f"{got['data_parallel'][0] / got['replicated'][0]:.2f}x | "
                     f"{got['data_parallel'][1] / got['replicated'][1]:.2f}x") if tail == "data_parallel" else " | "
            line = f"| {n} | {hidden} | {tail} | {cpu:.3f} | {sps:,.0f} | {auc:.4f} | {ratio} |"
            lines.append(line)
            print(line, flush=True)
    write_report(a.report, lines)


if __name__ == "__main__":
    main()
