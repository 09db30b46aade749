"""One request model for the CLI, the Python API, `check` and calibration: typed groups (cluster, training,
configuration with its mesh, search), each knob declared once (groups.py) and read from there by the API's
signatures and routing (build.py) and the CLI's options (planner/cli/flags.py)."""

from .build import api_signature, build_request, flat, knob_names
from .groups import (PP_MICRO_BATCH, ClusterRequest, ConfigRequest, MeshRequest, Request, SearchRequest,
                     TrainingRequest)
from .knobs import Flag, Knob, knob, knob_table, knobs_of

__all__ = ["Request", "ClusterRequest", "TrainingRequest", "ConfigRequest", "MeshRequest", "SearchRequest",
           "build_request", "flat", "knob_names", "api_signature", "knob", "knob_table", "knobs_of", "Flag", "Knob",
           "PP_MICRO_BATCH"]
