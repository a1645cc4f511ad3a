"""The orchestrator's tokenizer (orchestrator/api/tokenizer.py) is AutoTokenizer's own for every family Tandem serves
and every tokenizer class a checkpoint may declare: the same class, the same ids and text, the same chat template."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from orchestrator.api.tokenizer import load_tokenizer
from tandem.settings import DEMO_TARGET
from tests.helpers.tokenizer import write_tokenizer

MODEL_TYPES = [
    "llama", "mistral", "qwen2", "qwen3", "gemma3", "gemma3_text", "gemma4", "gemma4_text", "deepseek_v3",
    "kimi_k2", "kimi_k25", "step3p5", "step3p7",
]  # fmt: skip
DECLARED = [None, "TokenizersBackend", "PreTrainedTokenizerFast", "LlamaTokenizerFast", "GemmaTokenizerFast"]
TEXTS = ["def fibonacci(count: int) -> list[int]:", "The capital of France is Paris.\n\n  x = 1"]


@pytest.fixture(scope="module")
def tokenizer_files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tokenizer")
    write_tokenizer(directory, 320)
    return directory


@pytest.mark.parametrize("declared", DECLARED)
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_each_family_gets_autotokenizers_own(
    tokenizer_files: Path, tmp_path: Path, model_type: str, declared: str | None
) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((tokenizer_files / name).read_bytes())
    tokenizer_config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    tokenizer_config.pop("tokenizer_class", None)
    if declared is not None:
        tokenizer_config["tokenizer_class"] = declared
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
    ours, theirs = load_tokenizer(tmp_path), AutoTokenizer.from_pretrained(str(tmp_path))
    assert type(ours) is type(theirs)
    for text in TEXTS:
        assert outcome(ours, text) == outcome(theirs, text)


def outcome(tokenizer: PreTrainedTokenizerBase, text: str) -> tuple[list[int], str] | str:
    """The ids and their text, or the error (a declared class that does not fit these files fails alike)."""
    try:
        ids = tokenizer.encode(text)
        return ids, tokenizer.decode(ids)
    except Exception as error:
        return repr(error)


def test_the_demo_tokenizer_and_its_chat_template_are_autotokenizers() -> None:
    ours, theirs = load_tokenizer(DEMO_TARGET), AutoTokenizer.from_pretrained(str(DEMO_TARGET))
    assert type(ours) is type(theirs)
    messages = [{"role": "user", "content": "Write a parser."}]
    template = (DEMO_TARGET.parent / "chat_template.jinja").read_text()
    assert ours.apply_chat_template(messages, chat_template=template, tokenize=False, add_generation_prompt=True) == (
        theirs.apply_chat_template(messages, chat_template=template, tokenize=False, add_generation_prompt=True)
    )
    assert ours.all_special_ids == theirs.all_special_ids and ours.eos_token_id == theirs.eos_token_id


def test_loading_it_imports_no_model_code() -> None:
    script = (
        "import sys; from pathlib import Path; from orchestrator.api.tokenizer import load_tokenizer; "
        f"load_tokenizer(Path({str(DEMO_TARGET)!r})); print('torch.distributed.tensor' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    assert result.stdout.split()[-1] == "False"
