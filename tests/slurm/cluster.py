"""A private single-node Slurm for tests, brought up in a temporary folder.

Usage::

    with SlurmCluster() as cluster:
        if cluster.skip_reason:
            ...  # no Slurm here, and none could be started
        subprocess.run(["sbatch", ...], env=cluster.env())

If a Slurm is already reachable (``sinfo`` answers with the environment as it is) it is
used as is. Otherwise, as root with Debian's ``slurmctld``, ``slurmd`` and ``munge``
installed (``tests/slurm/install_slurm.sh``), munged (unless running), slurmctld and
slurmd are started by hand in the foreground and stopped by their PIDs on exit.
"""
from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

MUNGE_SOCKET = Path("/run/munge/munge.socket.2")
NODE_CPUS = 8  # declared; SlurmdParameters=config_overrides lets a 2-core machine claim it
SEARCH_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin", "/usr/bin"])


def _which(name: str) -> str | None:
    """A program on PATH or in the sbin folders (daemons live there; a user's PATH may lack them)."""
    return shutil.which(name, path=SEARCH_PATH)


def _free_port() -> int:
    """A TCP port that is free right now."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _run(cmd: list[str], env: dict | None = None, timeout: float = 10) -> subprocess.CompletedProcess:
    """Run a short command, capturing its output; never raises on failure or timeout."""
    try:
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return subprocess.CompletedProcess(cmd, 1, "", str(exc))


class SlurmCluster:
    """Context manager: a reachable Slurm, ours or an existing one.

    Attributes: ``skip_reason`` (None when usable), ``private`` (True when we started
    the daemons), ``conf`` (our slurm.conf, or None), ``node`` (our node's name),
    ``startup_s`` (seconds the bring-up took).
    """

    def __init__(self, cpus: int = NODE_CPUS, timeout: float = 30):
        self.cpus = cpus
        self.timeout = timeout
        self.skip_reason: str | None = None
        self.private = False
        self.conf: Path | None = None
        self.node = socket.gethostname().split(".")[0]
        self.root: Path | None = None
        self.startup_s = 0.0
        self._procs: list[tuple[str, subprocess.Popen]] = []

    # -- public -------------------------------------------------------------------

    def env(self, base: dict | None = None) -> dict:
        """An environment in which sinfo/sbatch/srun reach this cluster."""
        env = dict(os.environ if base is None else base)
        if self.conf is not None:
            env["SLURM_CONF"] = str(self.conf)
        return env

    def log_tail(self, lines: int = 30) -> str:
        """The last lines of our daemons' logs, for failure messages."""
        if self.root is None:
            return ""
        out = []
        for name in ("slurmctld.log", "slurmd.log", "munged.log"):
            path = self.root / "log" / name
            if path.exists():
                text = path.read_text(errors="replace").splitlines()[-lines:]
                out.append(f"--- {path}\n" + "\n".join(text))
        return "\n".join(out)

    def start(self) -> SlurmCluster:
        """Use a reachable Slurm, or start a private one; sets skip_reason when neither."""
        t0 = time.monotonic()
        try:
            if self._existing_slurm():
                return self
            self.skip_reason = self._cannot_start()
            if self.skip_reason:
                return self
            self.private = True
            self.root = Path(tempfile.mkdtemp(prefix="distsim-slurm-"))
            self._start_munge()
            self._write_conf()
            self._start_slurm()
            self._wait_idle()
        except Exception as exc:  # a broken bring-up becomes a skip (a failure under CI=true)
            self.skip_reason = f"private Slurm did not come up: {exc}\n{self.log_tail()}"
            self.stop()
        finally:
            self.startup_s = time.monotonic() - t0
        return self

    def stop(self) -> None:
        """Cancel our jobs, then stop the daemons we started, newest first, by PID."""
        if self.private and self._procs:
            self._cancel_jobs()
        for _, proc in reversed(self._procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=5)
        self._procs.clear()
        self._kill_leftovers()
        if self.root is not None and os.environ.get("DISTSIM_KEEP_SLURM_DIR") != "1":
            shutil.rmtree(self.root, ignore_errors=True)
            self.root = None

    def __enter__(self) -> SlurmCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- bring-up -----------------------------------------------------------------

    def _existing_slurm(self) -> bool:
        """True when sinfo already reaches a controller without our conf."""
        if not _which("sinfo"):
            return False
        res = _run([_which("sinfo"), "-h", "-o", "%N"], timeout=5)
        return res.returncode == 0 and bool(res.stdout.strip())

    def _cannot_start(self) -> str | None:
        """Why a private Slurm cannot be started here, or None."""
        if os.geteuid() != 0:
            return "no Slurm reachable and not root: cannot start a private one"
        missing = [p for p in ("slurmctld", "slurmd", "munged", "sbatch", "srun", "sinfo") if not _which(p)]
        if missing:
            return (f"no Slurm reachable and {', '.join(missing)} not installed "
                    "(run tests/slurm/install_slurm.sh as root)")
        try:
            pwd.getpwnam("munge")
        except KeyError:
            return "no munge user: the munge package is not installed properly"
        if not Path("/etc/munge/munge.key").exists():
            return "no /etc/munge/munge.key"
        return None

    def _munge_works(self) -> bool:
        """True when a munged answers on the default socket."""
        if not MUNGE_SOCKET.exists():
            return False
        cred = _run(["munge", "-n"], timeout=5)
        if cred.returncode != 0:
            return False
        try:
            res = subprocess.run(["unmunge"], input=cred.stdout, capture_output=True, text=True, timeout=5)
        except subprocess.TimeoutExpired:
            return False
        return res.returncode == 0

    def _start_munge(self) -> None:
        """Start munged as the munge user unless one already answers."""
        if self._munge_works():
            return
        user = pwd.getpwnam("munge")
        run_dir = MUNGE_SOCKET.parent
        run_dir.mkdir(mode=0o755, parents=True, exist_ok=True)
        os.chown(run_dir, user.pw_uid, user.pw_gid)
        log = self.root / "log"
        log.mkdir()
        os.chown(log, user.pw_uid, user.pw_gid)
        cmd = [_which("munged"), "--foreground", "--force", f"--log-file={log / 'munged.log'}"]
        with open(log / "munged.stderr", "wb") as err:
            proc = subprocess.Popen(cmd, user=user.pw_uid, group=user.pw_gid, extra_groups=[],
                                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
                                    start_new_session=True)
        self._procs.append(("munged", proc))
        self._wait(self._munge_works, "munged to answer", proc)

    def _write_conf(self) -> None:
        """Write slurm.conf, with all state, spool, pid and log paths in the private folder."""
        r = self.root
        for sub in ("state", "spool", "log", "run"):
            (r / sub).mkdir(exist_ok=True)
        lines = [
            "ClusterName=distsim-test",
            f"SlurmctldHost={self.node}(127.0.0.1)",
            f"SlurmctldPort={_free_port()}",
            f"SlurmdPort={_free_port()}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "MpiDefault=none",
            "SwitchType=switch/none",
            "JobCompType=jobcomp/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "SchedulerType=sched/builtin",
            "ReturnToService=2",
            "SlurmdParameters=config_overrides",
            "MailProg=/bin/true",
            "KillWait=2",
            "MinJobAge=5",  # sbatch --wait polls every 2 s only while MinJobAge/2 <= 2
            "InactiveLimit=0",
            f"StateSaveLocation={r / 'state'}",
            f"SlurmdSpoolDir={r / 'spool'}",
            f"SlurmctldPidFile={r / 'run' / 'slurmctld.pid'}",
            f"SlurmdPidFile={r / 'run' / 'slurmd.pid'}",
            f"SlurmctldLogFile={r / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={r / 'log' / 'slurmd.log'}",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
            f"NodeName={self.node} NodeAddr=127.0.0.1 CPUs={self.cpus} State=UNKNOWN",
            f"PartitionName=debug Nodes={self.node} Default=YES MaxTime=INFINITE State=UP",
        ]
        self.conf = r / "slurm.conf"
        self.conf.write_text("\n".join(lines) + "\n")

    def _start_slurm(self) -> None:
        """Start slurmctld, then slurmd, in the foreground so we hold their PIDs."""
        env = self.env()
        for name, cmd in (("slurmctld", [_which("slurmctld"), "-D", "-i"]), ("slurmd", [_which("slurmd"), "-D"])):
            with open(self.root / "log" / f"{name}.stderr", "wb") as err:
                proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                        stderr=err, start_new_session=True)
            self._procs.append((name, proc))
            if name == "slurmctld":
                self._wait(lambda: _run([_which("sinfo"), "-h"], env=env, timeout=5).returncode == 0,
                           "slurmctld to answer", proc)

    def _wait_idle(self) -> None:
        """Wait until sinfo shows our node idle."""
        env = self.env()

        def idle() -> bool:
            res = _run(["sinfo", "-h", "-N", "-n", self.node, "-o", "%t"], env=env, timeout=5)
            return res.returncode == 0 and res.stdout.strip() == "idle"

        self._wait(idle, f"node {self.node} to be idle", self._procs[-1][1])

    def _wait(self, ready, what: str, proc: subprocess.Popen) -> None:
        """Poll ready() until true; raise if proc dies or the timeout passes."""
        deadline = time.monotonic() + self.timeout
        while not ready():
            if proc.poll() is not None:
                raise RuntimeError(f"{Path(proc.args[0]).name} exited with {proc.returncode} while waiting for {what}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"timed out after {self.timeout:.0f} s waiting for {what}")
            time.sleep(0.1)

    def _kill_leftovers(self) -> None:
        """SIGKILL processes that still carry our SLURM_CONF (stuck slurmstepd, job tasks)."""
        if self.conf is None:
            return
        mark = f"SLURM_CONF={self.conf}".encode()
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit() or int(proc.name) == os.getpid():
                continue
            try:
                if mark in (proc / "environ").read_bytes().split(b"\0"):
                    os.kill(int(proc.name), signal.SIGKILL)
            except (OSError, ValueError):
                continue

    def _cancel_jobs(self) -> None:
        """Cancel every job of our private cluster and give them a moment to end."""
        env = self.env()
        _run(["scancel", "--full", "--partition=debug"], env=env)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            res = _run(["squeue", "-h", "-o", "%i"], env=env, timeout=5)
            if res.returncode != 0 or not res.stdout.strip():
                return
            time.sleep(0.2)
