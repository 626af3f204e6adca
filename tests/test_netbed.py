"""The emulated cluster (des.netbed): DES and PS jobs across two network-namespace hosts, over TCP
through a shaped bridge, with the bytes each host put on its interface measured by the kernel."""
import json
import os
import shutil
import subprocess
import sys

import pytest

from helpers import mpirun, write_small_ffm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
           OMPI_MCA_mpi_yield_when_idle="1", TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=ROOT)
TRAIN = ["-m", "des.train", "--model", "wdl", "--batch", "512", "--hidden", "256", "--dim", "4", "--threads", "1",
         "--holdout", "2000", "--lr", "0.02", "--replica-check", "0"]

needs_root = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("ip"), reason="network namespaces need root")


@pytest.mark.mpi
@needs_root
def test_des_and_ps_jobs_across_two_emulated_hosts(tmp_path):
    """2 hosts at 1 Gbit/s each: both jobs finish with the same held-out AUC on both hosts (DES and
    PS give the same AUC, within 1e-7, as on one machine), each host's interface carried at least the bytes its
    process handed to the collectives (so the traffic really crossed the emulated network, not
    shared memory), and the namespaces are gone afterwards."""
    from des.cluster.netbed import Netbed, hosts
    data = str(tmp_path / "train.ffm")
    write_small_ffm(data, 12_000, seed=2)
    out = {}
    with Netbed(2, rate="1gbit") as bed:
        assert hosts() == ["desh1", "desh2"]
        for ns in hosts():                  # 1 ms at 1 Gbit/s may wait below a socket (TSQ), not 4 MiB
            tsq = subprocess.run(["ip", "netns", "exec", ns, "cat", "/proc/sys/net/ipv4/tcp_limit_output_bytes"],
                                 capture_output=True, text=True, check=True).stdout
            assert int(tsq) == 125_000, (ns, tsq)
        cmd = bed.mpirun(2)                 # one phase up to 4 MiB: no acknowledgement to wait for
        assert cmd[cmd.index("btl_tcp_eager_limit") + 1] == cmd[cmd.index("btl_tcp_rndv_eager_limit") + 1] == "4194304"
        for mode in ("des", "ps"):
            run = bed.run(bed.mpirun(2) + [sys.executable, *TRAIN, "--mode", mode, "--data", data,
                                           "--summary-json", str(tmp_path / f"{mode}.json")],
                          env=ENV, cwd=ROOT, timeout=600)
            assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
            out[mode] = [json.load(open(tmp_path / f"{mode}.json.rank{r}")) for r in range(2)]
    assert hosts() == []
    des, ps = out["des"], out["ps"]
    assert des[0]["auc"] == des[1]["auc"] and ps[0]["auc"] == ps[1]["auc"]
    # measured 0 (reports/tolerances.md); at N = 2 each allreduce adds two terms, in either order the same
    assert abs(des[0]["auc"] - ps[0]["auc"]) < 1e-7 and des[0]["auc"] > 0.55
    for r in range(2):
        payload = des[r]["bytes_per_step_measured"]          # 4 * 512 * (1 + 256): each host sends it all at N=2
        wire_des, wire_ps = des[r]["wire_bytes_per_step"], ps[r]["wire_bytes_per_step"]
        ps_out = ps[r]["wire_out_bytes_per_step"] + ps[r]["allreduce_payload_bytes_per_step"]
        print(f"host {r + 1}: DES wire {wire_des:,.0f} B/step for a payload of {payload:,} "
              f"({wire_des / payload:.2f}x); PS wire {wire_ps:,.0f} B/step for {ps_out:,.0f} handed over "
              f"({wire_ps / ps_out:.2f}x)")
        # docs/netbed.md: a DES step put 1.06x its payload on the wire (TCP/IP headers, Horovod's
        # coordination); measured here 1.05x at 526,336 B. The PS's many small all-to-alls: <= 2x.
        assert payload <= wire_des <= 1.10 * payload
        assert ps_out <= wire_ps <= 2 * ps_out


@needs_root
def test_netbed_down_removes_everything_and_bad_host_counts_are_refused():
    from des.cluster.netbed import Netbed, down, hosts
    with pytest.raises(ValueError, match="1..250 hosts"):
        Netbed(0)
    bed = Netbed(3, rate=None).up()
    try:
        assert hosts() == ["desh1", "desh2", "desh3"]
        cmd = bed.mpirun(6)
        assert cmd[cmd.index("--host") + 1] == "10.77.0.1:2,10.77.0.2:2,10.77.0.3:2"
    finally:
        down()
    assert hosts() == [] and not os.path.exists("/sys/class/net/desbr0")


@needs_root
def test_a_host_cpu_budget_holds_every_process_of_the_host(tmp_path):
    """cpus=0.25: each host's processes (started by mpirun through the rsh agent) are in the host's
    cgroup and get a quarter of a CPU - a busy loop of 1.5 s wall burns 0.2-0.3 CPU s per s - over
    a 10 ms period and over a 4 ms one (cpu_period_us; a quota under the kernel's 1 ms is
    refused), while without a budget the same loop gets about a whole core; the cgroups go with
    the netbed."""
    from des.cluster.netbed import Netbed, _cgroups, cpu_root, PREFIX
    if cpu_root() is None:
        pytest.skip("no cgroup cpu controller")
    prog = tmp_path / "busy.py"
    prog.write_text("import os, sys, time\nt0, c0 = time.perf_counter(), time.process_time()\n"
                    "while time.perf_counter() - t0 < 1.5: pass\n"
                    "cg = sorted(l.strip() for l in open('/proc/self/cgroup') if ':cpu' in l or l.startswith('0::'))\n"
                    "ratio = (time.process_time() - c0) / (time.perf_counter() - t0)\n"
                    "open(os.path.join(sys.argv[1], str(os.getpid())), 'w').write(f'{ratio} {cg}')\n")
    ratios = {}
    for cpus, period in ((0.25, 10_000), (0.25, 4_000), (None, 10_000)):
        seen = tmp_path / f"seen-{cpus}-{period}"
        seen.mkdir()
        with Netbed(2, rate=None, cpus=cpus, cpu_period_us=period) as bed:
            run = bed.run(bed.mpirun(2) + [sys.executable, str(prog), str(seen)], env=ENV, cwd=ROOT, timeout=120)
            assert run.returncode == 0, run.stderr[-2000:]
            lines = [p.read_text() for p in seen.iterdir()]
            assert len(lines) == 2, lines
            ratios[cpus, period] = sorted(float(line.split()[0]) for line in lines)
            if cpus:
                root, version = cpu_root()
                name = "cpu.cfs_period_us" if version == 1 else "cpu.max"
                assert open(os.path.join(root, f"{PREFIX}1", name)).read().split()[-1] == str(period)
                assert sorted("/desh1" in line for line in lines) == [False, True], lines
                assert sorted("/desh2" in line for line in lines) == [False, True], lines
                used, throttled = bed.cpu_seconds(), bed.throttled_seconds()
                print("host CPU s", used, "throttled s", throttled)
                assert all(0.3 <= u <= 1.5 for u in used) and all(t > 0.5 for t in throttled)
        assert _cgroups() == []
    print("CPU s per wall s, budget 0.25 over 10 and 4 ms:", ratios[0.25, 10_000], ratios[0.25, 4_000],
          "no budget:", ratios[None, 10_000])
    assert all(0.2 <= r <= 0.3 for r in ratios[0.25, 10_000] + ratios[0.25, 4_000])
    assert all(r >= 0.6 for r in ratios[None, 10_000])        # 2 loops on 2 cores (a noisy machine: not 1.0)
    with pytest.raises(ValueError, match="a host's CPUs"):
        Netbed(2, cpus=0)
    with pytest.raises(ValueError, match="quota of 500 us.*at least 4000 us"):
        Netbed(2, cpus=0.25, cpu_period_us=2000)
    assert Netbed(4, cpus=0.45).cpu_period_us == 2500 and Netbed(4, cpus=0.1).cpu_period_us == 10_000


@pytest.mark.mpi
@needs_root
def test_des_transform_measures_the_link_at_start(tmp_path):
    """des.transform with no options on 2 emulated hosts: the bandwidth it measures with its probe
    allreduces is rounded to the class of the link the hosts were given (100 Mbit/s: 1.25e7 B/s;
    1 Gbit/s: 1.25e8), both processes assume the same, and the report says what was measured.
    With both processes on one machine the link is not timed: the fastest class, every run. At
    1 Gbit/s with des.train's options (its --link auto: costs given, the bandwidth to measure)."""
    from des.cluster.netbed import Netbed
    for rate, expected, how in (("100mbit", 1.25e7, []), ("1gbit", 1.25e8, ["--des-train"])):
        with Netbed(2, rate=rate) as bed:
            out = str(tmp_path / f"link_{rate}.json")
            run = bed.run(bed.mpirun(2) + [sys.executable, os.path.join(ROOT, "scripts", "mpi_link.py"), *how, out],
                          env=ENV, cwd=ROOT, timeout=300)
            assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
        ranks = [json.load(open(f"{out}.rank{r}")) for r in range(2)]
        print(rate, ranks[0]["link"])
        assert ranks[0]["link"].startswith("link measured at start: allreduce of 4 B")
        assert [r["assumed"] for r in ranks] == [expected, expected], (rate, ranks)
        assert ranks[0]["tail"] == ranks[1]["tail"] and ranks[0]["by_rows"] == ranks[1]["by_rows"]
    # the same job with both processes on this machine: shared memory, not timed (a busy machine
    # measured it slow enough to flip the choices, test_mpi's reports on a CI run)
    out = str(tmp_path / "link_one_machine.json")
    run = mpirun(2, os.path.join(ROOT, "scripts", "mpi_link.py"), out, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    ranks = [json.load(open(f"{out}.rank{r}")) for r in range(2)]
    assert [r["assumed"] for r in ranks] == [1.25e9, 1.25e9], ranks
    assert ranks[0]["link"].startswith("link not timed: every process on this machine"), ranks[0]["link"]
