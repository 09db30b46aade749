"""ModelSpec and GpuSpec to and from the plain dicts job files and stored runs hold (dataclasses.asdict's form,
JSON lists back to tuples, nested dataclasses rebuilt). No torch here."""

from __future__ import annotations

from dataclasses import fields

from cost_models.specs import ActivationProfile, ActivationTerms, BackwardMoment, GpuSpec, ModelSpec, MoeSpec


def gpu_spec_dict(gpu: GpuSpec) -> dict:
    return {f.name: getattr(gpu, f.name) for f in fields(gpu)}


def _activation_terms(terms: dict) -> ActivationTerms:
    dense = terms.get("dense")
    return ActivationTerms(**{**terms, "backward_moments": tuple(BackwardMoment(**m) for m in terms.get("backward_moments", ())),
                              "checkpoint_held": tuple(terms.get("checkpoint_held", (0.0, 0.0, 0.0, 0.0))),
                              "dense": _activation_terms(dense) if dense is not None else None})


def model_spec_from_dict(data: dict) -> ModelSpec:
    """The ModelSpec of its dataclasses.asdict() form (a job file's spec, a stored run's setup.model): the
    JSON lists back to tuples and the nested MoeSpec / ActivationProfile back to dataclasses."""
    fields_ = dict(data)
    fields_["lora_target_shapes"] = tuple(tuple(x) for x in fields_.get("lora_target_shapes", ()))
    if "attention_choices" in fields_:
        fields_["attention_choices"] = tuple(fields_["attention_choices"])
    if fields_.get("moe") is not None:
        moe = dict(fields_["moe"])
        moe["stacked_expert_tensors"] = tuple(tuple(x) for x in moe.get("stacked_expert_tensors", ()))
        moe["dense_layers"] = tuple(moe.get("dense_layers", ()))
        fields_["moe"] = MoeSpec(**moe)
    for key in ("activation_profile", "lora_activation_profile"):
        if fields_.get(key) is not None:
            profile = dict(fields_[key])
            profile["terms"] = tuple((dtype, attention, _activation_terms(terms))
                                     for dtype, attention, terms in profile.get("terms", ()))
            fields_[key] = ActivationProfile(**profile)
    return ModelSpec(**fields_)
