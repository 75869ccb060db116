"""Start and stop a Spark standalone cluster (a master and workers) from the installed pyspark.

Only launches processes: importing this module does not import pyspark or start a JVM. Each
process is ``$SPARK_HOME/bin/spark-class <Master|Worker> ...`` (spark-class execs the JVM), started
in a session of its own so that ``stop()`` reaches the JVM and everything it started (a worker's
executors and their Python workers) through its process group. A ``prefix`` is prepended to the
command, e.g. ``["ip", "netns", "exec", "ns1"]`` to run it in a network namespace.

    from spark_stream import standalone as ss
    m = ss.start_master("127.0.0.1", 7077, 8080, log_dir="/tmp/spark")
    w = ss.start_worker(m.url, "127.0.0.1", cores=1, memory="1g", webui_port=8081,
                        work_dir="/tmp/spark/w1", log_dir="/tmp/spark")
    m.wait_ready(); w.wait_registered()
    ...  # SparkSession.builder.master(m.url) with PYSPARK_PYTHON set
    w.stop(); m.stop()

Readiness is read from the logs (works whatever namespace the process is in): the master's
"I have been elected leader" line, a worker's "Successfully registered with master". When the
master's web UI is reachable from here, ``SparkMaster.state()`` returns its JSON (``/json/``:
workers, active and completed applications).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path

MASTER_CLASS = "org.apache.spark.deploy.master.Master"
WORKER_CLASS = "org.apache.spark.deploy.worker.Worker"


class SparkLaunchError(RuntimeError):
    pass


def spark_home() -> Path:
    """SPARK_HOME: $SPARK_HOME if set, else the installed pyspark package (pip's pyspark carries
    bin/spark-class and the jars)."""
    env = os.environ.get("SPARK_HOME")
    if env and (Path(env) / "bin" / "spark-class").exists():
        return Path(env)
    spec = importlib.util.find_spec("pyspark")  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise SparkLaunchError("pyspark is not installed (pip install pyspark), and SPARK_HOME is not set")
    home = Path(next(iter(spec.submodule_search_locations)))
    if not (home / "bin" / "spark-class").exists():
        raise SparkLaunchError(f"no bin/spark-class in {home}; set SPARK_HOME")
    return home


def java_home() -> str | None:
    """$JAVA_HOME, else the JDK of the ``java`` on the PATH (None if there is none)."""
    if os.environ.get("JAVA_HOME"):
        return os.environ["JAVA_HOME"]
    java = shutil.which("java")
    return str(Path(java).resolve().parent.parent) if java else None


def spark_env(host: str, log_dir: str | os.PathLike, *, work_dir: str | os.PathLike | None = None,
              pyspark_python: str | None = None, java: str | None = None, daemon_memory: str = "256m",
              env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a master or worker: this process's, plus SPARK_HOME, JAVA_HOME,
    SPARK_LOCAL_IP=host (every port the JVM and its executors open binds there), SPARK_LOG_DIR,
    SPARK_WORKER_DIR, PYSPARK_PYTHON (default: this Python), a small daemon heap, the master's REST
    submission server off, then ``env``."""
    e = dict(os.environ)
    e["SPARK_HOME"] = str(spark_home())
    jh = java or java_home()
    if jh:
        e["JAVA_HOME"] = jh
    e["SPARK_LOCAL_IP"] = host
    e["SPARK_LOG_DIR"] = str(log_dir)
    if work_dir is not None:
        e["SPARK_WORKER_DIR"] = str(work_dir)
    e["PYSPARK_PYTHON"] = pyspark_python or sys.executable
    e["SPARK_DAEMON_MEMORY"] = daemon_memory
    # no REST submission server (it would listen on 6066)
    e["SPARK_MASTER_OPTS"] = (e.get("SPARK_MASTER_OPTS", "") + " -Dspark.master.rest.enabled=false").strip()
    if env:
        e.update(env)
    return e


class SparkProcess:
    """One master or worker JVM: its Popen (session leader), log file and addresses."""

    role = "process"
    ready_line = ""

    def __init__(self, cmd: list[str], env: dict[str, str], log_path: Path, host: str, webui_port: int):
        self.cmd = cmd
        self.host = host
        self.webui_port = webui_port
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log_path, "ab")
        self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        self.pid = self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def log_tail(self, n: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-n:])

    def wait_for_log(self, needle: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if needle in self.log_text():
                return
            if not self.alive():
                raise SparkLaunchError(f"spark {self.role} exited ({self.proc.returncode}) before "
                                       f"{needle!r}; {self.log_path}:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise SparkLaunchError(f"spark {self.role}: no {needle!r} after {timeout:.0f} s; "
                                       f"{self.log_path}:\n{self.log_tail()}")
            time.sleep(0.2)

    def wait_ready(self, timeout: float = 90.0) -> None:
        self.wait_for_log(self.ready_line, timeout)

    def stop(self, timeout: float = 20.0) -> int | None:
        """SIGTERM the process group (the JVM and its children: executors, Python workers), SIGKILL
        what is left after ``timeout``. Returns the JVM's exit code."""
        try:
            pgid = os.getpgid(self.pid)
        except ProcessLookupError:
            pgid = self.pid  # the leader is gone: its group may not be
        try:
            os.killpg(pgid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
        # whatever is still running (an executor that ignored SIGTERM, the JVM itself)
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass
        self._log.close()
        return self.proc.returncode

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


class SparkMaster(SparkProcess):
    role = "master"
    ready_line = "I have been elected leader"

    def __init__(self, cmd, env, log_path, host: str, port: int, webui_port: int):
        super().__init__(cmd, env, log_path, host, webui_port)
        self.port = port

    def wait_ready(self, timeout: float = 90.0) -> None:
        """Wait for "I have been elected leader"; then take the ports the master actually bound from its
        log (Spark moves to the next free port when one is taken)."""
        super().wait_ready(timeout)
        text = self.log_text()
        m = re.search(r"Starting Spark master at spark://\S+:(\d+)", text)
        if m:
            self.port = int(m.group(1))
        m = re.search(r"Successfully started service 'MasterUI' on port (\d+)", text)
        if m:
            self.webui_port = int(m.group(1))

    @property
    def url(self) -> str:
        """The master URL for drivers and workers: spark://host:port."""
        return f"spark://{self.host}:{self.port}"

    @property
    def webui_url(self) -> str:
        return f"http://{self.host}:{self.webui_port}"

    def state(self, timeout: float = 5.0) -> dict:
        """The master's JSON status (``/json/``): workers (state ALIVE, cores, memory), activeapps,
        completedapps. Needs the web UI to be reachable from this process."""
        with urllib.request.urlopen(f"{self.webui_url}/json/", timeout=timeout) as r:
            return json.loads(r.read())

    def alive_workers(self) -> list[dict]:
        return [w for w in self.state().get("workers", []) if w.get("state") == "ALIVE"]

    def wait_workers(self, n: int, timeout: float = 90.0) -> list[dict]:
        """Wait until the master's JSON lists ``n`` ALIVE workers."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                alive = self.alive_workers()
                if len(alive) >= n:
                    return alive
            except OSError:
                alive = []
            if not self.alive():
                raise SparkLaunchError(f"spark master exited; {self.log_path}:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise SparkLaunchError(f"spark master: {len(alive)} of {n} workers alive after {timeout:.0f} s")
            time.sleep(0.3)


class SparkWorker(SparkProcess):
    role = "worker"
    ready_line = "Successfully registered with master"

    def __init__(self, cmd, env, log_path, host: str, master_url: str, webui_port: int, work_dir: Path):
        super().__init__(cmd, env, log_path, host, webui_port)
        self.master_url = master_url
        self.work_dir = work_dir

    def wait_registered(self, timeout: float = 90.0) -> None:
        """Wait for the worker's log line "Successfully registered with master"."""
        self.wait_ready(timeout)

    def executor_dirs(self) -> list[Path]:
        """The executors this worker ran: <work_dir>/<app id>/<executor id>."""
        if not self.work_dir.exists():
            return []
        return sorted(p for app in self.work_dir.iterdir() if app.is_dir() for p in app.iterdir() if p.is_dir())


def _spark_class() -> str:
    return str(spark_home() / "bin" / "spark-class")


def start_master(host: str, port: int, webui_port: int, *, log_dir: str | os.PathLike,
                 prefix: Sequence[str] = (), pyspark_python: str | None = None, java: str | None = None,
                 env: Mapping[str, str] | None = None, name: str = "master") -> SparkMaster:
    """Start ``spark-class org.apache.spark.deploy.master.Master --host H --port P --webui-port W``
    (log: <log_dir>/<name>.log). Returns at once; call ``wait_ready()``."""
    log_dir = Path(log_dir)
    cmd = [*prefix, _spark_class(), MASTER_CLASS, "--host", host, "--port", str(port), "--webui-port", str(webui_port)]
    e = spark_env(host, log_dir, pyspark_python=pyspark_python, java=java, env=env)
    return SparkMaster(cmd, e, log_dir / f"{name}.log", host, port, webui_port)


def start_worker(master_url: str, host: str, *, cores: int = 1, memory: str = "1g", webui_port: int,
                 work_dir: str | os.PathLike, log_dir: str | os.PathLike, prefix: Sequence[str] = (),
                 pyspark_python: str | None = None, java: str | None = None, env: Mapping[str, str] | None = None,
                 name: str | None = None) -> SparkWorker:
    """Start ``spark-class org.apache.spark.deploy.worker.Worker spark://H:P --host H --cores C --memory M
    --work-dir D --webui-port W`` (log: <log_dir>/<name>.log, default worker-<webui_port>). ``memory`` is
    what the worker offers executors (each executor's heap is the driver's spark.executor.memory).
    Returns at once; call ``wait_registered()``."""
    log_dir, work_dir = Path(log_dir), Path(work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    cmd = [*prefix, _spark_class(), WORKER_CLASS, master_url, "--host", host, "--cores", str(cores),
           "--memory", memory, "--work-dir", str(work_dir), "--webui-port", str(webui_port)]
    e = spark_env(host, log_dir, work_dir=work_dir, pyspark_python=pyspark_python, java=java, env=env)
    return SparkWorker(cmd, e, log_dir / f"{name or f'worker-{webui_port}'}.log", host, master_url, webui_port,
                       work_dir)


def stop_all(processes: Sequence[SparkProcess], timeout: float = 20.0) -> None:
    """Stop workers before the master; never raises."""
    for p in sorted(processes, key=lambda p: isinstance(p, SparkMaster)):
        try:
            p.stop(timeout)
        except Exception:  # noqa: BLE001 - best effort, keep stopping the others
            pass
