"""Find a ComfyUI checkout and run a real, isolated ComfyUI server with this pack installed, for tests.

The server gets a throwaway ``--base-directory`` (custom_nodes, input, output, temp, user) holding a symlink to
this checkout under a hyphenated name, so whatever folder the pack was cloned into, ComfyUI imports THIS code
the way users install it. Model folders come from an extra_model_paths.yaml, as on real installs. The database
is in memory so nothing is written into the ComfyUI checkout. The server runs in its own process group; at
teardown the group is terminated and any process that outlived it (e.g. a rank worker) fails the session.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import pytest

PACK_ROOT = Path(__file__).resolve().parents[1]
PACK_LINK_NAME = "comfy-mgpu"          # hyphenated on purpose: ComfyUI must load the pack under such a name
HELPER_MODULE = "mgpu_test_helpers"    # single-file test node pack written next to the symlink
MODEL_FOLDERS = ("diffusion_models", "text_encoders", "vae", "loras")
SKIP_REASON = ("ComfyUI not found: set COMFYUI_PATH to a ComfyUI checkout, or put this pack in "
               "ComfyUI/custom_nodes/<name>")

# ComfyUI 0.3.64 has no stock node giving CONDITIONING of Wan/LTXV width (4096) without a text encoder (the only
# input-less one, LotusConditioning, is 1024 wide), and the UMT5 it builds is always full XXL size. This node stands in.
HELPER_SOURCE = '''"""Test-only nodes installed by comfy-mgpu's test harness into a throwaway ComfyUI."""
import torch


class MgpuTestConditioning:
    """Seeded random text embeddings, shaped like a text encoder's output, with an all-ones attention mask."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "width": ("INT", {"default": 4096, "min": 1, "max": 16384}),
            "tokens": ("INT", {"default": 8, "min": 1, "max": 4096}),
            "seed": ("INT", {"default": 0, "min": 0, "max": 2**31 - 1}),
            "scale": ("FLOAT", {"default": 1.0, "min": 0.0, "max": 100.0, "step": 0.01}),
        }}

    RETURN_TYPES = ("CONDITIONING",)
    FUNCTION = "make"
    CATEGORY = "testing/mgpu"

    def make(self, width, tokens, seed, scale):
        emb = torch.randn(1, tokens, width, generator=torch.Generator().manual_seed(seed)) * scale
        return ([[emb, {"attention_mask": torch.ones(1, tokens, dtype=torch.long)}]],)


NODE_CLASS_MAPPINGS = {"MgpuTestConditioning": MgpuTestConditioning}
'''


def _is_comfyui(path: Path) -> bool:
    return (path / "main.py").is_file() and (path / "folder_paths.py").is_file() and (path / "comfy").is_dir()


def find_comfyui() -> Path | None:
    """COMFYUI_PATH, else the ComfyUI holding this pack as custom_nodes/<name> (symlinked or not); None if neither."""
    env = os.environ.get("COMFYUI_PATH")
    if env:
        path = Path(env).expanduser().resolve()
        return path if _is_comfyui(path) else None
    here = Path(__file__).absolute().parents[1]
    for pack in dict.fromkeys((here, PACK_ROOT, Path(os.environ.get("PWD", here)))):
        if pack.parent.name == "custom_nodes" and _is_comfyui(pack.parent.parent):
            return pack.parent.parent.resolve()
    return None


def comfyui_version(comfyui: Path) -> str:
    """Version string from comfyui_version.py, read without importing ComfyUI."""
    for line in (comfyui / "comfyui_version.py").read_text().splitlines():
        if line.startswith("__version__"):
            return line.split("=", 1)[1].strip().strip("\"'")
    return "unknown"


_RESULT_MARK = "@@RESULT@@"


def run_checks(module: str, check: str, *args: Any, timeout: float = 600) -> Any:
    """``<module>.<check>(*args)`` (a module of tests/) in a fresh interpreter where ComfyUI (first on the path, so
    its ``nodes`` module wins over this pack's package) runs on the CPU; returns what it returns, through JSON."""
    comfyui = find_comfyui()
    if comfyui is None:
        pytest.skip(SKIP_REASON)
    tests = Path(__file__).resolve().parent
    code = (f"import sys, json\nsys.path[:0] = [{str(comfyui)!r}, {str(tests)!r}, {str(tests.parent)!r}]\n"
            f"from comfy.cli_args import args\nargs.cpu = True\nimport {module} as checks\n"
            f"print({_RESULT_MARK!r} + json.dumps(checks.{check}(*{args!r})))\n")
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=comfyui, capture_output=True, text=True,
                          timeout=timeout, env=env, check=False)
    found = [line for line in proc.stdout.splitlines() if line.startswith(_RESULT_MARK)]
    assert proc.returncode == 0 and found, f"rc={proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return json.loads(found[-1][len(_RESULT_MARK):])


class PromptRejected(RuntimeError):
    """POST /prompt answered 400 (validation failed); `.body` holds ComfyUI's error and node_errors."""

    def __init__(self, body: Any):
        super().__init__(json.dumps(body, indent=1)[:4000])
        self.body = body


class _WsCollector:
    """Keeps one /ws connection for the server's client_id and records every message, so no event is missed."""

    def __init__(self, url: str):
        import websocket  # websocket-client

        self._ws = websocket.create_connection(url, timeout=1.0)
        self._timeout_exc = websocket.WebSocketTimeoutException
        self._closed_excs = (websocket.WebSocketException, OSError)
        self.messages: list[dict[str, Any]] = []
        self.binary_frames = 0
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="comfyui-ws", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                raw = self._ws.recv()
            except self._timeout_exc:
                continue
            except self._closed_excs:  # connection closed (server stopped)
                break
            if not raw:  # close frame
                break
            with self._cond:
                if isinstance(raw, bytes):
                    self.binary_frames += 1  # preview images
                else:
                    try:
                        self.messages.append(json.loads(raw))
                    except json.JSONDecodeError:
                        self.messages.append({"type": "_unparsed", "data": raw})
                self._cond.notify_all()

    def wait_for(self, pred, timeout: float) -> dict[str, Any] | None:
        """First recorded message satisfying pred, waiting up to timeout seconds."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for msg in self.messages:
                    if pred(msg):
                        return msg
                left = deadline - time.monotonic()
                if left <= 0 or not self._thread.is_alive():
                    return None
                self._cond.wait(min(left, 0.5))

    def close(self) -> None:
        self._stop.set()
        with contextlib.suppress(*self._closed_excs):
            self._ws.close()
        self._thread.join(timeout=5)


@dataclass
class ComfyServer:
    """A running ComfyUI; HTTP helpers use only the standard library, /ws uses websocket-client."""

    comfyui: Path
    root: Path
    base_dir: Path
    models_dir: Path
    port: int
    process: subprocess.Popen
    log_path: Path
    startup_s: float
    client_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    _ws: _WsCollector | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pack_dir(self) -> Path:
        """The pack as ComfyUI sees it (the symlink in custom_nodes)."""
        return self.base_dir / "custom_nodes" / PACK_LINK_NAME

    @property
    def output_dir(self) -> Path:
        return self.base_dir / "output"

    @property
    def diffusion_models(self) -> Path:
        return self.models_dir / "diffusion_models"

    @property
    def text_encoders(self) -> Path:
        return self.models_dir / "text_encoders"

    @property
    def vae(self) -> Path:
        return self.models_dir / "vae"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log_tail(self, chars: int = 6000) -> str:
        return self.log()[-chars:]

    def _request(self, method: str, path: str, body: Any = None, timeout: float = 60.0) -> tuple[int, Any]:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.base_url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"} if data else {})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                status, raw = resp.status, resp.read()
        except urllib.error.HTTPError as err:
            status, raw = err.code, err.read()
        try:
            return status, json.loads(raw) if raw else None
        except json.JSONDecodeError:
            return status, raw.decode(errors="replace")

    def get(self, path: str, timeout: float = 60.0) -> Any:
        status, body = self._request("GET", path, timeout=timeout)
        if status != 200:
            raise RuntimeError(f"GET {path} -> {status}: {body}")
        return body

    def object_info(self, node_class: str | None = None) -> dict[str, Any]:
        """All node definitions, or one node's (then the dict is that node's definition)."""
        if node_class is None:
            return self.get("/object_info")
        return self.get(f"/object_info/{node_class}")[node_class]

    def post_prompt(self, prompt: dict[str, Any]) -> str:
        """Queue an API-format prompt under this server's client_id; returns the prompt_id."""
        status, body = self._request("POST", "/prompt", {"prompt": prompt, "client_id": self.client_id})
        if status != 200:
            raise PromptRejected(body)
        return body["prompt_id"]

    def wait(self, prompt_id: str, timeout: float = 120.0) -> dict[str, Any]:
        """History entry of a finished prompt (status.status_str is "success" or "error")."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            entry = self.get(f"/history/{prompt_id}").get(prompt_id)
            if entry and entry.get("status", {}).get("status_str") in ("success", "error"):
                return entry
            if self.process.poll() is not None:
                raise RuntimeError(f"ComfyUI exited ({self.process.returncode}) while running {prompt_id}:\n"
                                   + self.log_tail())
            time.sleep(0.1)
        raise TimeoutError(f"prompt {prompt_id} not finished after {timeout}s:\n{self.log_tail()}")

    def _collector(self) -> _WsCollector:
        if self._ws is None:
            pytest.skip("websocket-client is not installed (pip install websocket-client)")
        return self._ws

    def ws_messages(self, prompt_id: str | None = None) -> list[dict[str, Any]]:
        """JSON /ws messages received so far, in order; with prompt_id only those whose data names it."""
        ws = self._collector()
        with ws._cond:
            msgs = list(ws.messages)
        if prompt_id is None:
            return msgs
        return [m for m in msgs if isinstance(m.get("data"), dict) and m["data"].get("prompt_id") == prompt_id]

    def wait_ws(self, prompt_id: str, msg_type: str, timeout: float = 60.0) -> dict[str, Any]:
        """Block until a /ws message of msg_type for prompt_id arrives."""
        msg = self._collector().wait_for(
            lambda m: m.get("type") == msg_type and isinstance(m.get("data"), dict)
            and m["data"].get("prompt_id") == prompt_id, timeout)
        if msg is None:
            raise TimeoutError(f"no {msg_type!r} message for {prompt_id} within {timeout}s:\n{self.log_tail()}")
        return msg

    def interrupt(self, prompt_id: str | None = None) -> None:
        """POST /interrupt (optionally only if prompt_id is the running prompt)."""
        status, body = self._request("POST", "/interrupt", {"prompt_id": prompt_id} if prompt_id else {})
        if status != 200:
            raise RuntimeError(f"POST /interrupt -> {status}: {body}")

    def stop(self, grace_s: float = 15.0) -> list[str]:
        """Terminate the server's process group; returns the processes that outlived SIGTERM (now SIGKILLed)."""
        if self._ws is not None:
            self._ws.close()
        pgid = self.process.pid
        try:
            tracked = psutil.Process(pgid).children(recursive=True)
        except psutil.NoSuchProcess:
            tracked = []
        _signal_group(pgid, signal.SIGTERM)
        try:
            self.process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
        deadline = time.monotonic() + grace_s
        survivors: list[psutil.Process] = []
        while time.monotonic() < deadline:
            survivors = [p for p in _alive(tracked + _group_members(pgid)) if p.pid != os.getpid()]
            if not survivors and self.process.poll() is not None:
                break
            time.sleep(0.2)
        leftovers = [_describe(p) for p in survivors]
        if self.process.poll() is None:
            leftovers.append(f"ComfyUI main process {pgid} ignored SIGTERM")
        _signal_group(pgid, signal.SIGKILL)
        for p in survivors:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        self.process.wait(timeout=30)
        return leftovers


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def _group_members(pgid: int) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter():
        try:
            if os.getpgid(p.pid) == pgid:
                out.append(p)
        except (ProcessLookupError, psutil.Error):
            continue
    return out


def _alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    seen, out = set(), []
    for p in procs:
        try:
            if p.pid not in seen and p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                seen.add(p.pid)
                out.append(p)
        except psutil.NoSuchProcess:
            continue
    return out


def _describe(p: psutil.Process) -> str:
    try:
        return f"pid {p.pid}: {' '.join(p.cmdline())[:200]}"
    except psutil.Error:
        return f"pid {p.pid}"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prepare_base(root: Path) -> tuple[Path, Path, Path]:
    """Lay out base dir, model dirs and extra_model_paths.yaml under root; returns (base, models, yaml)."""
    base, models = root / "base", root / "models"
    for sub in ("custom_nodes", "input", "output", "temp", "user"):
        (base / sub).mkdir(parents=True, exist_ok=True)
    (base / "custom_nodes" / PACK_LINK_NAME).symlink_to(PACK_ROOT, target_is_directory=True)
    (base / "custom_nodes" / f"{HELPER_MODULE}.py").write_text(HELPER_SOURCE)
    for name in MODEL_FOLDERS:
        (models / name).mkdir(parents=True, exist_ok=True)
    yaml_path = root / "extra_model_paths.yaml"
    lines = ["mgpu_tests:", f"    base_path: {models}"] + [f"    {name}: {name}" for name in MODEL_FOLDERS]
    yaml_path.write_text("\n".join(lines) + "\n")
    return base, models, yaml_path


def start_server(comfyui: Path, root: Path, extra_args: tuple[str, ...] = (), timeout: float = 240.0) -> ComfyServer:
    """Start ComfyUI on a free loopback port and wait for GET /system_stats; fails with the log tail."""
    base, models, yaml_path = prepare_base(root)
    frontend: list[str] = []
    if importlib.util.find_spec("comfyui_frontend_package") is None:
        (root / "frontend").mkdir(exist_ok=True)  # the API works without the web UI package
        frontend = ["--front-end-root", str(root / "frontend")]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "DO_NOT_TRACK": "1"}
    last_error = ""
    for attempt in range(3):  # the free port can be taken between probing and binding
        port = _free_port()
        log_path = root / f"comfyui-{attempt}.log"
        cmd = [sys.executable, "main.py", "--cpu", "--listen", "127.0.0.1", "--port", str(port),
               "--base-directory", str(base), "--extra-model-paths-config", str(yaml_path),
               "--database-url", "sqlite:///:memory:", "--disable-auto-launch", "--disable-api-nodes",
               *frontend, *extra_args]
        t0 = time.monotonic()
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(cmd, cwd=comfyui, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=env, start_new_session=True)
        server = ComfyServer(comfyui, root, base, models, port, proc, log_path, 0.0)
        while time.monotonic() - t0 < timeout and proc.poll() is None:
            try:
                with urllib.request.urlopen(server.base_url + "/system_stats", timeout=2) as resp:
                    if resp.status == 200:
                        server.startup_s = time.monotonic() - t0
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                time.sleep(0.2)
        if server.startup_s:
            try:
                server._ws = _WsCollector(f"ws://127.0.0.1:{port}/ws?clientId={server.client_id}")
                server._ws.wait_for(lambda m: m.get("type") == "status", timeout=30)
            except ImportError:
                server._ws = None
            return server
        last_error = server.log_tail()
        server.stop(grace_s=5)
        if "address already in use" not in last_error.lower():
            break
    raise RuntimeError(f"ComfyUI at {comfyui} did not start:\n{last_error}")


@pytest.fixture(scope="session")
def comfyui_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ComfyServer]:
    """One ComfyUI for the session, with this pack installed as custom_nodes/comfy-mgpu."""
    comfyui = find_comfyui()
    if comfyui is None:
        pytest.skip(SKIP_REASON)
    server = start_server(comfyui, tmp_path_factory.mktemp("comfyui"))
    try:
        yield server
    finally:
        leftovers = server.stop()
    assert not leftovers, "processes outlived the ComfyUI server (kill them with it):\n" + "\n".join(leftovers)
