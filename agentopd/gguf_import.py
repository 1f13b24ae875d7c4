"""A GGUF checkpoint as a bf16 Hugging Face folder, with its tokenizer and its own chat template.

    agentopd import-gguf model.Q4_K_M.gguf models/my-model      # the CLI
    import_gguf(Path("model.gguf"), Path("models/my-model"))    # the same in Python
    folder = gguf_folder(Path("model.gguf"))                    # student=model.gguf: converted once, cached

transformers reads GGUF files of the llama, qwen2, qwen3, gemma3 (and more) architectures and dequantizes them; it
needs the `gguf` package (`pip install 'agentopd[gguf]'`). A model loaded so refuses `save_pretrained` ("quantized
with gguf and is not serializable") until its quantizer is cleared: the weights are plain tensors by then. The
folder holds the dequantized weights in bf16 (a Q4 file's values, not the original model's: fine as a model in its
own right), config.json, generation_config.json and the tokenizer with the chat template the GGUF carries.

`student=`/`teacher=` take a `.gguf` file, or a folder holding exactly one, directly (agentopd.models): the folder is
built on first use under `$AGENTOPD_HOME/gguf/imported/<sha256 prefix>/` and reused after.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from agentopd.paths import agentopd_home, atomic_dir


def require_gguf() -> None:
    try:
        import gguf  # noqa: F401
    except ImportError:
        raise ValueError("reading a .gguf file needs the gguf package: pip install 'agentopd[gguf]'") from None


def import_gguf(file: Path, out_dir: Path) -> Path:
    """Write `file` (a .gguf) as a bf16 Hugging Face folder at `out_dir` (replaced whole, never left half-written)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    file = Path(file)
    if not file.is_file():
        raise ValueError(f"{file}: no such GGUF file")
    require_gguf()
    try:
        tokenizer = AutoTokenizer.from_pretrained(file.parent, gguf_file=file.name)
        model = AutoModelForCausalLM.from_pretrained(file.parent, gguf_file=file.name, dtype=torch.bfloat16)
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        raise ValueError(f"{file}: transformers could not read it as a GGUF checkpoint: {e}") from None
    model.hf_quantizer = None  # the dequantized weights are plain tensors; the quantizer only blocks saving
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config

    def save(tmp: Path) -> None:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)

    atomic_dir(Path(out_dir), save)
    return Path(out_dir)


def find_gguf(path: Path) -> Path | None:
    """`path` itself when it is a .gguf file; the one .gguf inside a folder without config.json; else None.
    ValueError for a folder holding several."""
    if path.is_file():
        return path if path.suffix == ".gguf" else None
    if not path.is_dir() or (path / "config.json").exists():
        return None
    files = sorted(path.glob("*.gguf"))
    if len(files) > 1:
        raise ValueError(f"{path} holds {len(files)} .gguf files ({', '.join(f.name for f in files[:4])}): name one of them")
    return files[0] if files else None


def _digest(file: Path) -> str:
    h = hashlib.sha256()
    with open(file, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def gguf_folder(file: Path, home: Path | None = None) -> Path:
    """The cached Hugging Face folder of a .gguf file (keyed by its bytes), imported on first use."""
    folder = (home or agentopd_home()) / "gguf" / "imported" / _digest(file)[:16]
    if not (folder / "config.json").exists():
        import_gguf(file, folder)
    return folder
