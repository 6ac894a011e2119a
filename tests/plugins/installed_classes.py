"""A norm's class as the installed transformers builds it: tests and their plugins name the module
(`layers.0.mixer.norm` of Mamba2), never the class, which transformers renames between releases
(5.25: MambaRMSNormGated became Mamba2RMSNormGated, Llama4TextL2Norm Llama4TextWeightlessRMSNorm)."""

from functools import cache


@cache
def built_class(model_type: str, module: str) -> type:
    """The class of `module` in the base model of `model_type`'s default config, built on the meta
    device (no memory, no weights), one hidden layer."""
    import torch
    from transformers import AutoConfig, AutoModel

    config = AutoConfig.for_model(model_type)
    if isinstance(getattr(config, "num_hidden_layers", None), int) and not getattr(config, "layer_types", None):
        config.num_hidden_layers = 1
    with torch.device("meta"):
        model = AutoModel.from_config(config)
    return type(model.get_submodule(module))


def eps_of(module) -> float:
    """A norm module's eps, under whichever attribute its class keeps it (Gemma3nRMSNorm: `eps` until
    5.24, `variance_epsilon` since 5.25)."""
    for attr in ("variance_epsilon", "eps", "epsilon"):
        if isinstance(getattr(module, attr, None), float):
            return getattr(module, attr)
    raise AttributeError(f"{type(module).__name__} keeps no eps attribute")
