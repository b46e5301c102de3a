"""``push_to_hub=<user/repo>``: upload an exported timm folder to the Hugging Face Hub.

The folder already holds what timm's ``push_to_hf_hub`` uploads (config.json, model.safetensors,
README.md), so this is huggingface_hub's create_repo + upload_folder, as there. Every failure
(offline, no token, no such user) is one line saying how to upload later.
"""

from __future__ import annotations

from pathlib import Path

from vitpipe.config.options import check_repo_id  # the rule export's preflight applies before anything loads
from vitpipe.errors import ConfigError


def push_folder(folder: Path, repo_id: str, *, private: bool = False) -> str:
    """Upload ``folder`` to model repo ``repo_id`` (created if missing); returns the commit URL."""
    import huggingface_hub
    from huggingface_hub import HfApi

    check_repo_id(repo_id)
    later = f"upload later with `hf upload {repo_id} {folder}` once online and logged in (`hf auth login`)"
    if huggingface_hub.constants.HF_HUB_OFFLINE:
        raise ConfigError(f"push_to_hub={repo_id}: HF_HUB_OFFLINE is set, nothing was uploaded; {later}")
    try:
        api = HfApi(library_name="timm")
        repo = api.create_repo(repo_id, private=private, exist_ok=True).repo_id
        info = api.upload_folder(repo_id=repo, folder_path=str(folder), commit_message="Add model (vitpipe export)")
    except Exception as e:  # network, auth, permissions: each one line with the fix
        why = (str(e).splitlines() or [""])[0][:200]
        raise ConfigError(f"push_to_hub={repo_id} failed ({type(e).__name__}: {why}); {later}") from None
    return str(getattr(info, "commit_url", info))
