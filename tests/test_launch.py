"""des.launch: a des.train job under mpirun that outlives a killed process. Unit checks of its
options, lock, log and checkpoint choice; then real mpirun launches on generated data: a process
killed (SIGKILL) after the first checkpoint, the job restarted from it and ending with the log
loss of the uninterrupted run; a process killed twice with --min-np below -np, the job ending on
fewer processes with the same result; a job failing before its first checkpoint, not restarted.
No process is left behind."""
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from des.jobs import launch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, PYTHONPATH=ROOT)


def test_options_that_cannot_restart_are_one_line_errors(capsys):
    for argv, message in ((["-np", "2", "--", "--mode", "des", "--data", "x"], "needs a des.train --checkpoint DIR"),
                          (["-np", "2", "--", "--data", "x", "--checkpoint", "c", "--restore", "c"], "--restore:"),
                          (["-np", "2", "--min-np", "3", "--", "--data", "x", "--checkpoint", "c"],
                           "--min-np 3: between 1 and -np 2"),
                          (["-np", "2", "--", "--data", "x", "--checkpoint", "c", "--tail", "sideways"],
                           "argument --tail: invalid choice: 'sideways'"),
                          (["-np", "2"], "no des.train arguments")):
        with pytest.raises(SystemExit) as e:
            launch.parse(argv)
        assert e.value.code == 2 and message in capsys.readouterr().err
    a, train = launch.parse(["-np", "3", "--max-restarts", "0", "--", "--data", "x"])   # no restarts: no folder needed
    assert (a.np, a.min_np, a.checkpoint, train) == (3, 3, None, ["--data", "x"])


def test_hosts_that_fail_their_check_are_left_out_of_the_next_attempt(tmp_path, capsys):
    alive = tmp_path / "alive"
    alive.mkdir()
    for h in ("a", "b", "c"):
        (alive / h).touch()
    a, _ = launch.parse(["-np", "4", "--hosts", "a,b:2,c", "--min-np", "2", "--host-check", f"test -e {alive}/{{host}}",
                         "--", "--data", "x", "--checkpoint", "c"])
    assert a.hosts == {"a": 1, "b": 2, "c": 1} and a.mpirun.endswith("--host {hosts}")
    assert launch.next_size(a, 4, a.hosts) == (4, {"a": 1, "b": 2, "c": 1}, [])      # a process died, no host
    (alive / "b").unlink()
    assert launch.next_size(a, 4, a.hosts) == (2, {"a": 1, "c": 1}, ["b"])
    (alive / "c").unlink()
    assert launch.next_size(a, 2, {"a": 1, "c": 1}) == (1, {"a": 1}, ["c"])          # below --min-np: run gives up
    one, _ = launch.parse(["-np", "3", "--min-np", "2", "--", "--data", "x", "--checkpoint", "c"])
    assert [launch.next_size(one, n, None)[0] for n in (3, 2)] == [2, 2]             # one machine: a slot fewer
    for bad, message in (("a,,b", "''"), ("a:x", "'a:x'"), ("a,a", "'a'")):
        with pytest.raises(SystemExit):
            launch.parse(["-np", "1", "--hosts", bad, "--", "--data", "x"])
        assert f"--hosts: {message}: HOST or HOST:SLOTS, each host once" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        launch.parse(["-np", "3", "--hosts", "a,b", "--", "--data", "x"])
    assert "--hosts: 2 slot(s) for -np 3" in capsys.readouterr().err


def test_one_launcher_per_checkpoint_folder(tmp_path):
    held = launch.lock(str(tmp_path))
    with pytest.raises(launch.LaunchError, match=f"{tmp_path}: another des.launch is writing this checkpoint folder"):
        launch.lock(str(tmp_path))
    held.close()
    launch.lock(str(tmp_path)).close()           # released with its holder


def test_the_newest_complete_checkpoint_and_what_failed(tmp_path):
    assert launch.newest(str(tmp_path)) is None
    for name, step in (("state.old", 5), ("state", 10)):
        os.makedirs(tmp_path / name)
        (tmp_path / name / "config.json").write_text(json.dumps({"position": {"epoch": 0, "step": step}}))
    assert launch.newest(str(tmp_path))[1] == {"epoch": 0, "step": 10}
    (tmp_path / "state" / "config.json").unlink()        # a save caught mid-swap: never read
    assert launch.newest(str(tmp_path))[1] == {"epoch": 0, "step": 5}
    assert launch.newest(str(tmp_path), since=time.time() + 1) is None    # an earlier job's: not this launch's
    said = ("mpirun noticed that process rank 1 with PID 4242 on node box exited on signal 9 (Killed).\n")
    assert launch.what_failed(137, said) == "rank 1 (PID 4242) on box: signal 9 (Killed)"
    assert launch.what_failed(137, said.replace("4242", "0")) == "rank 1 on box: signal 9 (Killed)"
    assert launch.what_failed(3, "nothing useful") == "exit status 3"
    lost = ("An MPI communication peer process has unexpectedly disconnected.  This\n...\n  Local host: vm\n"
            "  Local PID:  32261\n  Peer host:  10.77.0.3\n----\n")
    assert launch.what_failed(9, lost) == "exit status 9: the processes lost their connection to 10.77.0.3"


def _alive_in_group(pgid: int, within: float = 5.0) -> list[int]:
    """PIDs of the processes of group ``pgid`` still running after up to ``within`` s (signals take a
    moment; a zombie waits only for its reaping)."""
    deadline = time.time() + within
    while True:
        alive = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                alive.append(int(pid))
        if not alive or time.time() > deadline:
            return alive
        time.sleep(0.05)


def test_an_attempt_that_said_a_process_is_gone_ends_within_the_grace():
    """mpirun that said a process died but hangs on (as it did here waiting for a host taken down)
    is stopped --stop-grace seconds later, with every process of its group; one that never says
    so is left to run."""
    said = "mpirun noticed that process rank 1 with PID 7 on node h3 exited on signal 9 (Killed)."
    started = time.time()
    hung = launch.Attempt(["sh", "-c", f"echo '{said}'; sleep 60 & sleep 60"], grace=1.0)
    rc = hung.wait()
    assert rc != 0 and time.time() - started < 10, (rc, time.time() - started)
    assert _alive_in_group(hung.proc.pid) == []       # the background sleep too
    started = time.time()          # before Popen: the child's sleep 2 starts after this
    fine = launch.Attempt(["sh", "-c", "echo all good; sleep 2"], grace=0.5)
    assert fine.wait() == 0 and time.time() - started >= 2


def _data(tmp_path) -> str:
    path = str(tmp_path / "train.txt")
    subprocess.run([sys.executable, "-m", "des.data.synth", "--rows", "40000", "--out", path], env=ENV, cwd=ROOT,
                   check=True, capture_output=True)
    return path


def _train_args(data: str, ckpt: str, summary: str, every: str = "20") -> list[str]:
    return ["--mode", "des", "--data", data, "--batch", "512", "--steps", "300", "--hidden", "128,64",
            "--threads", "1", "--checkpoint", ckpt, "--checkpoint-every", every, "--summary-json", summary]


def _trainers(ckpt: str) -> list[int]:
    """PIDs of the des.train processes writing ``ckpt``."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
        except OSError:
            continue
        if b"des.train" in cmd and ckpt.encode() in cmd:
            out.append(int(pid))
    return sorted(out)


def _kill_after_checkpoints(ckpt: str, times: int, log: list) -> None:
    """SIGKILL one training process after each of ``times`` new complete checkpoints."""
    seen = 0.0
    for _ in range(times):
        deadline = time.time() + 300
        while time.time() < deadline:
            path = os.path.join(ckpt, "state", "config.json")
            if os.path.exists(path) and os.path.getmtime(path) > seen and len(_trainers(ckpt)) >= 2:
                seen = os.path.getmtime(path)
                victim = _trainers(ckpt)[-1]
                os.kill(victim, signal.SIGKILL)
                log.append(victim)
                break
            time.sleep(0.05)
        time.sleep(1.0)


def _launch(args: list[str], kill: int = 0, ckpt: str = "") -> tuple[subprocess.CompletedProcess, list]:
    killed: list = []
    killer = threading.Thread(target=_kill_after_checkpoints, args=(ckpt, kill, killed), daemon=True)
    if kill:
        killer.start()
    done = subprocess.run([sys.executable, "-m", "des.launch", *args], env=ENV, cwd=ROOT, capture_output=True,
                          text=True, timeout=1200)
    return done, killed


@pytest.mark.mpi
def test_a_killed_process_costs_a_restart_not_the_job(tmp_path):
    data = _data(tmp_path)
    runs = {}
    for name, kill, extra, every in (("whole", 0, ["-np", "2", "--max-restarts", "0"], "20"),
                                     ("killed", 1, ["-np", "2", "--max-restarts", "1"], "1s"),     # by time
                                     ("shrunk", 2, ["-np", "3", "--min-np", "2", "--max-restarts", "2"], "20")):
        ckpt, summary = str(tmp_path / f"ck_{name}"), str(tmp_path / f"{name}.json")
        done, killed = _launch([*extra, "--record", str(tmp_path / f"{name}.record"), "--",
                                *_train_args(data, ckpt, summary, every)], kill, ckpt)
        assert done.returncode == 0, done.stderr[-3000:]
        assert _trainers(ckpt) == []                                   # no process left behind
        assert len(killed) == kill, (killed, done.stderr[-2000:])
        log = [ln for ln in done.stderr.splitlines() if ln.startswith("[des.launch]")]
        restarts = [ln for ln in log if "restart" in ln and "from" in ln]
        assert len(restarts) == kill, log
        assert all(" signal 9 (Killed)" in ln and "of work since that checkpoint lost" in ln for ln in restarts), log
        record = json.load(open(tmp_path / f"{name}.record"))
        assert [r["rc"] != 0 for r in record] == [True] * kill + [False], record
        if every == "20":                      # by steps: restarted mid-epoch, at step 20 or 40 (by time: where it fell)
            assert [r["position"]["step"] for r in record[:-1]] == [20, 40][:kill], record
        runs[name] = json.load(open(summary + ".rank0")), log
    whole = runs["whole"][0]
    for name in ("killed", "shrunk"):
        got = runs[name][0]
        print(f"{name}: log loss {got['logloss']} (uninterrupted {whole['logloss']}), auc {got['auc']} "
              f"({whole['auc']}), ends on {got['world_size']}")
        print("\n".join(runs[name][1]))
        assert abs(got["logloss"] - whole["logloss"]) <= 1e-5 and abs(got["auc"] - whole["auc"]) <= 1e-5
    assert runs["killed"][0]["world_size"] == 2 and runs["shrunk"][0]["world_size"] == 2      # 3 -> 2 -> 2
    shrunk = [ln for ln in runs["shrunk"][1] if "restart" in ln and "from" in ln]
    assert shrunk[0].endswith("on 2 process(es)") and shrunk[1].endswith("on 2 process(es)"), shrunk


@pytest.mark.mpi
def test_a_job_failing_before_its_first_checkpoint_is_not_restarted(tmp_path):
    ckpt = str(tmp_path / "ck")
    done = subprocess.run([sys.executable, "-m", "des.launch", "-np", "2", "--max-restarts", "5", "--",
                           "--mode", "des", "--data", str(tmp_path / "missing.txt"), "--checkpoint", ckpt],
                          env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode != 0
    assert done.stderr.count("[des.launch] attempt") == 1 and "failed before its first checkpoint" in done.stderr
    assert "missing.txt" in done.stdout + done.stderr


@pytest.mark.mpi
def test_ctrl_c_on_the_launcher_ends_every_process_it_started(tmp_path):
    data = _data(tmp_path)
    ckpt = str(tmp_path / "ck")
    proc = subprocess.Popen([sys.executable, "-m", "des.launch", "-np", "2", "--max-restarts", "3", "--stop-grace", "5",
                             "--", *_train_args(data, ckpt, str(tmp_path / "s.json"))],
                            env=ENV, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while len(_trainers(ckpt)) < 3 and time.time() < deadline:       # mpirun and its 2 training processes
        time.sleep(0.1)
    assert len(_trainers(ckpt)) == 3
    time.sleep(3)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err[-2000:]
    assert "stopped by signal 2: every process of the attempt ended" in err
    assert err.count("[des.launch] attempt") == 1                      # not taken for a failure to restart
    assert _trainers(ckpt) == []
