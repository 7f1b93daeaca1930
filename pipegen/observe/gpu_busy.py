"""How busy this node's GPUs are while pipegen generates: `nvidia-smi` sampled once a second.

`GpuBusy.start(env)` runs `nvidia-smi --query-gpu=index,utilization.gpu --format=csv,noheader,nounits -lms 1000`
(narrowed to CUDA_VISIBLE_DEVICES when set) in a reader thread; without nvidia-smi, or when it lists no GPU,
it returns None and nothing is shown. `observe(generating)` is called at every step of the launcher's
tracking: the samples since the previous step count towards the mean when units were being generated
meanwhile (units finished, or requests in flight), so start-up, the server's load and the merge do not
dilute it. `mean()` is that mean over every GPU sampled, in percent.

Owns: the sampling process and the mean. Must never: make a run fail (a sampler that cannot start, or dies,
only leaves the figure out), or outlive the launcher (`stop()`; the child also ends with the pipe).
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import threading
from typing import Mapping

log = logging.getLogger("pipegen.gpu")

INTERVAL_MS = 1000


class GpuBusy:
    def __init__(self, proc: subprocess.Popen):
        self.proc = proc
        self._lock = threading.Lock()
        self._fresh: list[float] = []  # per-sample mean over the GPUs, since the last observe()
        self._sum = 0.0
        self._count = 0
        self._thread = threading.Thread(target=self._read, name="gpu-busy", daemon=True)
        self._thread.start()

    @classmethod
    def start(cls, env: Mapping[str, str]) -> "GpuBusy | None":
        if shutil.which("nvidia-smi") is None:
            return None
        argv = ["nvidia-smi", "--query-gpu=index,utilization.gpu", "--format=csv,noheader,nounits", f"-lms={INTERVAL_MS}"]
        visible = [x.strip() for x in (env.get("CUDA_VISIBLE_DEVICES") or "").split(",") if x.strip()]
        if visible and visible[0] != "-1":
            argv.append(f"--id={','.join(visible)}")
        try:
            proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
                                    text=True)
        except OSError as e:
            log.info("GPU utilisation not sampled: %s", e)
            return None
        return cls(proc)

    def _read(self) -> None:
        """Lines `index, utilization` for each GPU every interval; a sample is one interval's mean (an interval
        ends where a GPU's index comes again)."""
        interval: dict[str, float] = {}
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            index, _, value = line.partition(",")
            try:
                busy = float(value.strip())
            except ValueError:
                continue
            if index.strip() in interval:
                with self._lock:
                    self._fresh.append(sum(interval.values()) / len(interval))
                interval = {}
            interval[index.strip()] = busy

    def observe(self, generating: bool) -> None:
        """The samples since the last call count towards the mean if units were being generated meanwhile."""
        with self._lock:
            fresh, self._fresh = self._fresh, []
        if generating:
            self._sum += sum(fresh)
            self._count += len(fresh)

    def mean(self) -> float | None:
        return self._sum / self._count if self._count else None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
