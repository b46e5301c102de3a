"""Hydra configs, importable as ``vitpipe.conf`` (``vitpipe/conf`` links here; the wheel ships them as package data)
so that Hydra finds them at ``pkg://vitpipe.conf``; Hydra's package source needs this file."""
