"""Builds and loads target models from Hugging Face directories, dispatching on the config's architecture name.

Every target family offers the same interface (`TargetModel`): forward(input_ids, metadata, cache, capture) ->
TargetOutput, compute_logits, a `config` with the shapes the servers need, and the shared tables
`model.embed_tokens` and `lm_head`. A family is one `TargetArchitecture` entry: how to build the model from the
HF config, the checkpoint name map, its default EAGLE3 capture indices, and what of the checkpoint is not the
target's (layers after the last one) or stays in float32.

Tensor parallel: a family is built for one rank of a `ParallelGroup` and holds that rank's shard of the weights;
`load_target` reads only that shard from the checkpoint.

Quantized checkpoints: `load_target` keeps every linear weight the checkpoint stores quantized as stored (fp8 or INT4
with its scales, tandem.layers.stored), expanded before each product; with `dequantize` it holds them dequantized to
the serving dtype instead.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from tandem.layers.attention_backend import AttentionMetadata
from tandem.layers.kv_cache import CacheLayout, PagedKVCache
from tandem.layers.stored import StoredWeight
from tandem.models import aux_layers, gemma3
from tandem.models.config import (
    TARGET_FAMILIES,
    ConfigError,
    ModelConfig,
    architecture_of,
    read_hf_config,
    read_target_config,
)
from tandem.models.deepseek_v3 import CHECKPOINT_NAMES as DEEPSEEK_V3_NAMES
from tandem.models.deepseek_v3 import (
    KIMI_K25_NAMES,
    KIMI_K25_TOWERS,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    kimi_k25_text_config,
)
from tandem.models.gemma3 import MULTIMODAL_NAMES, MULTIMODAL_TOWERS, Gemma3Config, Gemma3ForCausalLM
from tandem.models.gemma4 import Gemma4ForCausalLM
from tandem.models.gemma4_config import Gemma4Config
from tandem.models.llama import LlamaForCausalLM
from tandem.models.stack import Embeddings, KeptKV, TargetOutput
from tandem.models.step3p5 import CHECKPOINT_NAMES as STEP3P5_NAMES
from tandem.models.step3p5 import Step3p5ForCausalLM
from tandem.models.step3p5_config import Step3p5Config
from tandem.parallel.group import SINGLE_PROCESS, ParallelGroup
from tandem.weights.loader import NameMap, checkpoint_tensors, keep_stored, load_weights, materialized, on_meta
from tandem.weights.quantized import quantization_of

LOG = logging.getLogger(__name__)

# Tensors a target checkpoint may carry that the target model does not use.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class TargetConfig(Protocol):
    @property
    def architecture(self) -> str: ...
    @property
    def num_layers(self) -> int: ...
    @property
    def hidden_size(self) -> int: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def cache_layout(self) -> CacheLayout: ...  # what one token leaves in one layer of the KV cache
    @property
    def max_position_embeddings(self) -> int: ...
    @property
    def eos_token_ids(self) -> tuple[int, ...]: ...
    @property
    def tie_word_embeddings(self) -> bool: ...


class TargetBackbone(Protocol):
    @property
    def embed_tokens(self) -> nn.Embedding: ...  # the raw table, as stored in the checkpoint


class TargetModel(Protocol):
    @property
    def config(self) -> TargetConfig: ...
    @property
    def model(self) -> TargetBackbone: ...
    @property
    def lm_head(self) -> nn.Linear: ...
    @property
    def cache_layout(self) -> CacheLayout: ...  # this rank's share of config.cache_layout
    @property
    def kept_kv(self) -> tuple[KeptKV, ...]: ...  # layers whose keys and values drafts may take (stack.KeptKV)
    def __call__(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        metadata: AttentionMetadata,
        cache: PagedKVCache,
        capture: Sequence[int] = (),  # capture indices in [0, num_layers + 1] (tandem.models.stack.run_layers)
        embeddings: Embeddings | None = None,  # rows embedded as given (tandem.models.stack.CausalLM)
    ) -> TargetOutput: ...
    def compute_logits(self, normed: torch.Tensor) -> torch.Tensor: ...  # [n, hidden] -> [n, vocab] float32
    def modules(self) -> Iterator[nn.Module]: ...
    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]: ...


@dataclass(frozen=True)
class TargetArchitecture:
    build: Callable[[dict[str, Any], ParallelGroup], TargetModel]  # HF config, rank -> model (weights not loaded)
    name_map: NameMap  # checkpoint names -> our module names
    default_capture_indices: Callable[[int], tuple[int, ...]]  # num_layers -> capture indices for a draft naming none
    # The checkpoint holds draft layers after the target's last one (DeepSeek NextN / MTP layers,
    # model.layers.{num_layers + i}.*): they are the MTP draft's, and the target does not even read them.
    skips_layers_after_last: bool = False
    # Buffer name suffixes kept in float32 at any serving dtype, as transformers keeps them.
    float32_buffers: tuple[str, ...] = ()
    # Checkpoint name prefixes of other models in the same files (a multimodal checkpoint's vision tower and
    # projector): the target does not read them, and they are not reported as unused.
    skipped_prefixes: tuple[str, ...] = ()


def _build_llama(hf: dict[str, Any], group: ParallelGroup) -> LlamaForCausalLM:
    return LlamaForCausalLM(ModelConfig.from_hf(hf), group)


def _build_gemma3(hf: dict[str, Any], group: ParallelGroup) -> Gemma3ForCausalLM:
    return Gemma3ForCausalLM(Gemma3Config.from_hf(hf), group)


def _build_gemma4(hf: dict[str, Any], group: ParallelGroup) -> Gemma4ForCausalLM:
    return Gemma4ForCausalLM(Gemma4Config.from_hf(hf), group)


def _build_gemma3_language_model(hf: dict[str, Any], group: ParallelGroup) -> Gemma3ForCausalLM:
    return Gemma3ForCausalLM(Gemma3Config.from_hf(gemma3.multimodal_text_config(hf)), group)


def _build_gemma4_language_model(hf: dict[str, Any], group: ParallelGroup) -> Gemma4ForCausalLM:
    return Gemma4ForCausalLM(Gemma4Config.from_hf(gemma3.language_model_config(hf)), group)


def _language_model(build: Callable[[dict[str, Any], ParallelGroup], TargetModel]) -> TargetArchitecture:
    """A multimodal Gemma checkpoint served as a text target: its language model, not its towers."""
    return TargetArchitecture(
        build, MULTIMODAL_NAMES, gemma3.default_capture_indices, skipped_prefixes=MULTIMODAL_TOWERS
    )


def _build_deepseek_v3(hf: dict[str, Any], group: ParallelGroup) -> DeepseekV3ForCausalLM:
    return DeepseekV3ForCausalLM(DeepseekV3Config.from_hf(hf), group)


def _build_kimi_k25(hf: dict[str, Any], group: ParallelGroup) -> DeepseekV3ForCausalLM:
    return DeepseekV3ForCausalLM(DeepseekV3Config.from_hf(kimi_k25_text_config(hf)), group)


def _kimi_k25_family() -> TargetArchitecture:
    """Kimi-K2.5's language model (DeepSeek-V3). EAGLE3 drafts name its layers by the generic rule: its EAGLE3-MLA
    heads' ids [2, 30, 58] are read as layer inputs (first id not 1), SGLang's capture points for them."""
    return TargetArchitecture(
        _build_kimi_k25,
        KIMI_K25_NAMES,
        aux_layers.default_capture_indices,
        float32_buffers=("e_score_correction_bias",),  # as DeepSeek-V3's
        skipped_prefixes=KIMI_K25_TOWERS,
    )


def _build_step3p5(hf: dict[str, Any], group: ParallelGroup) -> Step3p5ForCausalLM:
    return Step3p5ForCausalLM(Step3p5Config.from_hf(hf), group)


def _step3p5_family(skipped_prefixes: tuple[str, ...] = ()) -> TargetArchitecture:
    return TargetArchitecture(
        _build_step3p5,
        STEP3P5_NAMES,
        aux_layers.default_capture_indices,
        skips_layers_after_last=True,  # the MTP layers
        # As DeepSeek-V3's: the router's bias decides which experts run, by amounts below bfloat16's resolution.
        float32_buffers=("router_bias",),
        skipped_prefixes=skipped_prefixes,
    )


_LLAMA_FAMILY = TargetArchitecture(_build_llama, NameMap(), aux_layers.default_capture_indices)
TARGET_ARCHITECTURES: dict[str, TargetArchitecture] = {
    **dict.fromkeys(TARGET_FAMILIES, _LLAMA_FAMILY),
    "Gemma3ForCausalLM": TargetArchitecture(_build_gemma3, NameMap(), gemma3.default_capture_indices),
    "Gemma4ForCausalLM": TargetArchitecture(_build_gemma4, NameMap(), gemma3.default_capture_indices),
    "Gemma3ForConditionalGeneration": _language_model(_build_gemma3_language_model),
    "Gemma4ForConditionalGeneration": _language_model(_build_gemma4_language_model),
    "DeepseekV3ForCausalLM": TargetArchitecture(
        _build_deepseek_v3,
        DEEPSEEK_V3_NAMES,
        aux_layers.default_capture_indices,
        skips_layers_after_last=True,
        # The router's bias moves sigmoid scores near 0.5 by amounts below bfloat16's resolution there (2 ** -9),
        # and it decides which experts run.
        float32_buffers=("e_score_correction_bias",),
    ),
    "KimiK25ForConditionalGeneration": _kimi_k25_family(),  # the release's name
    "Kimi_K25ForConditionalGeneration": _kimi_k25_family(),  # transformers'
    "Step3p5ForCausalLM": _step3p5_family(),
    "Step3p7ForConditionalGeneration": _step3p5_family(skipped_prefixes=("vision_model.", "vit_large_projector.")),
}


def target_architecture(name: str) -> TargetArchitecture:
    if name not in TARGET_ARCHITECTURES:
        known = ", ".join(sorted(TARGET_ARCHITECTURES))
        raise ConfigError(f"architectures: {name!r} is not a supported target ({known})")
    return TARGET_ARCHITECTURES[name]


def check_tensor_parallel(model_dir: Path, tp: int, dequantize: bool = False) -> None:
    """Raises ConfigError / ParallelismError if the model cannot be split into tp ranks, before any rank starts, and
    QuantizationError if a rank's slice of a weight kept quantized would cut a block or group (not with `dequantize`).

    Builds rank 0's model on the meta device (no memory, no weights, no process group); of a quantized checkpoint it
    reads the headers (and INT4's two-integer weight shapes), no weights.
    """
    hf = read_hf_config(model_dir)
    architecture, model = target_on_meta(hf, ParallelGroup(rank=0, world_size=tp))
    if not dequantize and quantization_of(hf) is not None:
        assert isinstance(model, nn.Module)
        with checkpoint_tensors(model_dir, not_read(architecture, model.config.num_layers)) as tensors:
            keep_stored(model, tensors, architecture.name_map, torch.float32, "meta")


def target_on_meta(hf: dict[str, Any], group: ParallelGroup) -> tuple[TargetArchitecture, TargetModel]:
    """This rank's model on the meta device: shapes and dtypes, no memory."""
    architecture = _architecture(hf)
    return architecture, on_meta(lambda: architecture.build(hf, group))


def built_target(
    hf: dict[str, Any], dtype: torch.dtype, device: str, group: ParallelGroup = SINGLE_PROCESS
) -> tuple[TargetArchitecture, TargetModel]:
    """This rank's model as load_target holds it before reading weights: uninitialised on `device` (on "meta": shapes
    and dtypes only, no memory), floating tensors in `dtype` except the family's float32 buffers, the head tied."""
    architecture, model = target_on_meta(hf, group)
    return architecture, _materialized(architecture, model, dtype, device)


def _materialized(architecture: TargetArchitecture, model: TargetModel, dtype: torch.dtype, device: str) -> TargetModel:
    # Every family is an nn.Module; the protocol only lists what the servers use.
    assert isinstance(model, nn.Module)
    model = materialized(model, device, dtype)
    keep_float32(model, architecture.float32_buffers)
    if model.config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model


def not_read(architecture: TargetArchitecture, num_layers: int) -> Callable[[str], bool] | None:
    """The checkpoint names the target does not read (draft layers after its last, other models' towers); None:
    it reads every one."""
    skip = partial(_is_after_last_layer, num_layers) if architecture.skips_layers_after_last else None
    if architecture.skipped_prefixes:
        skip = partial(_is_skipped, architecture.skipped_prefixes, skip)
    return skip


def load_target(
    model_dir: Path,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    group: ParallelGroup = SINGLE_PROCESS,
    dequantize: bool = False,
) -> TargetModel:
    """Builds this rank's model and reads its shard of the checkpoint (all of it with one rank); quantized linear
    weights kept as stored, or with `dequantize` dequantized to `dtype`."""
    architecture, meta = target_on_meta(read_target_config(model_dir), group)
    num_layers = meta.config.num_layers
    if architecture.skips_layers_after_last:
        LOG.info(
            "%s: not reading model.layers.{>= %d}.* (draft layers after the last target layer)", model_dir, num_layers
        )
    if architecture.skipped_prefixes:
        skipped = "*, ".join(architecture.skipped_prefixes)
        LOG.info("%s: not reading %s* (not part of the text model)", model_dir, skipped)
    with checkpoint_tensors(model_dir, not_read(architecture, num_layers), dtype) as tensors:
        if not dequantize:
            assert isinstance(meta, nn.Module)
            keep_stored(meta, tensors, architecture.name_map, dtype, device)
            _warm_cpu_products(meta, dtype, device)
        model = _materialized(architecture, meta, dtype, device)
        assert isinstance(model, nn.Module)
        unused = load_weights(model, iter(tensors), architecture.name_map, source=str(model_dir))
    tied_head = ["lm_head.weight"] if model.config.tie_word_embeddings else []
    unexpected = [name for name in unused if name not in tied_head and not name.endswith(_IGNORED_SUFFIXES)]
    if unexpected:
        LOG.warning("%s: %d checkpoint tensors not used, e.g. %s", model_dir, len(unexpected), unexpected[:3])
    model.eval()
    return model


def _warm_cpu_products(model: nn.Module, dtype: torch.dtype, device: str) -> None:
    """Readies the fused CPU products of weights kept as stored (tandem.layers.cpu_products) before any request."""
    if device == "cpu" and dtype == torch.float32 and any(isinstance(m, StoredWeight) for m in model.modules()):
        from tandem.layers import cpu_products  # Numba: imported where a product needs it

        started = time.monotonic()
        cpu_products.warm()
        LOG.info("fused CPU products of the stored weights ready in %.1f s", time.monotonic() - started)


def _architecture(hf: dict[str, Any]) -> TargetArchitecture:
    return target_architecture(architecture_of(hf))


def keep_float32(model: nn.Module, suffixes: tuple[str, ...]) -> None:
    """Puts the buffers named by `suffixes` back in float32 after the model was cast (also used by MTP drafts)."""
    for name, buffer in list(model.named_buffers()):
        if name.endswith(suffixes):
            owner, _, leaf = name.rpartition(".")
            model.get_submodule(owner).register_buffer(leaf, buffer.float())


def _is_skipped(prefixes: tuple[str, ...], other: Callable[[str], bool] | None, name: str) -> bool:
    return name.startswith(prefixes) or (other is not None and other(name))


def _is_after_last_layer(num_layers: int, name: str) -> bool:
    """model.layers.{i}.* with i >= num_layers: e.g. model.layers.61.eh_proj.weight of DeepSeek-V3 (61 layers)."""
    parts = name.split(".", 3)
    return len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[2].isdigit() and int(parts[2]) >= num_layers
