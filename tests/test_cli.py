"""`portddp` (portddp/cli.py): arguments it cannot honour are refused in one line naming the value
and the fix, before mpirun or any namespace starts; options are passed on by every subcommand.

In-process calls of cli.main with mpirun, the cluster and its probe replaced: no root needed."""

from __future__ import annotations

import os
import sys

import pytest

from portddp import cli, cluster


@pytest.fixture
def launched(monkeypatch):
    """What cli.main would have launched (mpirun's command lines, cluster.main's arguments); fails the test
    at any `ip`/`tc` command (a namespace, link or the availability probe). The environment and path
    cli.main changes are put back afterwards."""
    calls = []
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
    monkeypatch.setenv("PORTDDP_MPIRUN_BIND", "")
    monkeypatch.setenv("PORTDDP_CLUSTER_UNAVAILABLE", "")

    def made(*cmd, **_):
        raise AssertionError(f"something was made: {cmd}")

    monkeypatch.setattr(cluster, "_run", made)
    monkeypatch.setattr(cli, "_call", lambda cmd: calls.append(("mpirun", cmd)) or 0)
    monkeypatch.setattr(cli, "binding", lambda n, bind, mpirun: [])
    monkeypatch.setattr(cluster, "main", lambda argv: calls.append(("cluster", argv)) or 0)
    return calls


_USAGE_ERRORS = [
    (["run", "overlap", "-n", "0"], "portddp run: error: -n 0: a job needs at least one rank: pass -n 1 or more"),
    (["run", "overlap", "-n", "-1"], "portddp run: error: -n -1: a job needs at least one rank: pass -n 1 or more"),
    (["compare", "-n", "0"], "portddp compare: error: -n 0: a job needs at least one rank: pass -n 1 or more"),
    (["mixed", "-n", "-3"], "portddp mixed: error: -n -3: a job needs at least one rank: pass -n 1 or more"),
    (["run", "overlap", "-n", "0", "--hosts", "2"],
     "portddp run: error: -n 0: a job needs at least one rank per host: pass a multiple of 2 (-n 2, 4, ...)"),
    (["run", "overlap", "-n", "3", "--hosts", "2"],
     "portddp run: error: -n 3 ranks do not spread evenly over 2 hosts: pass a multiple of 2"),
    (["compare", "--hosts", "0"], "portddp compare: error: --hosts 0: pass 1 to 250 emulated hosts"),
    (["mixed", "--hosts", "-1"], "portddp mixed: error: --hosts -1: pass 1 to 250 emulated hosts"),
    (["run", "overlap", "--link", "500mbit"], "portddp run: error: --link 500mbit applies only to an emulated "
                                              "cluster: add --hosts H (e.g. --hosts 2), or drop --link"),
    (["compare", "--link", "matched"], "portddp compare: error: --link matched applies only to an emulated "
                                       "cluster: add --hosts H (e.g. --hosts 2), or drop --link"),
    (["mixed", "--or-loopback"], "portddp mixed: error: --or-loopback applies only to an emulated cluster (where "
                                 "none can be made, run on loopback): add --hosts H, or drop it -- without --hosts "
                                 "the job runs on loopback anyway"),
    (["run", "overlap", "--hosts", "2", "--link", "1000"],
     "portddp run: error: link rate '1000' has no unit: write one, e.g. 1000mbit or 1gbit (1000bit if you do "
     "mean 1000 bits/s); 0 or unlimited: no shaping"),
    (["mixed", "-n", "2", "--hosts", "2", "--link", "fast"],
     "portddp mixed: error: link rate 'fast' not understood: use e.g. 1gbit, 500mbit, 2.5gbit, or unlimited"),
    (["run", "overlap", "--hosts", "2", "--link", "0mbit"],
     "portddp run: error: link rate '0mbit' is not above zero: pass a rate, e.g. 1gbit or 500mbit; unlimited (or a "
     "bare 0) for no shaping"),
    (["run", "overlap", "--hosts", "2", "--bind", "none"],
     "portddp run: error: --bind none applies only without --hosts (each emulated host runs its own ranks): drop "
     "--bind (with --or-loopback it applies where the job falls back to this machine)"),
    # the module's own options, parsed once here before mpirun (were: an argparse error per rank, after the launch)
    (["run", "overlap", "-n", "2", "--hots", "2"],
     "portddp run overlap [-n N] [--hosts H] [--link RATE] [--]: error: unrecognized arguments: --hots 2"),
    (["run", "no_sync", "--", "--every", "0"],
     "portddp run no_sync [-n N] [--hosts H] [--link RATE] [--]: error: --every 0: pass 1 or more (micro-batches "
     "per sync)"),
    (["compare", "-n", "2", "--steps", "0"],
     "portddp compare [-n N] [--hosts H] [--link RATE] [--]: error: --steps 0: pass 1 or more (optimizer steps)"),
]


@pytest.mark.parametrize("argv,message", _USAGE_ERRORS)
def test_refused_in_one_line_before_anything_starts(argv, message, launched, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2, err
    assert err.endswith(message + "\n"), err
    assert "Traceback" not in err and launched == []


def test_binding_refuses_no_ranks():
    """(cli.main refuses -n 0 first; binding itself said ZeroDivisionError.)"""
    with pytest.raises(ValueError, match="n=0 ranks: pass 1 or more"):
        cli.binding(0, "cores", sys.executable)


@pytest.mark.parametrize("command,module,extra", [(["compare"], "comparisons.equivalence", ["--model", "mlp"]),
                                                 (["mixed"], "comparisons.mixed", []),
                                                 (["run", "overlap"], "experiments.overlap", ["--batch", "8"])])
def test_or_loopback_runs_every_subcommand_on_this_machine(command, module, extra, launched, monkeypatch, capsys):
    """Where no cluster can be made, --or-loopback runs on loopback (and says why) for run, compare and
    mixed alike; without it each refuses."""
    monkeypatch.setattr(cluster, "unavailable", lambda: "not root (test)")
    with pytest.raises(SystemExit, match="portddp: no emulated cluster here: not root"):
        cli.main([*command, "-n", "2", "--hosts", "2", "--", *extra])
    assert launched == []
    assert cli.main([*command, "-n", "2", "--hosts", "2", "--link", "500mbit", "--or-loopback", "--", *extra]) == 0
    assert "no emulated cluster here (not root (test)): running on this machine's loopback" in capsys.readouterr().out
    assert os.environ["PORTDDP_CLUSTER_UNAVAILABLE"] == "not root (test)"
    [(what, cmd)] = launched
    assert what == "mpirun" and cmd[cmd.index("-n"):cmd.index("-n") + 2] == ["-n", "2"], cmd
    assert cmd[cmd.index("-m") + 1:] == [module, *extra], cmd


def test_hosts_go_to_the_cluster_with_the_default_link(launched, monkeypatch):
    monkeypatch.setattr(cluster, "unavailable", lambda: None)
    assert cli.main(["compare", "-n", "4", "--hosts", "2", "--", "--model", "mlp"]) == 0
    assert cli.main(["mixed", "-n", "2", "--hosts", "2", "--link", "0"]) == 0  # 0: unlimited (no shaping)
    (_, first), (_, second) = launched
    assert first == ["-n", "4", "--hosts", "2", "--link", "1gbit", "--", sys.executable, "-m",
                     "comparisons.equivalence", "--model", "mlp"], first
    assert second[:6] == ["-n", "2", "--hosts", "2", "--link", "0"], second


def test_report_help_shows_the_reports_own_options(monkeypatch, capsys):
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
    with pytest.raises(SystemExit) as exit_:
        cli.main(["report", "--help"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0
    assert out.startswith("usage: portddp report [-h] [--results RESULTS] [--out OUT]"), out
    assert "--results RESULTS" in out and "--out OUT" in out
    with pytest.raises(SystemExit):
        cli.main(["report", "--bogus"])
    assert "portddp report: error: unrecognized arguments: --bogus" in capsys.readouterr().err


def test_a_modules_help_is_printed_once_without_mpirun(capfd, monkeypatch):
    """`portddp run X -- --help` shows the experiment's options once: not once per rank, no cluster made."""
    monkeypatch.setattr(sys, "path", list(sys.path))  # (cli.main puts the checkout on both)
    monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
    for job in (["-n", "2", "--hosts", "2"], ["-n", "3", "--hosts", "2"]):  # (the help, whatever the job)
        assert cli.main(["run", "overlap", *job, "--", "--help"]) == 0
        out = capfd.readouterr().out
        assert out.count("usage: ") == 1 and "--out-dir OUT_DIR" in out and "$ mpirun" not in out, out


@pytest.mark.parametrize("argv,own", [(["run", "overlap"], ["portddp run overlap -- --help",
                                                             "python -m experiments.overlap --help"]),
                                      (["run"], ["portddp run EXPERIMENT -- --help"]),
                                      (["compare"], ["portddp compare -- --help",
                                                     "python -m comparisons.equivalence --help"])])
def test_wrapper_help_says_where_the_modules_own_options_are(argv, own, launched, capsys):
    """(`portddp run overlap --help` showed the wrapper's options only, with no word of --rounds & co.)"""
    with pytest.raises(SystemExit) as exit_:
        cli.main([*argv, "--help"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0 and launched == []
    assert "own options (passed on after --):" in out and all(f"  {line}" in out for line in own), out


def test_cluster_help_shows_the_defaults(capsys):
    with pytest.raises(SystemExit):
        cli.main(["cluster", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "no shaping (default: 1gbit)" in out and "(a multiple of --hosts) (default: 2)" in out, out


def test_ctrl_c_stops_the_job_and_says_so_in_one_line(tmp_path):
    """(Ctrl-C on `portddp run` printed two chained tracebacks.) SIGINT to the whole foreground group,
    as a terminal sends it: mpirun stops its ranks, portddp waits for that and exits 130."""
    import signal  # noqa: PLC0415
    import subprocess  # noqa: PLC0415
    import time  # noqa: PLC0415

    proc = subprocess.Popen([sys.executable, "-m", "portddp.cli", "run", "soak", "-n", "1", "--", "--impls", "torch-mpi",
                             "--out", str(tmp_path / "soak.json")], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        time.sleep(8)  # (mpirun and its rank started)
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, (out, err)
    # (the rank's own KeyboardInterrupt may be reported by the rank, as any interrupted script's; the
    # wrapper adds one line and no traceback of its own)
    assert err.endswith("portddp: interrupted; mpirun and its ranks have stopped\n"), err
    assert "cli.py" not in err and "subprocess.py" not in err, err
