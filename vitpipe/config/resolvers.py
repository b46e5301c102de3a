"""The resolvers of the shipped configs that read the model code or torch, registered when vitpipe is
imported but importing what they read only when a config resolves them: ``${auto_precision:}``
(``vitpipe.config.build.auto_precision``, torch) and ``${variant:<name>,<key>}``
(``vitpipe.models.variants.variant_value``: the table and the builders' defaults, read without torch). So a
command line is composed and checked (``vitpipe.tasks.cli.command_line_mistake``) in a second, before torch and Lightning load.
The resolvers of run directories and the SLURM launcher (``vitpipe.run.dirs``, ``vitpipe.config.launcher``)
read nothing heavy and are registered by their own modules."""

from __future__ import annotations

import contextlib


def auto_precision() -> str:
    from vitpipe.config.build import auto_precision as decide

    return decide()


def variant(name: str, key: str):
    from vitpipe.models.variants import variant_value

    return variant_value(name, key)


def register_resolvers() -> None:
    from omegaconf import OmegaConf

    for name, resolve in (("auto_precision", auto_precision), ("variant", variant)):
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, resolve)


@contextlib.contextmanager
def composing_without_torch():
    """While a command line is composed only to be checked: ``${auto_precision:}`` gives ``32-true`` without
    asking torch. OmegaConf's merge dereferences an interpolation that a config merges a value over
    (``debug=fast``'s ``trainer.precision: 32-true`` over conf/trainer's ``${auto_precision:}``), which alone
    would load torch (1.5 s, and 6 s with what vitpipe.config.build imports) for a value the check never
    reads: it holds plain values only, and the composed node stays the interpolation."""
    from omegaconf import OmegaConf

    OmegaConf.register_new_resolver("auto_precision", lambda: "32-true", replace=True)
    try:
        yield
    finally:
        OmegaConf.register_new_resolver("auto_precision", auto_precision, replace=True)
