"""This host, as a calibration sees it: the environment its ranks start in, the CPU measured as the
cost model's "GPU" (--device cpu: calibration.runner --probe, kept in DIR/host.json), and the fingerprint
a fitted profile is checked against."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from calibration import launch as launching
from calibration import store
from cost_models.specs import ClusterSpec, TrainingSpec

from ..errors import PlannerError
from .progress import Progress
from .request import CalibrationRequest, Target

ROOT = Path(__file__).resolve().parents[2]  # the checkout: ranks run `-m calibration.runner` from here


def runner_env() -> dict:
    """Ranks import calibration/ from this installation and a --factory module from the current directory
    (as `python -m` would); one thread each (torchrun's default)."""
    paths = [str(ROOT), os.getcwd(), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {"PYTHONPATH": os.pathsep.join(dict.fromkeys(paths)), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def cpu_cluster(host: store.HostSpec, n_ranks: int, per_node: int) -> ClusterSpec:
    return ClusterSpec(gpu=host.gpu_spec(), n_gpus=n_ranks, gpus_per_node=per_node,
                       internode_bytes_per_s=host.bus_bytes_per_s)


def probe_host(out_dir: Path, target: Target, training: TrainingSpec, ranks: int, dtypes: set[str],
               timeout_s: float, node_rank: int = 0, progress: Progress | None = None) -> store.HostProbe:
    """DIR/host.json, measured now unless an earlier probe there covers these dtypes. Other nodes of a
    multi-node CPU calibration wait for node 0's (same candidates on every node need the same "GPU")."""
    path = out_dir / "host.json"
    if node_rank:
        deadline = time.monotonic() + timeout_s
        while not path.exists():
            if time.monotonic() > deadline:
                raise PlannerError("out", f"no {path} from node 0 after {timeout_s:.0f} s: --out must be a "
                                          "directory every node sees")
            time.sleep(1.0)
        return store.HostProbe.model_validate_json(path.read_text())
    if path.exists():
        probe = store.HostProbe.model_validate_json(path.read_text())
        if dtypes <= {d for d, v in probe.host.peak_flops.items() if v > 0} and probe.host.ranks == ranks:
            return probe
    if progress:
        progress.note("measuring the CPU (matmul FLOP/s, memory and gloo bandwidth) ...")
    spec = target.run_spec
    shape = (2 * training.seq_len, spec.hidden_size, spec.ffn_hidden_size)
    argv = launching.Launch(nproc_per_node=ranks).torchrun_args() + [
        "-m", "calibration.runner", "--probe", "--shape", ",".join(map(str, shape)), "--dtypes", ",".join(sorted(dtypes)),
        "--block-bytes", str(4 * spec.block_params), "--out", str(out_dir / "probe.json")]
    outcome = launching.run_job(argv, timeout_s=timeout_s, result_path=out_dir / "probe.json",
                                error_dir=out_dir / "logs" / "probe-errors", log_path=out_dir / "logs" / "probe.log",
                                env=runner_env(), cwd=ROOT)
    if outcome.status != "ok":
        raise PlannerError("device", f"measuring the CPU failed ({outcome.status}): {outcome.message}; see "
                                     f"{out_dir / 'logs' / 'probe.log'}")
    probe = store.HostProbe.model_validate(outcome.result)
    store.write_atomic(path, probe.model_dump_json(indent=2) + "\n")
    if progress:
        host = probe.host
        progress.note(f"  {host.name}: {host.peak_flops['fp32'] / 1e9:.1f} GFLOP/s fp32 per rank, gloo "
                      f"{host.bus_bytes_per_s / 1e9:.2f} GB/s bus, {probe.hop_latency_s * 1e6:.0f} us per hop")
    return probe


def live_fingerprint(request: CalibrationRequest, per_node: int, nodes: int) -> store.Fingerprint:
    """This cluster's fingerprint, taken in a short subprocess (so this process never holds a CUDA context
    that would sit on GPU 0 during the runs)."""
    code = ("import json, torch; from calibration.runner import fingerprint; "
            f"print(json.dumps(fingerprint(torch.device({request.device!r}), {per_node}, {nodes})))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, **runner_env()}, cwd=ROOT, timeout=300)
    if proc.returncode:
        raise PlannerError("device", f"cannot read this machine's fingerprint: {proc.stderr.strip()[-300:]}")
    return store.Fingerprint.model_validate_json(proc.stdout.strip().splitlines()[-1])


def cpu_fingerprint(out: Path, host: store.HostSpec, per_node: int) -> store.Fingerprint:
    probe_path = out / "host.json"
    if probe_path.exists():
        return store.HostProbe.model_validate_json(probe_path.read_text()).fingerprint
    from importlib.metadata import version

    return store.Fingerprint(device_type="cpu", device_name=store.cpu_name(), devices_per_node=per_node,
                             torch_version=version("torch"))

