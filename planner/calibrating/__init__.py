"""`fsdp-plan calibrate`: plan -> run the top K (or one given config) under torchrun -> fit -> re-rank.

    from planner.calibrating import CalibrationRequest, calibrate
    report = calibrate(CalibrationRequest(model="llama3-8b", gpus=8, top=3, out_dir="calib"))
    report.best                      # the config that trained fastest, as a planner Candidate
    report.profile_path              # DIR/profile.json, for `fsdp-plan --profile`

Each run is its own torchrun job (calibration.launch) of calibration.runner; its line goes to
DIR/results.jsonl as soon as it ends, measured or failed. The fit (calibration.fit) uses every measured
run in the file, so `--resume` with a larger --top extends a calibration.

--device cpu runs the same FSDP code on gloo, one thread per rank. The cost model has no CPU in its GPU
catalog, so the CPU is measured first (calibration.runner --probe: matmul FLOP/s at the model's shape
per dtype, copy bandwidth, gloo bus bandwidth and latency; DIR/host.json) and used as the "GPU". The
fitted coefficients are then fractions of those measured rates on this host: they calibrate the
machinery (and test it), they say nothing about a GPU.

torch is imported only where a model must be built in this process (a user factory) or a CUDA
fingerprint taken; launching and fitting need neither.

The package, one job per module:

    request.py     what is asked (CalibrationRequest), the model it runs (Target), what comes back
                   (RunView, CalibrationReport)
    flow.py        the orchestration: candidates -> one torchrun job per run -> results.jsonl -> fit -> re-rank
    host.py        this host: the environment ranks start in, the CPU probe (host.json), fingerprints
    progress.py    the progress line / bar on stderr
    multinode.py   the text a multi-node calibration prints: per-node commands, the SLURM script

The report's text and JSON are in planner/reports/table_calibration.py, beside the other report code.
"""

from .flow import calibrate
from .multinode import slurm_script
from .request import CalibrationReport, CalibrationRequest

__all__ = ["CalibrationRequest", "CalibrationReport", "calibrate", "slurm_script"]
