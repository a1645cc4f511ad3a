"""The orchestrator's tokenizer: AutoTokenizer's choice for a checkpoint, without importing the model's code.

AutoTokenizer loads the checkpoint's config only to read three things: its model type, the tokenizer class it
declares, and the name of its config class (transformers' auto tables are keyed by class names). Loading the real
config class imports transformers' model-loading stack, torch's distributed tensors among it: about 1 s of CPU at
every orchestrator start, in a process that never loads a model. So AutoTokenizer is given a stand-in: a config of
the real class's name and model type, carrying what the checkpoint's config.json says. tests/unit/test_tokenizer.py
checks that each family's tokenizer comes out as AutoTokenizer's own.
"""

from __future__ import annotations

import json
from pathlib import Path

from transformers import AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase
from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

# What AutoTokenizer reads of a config besides its class and model type.
READ_FIELDS = ("tokenizer_class", "model_name")


def load_tokenizer(directory: Path) -> PreTrainedTokenizerBase:
    config_file = directory / "config.json"
    raw = json.loads(config_file.read_text()) if config_file.is_file() else {}
    model_type = raw.get("model_type", "")
    class_name = CONFIG_MAPPING_NAMES.get(model_type)
    if class_name is None:  # no config, or one transformers does not know: AutoTokenizer's own way
        tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(str(directory))
        return tokenizer
    stand_in = type(class_name, (PretrainedConfig,), {"model_type": model_type})
    config = stand_in(**{field: raw[field] for field in READ_FIELDS if field in raw}, name_or_path=str(directory))
    tokenizer = AutoTokenizer.from_pretrained(str(directory), config=config)
    return tokenizer
