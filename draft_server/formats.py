"""The draft kinds a replica can serve, chosen by the checkpoint's architecture name through one registry.

- EAGLE3 heads (`LlamaForCausalLMEagle3`, `Eagle3LlamaForCausalLM`) and EAGLE3 heads with MLA attention
  (`Eagle3DeepseekV2ForCausalLM`): tandem.models.eagle3 on the DraftRunner, fed the aux layers named by the head.
- MTP layers stored in a target-format checkpoint (the architecture is a TARGET's, e.g. `DeepseekV3ForCausalLM` or
  `Step3p5ForCausalLM` with `num_nextn_predict_layers`, under `text_config` for Step-3.7): tandem.models.mtp.
  DeepSeek NextN runs on the DraftRunner, one layer reused at every step, fed the target's post-final-norm hidden;
  chained multi-layer MTP runs on the MTPRunner, fed the target's final stream before or after its norm, as the
  hidden flow (`--mtp-feedback`, "auto": the family's authors') says.
- Block drafters, DFlash and DFlash2 (`DFlashDraftModel`, `DFlash2DraftModel`, z-lab's layouts) and DSpark
  (`Qwen3DSparkModel`, DeepSpec's): tandem.models.dflash (and .dflash2) on the BlockRunner, fed the outputs of the
  target layers the config names, with the target's embedding and LM head pulled where the checkpoint lacks them.
- Gemma 4's assistant (`Gemma4AssistantForCausalLM`): tandem.models.gemma4_assistant on the AssistantRunner, fed
  the target's final hidden state and the keys and values of its last K/V-keeping layer of each type.
- Standalone draft models: a target-format checkpoint WITHOUT MTP layers (`LlamaForCausalLM`, `Qwen2ForCausalLM`,
  `Gemma3ForCausalLM`, ... with no `num_nextn_predict_layers`): a plain causal LM with the target's vocabulary on the
  StandaloneRunner, fed the committed tokens only (it subscribes `tokens_only`, no capture indices).

Each kind is prepared the same way: load, check against the target's info (refusing with both values named), say
which capture indices to subscribe with and which shared tables to pull from the target, then build the runner
once the tables are filled.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from draft_server.assistant_runner import prepare_assistant
from draft_server.block_runner import BlockRunner
from draft_server.compat import IncompatibleDraft, check_compatibility
from draft_server.image_inputs import takes_merged
from draft_server.mtp_runner import MTPRunner
from draft_server.proposals import PreparedDraft, ProposalRunner
from draft_server.runner import DraftModel, DraftRunner
from draft_server.settings import DraftSettings
from draft_server.standalone_runner import StandaloneRunner
from tandem.models.aux_layers import CaptureSpec, resolve_capture
from tandem.models.block_format import BLOCK_ARCHITECTURES, BLOCK_NAMES
from tandem.models.config import ConfigError, read_hf_config
from tandem.models.dflash import DFlashConfig
from tandem.models.dflash2 import load_block_draft
from tandem.models.eagle3 import EAGLE3_LAYER_KINDS, load_eagle3
from tandem.models.gemma4_assistant import ARCHITECTURE as ASSISTANT_ARCHITECTURE
from tandem.models.mtp import NextNDraft, declared_mtp_layers, load_mtp
from tandem.models.registry import TARGET_ARCHITECTURES, load_target, target_architecture
from tandem.models.tokenizer_digest import TOKENIZER_FILE, tokenizer_digest
from tandem.settings import KVCacheSettings
from tandem.wire import target_pb2

LOG = logging.getLogger(__name__)


def prepare_draft(settings: DraftSettings, info: target_pb2.TargetInfo) -> PreparedDraft:
    """Loads the draft checkpoint, checks it against the target and resolves what it needs from the target."""
    architectures = read_hf_config(settings.model_dir).get("architectures") or ["?"]
    prepare = DRAFT_FORMATS.get(architectures[0])
    if prepare is None:
        known = ", ".join(sorted(DRAFT_FORMATS))
        raise ConfigError(f"architectures: {architectures[0]!r} is not a draft this server runs ({known})")
    prepared = prepare(settings, info)
    if settings.image_embeddings == "merged" and not prepared.image_embeddings:
        raise IncompatibleDraft(
            f"--image-embeddings merged: a {prepared.kind} draft embeds only its own tokens (EAGLE3 and NextN heads "
            "take the target's image embeddings)"
        )
    return prepared


def _prepare_eagle3(settings: DraftSettings, info: target_pb2.TargetInfo) -> PreparedDraft:
    model, has_embedding = load_eagle3(settings.model_dir, dtype=getattr(torch, settings.dtype), device=settings.device)
    check_compatibility(model.config, info, has_embedding)
    capture = resolve_capture(
        model.config.aux_layer_ids,
        info.num_layers,
        model.config.num_aux,
        settings.aux_layer_convention,
        default_indices=target_architecture(info.architecture).default_capture_indices,
    )
    config = model.config
    merged = takes_merged(settings.image_embeddings, config.image_embeddings, config.hidden_size, info.hidden_size)
    LOG.info(
        "EAGLE3 head: draft vocabulary %d of %d (%s); embedding %s, rows %s; an image's tokens embedded as %s",
        config.draft_vocab_size,
        config.vocab_size,
        "the full vocabulary" if config.draft_vocab_size == config.vocab_size else "mapped through d2t",
        "from the checkpoint" if has_embedding else "the target's raw table, pulled at start-up",
        "as stored" if config.embedding_scale is None else f"scaled by {config.embedding_scale:.4g} (scale_embeddings)",
        "the target's input (merged)" if merged else "the placeholder token",
    )

    def fill(name: str, table: torch.Tensor) -> None:
        model.embed_tokens.weight.data.copy_(table)

    return PreparedDraft(
        architecture=model.config.architecture,
        kind="eagle3",
        capture=capture,
        missing_tables=() if has_embedding else ("embed_tokens",),
        fill_table=fill,
        build_runner=lambda cache: DraftRunner(model, cache),
        image_embeddings=merged,
    )


def _prepare_mtp(settings: DraftSettings, info: target_pb2.TargetInfo) -> PreparedDraft:
    loaded = load_mtp(settings.model_dir, dtype=getattr(torch, settings.dtype), device=settings.device)
    mtp = loaded.model
    config = mtp.config
    problems = [
        f"{what}: the MTP checkpoint has {ours}, the target has {theirs}"
        for what, ours, theirs in (
            ("architecture", config.target.architecture, info.architecture),
            ("hidden_size", config.hidden_size, info.hidden_size),
            ("vocab_size", config.vocab_size, info.vocab_size),
            # The MTP layers are stored after the target's last layer: model.layers.{num_layers + i}.
            ("num_hidden_layers", config.num_target_layers, info.num_layers),
        )
        if ours != theirs
    ]
    if problems:
        raise IncompatibleDraft("MTP draft does not fit the target: " + "; ".join(problems))
    if config.style == "chained" and settings.num_steps > config.num_mtp_layers:
        raise IncompatibleDraft(
            f"speculative-num-steps: {settings.num_steps} draft steps, but the MTP draft has {config.num_mtp_layers} "
            f"layers (one per step); pass --speculative-num-steps {config.num_mtp_layers} or fewer"
        )
    flow = config.family.default_flow if settings.mtp_feedback == "auto" else settings.mtp_feedback
    capture_index = config.capture_index_for(flow)
    capture = CaptureSpec((capture_index,), config.style, None)
    LOG.info(
        "%s MTP draft with %d layer(s): capture index %d of %d target layers (%s); hands on %s hidden (%s)",
        config.style,
        config.num_mtp_layers,
        capture_index,
        info.num_layers,
        "post-final-norm hidden" if capture_index > info.num_layers else "final pre-norm stream",
        flow,
        "the family's default" if settings.mtp_feedback == "auto" else "--mtp-feedback",
    )

    def build(cache: KVCacheSettings) -> ProposalRunner:
        if config.style == "nextn":
            model: DraftModel = NextNDraft(mtp, flow)
            return DraftRunner(model, cache)
        return MTPRunner(mtp, cache, chain=settings.mtp_mode == "chain", flow=flow)

    return PreparedDraft(
        architecture=config.target.architecture,
        kind="nextn" if config.style == "nextn" else "chained-mtp",
        capture=capture,
        missing_tables=tuple(loaded.missing_shared),
        fill_table=mtp.fill_shared,  # type: ignore[arg-type]
        build_runner=build,
        # NextN reuses its one layer at every step like an EAGLE3 head; a chain's layers take only their own tokens.
        image_embeddings=config.style == "nextn"
        and takes_merged(settings.image_embeddings, None, config.hidden_size, info.hidden_size),
    )


def _prepare_standalone(settings: DraftSettings, info: target_pb2.TargetInfo) -> PreparedDraft:
    model = load_target(settings.model_dir, dtype=getattr(torch, settings.dtype), device=settings.device)
    config = model.config
    problems = []
    if config.vocab_size != info.vocab_size:
        problems.append(
            f"vocabulary: the draft has vocab_size {config.vocab_size}, the target has vocab_size {info.vocab_size}"
        )
    digest = tokenizer_digest(settings.model_dir)
    if digest and info.tokenizer_digest and digest != info.tokenizer_digest:
        problems.append(
            f"tokenizer: the draft's {TOKENIZER_FILE} maps tokens to other ids than the target's (sha256 of the "
            f"token -> id map: the draft has {digest[:16]}, the target has {info.tokenizer_digest[:16]})"
        )
    if problems:
        raise IncompatibleDraft("standalone draft does not fit the target: " + "; ".join(problems))
    if not (digest and info.tokenizer_digest):
        LOG.warning("tokenizer not checked: draft or target directory has no %s; vocab_size matches", TOKENIZER_FILE)
    LOG.info(
        "standalone %s draft: %d layers, hidden %d, vocab %d; takes committed tokens only",
        config.architecture,
        config.num_layers,
        config.hidden_size,
        config.vocab_size,
    )

    def fill(name: str, table: torch.Tensor) -> None:
        raise ValueError(f"{name}: a standalone draft has its own tables and pulls none")

    return PreparedDraft(
        architecture=config.architecture,
        kind="standalone",
        capture=CaptureSpec((), "none", None),
        missing_tables=(),
        fill_table=fill,
        build_runner=lambda cache: StandaloneRunner(model, cache),
        tokens_only=True,
    )


def _prepare_block(settings: DraftSettings, info: target_pb2.TargetInfo) -> PreparedDraft:
    model, missing = load_block_draft(settings.model_dir, getattr(torch, settings.dtype), settings.device)
    config = model.config
    check_dflash(config, info, settings.num_steps)
    capture = CaptureSpec(config.capture_indices(info.num_layers), "output", config.target_layer_ids)
    kind = BLOCK_NAMES[config.architecture].lower()
    LOG.info(
        "%s draft: %d layers, block %d (up to %d drafts a round), mask token %d; target layer outputs %s -> "
        "capture indices %s of %d target layers; %s",
        kind,
        config.layer.num_layers,
        config.block_size,
        config.drafts_per_block,
        config.mask_token_id,
        list(config.target_layer_ids),
        list(capture.indices),
        info.num_layers,
        "embedding and LM head from the target" if missing else "its own embedding and LM head",
    )
    return PreparedDraft(
        architecture=config.architecture,
        kind=kind,
        capture=capture,
        missing_tables=missing,
        fill_table=model.fill_table,
        build_runner=lambda cache: BlockRunner(model, cache),
    )


def check_dflash(config: DFlashConfig, info: target_pb2.TargetInfo, num_steps: int) -> None:
    """Refuses a block drafter that does not fit the target (or the asked draft length), naming both values."""
    last = info.num_layers - 1
    facts = (
        ("hidden_size", config.hidden_size, info.hidden_size, config.hidden_size == info.hidden_size),
        ("vocab_size", config.vocab_size, info.vocab_size, config.vocab_size == info.vocab_size),
        (
            "mask_token_id",
            config.mask_token_id,
            f"vocab_size {info.vocab_size}",
            config.mask_token_id < info.vocab_size,
        ),
        (
            "target_layer_ids",
            list(config.target_layer_ids),
            f"layers 0..{last}",
            all(-1 <= i <= last for i in config.target_layer_ids),
        ),
        (
            "num_target_layers",
            config.num_target_layers,
            info.num_layers,
            config.num_target_layers in (None, info.num_layers),
        ),
    )
    problems = [
        f"{what}: the draft has {ours}, the target has {theirs}" for what, ours, theirs, fits in facts if not fits
    ]
    if num_steps > config.drafts_per_block:
        problems.append(
            f"speculative-num-steps: {num_steps} drafts asked, the draft's block_size {config.block_size} gives "
            f"{config.drafts_per_block}; pass --speculative-num-steps {config.drafts_per_block} or fewer"
        )
    if problems:
        name = BLOCK_NAMES[config.architecture]
        raise IncompatibleDraft(f"{name} draft does not fit the target: " + "; ".join(problems))


def _prepare_target_format(settings: DraftSettings, info: target_pb2.TargetInfo) -> PreparedDraft:
    """A target-format checkpoint: MTP layers when its config declares them (num_nextn_predict_layers >= 1),
    otherwise the whole model as a standalone draft."""
    if declared_mtp_layers(read_hf_config(settings.model_dir)) > 0:
        return _prepare_mtp(settings, info)
    return _prepare_standalone(settings, info)


DraftFormat = Callable[[DraftSettings, target_pb2.TargetInfo], PreparedDraft]
# Architecture name -> how to prepare it. MTP layers live in target-format checkpoints, hence the target names, which
# also name standalone draft models (a target-format checkpoint without MTP layers).
DRAFT_FORMATS: dict[str, DraftFormat] = {
    **dict.fromkeys(EAGLE3_LAYER_KINDS, _prepare_eagle3),
    **dict.fromkeys(BLOCK_ARCHITECTURES, _prepare_block),
    ASSISTANT_ARCHITECTURE: prepare_assistant,
    **dict.fromkeys(TARGET_ARCHITECTURES, _prepare_target_format),
}
