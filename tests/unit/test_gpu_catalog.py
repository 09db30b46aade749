"""The GPU catalog (planner/catalog/gpus.json): complete, sourced, and its figures as
shared/reference/hardware.md gives them."""

import json
from pathlib import Path

import pytest

from cost_models.specs import ClusterSpec, GpuSpec, SpecError
from planner.errors import PlannerError
from planner.hardware import _CATALOG, get_gpu, gpu_catalog, make_cluster

ROOT = Path(__file__).resolve().parents[2]
ENTRIES = json.loads(_CATALOG.read_text())["gpus"]
IDS = [e["id"] for e in ENTRIES]
GB, GiB, TB, TF = 1e9, 2**30, 1e12, 1e12

FP8_ARCHITECTURES = {"hopper", "ada", "blackwell", "cdna3", "cdna4"}   # FP8 tensor cores
NO_FP8_ARCHITECTURES = {"ampere", "volta"}
POSITIVE = ("memory_mib", "hbm_tb_per_s", "intra_node_bus_gb_per_s", "pcie_gb_per_s", "internode_gbit_per_s",
            "cpu_ram_gib_per_node", "gpus_per_node", "scale_up_domain_gpus", "host_link_peak_gb_per_s",
            "nics_per_node")
DESCRIBED = ("name", "source", "cpu_ram_source", "nic", "host_link", "scale_up_link", "architecture")


def test_the_parts_of_today_are_there():
    assert set(IDS) >= {"h100-80gb", "h100-96gb", "h100-pcie", "h100-nvl", "h200-141gb", "gh200", "h20", "b200",
                        "b300", "gb200", "l40s", "mi300x-192gb", "mi325x", "mi355x"}
    assert len(IDS) == len(set(IDS))


@pytest.mark.parametrize("entry", ENTRIES, ids=IDS)
def test_every_entry_is_sourced_and_positive(entry):
    for key in DESCRIBED:
        assert entry[key].strip(), f"{entry['id']}: empty {key}"
    for key in POSITIVE:
        assert entry[key] > 0, f"{entry['id']}: {key} = {entry[key]}"
    assert entry["tflops"] and all(v > 0 for v in entry["tflops"].values())
    assert {"fp16", "fp32"} <= set(entry["tflops"])   # step time falls back on fp32
    assert entry["scale_up_peak_gb_per_s"] >= 0
    if entry["scale_up_domain_gpus"] > 1:             # a domain needs a link
        assert entry["scale_up_peak_gb_per_s"] > 0
    assert entry["gpus_per_node"] <= max(8, entry["scale_up_domain_gpus"])


@pytest.mark.parametrize("entry", ENTRIES, ids=IDS)
def test_fp8_exactly_on_parts_with_fp8_tensor_cores(entry):
    arch = entry["architecture"]
    assert arch in FP8_ARCHITECTURES | NO_FP8_ARCHITECTURES, f"{entry['id']}: unknown architecture {arch!r}"
    assert ("fp8" in entry["tflops"]) == (arch in FP8_ARCHITECTURES)


def test_fp8_by_part():
    catalog = gpu_catalog()
    with_fp8 = {"h100-80gb", "h100-96gb", "h100-pcie", "h100-nvl", "h200-141gb", "gh200", "gh200-144gb", "h20",
                "b200", "b300", "gb200", "l4-24gb", "l40s", "rtx4090-24gb", "mi300x-192gb", "mi325x", "mi355x"}
    without = {"a100-40gb", "a100-80gb", "a10g-24gb", "v100-16gb", "v100-32gb"}
    assert with_fp8 | without == set(catalog)
    assert all(catalog[i].supports("fp8") for i in with_fp8)
    assert not any(catalog[i].supports("fp8") for i in without)


@pytest.mark.parametrize("gpu", [g for g in gpu_catalog().values() if g.supports("fp8") and g.supports("bf16")],
                         ids=lambda g: g.id)
def test_fp8_is_twice_bf16(gpu):
    # hardware.md: "FP8 dense is twice bf16 dense on all of these". 2% for L40S, whose datasheet gives
    # 362.05 bf16 and 733 fp8 (the others agree within 0.5%).
    assert gpu.peak_flops["fp8"] == pytest.approx(2 * gpu.peak_flops["bf16"], rel=0.02)


def test_figures_checked_by_hand_against_hardware_md():
    c = gpu_catalog()
    assert c["b200"].hbm_bytes_per_s == 8 * TB
    assert c["b200"].peak_flops["bf16"] == 2250 * TF and c["b200"].peak_flops["fp8"] == 4500 * TF
    assert c["gb200"].scale_up_domain_gpus == 72
    # Blackwell Ultra (HGX B300 table: 36 / 72 PFLOP/s bf16 / fp8 sparse for 8 GPUs): B200's dense GEMM peaks, 288 GB,
    # ConnectX-8's 800 Gb/s a GPU
    assert c["b300"].peak_flops == c["b200"].peak_flops and c["b300"].memory_bytes == 288 * GiB
    assert c["b300"].default_internode_gbit_per_s == 8 * 800 and c["b300"].tdp_w == 1100
    assert c["gb200"].peak_flops["bf16"] == 2500 * TF
    assert c["h200-141gb"].memory_bytes / GiB == pytest.approx(141, rel=0.005)   # nvidia-smi: 143771 MiB
    assert c["h100-nvl"].hbm_bytes_per_s == 3.9 * TB and c["h100-nvl"].peak_flops["fp8"] == 1671 * TF
    assert c["h100-pcie"].peak_flops["bf16"] == 756 * TF and c["h100-pcie"].scale_up_domain_gpus == 1
    assert c["h100-96gb"].memory_bytes == 96 * GiB and c["h100-96gb"].hbm_bytes_per_s == 2.4 * TB
    assert (c["h20"].peak_flops["bf16"], c["h20"].hbm_bytes_per_s) == (148 * TF, 4.0 * TB)
    assert c["gh200-144gb"].hbm_bytes_per_s == 4.9 * TB and c["gh200"].hbm_bytes_per_s == 4.0 * TB
    assert c["gh200"].default_cpu_ram_bytes_per_node == 480 * GiB
    assert c["l40s"].hbm_bytes_per_s == 0.864 * TB and c["l40s"].scale_up_peak_bytes_per_s == 0
    assert c["mi300x-192gb"].peak_flops["fp8"] == 2615 * TF
    assert c["mi325x"].memory_bytes == 256 * GiB and c["mi325x"].hbm_bytes_per_s == 6.0 * TB
    assert c["mi355x"].memory_bytes == 288 * GiB
    # the scale-up links: NVLink4 900 GB/s total, NVLink5 1.8 TB/s, Infinity Fabric 7 x 128 GB/s (both ways)
    assert c["h100-80gb"].scale_up_peak_bytes_per_s == 450 * GB
    assert c["b200"].scale_up_peak_bytes_per_s == 900 * GB
    assert c["mi300x-192gb"].scale_up_peak_bytes_per_s == 7 * 128 / 2 * GB


def test_offload_over_c2c_not_pcie():
    c = gpu_catalog()
    for gpu in ("gh200", "gb200"):
        assert "NVLink-C2C" in c[gpu].host_link
        assert c[gpu].pcie_bytes_per_s > c["h100-80gb"].pcie_bytes_per_s   # 50 GB/s: PCIe Gen5 in practice
    assert c["h100-80gb"].host_link.startswith("PCIe Gen5")


def test_existing_figures_unchanged():
    """The ten parts the catalog had before today's were added: the figures their estimates use."""
    c = gpu_catalog()
    old = {  # id: memory MiB, HBM TB/s, bf16, fp16, fp32 TFLOP/s, bus GB/s, PCIe GB/s, network Gb/s, RAM GiB
        "a100-40gb": (40960, 1.555, 312, 312, 19.5, 230, 25, 1600, 1024),
        "a100-80gb": (81920, 2.039, 312, 312, 19.5, 230, 25, 1600, 2048),
        "h100-80gb": (81559, 3.35, 989, 989, 67, 370, 50, 3200, 2048),
        "h200-141gb": (143771, 4.8, 989, 989, 67, 370, 50, 3200, 2048),
        "l4-24gb": (23034, 0.3, 121, 121, 30.3, 20, 25, 200, 384),
        "a10g-24gb": (23028, 0.6, 70, 70, 31, 20, 25, 100, 768),
        "v100-16gb": (16384, 0.9, 0, 125, 15.7, 120, 12, 400, 512),
        "v100-32gb": (32768, 0.9, 0, 125, 15.7, 120, 12, 400, 1536),
        "rtx4090-24gb": (24564, 1.0, 165, 165, 82.6, 20, 25, 100, 256),
        "mi300x-192gb": (196608, 5.3, 1307, 1307, 163.4, 300, 50, 3200, 2048),
    }
    for gpu_id, (mib, hbm, bf16, fp16, fp32, bus, pcie, net, ram) in old.items():
        g = c[gpu_id]
        assert (g.memory_bytes, g.hbm_bytes_per_s) == (mib * 2**20, pytest.approx(hbm * TB)), gpu_id
        assert [g.peak_flops.get(k, 0) for k in ("bf16", "fp16", "fp32")] == pytest.approx(
            [bf16 * TF, fp16 * TF, fp32 * TF]), gpu_id
        assert (g.intra_node_bus_bytes_per_s, g.pcie_bytes_per_s) == pytest.approx((bus * GB, pcie * GB)), gpu_id
        assert (g.default_internode_gbit_per_s, g.default_cpu_ram_bytes_per_node) == (net, ram * GiB), gpu_id
        assert g.default_gpus_per_node == 8, gpu_id   # clusters of them are cut into nodes as before


@pytest.mark.parametrize("gpu_id", IDS)
@pytest.mark.parametrize("gpus", [1, 8, 144])
def test_every_catalog_id_builds_a_cluster(gpu_id, gpus):
    cluster = make_cluster(gpus, gpu=gpu_id)
    spec = gpu_catalog()[gpu_id]
    assert isinstance(cluster, ClusterSpec) and cluster.gpu is spec
    assert cluster.gpus_per_node == min(gpus, spec.default_gpus_per_node)
    assert cluster.scale_up_gpus == min(gpus, spec.scale_up_domain_gpus)
    assert cluster.cpu_ram_bytes_per_node == spec.default_cpu_ram_bytes_per_node > 0
    assert cluster.internode_bytes_per_s == spec.default_internode_gbit_per_s * 1e9 / 8


def test_gb200_nvl72_is_one_domain_of_trays():
    rack = make_cluster(72, gpu="gb200")
    assert (rack.scale_up_gpus, rack.gpus_per_node, rack.n_nodes) == (72, 4, 18)
    two_racks = make_cluster(144, gpu="gb200")
    assert two_racks.scale_up_gpus == 72
    hgx = make_cluster(72, gpu="b200")
    assert (hgx.scale_up_gpus, hgx.gpus_per_node) == (8, 8)
    assert make_cluster(72, gpu="gb200", scale_up_domain_gpus=36).scale_up_gpus == 36   # NVL36
    assert make_cluster(8, gpu="gh200").gpus_per_node == 1
    assert make_cluster(8, gpu="l40s").scale_up_gpus == 1           # PCIe only
    with pytest.raises(PlannerError, match="scale_up_domain_gpus"):
        make_cluster(8, gpu="gb200", scale_up_domain_gpus=0)


def test_older_constructions_keep_working():
    gpu = GpuSpec(id="t", name="t", memory_bytes=GiB, hbm_bytes_per_s=1e12, peak_flops={"fp32": 1e12},
                  intra_node_bus_bytes_per_s=1e11)
    assert (gpu.scale_up_domain_gpus, gpu.default_gpus_per_node, gpu.supports("fp8")) == (0, 8, False)
    cluster = ClusterSpec(gpu=gpu, n_gpus=16, gpus_per_node=8, internode_bytes_per_s=1e10)
    assert cluster.scale_up_gpus == 8                               # unknown: the node
    with pytest.raises(SpecError, match="scale_up_domain_gpus"):
        ClusterSpec(gpu=gpu, n_gpus=16, gpus_per_node=8, internode_bytes_per_s=1e10, scale_up_domain_gpus=72)
    with pytest.raises(SpecError, match="gpu.nics_per_node"):
        GpuSpec(id="t", name="t", memory_bytes=GiB, hbm_bytes_per_s=1e12, intra_node_bus_bytes_per_s=1e11,
                nics_per_node=-1)


def test_an_unknown_gpu_names_every_choice_on_one_line():
    with pytest.raises(PlannerError) as err:
        get_gpu("b100")
    message = str(err.value)
    assert "\n" not in message and message.startswith("gpu: unknown GPU 'b100'")
    assert "b200" in message.split("did you mean ")[1].split("?")[0].split(", ")
    assert all(gpu_id in message.split("choose one of: ")[1].split(", ") for gpu_id in IDS)


def test_docs_table_matches_the_catalog():
    rows = {}
    for line in (ROOT / "docs" / "gpus.md").read_text().splitlines():
        if line.startswith("| `"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            rows[cells[0].strip("`")] = cells
    assert set(rows) == set(IDS)
    for e in ENTRIES:
        cells, t = rows[e["id"]], e["tflops"]
        assert int(cells[2]) == round(e["memory_mib"] / 1024), e["id"]
        assert float(cells[3]) == e["hbm_tb_per_s"], e["id"]
        assert cells[4] == (f"{t['bf16']:g}" if "bf16" in t else "—"), e["id"]
        assert cells[5] == (f"{t['fp8']:g}" if "fp8" in t else "—"), e["id"]
        assert cells[9], e["id"]   # a source
