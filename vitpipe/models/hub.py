"""Hugging Face Hub weights without torch: whether the cache holds a repository's file, or else whether the
Hub answers at all, asked with one request and no retries; and the one line that says how to place the
weights by hand when neither holds.

Two readers: ``vitpipe.models.weights`` (timm's weights, the repository and files from timm's pretrained
config) and the command line's check of ``model.pretrained=true`` (``vitpipe.tasks.cli``), which answers
before torch loads from the variant table's timm names (``variant_hub_files``).
"""

from __future__ import annotations

from vitpipe.errors import ConfigError

# timm's Hub layout for the variant table's weights (vitpipe.models.variants.TIMM_NAMES): repository
# timm/<name>, safetensors before the pickled file (timm's order); tests/test_pretrained.py holds each
# name's timm pretrained config to it
HUB_FILES = ("model.safetensors", "pytorch_model.bin")


def variant_hub_files(timm_name: str) -> tuple[str, str | None, list[str]]:
    """(repository, revision, files in the order timm asks for them) of a variant's timm weights."""
    return f"timm/{timm_name}", None, list(HUB_FILES)


def cached_or_reachable(name: str, repo: str, revision: str | None, files: list[str]) -> str | None:
    """The cached path of the first of ``files`` the Hugging Face cache holds; None when none is cached and
    the Hub answers (the caller downloads). ConfigError when none is cached and HF_HUB_OFFLINE is set, or
    the Hub is unreachable, found with one request: huggingface_hub would retry with backoff for about 25 s
    per file and log every attempt."""
    from huggingface_hub import constants, get_hf_file_metadata, hf_hub_url, try_to_load_from_cache
    from huggingface_hub.utils import HfHubHTTPError

    for filename in files:
        cached = try_to_load_from_cache(repo, filename, revision=revision)
        if isinstance(cached, str):
            return cached
    if constants.HF_HUB_OFFLINE:
        raise ConfigError(offline_weights_message(name, repo, "HF_HUB_OFFLINE is set"))
    try:
        get_hf_file_metadata(hf_hub_url(repo, files[0], revision=revision))  # one request, no retries
    except HfHubHTTPError:
        pass  # the Hub answered (e.g. no such file: the caller tries the others)
    except Exception as e:  # noqa: BLE001 - no answer at all: DNS, refused, timeout, proxy
        raise ConfigError(offline_weights_message(name, repo, type(e).__name__)) from None
    return None


def offline_weights_message(name: str, repo: str, why: str) -> str:
    """One line: which weights could not be fetched (``why``: the error's name) and the two ways to place
    them by hand."""
    from huggingface_hub.constants import HF_HUB_CACHE

    return (
        f"could not fetch timm weights {name!r} ({why}: offline, and not in the Hugging Face "
        f"cache {HF_HUB_CACHE}). Either run `hf download {repo}` on a connected machine and copy its "
        f"hub/models--{repo.replace('/', '--')} folder into that cache (HF_HOME sets where; HF_HUB_OFFLINE=1 "
        f"skips the network), or download model.safetensors from https://huggingface.co/{repo} and pass "
        f"model.pretrained=/path/to/model.safetensors"
    )
