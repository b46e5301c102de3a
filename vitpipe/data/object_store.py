"""S3 for shards: a quick check before anything streams, and uploading a finished shard folder.

The client is boto3's, made as LitData makes it (``boto3.Session().client("s3", **storage_options)``),
so the same settings reach both: the standard AWS variables (``AWS_ENDPOINT_URL``,
``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_DEFAULT_REGION``, ``AWS_CA_BUNDLE``) or
``data.storage_options`` (e.g. ``{endpoint_url: https://..., verify: /path/ca.pem}``), which win.

LitData's own client retries up to 1,000 times, so a wrong key, a missing bucket or an endpoint that
does not answer would hang a run. ``check_s3`` asks first with short timeouts and two attempts, and
turns each failure into one line naming the URL and what to change (``ConfigError``).
"""

from __future__ import annotations

import os
from pathlib import Path

from vitpipe.errors import ConfigError

CHECK_CONFIG = {"connect_timeout": 5, "read_timeout": 15, "retries": {"max_attempts": 2, "mode": "standard"}}


def is_s3(url: str) -> bool:
    return str(url).startswith("s3://")


def split_s3(url: str) -> tuple[str, str]:
    """``s3://bucket/some/prefix/`` -> ("bucket", "some/prefix")."""
    bucket, _, prefix = str(url)[len("s3://"):].partition("/")
    return bucket, prefix.strip("/")


def client(storage_options: dict | None = None, *, quick: bool = False):
    import boto3
    from botocore.config import Config

    opts = dict(storage_options or {})
    if quick:
        opts["config"] = Config(**CHECK_CONFIG)
    return boto3.Session().client("s3", **opts)


def _endpoint(storage_options: dict | None) -> str:
    return str((storage_options or {}).get("endpoint_url") or os.environ.get("AWS_ENDPOINT_URL") or "AWS S3")


def check_s3(url: str, storage_options: dict | None = None, *, key: str = "data.root", need: str | None = None) -> None:
    """Raise ConfigError (one line) unless bucket ``url`` answers with these credentials (and holds
    ``url/need`` when given). Takes seconds, never LitData's retry loop."""
    import botocore.exceptions as bx

    bucket, prefix = split_s3(url)
    where = f"{key}={url}"
    if not bucket:
        raise ConfigError(f"{where}: no bucket in the URL; use s3://<bucket>/<prefix>")
    endpoint = _endpoint(storage_options)
    try:
        s3 = client(storage_options, quick=True)
        s3.head_bucket(Bucket=bucket)
        if need is not None:
            s3.head_object(Bucket=bucket, Key=f"{prefix}/{need}" if prefix else need)
    except bx.NoCredentialsError:
        raise ConfigError(f"{where}: no S3 credentials; set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
                          "(or data.storage_options.aws_access_key_id/aws_secret_access_key)") from None
    except bx.SSLError as e:
        raise ConfigError(f"{where}: the TLS certificate of {endpoint} is not trusted ({_short(e)}); point "
                          "AWS_CA_BUNDLE and SSL_CERT_FILE at a bundle holding its CA") from None
    except (bx.EndpointConnectionError, bx.ConnectTimeoutError, bx.ReadTimeoutError) as e:
        raise ConfigError(f"{where}: cannot reach the S3 endpoint {endpoint} ({_short(e)}); check AWS_ENDPOINT_URL "
                          "or data.storage_options.endpoint_url") from None
    except bx.ClientError as e:
        code = str(e.response.get("Error", {}).get("Code", ""))
        status = int(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
        if code in ("404", "NoSuchKey") and need is not None and status == 404 and _bucket_exists(s3, bucket):
            raise ConfigError(f"{where}: no {need} under it; write shards with scripts/make_shards.py out={url}") from None
        if code in ("404", "NoSuchBucket"):
            raise ConfigError(f"{where}: bucket {bucket} does not exist at {endpoint}") from None
        if status == 403 or code in ("403", "InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied"):
            raise ConfigError(f"{where}: {endpoint} refused these credentials ({code or status}); check "
                              "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or data.storage_options") from None
        raise ConfigError(f"{where}: S3 error {code or status} from {endpoint}: {_short(e)}") from None
    except bx.BotoCoreError as e:
        raise ConfigError(f"{where}: S3 client error ({type(e).__name__}: {_short(e)})") from None


def _bucket_exists(s3, bucket: str) -> bool:
    try:
        s3.head_bucket(Bucket=bucket)
        return True
    except Exception:  # noqa: BLE001 - only asked to word the error above
        return False


def _short(e: Exception, n: int = 160) -> str:
    text = " ".join(str(e).split())
    return text if len(text) <= n else text[: n - 3] + "..."


def upload_tree(local_dir: str | Path, url: str, storage_options: dict | None = None, *, last: tuple[str, ...] = ()) -> int:
    """Upload every file under ``local_dir`` to ``url``, keeping relative paths; the files named in
    ``last`` go up after all others (a reader that finds them finds everything they index).
    Each object appears whole or not at all (a PUT is atomic). Returns the bytes sent."""
    from tqdm import tqdm

    local_dir = Path(local_dir)
    bucket, prefix = split_s3(url)
    files = sorted(p for p in local_dir.rglob("*") if p.is_file())
    files.sort(key=lambda p: p.relative_to(local_dir).as_posix() in last)  # stable: the index files go last
    s3 = client(storage_options)
    sent = 0
    with tqdm(total=sum(p.stat().st_size for p in files), unit="B", unit_scale=True, desc=f"upload -> {url}") as bar:
        for p in files:
            rel = p.relative_to(local_dir).as_posix()
            s3.upload_file(str(p), bucket, f"{prefix}/{rel}" if prefix else rel, Callback=bar.update)
            sent += p.stat().st_size
    return sent
