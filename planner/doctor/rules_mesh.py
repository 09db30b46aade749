"""The doctor's rules on where the setup can run at all: the feasibility table's refusals, the mesh rules, the
pipeline's stage split and TP across nodes."""

from __future__ import annotations


from cost_models.feasibility import refusals
from cost_models.mesh_rules import mesh_refusals

from planner.doctor.findings import ERROR, WARNING, Context, Finding


def cannot_run(ctx: Context):
    """The configuration cannot run on this cluster at all (cost_models.feasibility, the table the estimate and
    the API refuse by)."""
    for r in refusals(ctx.cluster, ctx.candidate.config):
        yield Finding(r.code, ERROR, f"{r.reason}.", r.fix)


def mesh_rules_broken(ctx: Context):
    """A tensor / context / expert parallel degree the model, the sequence or the cluster does not allow
    (cost_models/mesh_rules.py, the table the estimate and the search use): the run fails, or splits unevenly."""
    for r in mesh_refusals(ctx.model, ctx.cluster, ctx.training, ctx.config):
        yield Finding(r.code, ERROR, f"{r.reason}.", r.fix)


def pipeline_split(ctx: Context):
    """torchtitan splits the blocks its own way (module_fqns_per_model_part as written, or its
    _generate_llm_fqn_per_model_part, which gives the extra blocks to the first stages); the estimate prices the
    even split with the end stages one block fewer (cost_models/pipeline.py): a stage with more blocks holds more
    parameters and activations, and the slowest stage paces the pipeline."""
    settings, config = ctx.setup.pipeline, ctx.config
    if settings is None or config.pp == 1:
        return
    from cost_models.pipeline import blocks_per_stage

    theirs = settings.blocks_per_stage(ctx.model.n_layers)
    ours = blocks_per_stage(ctx.model.n_layers, config.pp_stages)
    if tuple(theirs) != ours:
        yield Finding("pp-split-not-priced", WARNING,
                      f"torchtitan runs {', '.join(map(str, theirs))} blocks on stages 0-{len(theirs) - 1}; the "
                      f"estimate prices the even split {', '.join(map(str, ours))} (the most blocks on one stage: "
                      f"{max(theirs)} against {max(ours)}).",
                      "write the even split as parallelism.module_fqns_per_model_part (`fsdp-plan --emit "
                      "torchtitan` with the same --pp and --pp-schedule writes it)")


def tp_across_nodes(ctx: Context):
    """TP past the fast tier: every block's sequence-parallel all-gathers and reduce-scatters (2 + 2 forward,
    the same in backward) are exposed on the inter-node network, which is many times slower than NVLink."""
    tp, fast = ctx.config.tp, ctx.cluster.fast_tier_gpus
    if tp <= fast:
        return
    inter, intra = ctx.cluster.internode_bytes_per_s, ctx.cluster.gpu.intra_node_bus_bytes_per_s
    gpn = ctx.cluster.gpus_per_node
    yield Finding("tp-across-nodes", WARNING,
                  f"tp={tp} spans {-(-tp // fast)} nodes of {fast} GPUs: each block's TP all-gathers and "
                  f"reduce-scatters (forward and backward) run on the inter-node tier, {inter / gpn / 1e9:.0f} GB/s "
                  f"per GPU (the node's {inter / 1e9:.0f} GB/s of network shared by its {gpn} GPUs, every one in a "
                  f"TP group that crosses) against {intra / 1e9:.0f} GB/s inside the node, on the critical path of "
                  "every block.",
                  f"tp <= {fast} (TP inside a node), with context or data parallelism across nodes "
                  f"(e.g. tp {max(d for d in range(1, fast + 1) if fast % d == 0 and tp % d == 0)} and cp or "
                  "dp_shard for the rest)")
