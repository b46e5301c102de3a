"""The bodies of scripts/*.py: each script is a thin ``@hydra.main`` wrapper over one module here."""
