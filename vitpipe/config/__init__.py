"""Configs: checks of a composed config, instantiation, the recipe line, the SLURM launcher's job shape."""
