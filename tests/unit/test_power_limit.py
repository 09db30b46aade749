"""A board power cap (--power-limit-w WATTS, API power_limit_w, the catalog's power_limit_w): matmul and attention
rates x (cap / TDP)^(1/3), HBM and links unchanged (GpuSpec.clock_scale); h100-96gb is H100 SXM at 500 W."""

import json
from dataclasses import replace

import jsonschema
import pytest

from cost_models.kernel_time import Rates
from cost_models.profile import DEFAULT_PROFILE
from planner import estimate
from planner.cli import main
from planner.errors import PlannerError
from planner.hardware import _CATALOG, get_gpu, make_cluster
from planner.schemas import json_schema

ENTRIES = json.loads(_CATALOG.read_text())["gpus"]
B200_750W = 0.9086  # (750 / 1000)^(1/3) = 0.90856, by hand


def rates(gpu):
    return Rates.of(gpu, "bf16", DEFAULT_PROFILE)


def invoke(argv, capsys):
    try:
        main(argv)
        code = 0
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("entry", ENTRIES, ids=[e["id"] for e in ENTRIES])
def test_every_entry_says_where_its_board_power_comes_from(entry):
    assert entry["tdp_source"].strip()
    assert entry.get("tdp_w", 1) > 0 and entry.get("power_limit_w", 0) <= entry.get("tdp_w", 0)
    assert ("tdp_w" in entry) == (not entry["tdp_source"].startswith("unset"))


def test_board_powers_by_hand():
    tdp = {g: get_gpu(g).tdp_w for g in ("a100-80gb", "h100-80gb", "h200-141gb", "b200", "gb200", "h20", "gh200")}
    assert tdp == {"a100-80gb": 400, "h100-80gb": 700, "h200-141gb": 700, "b200": 1000, "gb200": 1200, "h20": 0,
                   "gh200": 0}


def test_750_w_on_b200_scales_compute_not_memory_or_links():
    full, capped = get_gpu("b200"), make_cluster(8, "b200", power_limit_w=750).gpu
    assert capped.clock_scale == pytest.approx(B200_750W, abs=5e-5)
    # b200 has no measured efficiencies: the profile's defaults (0.8, 0.35) are what the cap scales
    assert capped.matmul_fraction(0.8) == pytest.approx(0.8 * B200_750W, abs=5e-5)
    a, b = rates(full), rates(capped)
    assert b.matmul_flops_per_s / a.matmul_flops_per_s == pytest.approx(B200_750W, abs=5e-5)
    assert b.float8_flops_per_s / a.float8_flops_per_s == pytest.approx(B200_750W, abs=5e-5)
    assert b.attention_flops_per_s / a.attention_flops_per_s == pytest.approx(B200_750W, abs=5e-5)
    assert b.memory_bytes_per_s == a.memory_bytes_per_s
    assert (capped.intra_node_bus_bytes_per_s, capped.pcie_bytes_per_s) == (full.intra_node_bus_bytes_per_s,
                                                                           full.pcie_bytes_per_s)


def test_h100_96gb_is_h100_sxm_efficiencies_at_500_w():
    h96, sxm = get_gpu("h100-96gb"), get_gpu("h100-80gb")
    assert (h96.matmul_efficiency, h96.attention_efficiency, h96.tdp_w, h96.power_limit_w) == (0.8, 0.30, 700, 500)
    built = replace(sxm, hbm_bytes_per_s=h96.hbm_bytes_per_s, power_limit_w=500)
    assert rates(h96) == rates(built)
    # the constants the entry carried before (0.715, 0.268: 0.8 and 0.30 x 0.894, rounded)
    assert h96.matmul_fraction(0.8) == pytest.approx(0.715, abs=5e-4)
    assert h96.attention_fraction(0.35) == pytest.approx(0.268, abs=5e-4)
    # --power-limit-w 700 lifts the cap: H100 SXM's rates
    uncapped = make_cluster(8, "h100-96gb", power_limit_w=700).gpu
    assert rates(uncapped).matmul_flops_per_s == rates(sxm).matmul_flops_per_s


def test_the_step_prices_compute_at_the_capped_clock():
    knobs = dict(gpu="b200", seq_len=2048, precision="bf16")
    full, capped = estimate("gpt-125m", 8, **knobs).time, estimate("gpt-125m", 8, power_limit_w=750, **knobs).time
    assert capped.matmul_s / full.matmul_s == pytest.approx(1 / 0.75 ** (1 / 3), rel=1e-9)
    assert capped.attention_s / full.attention_s == pytest.approx(1 / 0.75 ** (1 / 3), rel=1e-9)
    assert capped.memory_bound_s == full.memory_bound_s


@pytest.mark.parametrize("gpu,watts,message", [
    ("b200", "1001", "error: power_limit_w: must be watts > 0 and <= 1000 (b200's TDP), got 1001.0"),
    ("b200", "0", "error: power_limit_w: must be watts > 0 and <= 1000 (b200's TDP), got 0.0"),
    ("h100-96gb", "-500", "error: power_limit_w: must be watts > 0 and <= 700 (h100-96gb's TDP), got -500.0"),
    ("h20", "300", "error: power_limit_w: h20 has no board power (TDP) in the catalog, so a power limit cannot be "
                   "priced; leave --power-limit-w out"),
])
def test_a_bad_power_limit_is_one_line_and_exit_2(gpu, watts, message, capsys):
    code, out, err = invoke(["estimate", "--model", "gpt-125m", "--gpus", "8", "--gpu", gpu,
                             f"--power-limit-w={watts}"], capsys)
    assert (code, out, err) == (2, "", message + "\n")


def test_the_api_refuses_it_too():
    with pytest.raises(PlannerError, match="power_limit_w: must be watts > 0 and <= 400 "):
        estimate("gpt-125m", 8, gpu="a100-80gb", power_limit_w=450)


@pytest.mark.parametrize("gpu,flag,cluster", [
    ("b200", ["--power-limit-w", "750"], {"power_limit_w": 750.0, "tdp_w": 1000.0}),
    ("b200", [], {}),
    ("h100-96gb", [], {"power_limit_w": 500.0, "tdp_w": 700.0}),     # the catalog's cap
])
def test_the_cap_reaches_the_plan_json_cluster(gpu, flag, cluster, capsys):
    code, out, err = invoke(["--model", "gpt-125m", "--gpus", "8", "--gpu", gpu, *flag, "--format", "json",
                             "--top", "1"], capsys)
    assert code == 0, err
    doc = json.loads(out)
    jsonschema.validate(doc, json_schema("plan"))
    assert doc["cluster"] == {"gpu": gpu, "gpus": 8, "gpus_per_node": 8, **cluster}
