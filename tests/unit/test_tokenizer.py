"""The orchestrator's tokenizer (orchestrator/api/tokenizer.py) is AutoTokenizer's own for every family Tandem serves
and every tokenizer class a checkpoint may declare: the same class, the same ids and text, the same chat template;
also in the orchestrator's process, where torch is absent (launch.service_commands.hide_torch)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from launch.service_commands import hide_torch
from orchestrator.api.tokenizer import load_tokenizer
from tandem.settings import DEMO_TARGET
from tests.helpers.tokenizer import write_tokenizer
from tests.helpers.tokenizer_outcome import outcome

MODEL_TYPES = [
    "llama", "mistral", "qwen2", "qwen3", "gemma3", "gemma3_text", "gemma4", "gemma4_text", "deepseek_v3",
    "kimi_k2", "kimi_k25", "step3p5", "step3p7",
]  # fmt: skip
DECLARED = [None, "TokenizersBackend", "PreTrainedTokenizerFast", "LlamaTokenizerFast", "GemmaTokenizerFast"]
ROOT = Path(__file__).resolve().parents[2]
TEXTS = ["def fibonacci(count: int) -> list[int]:", "The capital of France is Paris.\n\n  x = 1"]


@pytest.fixture(scope="module")
def tokenizer_files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tokenizer")
    write_tokenizer(directory, 320)
    return directory


def checkpoint(tokenizer_files: Path, directory: Path, model_type: str, declared: str | None) -> Path:
    """The tokenizer's files and a config.json of `model_type` in `directory`, declaring `declared` (or no class)."""
    directory.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (directory / name).write_bytes((tokenizer_files / name).read_bytes())
    tokenizer_config = json.loads((directory / "tokenizer_config.json").read_text())
    tokenizer_config.pop("tokenizer_class", None)
    if declared is not None:
        tokenizer_config["tokenizer_class"] = declared
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    (directory / "config.json").write_text(json.dumps({"model_type": model_type}))
    return directory


@pytest.mark.parametrize("declared", DECLARED)
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_each_family_gets_autotokenizers_own(
    tokenizer_files: Path, tmp_path: Path, model_type: str, declared: str | None
) -> None:
    checkpoint(tokenizer_files, tmp_path, model_type, declared)
    ours, theirs = load_tokenizer(tmp_path), AutoTokenizer.from_pretrained(str(tmp_path))
    assert type(ours) is type(theirs)
    for text in TEXTS:
        assert outcome(ours, text) == outcome(theirs, text)


# In a process started as the orchestrator's is: each directory's tokenizer as "module.Class" and its outcomes.
WITHOUT_TORCH = """
import json, sys
from pathlib import Path
from launch.service_commands import hide_torch
hide_torch()
import orchestrator.main
from launch.service_commands import hide_torch
from orchestrator.api.tokenizer import load_tokenizer
from tests.helpers.tokenizer_outcome import outcome
texts = json.loads(sys.argv[1])
found = {}
for directory in sys.argv[2:]:
    tokenizer = load_tokenizer(Path(directory))
    kind = type(tokenizer)
    found[directory] = [f"{kind.__module__}.{kind.__name__}", [list(outcome(tokenizer, text)) for text in texts]]
print(json.dumps({"found": found, "torch": sys.modules["torch"] is not None}))
"""


def test_without_torch_each_family_gets_autotokenizers_own(tokenizer_files: Path, tmp_path: Path) -> None:
    directories = [
        checkpoint(tokenizer_files, tmp_path / f"{model_type}-{declared}", model_type, declared)
        for model_type in MODEL_TYPES
        for declared in DECLARED
    ]
    command = [sys.executable, "-c", WITHOUT_TORCH, json.dumps(TEXTS), *map(str, [*directories, DEMO_TARGET])]
    result = subprocess.run(command, capture_output=True, text=True, timeout=240, check=True, cwd=ROOT)
    answer = json.loads(result.stdout.splitlines()[-1])
    assert answer["torch"] is False
    assert "PyTorch was not found" not in result.stderr
    for directory in [*directories, DEMO_TARGET]:
        theirs = AutoTokenizer.from_pretrained(str(directory))
        kind = type(theirs)
        expected = [f"{kind.__module__}.{kind.__name__}", [list(outcome(theirs, text)) for text in TEXTS]]
        assert answer["found"][str(directory)] == expected, directory


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


def test_a_process_that_has_torch_keeps_it() -> None:
    import torch

    hide_torch()
    assert sys.modules["torch"] is torch
