"""The built-in plugin: DeepInfer's own stages, backends, models and recipes, registered through the same
hooks a third-party package uses. Factories import lazily so `import deepinfer` stays light."""

from __future__ import annotations

from .core.hookspecs import hookimpl


@hookimpl
def deepinfer_register_stages(register):
    from .stages.constrain import GrammarStage
    from .stages.dspark_draft import DSparkDraft
    from .stages.detokenize import DetokenizeStage
    from .stages.model_call import ForwardStage
    from .stages.mtp_draft import MTPDraft
    from .stages.prefill import PrefillStage
    from .stages.prefix_cache import PrefixCacheStage
    from .stages.sample import SampleStage
    from .stages.swa_replay import SwaReplayStage
    from .stages.tokenize import TokenizeStage
    from .stages.verify import VerifyStage

    for cls in (TokenizeStage, PrefixCacheStage, SwaReplayStage, PrefillStage, ForwardStage, VerifyStage,
                GrammarStage, SampleStage, DetokenizeStage, DSparkDraft, MTPDraft):
        register.stage(kind=cls.kind, name=cls.name, factory=cls)


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


@hookimpl
def deepinfer_register_backends(register):
    def reference(device="cpu"):
        from .backends.reference.ops import ReferenceOps

        return ReferenceOps(device)

    register.backend(name="reference", factory=reference)

    def nvidia(device="cuda"):
        from .backends.nvidia.ops import NvidiaOps  # imports triton: only when the backend is built

        return NvidiaOps(device)

    def nvidia_available() -> bool:
        from .backends.nvidia import available  # triton is imported only when CUDA is present

        return available()

    register.backend(name="nvidia", factory=nvidia, available=nvidia_available)


@hookimpl
def deepinfer_register_models(register):
    from .models import llama

    for arch in llama.ARCHITECTURES:
        register.model(architecture=arch, factory=llama.factory(arch))

    from .models import deepseek, moe_llama

    for models in (moe_llama.MODELS, deepseek.MODELS):
        for arch, cls in models.items():
            register.model(architecture=arch, factory=cls)  # the class itself takes (hf_config, ops)

    def ced(hf_config, ops):
        from .models.ced.model import CEDForCausalLM

        return CEDForCausalLM(hf_config, ops)

    register.model(architecture="CEDForCausalLM", factory=ced)


@hookimpl
def deepinfer_register_recipes(register):
    from .core.recipe import builtin_dir  # the files are read when a pipeline is built from one

    for f in sorted(builtin_dir().glob("*.toml")):
        register.recipe(name=f.stem, spec=f)


@hookimpl
def deepinfer_register_parsers(register):
    from .entrypoints.parsers import builtin_parsers  # plain Python: no server dependency is imported

    for (kind, name), factory in builtin_parsers().items():
        register.parser(kind=kind, name=name, factory=factory)
