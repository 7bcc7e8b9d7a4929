"""The pack on Windows, the most common ComfyUI platform: it must import there (else ComfyUI lists it as IMPORT
FAILED and even MGPU Plan is gone), plan, and say plainly that FSDP ranks need Linux.

A fresh interpreter is made to look like Windows where that is safe: what loads differently per platform (torch's
libraries, ComfyUI itself) is imported first; then the POSIX-only modules (fcntl, termios, ...) and attributes
(AF_UNIX, SIGUSR1, posix_fallocate, faulthandler.register) are taken away and ``sys.platform`` is "win32". The pack
is then imported the way ComfyUI imports a pack folder: its root ``__init__.py`` under the folder path as module name.
With ComfyUI (COMFYUI_PATH) the V3 entry point's node list is checked too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from comfy_checkpoints import write_tiny_wan21_t2v
from tiny_models import comfyui_path

REPO = str(Path(__file__).resolve().parent.parent)

AS_WINDOWS = r'''
import asyncio, contextlib, importlib, importlib.util, io, json, os, pkgutil, sys

pack, comfy_root, dit = sys.argv[1:4]
import accelerate, psutil, safetensors, torch, torch.distributed.fsdp, xxhash   # platform-specific loading
if comfy_root:
    sys.path.insert(0, comfy_root)
    import comfy.cli_args
    comfy.cli_args.args.cpu = True
    import aiohttp, comfy.model_management, comfy.sample, comfy.samplers, comfy.sd, comfy.utils, folder_paths
    import latent_preview
    from comfy_api.latest import io as comfy_io
loop = asyncio.new_event_loop()              # its self-pipe is a POSIX socketpair: made before AF_UNIX goes

import faulthandler, signal, socket
for name in ("fcntl", "termios", "resource", "pwd", "grp"):
    sys.modules[name] = None                  # "import fcntl" now raises ImportError, as on Windows
for owner, attr in ((socket, "AF_UNIX"), (signal, "SIGUSR1"), (os, "posix_fallocate"), (faulthandler, "register")):
    if hasattr(owner, attr):
        delattr(owner, attr)
sys.platform = "win32"

name = pack.replace(".", "_x_")              # ComfyUI: a pack folder's module is named after its path
spec = importlib.util.spec_from_file_location(name, os.path.join(pack, "__init__.py"))
module = importlib.util.module_from_spec(spec)
sys.modules[name] = module
spec.loader.exec_module(module)

import mgpu
result = {"mgpu": sorted(m.name for m in pkgutil.walk_packages(mgpu.__path__, "mgpu.")
                         if not m.name.endswith("__main__"))}
for name in result["mgpu"]:
    importlib.import_module(name)

from mgpu.cli import main
out = io.StringIO()
with contextlib.redirect_stdout(out):
    main(["plan", "--dit", dit, "--devices", "2x24GiB", "--json"])
result["plan"] = [p["strategy"] for p in json.loads(out.getvalue())["placements"]]

from mgpu.errors import MgpuError
from mgpu.ranks.pool import PoolConfig, RankPool
try:
    RankPool(PoolConfig(["cuda:0", "cuda:1"])).start()
except MgpuError as exc:
    result["pool"] = str(exc)

if comfy_root:
    extension = loop.run_until_complete(module.comfy_entrypoint())
    result["nodes"] = sorted(node.__name__ for node in loop.run_until_complete(extension.get_node_list()))
print("RESULT " + json.dumps(result))
'''


def run_as_windows(tmp_path: Path, comfy_root: str | None) -> dict:
    dit = write_tiny_wan21_t2v(tmp_path / "wan.safetensors")
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    env.pop("PYTHONPATH", None)      # nothing of the pack on the path: the pack's __init__ must register mgpu itself
    proc = subprocess.run([sys.executable, "-c", AS_WINDOWS, REPO, comfy_root or "", str(dit)], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return json.loads(lines[-1].removeprefix("RESULT "))


def check_runtime(result: dict) -> None:
    assert {"mgpu.ranks.pool", "mgpu.ranks.rank", "mgpu.ranks.shm", "mgpu.planning.partition", "mgpu.planning.devices",
            "mgpu.planning.sizing", "mgpu.sharding.sharded", "mgpu.sharding.fsdp", "mgpu.weights.quant"} <= set(result["mgpu"])
    assert result["plan"] == ["single"]
    assert "FSDP on cuda:0, cuda:1) needs Linux, and this ComfyUI runs on Windows" in result["pool"]
    assert "WSL2" in result["pool"] and "load the model on one device" in result["pool"]


def test_the_pack_imports_and_plans_without_posix_and_fsdp_says_it_needs_linux(tmp_path) -> None:
    check_runtime(run_as_windows(tmp_path, None))


@pytest.mark.comfyui
def test_comfyui_gets_every_node_of_the_pack_on_windows(tmp_path) -> None:
    root = comfyui_path()
    if root is None:
        pytest.skip("ComfyUI not found: set COMFYUI_PATH")
    result = run_as_windows(tmp_path, root)
    check_runtime(result)
    assert {"MgpuPlan", "MgpuLoadDiffusionModel", "MgpuLoadTextEncoder", "MgpuLoadVAE"} <= set(result["nodes"])
