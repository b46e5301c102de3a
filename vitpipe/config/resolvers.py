"""The resolvers of the shipped configs that read the model code or torch, registered when vitpipe is
imported but importing what they read only when a config resolves them: ``${auto_precision:}``
(``vitpipe.config.build.auto_precision``, torch) and ``${variant:<name>,<key>}``
(``vitpipe.models.registry.variant_value``, the builders' signatures). So a command line is composed and
checked (``vitpipe.tasks.cli.command_line_mistake``) in a second, before torch and Lightning load.
The resolvers of run directories and the SLURM launcher (``vitpipe.run.dirs``, ``vitpipe.config.launcher``)
read nothing heavy and are registered by their own modules."""

from __future__ import annotations


def auto_precision() -> str:
    from vitpipe.config.build import auto_precision as decide

    return decide()


def variant(name: str, key: str):
    from vitpipe.models.registry import variant_value

    return variant_value(name, key)


def register_resolvers() -> None:
    from omegaconf import OmegaConf

    for name, resolve in (("auto_precision", auto_precision), ("variant", variant)):
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, resolve)
