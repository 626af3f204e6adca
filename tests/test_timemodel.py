"""des.cluster.timemodel against hand-computed step times; options parsed or refused with a message.
(Its validation against the emulated cluster is a benchmark: scripts/bench_timemodel.py.)"""
import pytest

from des.cluster import timemodel
from des.cluster.timemodel import Network, des_tail_traffic, des_traffic, parse_rate, parse_time, ps_traffic, step_time


def test_units():
    assert parse_rate("10gbit") == 1.25e9 and parse_rate("100mbit") == 12.5e6 and parse_rate("5MBps") == 5e6
    assert parse_time("20us") == pytest.approx(2e-5) and parse_time("1.5ms") == pytest.approx(1.5e-3)
    with pytest.raises(ValueError, match="bandwidth '10 furlongs'"):
        parse_rate("10 furlongs")
    with pytest.raises(ValueError, match="e.g. 20us"):
        parse_time("20")


def test_des_step_by_hand():
    """N=4, 100 MB/s, 10 us per message, 1 ms cycle; 10 ms of computation; 1 MB of partials:
    fixed 1 ms + 2*3*10 us = 1.06 ms; ring 2*3/4 * 1e6 B / 1e8 B/s = 15 ms; total 26.06 ms."""
    t = step_time(0.010, des_traffic(1e6), 4, Network(1e8, latency=1e-5, cycle=1e-3))
    assert t["fixed"] == pytest.approx(1.06e-3) and t["bandwidth"] == pytest.approx(0.015)
    assert t["total"] == pytest.approx(0.02606) and t["comm_share"] == pytest.approx(0.01606 / 0.02606)


def test_ps_step_by_hand():
    """2 tables: 6 all-to-alls + 2 allreduces in 5 phases; 1.2 MB out, 0.9 MB in over the
    all-to-alls, 400 kB of dense gradients; measured 50 us per call. N=2, 50 MB/s:
    fixed 5 ms + 8 * 50 us = 5.4 ms; bytes (max(out,in) 1.2e6 + 1*(4 + 4e5)) / 5e7 = 32.00008 ms."""
    t = step_time(0.004, ps_traffic(2, 1.2e6, 0.9e6, 4e5), 2, Network(5e7, cycle=1e-3, call=5e-5))
    assert t["fixed"] == pytest.approx(5.4e-3)
    assert t["bandwidth"] == pytest.approx((1.2e6 + 4 + 4e5) / 5e7)
    assert t["total"] == pytest.approx(0.004 + 5.4e-3 + (1.2e6 + 4 + 4e5) / 5e7)


def test_all_to_all_traffic_at_its_own_bandwidth():
    """The same PS step with all-to-alls calibrated at 80 MB/s (the allreduce still at 50):
    bytes 1.2e6 / 8e7 + (4 + 4e5) / 5e7; without alltoall_bandwidth the allreduce's is used."""
    net = Network(5e7, cycle=1e-3, call=5e-5, alltoall_bandwidth=8e7)
    t = step_time(0.004, ps_traffic(2, 1.2e6, 0.9e6, 4e5), 2, net)
    assert t["bandwidth"] == pytest.approx(1.2e6 / 8e7 + (4 + 4e5) / 5e7)
    d = step_time(0.004, des_traffic(1e6), 2, net)           # DES has no all-to-all: unchanged
    assert d["bandwidth"] == pytest.approx(1e6 / 5e7)


def test_processes_sharing_cores_overlap_their_waits_with_the_others_computation():
    """4 processes timed on 2 cores at 400 ms; 2 MB of partials at 10 MB/s = 300 ms of bytes.
    Sharing the cores: max(400, 400 * 2/4 + 300) = 500 ms; bytes that fit in the others' turn
    (20 ms) hide completely (400 ms); with a host each, or as many cores as processes, the sum."""
    net = Network(1e7, latency=0.0, cycle=0.0)
    assert step_time(0.4, des_traffic(2e6), 4, net, cores=2)["total"] == pytest.approx(0.5)
    assert step_time(0.4, des_traffic(2e6 / 15), 4, net, cores=2)["total"] == pytest.approx(0.4)
    for cores in (None, 4, 8):
        assert step_time(0.4, des_traffic(2e6), 4, net, cores=cores)["total"] == pytest.approx(0.7)
    t = step_time(0.4, des_traffic(2e6), 4, net, cores=2)
    assert t["own_compute"] == pytest.approx(0.2) and t["comm_share"] == pytest.approx(0.3 / 0.5)


def test_computation_that_runs_while_the_bytes_travel():
    """A PS step of 300 ms computation and 300 ms of bytes (30 MB/s, 9 MB): with 40 % of the
    computation running while the bytes travel, 0.6 x 300 + 300 = 480 ms; never below either term
    alone (all of it: 300; 100 ms of computation, all of it overlapped: still the bytes' 300);
    calibrate_overlap inverts it and clips to 0..1."""
    net = Network(3e7, latency=0.0, cycle=0.0)
    traffic = des_traffic(9e6)                    # N=2: the ring sends 1/2 x 2 x 9e6 = 9 MB
    assert step_time(0.3, traffic, 2, net)["total"] == pytest.approx(0.6)
    assert step_time(0.3, traffic, 2, net, overlap=0.4)["total"] == pytest.approx(0.48)
    assert step_time(0.3, traffic, 2, net, overlap=1.0)["total"] == pytest.approx(0.3)
    assert step_time(0.1, traffic, 2, net, overlap=1.0)["total"] == pytest.approx(0.3)
    assert step_time(0.9, traffic, 2, net, overlap=1.0)["total"] == pytest.approx(0.9)
    assert timemodel.calibrate_overlap(0.48, 0.3, 0.3) == pytest.approx(0.4)
    assert timemodel.calibrate_overlap(0.7, 0.3, 0.3) == 0.0 and timemodel.calibrate_overlap(0.2, 0.3, 0.3) == 1.0
    with pytest.raises(ValueError, match="overlap 1.5"):
        step_time(0.3, traffic, 2, net, overlap=1.5)


def test_micro_batches_pipeline_the_partials_with_their_allreduces():
    """DES with 4 micro-batches, N=2 (the ring sends P), 10 MB/s, a 1 ms cycle per slice: 4 MB of
    partials = 400 ms + 4 cycles = 404 ms, 101 ms a slice. 500 ms of computation, 200 of it the
    partials' forward (50 ms a slice): 300 + 50 + 3 x max(50, 101) + 101 = 754 ms, against
    500 + 401 = 901 ms in one slice. When the slices' computation is the slower stage (500 ms of
    partials, 44 ms of bytes): 4 x 125 + 11 = 511 ms. calibrate_sliced inverts the first."""
    net = Network(1e7, latency=0.0, cycle=1e-3, call=0.0)
    assert des_traffic(4e6, 4) == {"phases": 4, "allreduce": [1e6] * 4, "slices": 4}
    assert step_time(0.5, des_traffic(4e6), 2, net)["total"] == pytest.approx(0.901)
    assert step_time(0.5, des_traffic(4e6), 2, net, sliced_compute=0.2)["total"] == pytest.approx(0.901)
    four = step_time(0.5, des_traffic(4e6, 4), 2, net, sliced_compute=0.2)
    assert four["total"] == pytest.approx(0.754) and four["fixed"] == pytest.approx(0.004)
    assert step_time(0.5, des_traffic(4e5, 4), 2, net, sliced_compute=0.5)["total"] == pytest.approx(0.511)
    assert step_time(0.5, des_traffic(4e6, 4), 2, net)["total"] == pytest.approx(0.904)   # nothing sliced
    assert timemodel.calibrate_sliced(0.754, 0.5, 0.404, 4) == pytest.approx(0.2)
    assert timemodel.calibrate_sliced(2.0, 0.5, 0.404, 4) == 0.0
    with pytest.raises(ValueError, match="sliced_compute 0.6"):
        step_time(0.5, des_traffic(4e6, 4), 2, net, sliced_compute=0.6)


def test_one_process_has_no_communication():
    t = step_time(0.01, ps_traffic(39, 1e6, 1e6, 1e6), 1, Network.parse("1gbit"))
    assert t["total"] == 0.01 and t["comm_share"] == 0.0
    assert timemodel.HOROVOD_CYCLE == 1e-3


@pytest.mark.mpi
def test_sync_computation_waits_for_the_slowest_process_and_noop_does_not():
    """Under mpirun (2 ranks, the last sleeping 0.4 s before each step): the timing communicators
    of ``--comm noop`` do not wait for it, those of ``--comm sync`` (DES's allreduce, the PS's
    slice-size allreduce) do - the model's computation term includes that wait -, and so does
    every call of ``--comm meet`` (the PS's allreduces and its all-to-alls of no rows). The plan
    agreement compares ranks over ``sync`` and has nothing to compare over ``noop``."""
    import json
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_mpi_yield_when_idle="1", TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=root)
    done = subprocess.run(["mpirun", "-np", "2", "--oversubscribe", "--bind-to", "none", sys.executable,
                           "scripts/mpi_sync.py"], env=env, cwd=root, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    t = next(line for line in lines if "des_sync" in line)
    said = {line["rank"]: line for line in lines if "rank" in line}
    # the plan agreement over the timing communicators (des.train --comm noop/sync under mpirun
    # stopped at transform: the no-op broadcast handed rank 1 zeros as rank 0's plan)
    assert said[0] == {"rank": 0, "noop": "agreed", "sync": "agreed"}, said
    assert said[1]["noop"] == "agreed", said
    assert said[1]["sync"] == ("rank 1 of 2 disagrees with rank 0 on the plan: rank 0 has 'F0 -> 0', "
                               "rank 1 has 'F0 -> 0, F1 -> 0'"), said
    assert t["des_sync"] > 0.3 and t["ps_sync"] > 0.3, t
    assert t["ps_meet_allreduce"] > 0.3 and t["ps_meet_alltoall"] > 0.3, t    # --comm meet: every call waits
    assert t["des_noop"] < 0.2 and t["ps_noop"] < 0.2, t


def test_projection_rows_and_table(monkeypatch):
    """des.jobs.projection with the computation and the traffic stubbed (they need runs and data):
    one row per model, N and mode, samples/s = batch / the model's step time, and its table."""
    from des.jobs import projection
    monkeypatch.setattr(projection, "compute_seconds", lambda mode, *rest: {"des": 0.02, "ps": 0.01}[mode])
    monkeypatch.setattr(projection, "traffic_at", lambda model, data, fmt, a, n: {
        "des": des_traffic(4 * 2048 * 18), "ps": ps_traffic(4, 2e6, 2e6, 1e5)})
    from des.jobs.compare import parser
    a = parser().parse_args(["--bandwidth", "10gbit", "--batch", "2048", "--preset", "wide", "--rows", "100"])
    rows = projection.project(["lr"], ["x"], "libffm", a, [4, 16], "out")
    assert [(r["model"], r["n"], r["mode"]) for r in rows] == [("lr", 4, "des"), ("lr", 4, "ps"),
                                                              ("lr", 16, "des"), ("lr", 16, "ps")]
    # by hand, 10gbit = 1.25e9 B/s, 20 us per message, 1 ms cycle; DES: 4 x 2048 x 18 = 147,456 B
    # of partials, 1 phase, 1 call; PS: 5 phases, 2 allreduces (4 B, 1e5 B) + 3 x 4 = 12 all-to-alls
    # (14 calls) of 2e6 B in all each way, max(out, in) = 2e6 B; a call costs 2(N-1) x 20 us
    total = {
        # 0.02 + 1 ms + 2x3x20us + 2x3/4 x 147,456 B / 1.25e9 = 0.02 + 0.00112 + 0.0001769472
        (4, "des"): 0.0212969472,
        # 0.01 + 5 ms + 14 x 120us + (2x3/4 x 100,004 B + 2e6 B) / 1.25e9 = 0.01 + 0.00668 + 0.0017200048
        (4, "ps"): 0.0184000048,
        # 0.02 + 1 ms + 2x15x20us + 2x15/16 x 147,456 B / 1.25e9 = 0.02 + 0.0016 + 0.000221184
        (16, "des"): 0.021821184,
        # 0.01 + 5 ms + 14 x 600us + (2x15/16 x 100,004 B + 2e6 B) / 1.25e9 = 0.01 + 0.0134 + 0.001750006
        (16, "ps"): 0.025150006,
    }
    for r in rows:
        assert r["total"] == pytest.approx(total[(r["n"], r["mode"])], rel=1e-9)
        assert r["samples_per_s"] == pytest.approx(2048 / total[(r["n"], r["mode"])], rel=1e-9)
    assert "| lr | 16 |" in projection.markdown(rows, a)
    a.call = "170us"                   # a measured cost per collective call replaces 2(N-1) x latency
    slow = projection.project(["lr"], ["x"], "libffm", a, [16], "out")
    # PS at N=16: fixed 5 ms + 14 x 170 us = 7.38 ms; 0.01 + 0.00738 + 0.001750006 (bytes as above)
    assert slow[1]["mode"] == "ps" and slow[1]["fixed"] == pytest.approx(7.38e-3, rel=1e-9)
    assert slow[1]["total"] == pytest.approx(0.019130006, rel=1e-9)
    assert "170us per collective call" in projection.markdown(slow, a)


def test_a_columnar_projection_times_the_columnar_copy(monkeypatch, tmp_path):
    """des.compare --bandwidth --columnar: the computation is timed reading the columnar copy (a
    projection once timed the text reader by mistake), the bytes come from the data's own files."""
    from des.jobs import compare
    from des.jobs import projection
    seen = {"compute": set(), "traffic": set()}
    monkeypatch.setattr(projection, "compute_seconds",
                        lambda mode, model, data, fmt, *rest: seen["compute"].add((tuple(data), fmt)) or 0.01)
    monkeypatch.setattr(projection, "traffic_at", lambda model, data, fmt, a, n: seen["traffic"].add(
        (tuple(data), fmt)) or {"des": des_traffic(1e4), "ps": ps_traffic(2, 1e5, 1e5, 1e3)})
    assert compare.main(["--models", "lr", "--preset", "tiny", "--rows", "300", "--batch", "64", "--columnar",
                         "--bandwidth", "1gbit", "--np", "2,4", "--out", str(tmp_path)]) == 0
    (timed, timed_fmt), = seen["compute"]
    (data, fmt), = seen["traffic"]
    assert timed_fmt == "columnar" and timed == (data[0] + ".cols",) and fmt != "columnar"


def test_the_bench_takes_the_median_of_repeated_runs(tmp_path):
    """scripts/bench_timemodel.py --repeats 3 --modes ps, recomputed from saved runs (no netbed):
    each point's measured step and the computation (the PS's real runs on unshaped links) are the
    medians of their 3 runs' step times (global batch / samples/s), and the table shows the
    measured range and the CPU per step."""
    import importlib.util
    import json
    import os
    spec = importlib.util.spec_from_file_location(
        "bench_timemodel", os.path.join(os.path.dirname(os.path.dirname(__file__)), "scripts", "bench_timemodel.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out, batch = tmp_path / "tm", 1000
    out.mkdir()
    rank = {"wire_out_bytes_per_step": 3e5, "wire_in_bytes_per_step": 3e5, "allreduce_payload_bytes_per_step": 404,
            "tables": 1, "lookups": 1, "peak_rss_mib": 100.0}

    def save(tag, step_seconds, cpu):        # rank 1 used 0.1 s more CPU per step than rank 0
        for r in range(2):
            (out / f"lr-ps{tag}.json.rank{r}").write_text(json.dumps(dict(
                rank, samples_per_second=batch / step_seconds, cpu_seconds_per_step=cpu + 0.1 * r)))
    for k, (noop, unshaped, measured) in enumerate([(0.2, 0.30, 0.5), (0.1, 0.10, 0.4), (0.3, 0.35, 0.9)]):
        save(f"-noop-n2-r{k}", noop, 0.1)
        save(f"-unshaped-n2-r{k}", unshaped, [0.2, 0.0, 0.25][k])     # the PS's computation: its real runs
        save(f"-n2-30mbit-r{k}", measured, [0.15, 0.05, 0.35][k])
    cal = {"effective_bandwidth_Bps_1MiB": 3e6, "effective_alltoall_Bps_1MiB": 3e6, "cycle": 1e-3,
           "per_call_in_a_phase": 1e-4}
    (out / "timemodel.json").write_text(json.dumps([{"n": 2, "rate": "30mbit", "calibration": cal}]))
    assert bench.main(["--model", "lr", "--preset", "criteo-like", "--rows", "300", "--batch", str(batch),
                       "--np", "2", "--rates", "30mbit", "--cpus", "share", "--modes", "ps", "--repeats", "3",
                       "--ps-overlap", "0", "--out", str(out), "--reuse-netbed", "--reuse-compute"]) == 0
    [row] = json.loads((out / "timemodel.json").read_text())
    assert row["mode"] == "ps" and row["computation"] == "unshaped"
    assert row["measured_runs"] == pytest.approx([0.5, 0.4, 0.9])
    assert row["measured"] == pytest.approx(0.5) and row["compute"] == pytest.approx(0.30)
    assert row["noop_compute"] == pytest.approx(0.2)
    # the plain sum: computation + the all-to-alls' 3e5 B + the dense 400 B, at 3 MB/s
    assert row["predicted"] == pytest.approx(0.30 + (3e5 + 4 + 400) / 3e6)
    table = (out / "timemodel.md").read_text()
    assert "| 2 | 30mbit | ps | 500.0 (400–900) |" in table
    # CPU per step and process: the mean over ranks, the median over runs; its share of the budget
    from des.cluster.netbed import parse_cpus
    budget = parse_cpus("share", 2)
    assert row["cpu_per_step"] == pytest.approx(0.2) and row["compute_cpu_per_step"] == pytest.approx(0.25)
    assert f"| 0.200 ({0.2 / (budget * 0.5):.0%}) / 0.250 ({0.25 / (budget * 0.3):.0%}) |" in table


def test_the_data_parallel_tail_costs_four_phases_and_half_rings():
    """N = 4, 1e8 B/s, 10 us per message, 1 ms cycle: partials of 1e6 B reduce-scattered and their
    gradient all-gathered (each (N-1)/N x 1e6 = 7.5e5 B sent), outputs of 16,384 B all-gathered
    (12,288 B), the tail's 4e5 B of gradients in a ring allreduce (2 x 3/4 x 4e5 = 6e5 B):
    2,112,288 B at 1e8 B/s = 21.12288 ms; 4 cycles + 4 calls x 2 x 3 x 10 us = 4.24 ms."""
    t = step_time(0.010, des_tail_traffic(1e6, 16384, 4e5), 4, Network(1e8, latency=1e-5, cycle=1e-3))
    assert t["bandwidth"] == pytest.approx(0.02112288) and t["fixed"] == pytest.approx(0.00424)
    assert t["total"] == pytest.approx(0.010 + 0.02112288 + 0.00424)


def test_projection_shows_both_tails(monkeypatch):
    """With a data-parallel row (computation per process falls with N), the table shows the
    computation of both tails and the PS's, and each tail's samples/s."""
    from des.jobs import projection
    monkeypatch.setattr(projection, "compute_seconds",
                        lambda mode, model, data, fmt, a, n, out: {"des": 0.04, "des-dp": 0.01 + 0.03 / n, "ps": 0.02}[mode])
    monkeypatch.setattr(projection, "traffic_at", lambda model, data, fmt, a, n: {
        "des": des_traffic(4 * 2048 * 18), "des-dp": des_tail_traffic(4 * 2048 * 18, 4 * 2048, 4e4),
        "ps": ps_traffic(4, 2e6, 2e6, 1e5)})
    from des.jobs.compare import parser
    a = parser().parse_args(["--bandwidth", "10gbit", "--batch", "2048", "--preset", "wide", "--rows", "100"])
    rows = projection.project(["deepfm"], ["x"], "libffm", a, [16, 64], "out")
    assert [(r["n"], r["mode"]) for r in rows] == [(16, "des"), (16, "des-dp"), (16, "ps"),
                                                   (64, "des"), (64, "des-dp"), (64, "ps")]
    # N=64, data-parallel tail by hand: computation 0.01 + 0.03/64 = 0.01046875; 4 phases x 1 ms +
    # 4 calls x 2x63x20us = 0.004 + 0.01008 = 0.01408; half rings of 147,456 B (twice) and 8,192 B,
    # a ring of 4e4 B: 2x63/64 x (73,728 + 4,096 + 73,728 + 40,000 = 191,552) = 377,118 B / 1.25e9
    # = 0.0003016944; total 0.01046875 + 0.01408 + 0.0003016944 = 0.0248504444
    assert (rows[4]["n"], rows[4]["mode"]) == (64, "des-dp")
    assert rows[4]["fixed"] == pytest.approx(0.01408, rel=1e-9)
    assert rows[4]["bandwidth"] == pytest.approx(0.0003016944, rel=1e-9)
    assert rows[4]["total"] == pytest.approx(0.0248504444, rel=1e-9)
    assert rows[4]["samples_per_s"] == pytest.approx(2048 / 0.0248504444, rel=1e-9)
    table = projection.markdown(rows, a)
    assert "| deepfm | 64 | 40.0 / 10.5 / 20.0 |" in table, table
